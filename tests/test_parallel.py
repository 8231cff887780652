"""horse.parallel: the GPT split over 2 tensor-parallel ranks (gloo, spawned processes) computes what
the whole model computes on one process: logits, loss and every gradient, with and without
sequence parallelism; and the pieces it is made of against plain torch."""

import dataclasses
import itertools
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812
from helpers import check_descriptor_strides_in_bytes, free_port
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from horse import hf, kernels, train
from horse.hf import weights
from horse.model import GPT, GPTConfig, KVCache
from horse.parallel import (
    GPT_PLAN,
    Parallel,
    Style,
    allreduce_sequence_parallel_grads,
    apply,
    build_model,
    check_divisible,
    copy_to_tp,
    found_nonfinite,
    gather_from_sequence,
    gather_state_dicts,
    global_grad_norm,
    init_from_env,
    materialize,
    parallelize,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    row_parallel,
    scatter_to_sequence,
    shard,
    shard_spec,
    shard_state_dict,
    style_of,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    vocab_parallel_linear_cross_entropy,
)

# Under pytest-xdist in one worker with tests/test_train_parallel.py: one group of ranks at a time.
pytestmark = pytest.mark.xdist_group("multiprocess")
TP = 2
GPT2 = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
# LLaMA's own head, and a vocabulary padded past the ids in use: rank 1 holds padding columns.
LLAMA = dataclasses.replace(
    GPT2,
    norm="rmsnorm",
    mlp="swiglu",
    positions="rotary",
    n_kv_heads=2,
    bias=False,
    tie_embeddings=False,
    vocab_used=50,
)


def _spawn(worker, *args) -> None:
    """Run worker(parallel, *args) on TP gloo ranks (one tp group); a failure on any rank fails here."""
    mp.spawn(_rank_main, args=(free_port(), worker, args), nprocs=TP)


def _rank_main(rank: int, port: int, worker, args) -> None:
    check_descriptor_strides_in_bytes()  # what conftest does, in this new process
    env = {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "WORLD_SIZE": TP,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    os.environ.update({k: str(v) for k, v in env.items()})
    torch.set_num_threads(1)  # two processes on two cores
    parallel = init_from_env(tp=TP, device_type="cpu")
    assert (parallel.tp_rank, parallel.tp_size, parallel.dp_size) == (rank, TP, 1)
    try:
        worker(parallel, *args)
    finally:
        dist.destroy_process_group()


def _gather_last_dim(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel.tp_group)
    return torch.cat(parts, dim=-1)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str) -> None:
    scale = expected.abs().nan_to_num(posinf=0.0).max().item()  # the largest element (padding's -inf aside)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{name}: {m}")


def _whole_and_shard(config: GPTConfig, parallel: Parallel, backend: str = "reference") -> tuple[GPT, GPT]:
    """The whole model and this rank's shard, on the same weights: GPT-2's init moved off its
    zeros and ones (so that every bias and norm weight matters), then sliced."""
    torch.manual_seed(0)
    whole = GPT(config, "reference")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    model = parallelize(GPT(config, backend), parallel)
    model.load_state_dict(shard_state_dict(whole.state_dict(), config, parallel.tp_rank, parallel.tp_size))
    return whole, model


# ----------------------------------------------------------------------------------------------
# The model, tp=2 against tp=1
# ----------------------------------------------------------------------------------------------


def _check_model_matches_whole(parallel: Parallel) -> None:
    for config in (GPT2, LLAMA):
        for sequence_parallel in (False, True):
            p = dataclasses.replace(parallel, sequence_parallel=sequence_parallel)
            case = f"{config.mlp} sequence_parallel={sequence_parallel}"
            whole, model = _whole_and_shard(config, p)
            generator = torch.Generator().manual_seed(2)
            idx, targets = torch.randint(
                0, config.vocab_used or config.vocab_size, (2, 2, 8), generator=generator
            )

            with torch.no_grad():
                _assert_close(_gather_last_dim(model(idx), p), whole(idx), 1e-5, f"{case}: logits")
            loss_ref = whole.loss(idx, targets)
            loss = model.loss(idx, targets)
            _assert_close(loss, loss_ref, 1e-5, f"{case}: loss")
            loss_ref.backward()
            loss.backward()
            allreduce_sequence_parallel_grads(model, p)

            # Every rank's gradients, sharded and replicated, are its slice of the whole model's.
            grads_ref = {name: q.grad for name, q in whole.named_parameters()}
            grads = {name: q.grad for name, q in model.named_parameters()}
            expected = shard_state_dict(grads_ref, config, p.tp_rank, p.tp_size)
            assert grads.keys() == expected.keys()
            for name in grads:
                _assert_close(grads[name], expected[name], 1e-5, f"{case}: grad of {name}")
            every_rank = [None] * p.tp_size
            dist.all_gather_object(every_rank, grads, group=p.tp_group)
            for name, g in gather_state_dicts(every_rank, config).items():
                _assert_close(g, grads_ref[name], 1e-5, f"{case}: gathered grad of {name}")

            norm_ref = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads_ref.values()]))
            _assert_close(global_grad_norm(model.named_parameters(), p), norm_ref, 1e-5, f"{case}: norm")
            ddp_names = ((f"module.{name}", q) for name, q in model.named_parameters())
            _assert_close(global_grad_norm(ddp_names, p), norm_ref, 1e-5, f"{case}: norm, DDP names")

    p = dataclasses.replace(parallel, sequence_parallel=True)
    model = parallelize(GPT(GPT2), p)
    with pytest.raises(ValueError, match="must divide the sequence length 7"):
        model(torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="tp=1 only"):
        model(torch.zeros(1, 4, dtype=torch.long), KVCache(GPT2))

    # A torch DeviceMesh's "tp" dimension makes the same shard as the Parallel, collectives included.
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))
    shards = []
    for where in (mesh, mesh["tp"], parallel):
        torch.manual_seed(0)
        shards.append(parallelize(GPT(LLAMA), where))
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    for shard_ in shards[:2]:
        assert shard_.state_dict().keys() == shards[2].state_dict().keys()
        assert all(torch.equal(t, shards[2].state_dict()[n]) for n, t in shard_.state_dict().items())
        assert torch.equal(shard_.loss(idx, idx), shards[2].loss(idx, idx))


def test_tensor_parallel_gpt_matches_the_whole_model():
    _spawn(_check_model_matches_whole)


def _check_triton_fp16(parallel: Parallel) -> None:
    # In the interpreter: attention, the MLP's first projection and the fused norms, on shards.
    calls = dict.fromkeys(
        ["flash_attention", "linear_act", "gated_linear", "add_layer_norm", "add_rms_norm"], 0
    )
    for name in calls:  # counted (this process only; the model looks the kernels up at call time)
        fn = getattr(kernels, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        setattr(kernels, name, counted)
    for config, sequence_parallel in itertools.product([GPT2, LLAMA], [False, True]):
        config = dataclasses.replace(config, n_layer=1)
        p = dataclasses.replace(parallel, sequence_parallel=sequence_parallel)
        case = f"{config.mlp} sequence_parallel={sequence_parallel}"
        whole, model = _whole_and_shard(config, p, backend="triton")
        idx, targets = torch.randint(
            0, config.vocab_used or config.vocab_size, (2, 2, 8), generator=torch.Generator().manual_seed(2)
        )
        loss_ref = whole.loss(idx, targets)
        with torch.autocast("cpu", torch.float16):
            loss = model.loss(idx, targets)
        loss_ref.backward()
        loss.backward()
        allreduce_sequence_parallel_grads(model, p)
        assert loss.item() == pytest.approx(loss_ref.item(), rel=2e-3), case
        expected = shard_state_dict({n: q.grad for n, q in whole.named_parameters()}, config, p.tp_rank, TP)
        for name, q in model.named_parameters():
            _assert_close(q.grad, expected[name], 1e-2, f"{case}: grad of {name}")
    assert calls == {
        "flash_attention": 4,
        "linear_act": 2,
        "gated_linear": 2,
        "add_layer_norm": 4,
        "add_rms_norm": 4,
    }


def test_tensor_parallel_gpt_on_the_triton_kernels_in_fp16():
    _spawn(_check_triton_fp16)


# ----------------------------------------------------------------------------------------------
# The pieces: conjugate functions, the vocabulary-parallel embedding and loss, the skip flag
# ----------------------------------------------------------------------------------------------


def _check_pieces(parallel: Parallel) -> None:
    rank, group = parallel.tp_rank, parallel.tp_group
    torch.manual_seed(0)  # the same "whole" tensors on both ranks
    x_whole, g_whole = torch.randn(2, 6, 3), torch.randn(2, 6, 3)
    g_rank = g_whole * (rank + 1)  # a different upstream gradient on each rank
    g_sum = g_whole * sum(r + 1 for r in range(TP))

    def run(fn, x, upstream):
        x = x.clone().requires_grad_()
        y = fn(x, group)
        y.backward(upstream)
        return y.detach(), x.grad

    y, dx = run(copy_to_tp, x_whole, g_rank)
    assert torch.equal(y, x_whole) and torch.allclose(dx, g_sum)
    y, dx = run(reduce_from_tp, x_whole * (rank + 1), g_whole)
    assert torch.allclose(y, x_whole * 3) and torch.equal(dx, g_whole)
    mine = x_whole.chunk(TP, dim=1)[rank]
    y, dx = run(gather_from_sequence, mine, g_rank)
    assert torch.equal(y, x_whole) and torch.allclose(dx, g_sum.chunk(TP, dim=1)[rank])
    y, dx = run(reduce_scatter_to_sequence, x_whole * (rank + 1), g_whole.chunk(TP, dim=1)[rank])
    assert torch.allclose(y, (x_whole * 3).chunk(TP, dim=1)[rank]) and torch.equal(dx, g_whole)
    y, dx = run(scatter_to_sequence, x_whole, g_whole.chunk(TP, dim=1)[rank])
    assert torch.equal(y, mine) and torch.equal(dx, g_whole)

    # Embedding: ids on both ranks' rows, the first and last of each.
    weight = torch.randn(10, 3)
    idx = torch.tensor([[0, 4, 5, 9], [9, 3, 3, 6]])
    upstream = torch.randn(2, 4, 3)
    local = shard(weight, shard_spec("wte.weight", dataclasses.replace(GPT2, vocab_size=10)), rank, TP)
    local.requires_grad_()
    out = vocab_parallel_embedding(idx, local, parallel)
    out.backward(upstream)
    whole = weight.clone().requires_grad_()
    F.embedding(idx, whole).backward(upstream)
    assert torch.equal(out, F.embedding(idx, weight))
    torch.testing.assert_close(local.grad, whole.grad.chunk(TP)[rank])

    # Cross entropy: logits far from 0 (the max is subtracted across ranks), targets on both ranks.
    for dtype in (torch.float32, torch.float16):
        logits = (torch.randn(7, 10) * 3 + 200).to(dtype)
        targets = torch.tensor([0, 4, 5, 9, 2, 7, 5])
        local = logits.chunk(TP, dim=1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, parallel)
        loss.backward()
        whole = logits.float().requires_grad_()
        loss_ref = F.cross_entropy(whole, targets)
        loss_ref.backward()
        assert loss.dtype == torch.float32 and local.grad.dtype == dtype
        torch.testing.assert_close(loss, loss_ref)
        torch.testing.assert_close(
            local.grad.float(), whole.grad.chunk(TP, dim=1)[rank], atol=1e-3, rtol=1e-3
        )

    # One rank's inf makes every rank skip; the caller's flag is left alone.
    flag = torch.tensor(float(rank == 1))
    assert found_nonfinite(flag, parallel).item() and flag.item() == float(rank == 1)
    assert not found_nonfinite(torch.tensor(False), parallel).item()


def test_conjugate_functions_vocab_parallel_embedding_and_loss_and_the_skip_flag():
    _spawn(_check_pieces)


def _check_softcapped_losses(parallel: Parallel) -> None:
    rank, softcap = parallel.tp_rank, 2.0  # logits of about ±6: tanh's bend, where an error would show
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 5, 8, generator=g), torch.randn(22, 8, generator=g)
    targets = torch.tensor([[0, 3, 10, 11, 21], [-100, 12, 7, 20, 1]])  # both ranks' columns, one ignored
    options = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": softcap}
    for use_triton in (True, False):  # the statistics and gradient kernels, and their plain-PyTorch twins
        results = []
        for tp, w in ((parallel, weight.chunk(TP)[rank]), (Parallel(), weight)):  # tp 2, then tp 1
            x_in, w_in = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = vocab_parallel_linear_cross_entropy(x_in, w_in, targets, tp, use_triton, **options)
            loss.backward()
            results.append((loss, x_in.grad, w_in.grad))
        (loss, dx, dw), (loss_1, dx_1, dw_1) = results
        torch.testing.assert_close(loss, loss_1, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx, dx_1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw, dw_1.chunk(TP)[rank], rtol=1e-5, atol=1e-6)
    logits = (x @ weight.T).flatten(0, 1)  # the unfused loss, on logits split by vocabulary
    local = logits.chunk(TP, dim=1)[rank].clone().requires_grad_()
    whole = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets.flatten(), parallel, softcap=softcap)
    loss_1 = vocab_parallel_cross_entropy(whole, targets.flatten(), Parallel(), softcap=softcap)
    loss.backward(), loss_1.backward()
    torch.testing.assert_close(loss, loss_1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(local.grad, whole.grad.chunk(TP, dim=1)[rank], rtol=1e-5, atol=1e-7)


def test_the_vocab_parallel_losses_with_a_softcap_at_tp2_equal_tp1():
    _spawn(_check_softcapped_losses)


# ----------------------------------------------------------------------------------------------
# In one process: initialisation, resharding, the checks, tp=1
# ----------------------------------------------------------------------------------------------


def test_a_resume_allocates_its_model_without_drawing_it(monkeypatch):
    # Resuming, the trainer's model is allocated from the meta device and left for the checkpoint:
    # no weights drawn, no throw-away model built; a fresh start draws them all.
    drawn = []
    draw = apply.initial_rows
    monkeypatch.setattr(apply, "initial_rows", lambda name, *args: drawn.append(name) or draw(name, *args))
    cfg = train.TrainConfig()
    model, _ = train.make_model(cfg, LLAMA, "reference", Parallel(), "cpu", pretrained=False, resuming=True)
    assert drawn == [] and not any(p.is_meta for p in model.parameters())
    torch.testing.assert_close(model.rotary.cos, GPT(LLAMA).rotary.cos, rtol=0, atol=0)
    train.make_model(cfg, LLAMA, "reference", Parallel(), "cpu", pretrained=False)
    assert set(drawn) == {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_tp_ranks_start_from_the_slices_of_the_tp1_model(config):
    torch.manual_seed(123)  # build_model seeds itself: the global RNG's state does not matter
    whole_model = build_model(config, "reference", Parallel(), "cpu", seed=0)
    models = [
        build_model(config, "reference", Parallel(tp_rank=r, tp_size=TP), "cpu", seed=0) for r in range(TP)
    ]
    whole, shards = whole_model.state_dict(), [m.state_dict() for m in models]
    eager = GPT(config)  # built on the CPU, then drawn from the seed: the same as on the meta device
    eager.init_weights(0)
    assert all(torch.equal(t, whole[name]) for name, t in eager.state_dict().items())
    # Each rank's FLOPs are its share: together the whole model's, replicated parameters once per rank.
    replicated = sum(p.numel() for n, p in whole_model.named_parameters() if shard_spec(n, config) is None)
    if whole_model.wpe is not None:
        replicated -= whole_model.wpe.weight.numel()  # a lookup, not a matmul
    flops = sum(m.flops_per_token(16) for m in models)
    assert flops == whole_model.flops_per_token(16) + 6 * (TP - 1) * replicated
    attn = parallelize(GPT(config), Parallel(tp_size=TP)).blocks[0].attn
    assert (attn.n_heads, attn.n_kv_heads) == (config.n_head // TP, config.kv_heads // TP)
    assert attn.c_attn.weight.shape == ((config.n_head + 2 * config.kv_heads) * config.head_dim // TP, 32)
    assert attn.c_proj.in_features == config.d_model // TP
    assert shards[0].keys() == whole.keys()
    gathered = gather_state_dicts(shards, config)
    for name in whole:
        assert torch.equal(gathered[name], whole[name]), name
        assert torch.equal(shards[1][name], shard(whole[name], shard_spec(name, config), 1, TP)), name


def test_shard_and_gather_round_trip_with_qkv_parts():
    config = dataclasses.replace(LLAMA, n_head=8, n_kv_heads=2, d_model=32)  # q 32 rows, k and v 8 each
    rows = torch.arange(48.0)[:, None].expand(48, 3)
    spec = shard_spec("module.blocks.0.attn.c_attn.weight", config)
    assert spec == (0, [32, 8, 8])
    first = shard(rows, spec, 0, TP)[:, 0].tolist()
    assert first == list(range(16)) + list(range(32, 36)) + list(range(40, 44))  # half of q, of k, of v
    full = {name: torch.randn(shape) for name, shape in [("wte.weight", (64, 32)), ("norm_f.weight", (32,))]}
    full["_orig_mod.blocks.1.mlp.down_proj.weight"] = torch.randn(32, config.hidden)
    shards = [shard_state_dict(full, config, rank, TP) for rank in range(TP)]
    assert shards[1]["_orig_mod.blocks.1.mlp.down_proj.weight"].shape == (32, config.hidden // TP)
    assert shards[1]["wte.weight"].shape == (32, 32) and torch.equal(
        shards[1]["norm_f.weight"], full["norm_f.weight"]
    )
    assert shard_spec("blocks.0.attn.c_proj.bias", config) is None  # added once, after the sum
    assert all(torch.equal(t, full[n]) for n, t in gather_state_dicts(shards, config).items())


def test_the_plan_gives_each_module_its_form_and_refuses_one_that_does_not_fit(monkeypatch):
    model = parallelize(GPT(LLAMA), Parallel(tp_size=TP))
    forms = {name: type(module).__name__ for name, module in model.named_modules() if style_of(name)}
    expected = {"": "GPT", "wte": "VocabParallelEmbedding", "lm_head": "Linear"}
    for block in ("blocks.0", "blocks.1"):
        expected |= {
            f"{block}.attn": "CausalSelfAttention",  # its head counts divided
            f"{block}.attn.c_attn": "Linear",  # fed the whole input by its hook
            f"{block}.attn.c_proj": "RowParallelLinear",
            f"{block}.mlp": "MLP",  # its input whole once, by its hook, for the up projections
            f"{block}.mlp.gate_proj": "Linear",
            f"{block}.mlp.up_proj": "Linear",
            f"{block}.mlp.down_proj": "RowParallelLinear",
        }
    assert forms == expected
    hooked = {name for name, module in model.named_modules() if module._forward_pre_hooks}
    assert hooked == {"blocks.0", "head_input"} | {
        f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.c_attn", "mlp")
    }
    # The model's own classes run; the modules put in a layer's place subclass none of the model's.
    model_classes = {type(m) for m in GPT(LLAMA).modules()} - {nn.Linear, nn.Embedding, nn.ModuleList}
    assert not any(
        issubclass(type(m), tuple(model_classes)) for m in (model.wte, model.blocks[0].mlp.down_proj)
    )
    monkeypatch.setitem(GPT_PLAN, "norm_f", Style(form=row_parallel))
    with pytest.raises(TypeError, match="norm_f is a RMSNorm; its plan's form row_parallel takes a Linear"):
        parallelize(GPT(LLAMA), Parallel(tp_size=TP))


def test_divisibility_errors_name_the_field():
    with pytest.raises(
        ValueError, match="tensor parallel size 3 must divide n_head 4, n_kv_heads 4, vocab_size 64"
    ):
        check_divisible(GPT2, 3)
    with pytest.raises(ValueError, match="must divide n_kv_heads 2$"):
        check_divisible(LLAMA, 4)
    with pytest.raises(ValueError, match="must divide mlp_hidden 102$"):
        parallelize(GPT(dataclasses.replace(GPT2, mlp_hidden=102)), Parallel(tp_size=4))
    with pytest.raises(ValueError, match="--tp 3 must divide the world size 1"):
        init_from_env(tp=3)


def test_at_tp1_the_parallel_functions_are_the_plain_ones():
    parallel = init_from_env()
    assert parallel == Parallel() and not parallel.distributed
    x = torch.randn(2, 5, 3)
    for fn in (
        copy_to_tp,
        reduce_from_tp,
        gather_from_sequence,
        reduce_scatter_to_sequence,
        scatter_to_sequence,
    ):
        assert fn(x, None) is x
    logits, targets = torch.randn(6, 11), torch.randint(0, 11, (6,))
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(logits, targets, parallel), F.cross_entropy(logits, targets)
    )
    model = GPT(GPT2)
    model.loss(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)).backward()
    norm = global_grad_norm(model.named_parameters(), parallel)
    assert norm.item() == pytest.approx(
        math.sqrt(sum(p.grad.square().sum().item() for p in model.parameters()))
    )
    assert found_nonfinite(torch.tensor(1.0), parallel).item()


def _bin_read_once_per_host(parallel: Parallel, path, tmp) -> None:
    tempfile.tempdir = str(tmp)  # the host's temporary directory, this test's own
    loads, torch_load = [], torch.load
    torch.load = lambda *args, **kwargs: loads.append(args[0]) or torch_load(*args, **kwargs)
    config = hf.pretrained_config(path)
    with torch.device("meta"):
        model = parallelize(GPT(config), parallel)
    materialize(model, parallel, "cpu", None, weights.weight_source(path, config))
    assert len(loads) == (1 if parallel.tp_rank == 0 else 0), (parallel.tp_rank, loads)
    torch.load = torch_load
    whole = shard_state_dict(
        hf.from_pretrained(path).state_dict(), config, parallel.tp_rank, parallel.tp_size
    )
    for name, t in model.state_dict().items():
        assert torch.equal(t, whole[name]), (parallel.tp_rank, name)


def test_a_bin_folder_is_unpickled_once_per_host_and_each_rank_reads_its_slices(tmp_path):
    """--init-from a .bin folder on two ranks of one host: LOCAL_RANK 0 alone unpickles it (into a
    safetensors copy in the host's temporary directory, tied weights and all), and each rank's shard
    read from the copy is the whole load's cut by the plan, byte for byte."""
    from test_hf import hf_llama, save_hf

    path = save_hf(hf_llama(tie=True, bias=True), tmp_path / "bin", "bin")
    (tmp_path / "tmp").mkdir()
    _spawn(_bin_read_once_per_host, path, tmp_path / "tmp")
    assert [p.name.startswith("horse-init-from-") for p in (tmp_path / "tmp").iterdir()] == [True]
