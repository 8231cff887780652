"""Document masking: a row packed with documents computes what its documents compute apart (loss and
every gradient), on the reference path, on the kernels in the interpreter, and over 2 tensor-parallel
ranks with sequence parallelism (gloo)."""

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_close, check_descriptor_strides_in_bytes, free_port

from horse import checkpoint, cli, data, kernels, train
from horse.model import GPT, GPTConfig, documents_of
from horse.parallel import (
    allreduce_sequence_parallel_grads,
    checkpoint_blocks,
    data_parallel,
    gather_state_dicts,
    init_from_env,
    parallelize,
    shard_state_dict,
)

EOT = 63
GPT2 = GPTConfig(
    vocab_size=64, block_size=64, n_layer=2, n_head=4, d_model=32, document_masking=True, eot_id=EOT
)
LLAMA = dataclasses.replace(
    GPT2, norm="rmsnorm", mlp="swiglu", positions="rotary", n_kv_heads=2, bias=False, tie_embeddings=False
)
CONFIGS = {"gpt2": GPT2, "llama-like": LLAMA}
# One document shorter than the interpreter's attention tiles (32 queries by 16 keys), one of length
# 1 (a lone end of text) and one longer than a tile, which the row's end cuts before its end of text.
LENGTHS = (11, 1, 40)


def _packed_row(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets) (1, 52): the documents of LENGTHS one after another, each but the last ending
    in the end-of-text token; targets the next tokens, across the documents as a loader gives them."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOT, (sum(LENGTHS) + 1,), generator=generator)
    ends = torch.tensor(LENGTHS[:-1]).cumsum(0) - 1
    tokens[ends] = EOT
    return tokens[None, :-1], tokens[None, 1:]


def _spans() -> list[slice]:
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    return [slice(s, s + n) for s, n in zip(starts, LENGTHS, strict=True)]


def _model(config: GPTConfig, backend: str = "reference", dtype=torch.float32) -> GPT:
    """GPT-2's init moved off its zeros and ones, so that every bias and norm weight matters."""
    torch.manual_seed(0)
    model = GPT(config, backend)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.to(dtype)


def _loss_sum_and_grads(model: GPT, pieces: list[tuple[torch.Tensor, torch.Tensor]], autocast=None):
    """The sum of the token losses over pieces [(idx, targets)] and its gradients."""
    model.zero_grad()
    total = 0
    for idx, targets in pieces:
        with torch.autocast("cpu", torch.float16, enabled=autocast is not None):
            total = total + model.loss(idx, targets) * targets.numel()
    total.backward()
    return total.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_documents_of_finds_starts_positions_and_offsets():
    idx = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 3], [EOT, 1, 2, 3, EOT, 4, 5]])
    documents = documents_of(idx, EOT)
    assert documents.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 0, 1]]
    assert documents.document.tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 2, 2]]
    # Each token's document's first column: flash_attention's document_starts.
    assert documents.starts.tolist() == [[0, 0, 0, 3, 3, 5, 6], [0, 1, 1, 1, 1, 5, 5]]
    assert documents.starts.dtype == torch.int32


@pytest.mark.parametrize("variant", CONFIGS)
def test_a_packed_row_computes_its_documents_apart_on_the_reference_path(variant):
    config = CONFIGS[variant]
    model = _model(config)
    idx, targets = _packed_row()
    packed = _loss_sum_and_grads(model, [(idx, targets)])
    apart = _loss_sum_and_grads(model, [(idx[:, span], targets[:, span]) for span in _spans()])
    torch.testing.assert_close(packed[0], apart[0], rtol=1e-5, atol=0)
    for name, grad in packed[1].items():
        scale = apart[1][name].abs().max().item()
        torch.testing.assert_close(grad, apart[1][name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    # Without document masking the packed row is one sequence, and the loss is not the documents'.
    unmasked = _model(dataclasses.replace(config, document_masking=False))
    assert not torch.allclose(_loss_sum_and_grads(unmasked, [(idx, targets)])[0], apart[0], rtol=1e-3)


@pytest.mark.parametrize("variant", CONFIGS)
def test_a_packed_row_on_the_kernels_in_fp16_matches_its_documents_apart(variant, monkeypatch):
    """The kernels' packed row (flash_attention's document_starts) against the documents apart in float64
    (the truth), within twice the error of the reference path's own float16 run of the documents apart."""
    config = CONFIGS[variant]
    calls = []
    dense = kernels.flash_attention

    def recording(*args, **kwargs):
        calls.append(kwargs.get("document_starts") is not None)
        return dense(*args, **kwargs)

    monkeypatch.setattr(kernels, "flash_attention", recording)
    idx, targets = _packed_row()
    spans = [(idx[:, span], targets[:, span]) for span in _spans()]
    actual = _loss_sum_and_grads(_model(config, "triton"), [(idx, targets)], autocast=torch.float16)
    assert calls == [True] * config.n_layer
    truth = _loss_sum_and_grads(_model(config, dtype=torch.float64), spans)
    baseline = _loss_sum_and_grads(_model(config), spans, autocast=torch.float16)
    assert_close("loss", actual[0], truth[0], baseline[0])
    for name, grad in actual[1].items():
        assert_close(f"grad of {name}", grad, truth[1][name], baseline[1][name])


# ----------------------------------------------------------------------------------------------
# Two ranks (gloo): tensor parallel with sequence parallelism, and FSDP2
# ----------------------------------------------------------------------------------------------


def _rank_main(rank: int, port: int, worker) -> None:
    check_descriptor_strides_in_bytes()  # what conftest does, in this new process
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()})
    torch.set_num_threads(1)  # two processes on two cores
    try:
        worker()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _tensor_parallel() -> None:
    parallel = dataclasses.replace(init_from_env(tp=2, device_type="cpu"), sequence_parallel=True)
    idx, targets = _packed_row()
    spans = [(idx[:, span], targets[:, span]) for span in _spans()]
    for name, config in CONFIGS.items():
        whole = _model(config)
        apart = _loss_sum_and_grads(whole, spans)
        model = parallelize(GPT(config), parallel)
        state = shard_state_dict(whole.state_dict(), config, parallel.tp_rank, parallel.tp_size)
        model.load_state_dict(state)
        loss = model.loss(idx, targets) * targets.numel()
        loss.backward()
        allreduce_sequence_parallel_grads(model, parallel)
        torch.testing.assert_close(loss, apart[0], rtol=1e-5, atol=0, msg=f"{name}: loss")
        every_rank = [None] * parallel.tp_size
        grads = {n: p.grad for n, p in model.named_parameters()}
        dist.all_gather_object(every_rank, grads, group=parallel.tp_group)
        for n, grad in gather_state_dicts(every_rank, config).items():
            scale = apart[1][n].abs().max().item()
            case = f"{name}: grad of {n}"
            torch.testing.assert_close(grad, apart[1][n], rtol=1e-5, atol=1e-6 * scale, msg=case)


def _fully_sharded() -> None:
    parallel = init_from_env(device_type="cpu", dp_shard=2)
    idx, targets = _packed_row()
    spans = [(idx[:, span], targets[:, span]) for span in _spans()]
    for name, config in CONFIGS.items():
        apart = _loss_sum_and_grads(_model(config), spans)
        model = _model(config)
        loss_fn = data_parallel(model, model.loss, parallel)  # FSDP2: each rank holds half the rows
        loss = loss_fn(idx, targets) * targets.numel()  # the same row on both ranks: their mean is its
        loss.backward()
        torch.testing.assert_close(loss, apart[0], rtol=1e-5, atol=0, msg=f"{name}: loss")
        for n, p in model.named_parameters():
            scale = apart[1][n].abs().max().item()
            case = f"{name}: grad of {n}"
            torch.testing.assert_close(
                p.grad.full_tensor(), apart[1][n], rtol=1e-5, atol=1e-6 * scale, msg=case
            )


@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("layout", ["tp2-sequence-parallel", "fsdp-dp-shard-2"])
def test_a_packed_row_split_over_two_ranks_computes_its_documents_apart(layout):
    worker = {"tp2-sequence-parallel": _tensor_parallel, "fsdp-dp-shard-2": _fully_sharded}[layout]
    mp.spawn(_rank_main, args=(free_port(), worker), nprocs=2)


def test_activation_checkpointing_recomputes_the_documents_blocks_alike():
    model, checkpointed = _model(GPT2), _model(GPT2)
    checkpoint_blocks(checkpointed)
    idx, targets = _packed_row()
    loss, grads = _loss_sum_and_grads(model, [(idx, targets)])
    loss_ckpt, grads_ckpt = _loss_sum_and_grads(checkpointed, [(idx, targets)])
    assert torch.equal(loss, loss_ckpt)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_trainer_masks_documents_where_the_data_ends_them(tmp_path, capsys):
    (tmp_path / "in.txt").write_text(data.builtin_text()[:50_000])
    data.prepare([tmp_path / "in.txt"], tmp_path / "data")
    small = {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 32}
    quick = dict(batch_size=4, max_steps=1, eval_interval=1, eval_tokens=64, sample_tokens=0, device="cpu")
    cfg = train.TrainConfig(data=str(tmp_path / "data"), out_dir=str(tmp_path / "run"), **quick)
    train.train(cfg, small)
    assert "bytes+eot, evaluated on the first 64; document masking on)" in capsys.readouterr().out
    saved, _ = checkpoint.read_metadata(checkpoint.resolve(tmp_path / "run"))
    assert (saved.document_masking, saved.eot_id) == (True, 256)
    train.train(dataclasses.replace(cfg, out_dir=str(tmp_path / "off")), small | {"document_masking": False})
    assert "document masking off)" in capsys.readouterr().out
    # The built-in corpus is bytes without an end of text: off by default, and an error when asked for.
    builtin = dataclasses.replace(cfg, data="", out_dir=str(tmp_path / "builtin"))
    with pytest.raises(ValueError, match="--document-masking needs an end-of-text id.*tokenizer \\(bytes\\)"):
        train.train(builtin, small | {"document_masking": True})


def test_a_run_saved_before_document_masking_resumes_as_it_began(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    model = dataclasses.asdict(GPTConfig())
    del model["document_masking"], model["eot_id"]  # config.json as runs wrote it before
    run = {"train": dataclasses.asdict(train.TrainConfig(out_dir=str(out))), "model": model}
    (out / "config.json").write_text(json.dumps(run))
    _, overrides = cli.parse_args(["--out-dir", str(out), "--resume"])
    assert (overrides["document_masking"], overrides["eot_id"]) == (False, None)
