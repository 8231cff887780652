"""FSDP2 in horse.train, 4 CPU processes (gloo, fp32, the reference backend): --dp-shard 4 takes the
steps that DDP takes on the same 4 ranks; --tp 2 --dp-shard 2 (sequence parallel, activation
checkpointing, from a Hugging Face LLaMA) those of --tp 2; a --dp-shard 4 checkpoint, saved on a
signal's way out, resumes as --dp-replicate 2 --dp-shard 2 and a --tp 2 --dp-shard 2 one as one
process, repeating the uninterrupted runs' steps; exports of either layout are the same model. In
spawned ranks: each rank holds about 1/dp_shard of DDP's bytes of parameters, gradients and AdamW
state; the gradient norm and clipping over the shards are the whole model's; an inf on one rank's
shard makes every rank skip; FSDP's mixed precision gathers bf16 for float32 master weights; the
compiled, checkpointed blocks match the eager ones. Layouts that do not fit are errors that name
the values."""

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close, command_line_flags, free_port, run_gloo_ranks
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from horse import checkpoint, optim, train
from horse.generate import generate
from horse.hf import weights
from horse.loss_scale import LossScaler
from horse.model import GPT
from horse.parallel import (
    Parallel,
    build_model,
    check_layout,
    fully_shard_gpt,
    global_grad_norm,
    init_from_env,
    local,
    shard,
    shard_spec,
    state_bytes,
    unshard,
)

# Under pytest-xdist in one worker with the other multi-process tests: one group of ranks at a time.
pytestmark = pytest.mark.xdist_group("multiprocess")
ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "faulty_train.py"  # horse/train.py, with faults when HORSE_FAULTS names some
# GPT-2's shapes, small; 30 positions: the position table's rows split 8, 8, 8, 6 over 4 ranks and
# 15, 15 over 2, so resharding reads across uneven pieces. Global batch: 4 sequences.
GPT2 = {"n_layer": 2, "d_model": 64, "n_head": 4, "block_size": 30}
RUN = dict(
    max_steps=4, warmup_steps=1, eval_interval=2, eval_tokens=60, sample_tokens=0, ckpt_interval=2,
    keep_last=0, log_interval=100, precision="fp32", backend="reference", device="cpu",
)  # fmt: skip
LLAMA_RUN = {"seq_len": 32, "eval_tokens": 64}  # from a Hugging Face folder: its shapes


def _launch(run: Path, faults: str = "", **flags) -> tuple[int, str]:
    """(exit status, console output) of horse/train.py on 4 CPU processes under torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    command += [str(DRIVER), "--out-dir", str(run), *command_line_flags(RUN | flags)]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HORSE_FAULTS": faults}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def _steps(run: Path) -> dict[int, tuple]:
    """(loss, gradient norm, validation loss) by step, from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"], r.get("val_loss")) for r in records}


def _assert_same_steps(actual: dict, expected: dict, steps) -> None:
    """The same loss, gradient norm and validation loss at each step, up to summation order (the
    norm is the sharp test: AdamW's update ignores the gradients' scale)."""
    for step in steps:
        assert actual[step] == pytest.approx(expected[step], rel=1e-5), f"step {step}"


def _hf_llama(path: Path) -> Path:
    """A tiny LLaMA (GQA, SwiGLU, RMSNorm, rotary, its own LM head) saved as transformers saves it,
    with a byte vocabulary for the built-in corpus."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Five launches on 4 processes, 4 steps each, checkpoints every 2:
    ddp4: DDP over 4 ranks, a sequence each; fsdp4: --dp-shard 4, the same batches, rank 2 sent
    SIGUSR1 in step 3 (it saves step 3 and exits 75); hsdp: fsdp4's step-2 checkpoint resumed as
    --dp-replicate 2 --dp-shard 2, its end sample generated on the shards; tp2: --tp 2
    --sequence-parallel from a LLaMA folder, 2 replicas of 2 sequences, its sample skipped; tp2fsdp2:
    the same with --dp-shard 2 --activation-checkpointing."""
    tmp = tmp_path_factory.mktemp("fsdp")
    runs = {name: tmp / name for name in ("ddp4", "fsdp4", "hsdp", "tp2", "tp2fsdp2", "llama")}
    status, out = _launch(runs["ddp4"], batch_size=1, **GPT2)
    assert status == 0, out[-3000:]
    status, out = _launch(runs["fsdp4"], "usr1@3:2", batch_size=1, dp_shard=4, **GPT2)
    assert "(FSDP2: dp_replicate 1 x dp_shard 4)" in out, out[-3000:]
    assert status != 0 and "preempted: SIGUSR1 during step 3; step 3 finished and saved" in out, out[-3000:]
    shutil.copytree(runs["fsdp4"] / "ckpt_0000002", runs["hsdp"] / "ckpt_0000002")
    hsdp = dict(resume=True, batch_size=1, dp_shard=2, dp_replicate=2, sample_tokens=8)
    status, out = _launch(runs["hsdp"], **hsdp, **GPT2)
    assert status == 0 and "(FSDP2: dp_replicate 2 x dp_shard 2)" in out, out[-3000:]
    assert "resumed from ckpt_0000002" in out
    assert out.count("----- sample: 8 tokens") == 1  # generated on the shards, printed once
    llama = dict(init_from=_hf_llama(runs["llama"]), **LLAMA_RUN, batch_size=2)
    status, out = _launch(runs["tp2"], tp=2, sequence_parallel=True, sample_tokens=8, **llama)
    assert status == 0 and "no sample at --tp 2: generation needs the whole vocabulary" in out, out[-3000:]
    flags = dict(tp=2, sequence_parallel=True, dp_shard=2, activation_checkpointing=True)
    status, out = _launch(runs["tp2fsdp2"], **flags, **llama)
    assert status == 0 and "tp 2 (sequence parallel) x dp 2 (FSDP2: dp_replicate 1 x dp_shard 2)" in out
    return runs


def test_dp_shard_4_takes_ddps_steps_and_its_checkpoint_resumes_as_hsdp(runs):
    ddp = _steps(runs["ddp4"])
    _assert_same_steps(_steps(runs["fsdp4"]), ddp, [1, 2, 3])  # then the signal
    _assert_same_steps(_steps(runs["hsdp"]), ddp, [3, 4])
    _assert_same_steps(_steps(runs["hsdp"]), _steps(runs["fsdp4"]), [3])
    # The signal's checkpoint: whole, every rank's piece in the manifest with its size and SHA-256.
    ckpt = runs["fsdp4"] / "ckpt_0000003"
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    assert (manifest["tp_size"], manifest["dp_shard"]) == (1, 4) and checkpoint.verify(ckpt) == []
    pieces = [f"model-fsdp{s:02d}-of-04.safetensors" for s in range(4)]
    assert set(pieces) < manifest["files"].keys()
    assert manifest["tensors"]["wpe.weight"] == {"shape": [30, 64], "rows": [0, 8, 16, 24, 30]}
    # Each file holds its rows only: the position table's, and AdamW's moments of them.
    assert load_file(ckpt / pieces[3])["wpe.weight"].shape == (6, 64)
    state = checkpoint.load_state(ckpt, dp_shard_rank=3)
    assert state["optimizer"]["state"]["wpe.weight"]["exp_avg"].shape == (6, 64)
    # A piece missing: the checkpoint is torn, never picked up.
    (ckpt / pieces[1]).rename(runs["fsdp4"] / "aside")
    try:
        assert checkpoint.latest(runs["fsdp4"]).name == "ckpt_0000002"
    finally:
        (runs["fsdp4"] / "aside").rename(ckpt / pieces[1])


def test_tp2_dp_shard_2_takes_tp2s_steps_and_exports_its_model(runs, tmp_path, capsys):
    _assert_same_steps(_steps(runs["tp2fsdp2"]), _steps(runs["tp2"]), [1, 2, 3, 4])
    ckpt = runs["tp2fsdp2"] / "ckpt_0000004"
    names = {f.name for f in ckpt.iterdir()}
    assert {f"model-tp{t:02d}-of-02-fsdp{s:02d}-of-02.safetensors" for t in (0, 1) for s in (0, 1)} < names
    exported = {}
    for name in ("tp2", "tp2fsdp2"):
        weights.main(["export", str(runs[name]), "--out", str(tmp_path / f"{name}.safetensors")])
        exported[name] = load_file(tmp_path / f"{name}.safetensors")
    assert "(saved at tp=2, dp_shard=2)" in capsys.readouterr().out
    assert exported["tp2"].keys() == exported["tp2fsdp2"].keys()
    for name, expected in exported["tp2"].items():
        # AdamW moves a weight by up to lr a step whatever its gradient: near-zero gradients leave
        # summation order a few percent of that (as tests/test_train_parallel.py allows).
        torch.testing.assert_close(exported["tp2fsdp2"][name], expected, rtol=0, atol=1e-4, msg=name)


def test_a_tp2_dp_shard_2_checkpoint_resumes_in_one_process(runs, tmp_path):
    shutil.copytree(runs["tp2fsdp2"] / "ckpt_0000002", tmp_path / "ckpt_0000002")
    llama = dict(init_from=str(runs["llama"]), **LLAMA_RUN, batch_size=4)
    records = train.train(train.TrainConfig(out_dir=str(tmp_path), resume=True, **(RUN | llama)))
    actual = {r["step"]: (r["loss"], r["grad_norm"], r.get("val_loss")) for r in records}
    _assert_same_steps(actual, _steps(runs["tp2"]), [3, 4])
    # A dp-shard rank's rows of a tensor, read piece by piece; no rows at all where a piece is empty.
    pieces = checkpoint.Pieces(tmp_path / "ckpt_0000002")
    whole = pieces.whole("blocks.0.attn.c_attn.weight")  # (q + k + v rows, C), assembled by the plan
    local_q_k_v = shard(whole, shard_spec("blocks.0.attn.c_attn.weight", pieces.config), 1, 2)
    assert torch.equal(pieces.shard_rows("blocks.0.attn.c_attn.weight", None, 1, 10, 27), local_q_k_v[10:27])
    assert pieces.shard_rows("blocks.0.attn.c_attn.weight", "exp_avg", 1, 5, 5).shape == (0, 32)


def test_a_checkpoint_that_cannot_take_the_asked_layout_names_both(runs):
    ckpt = runs["fsdp4"] / "ckpt_0000002"
    config, _ = checkpoint.read_metadata(ckpt)
    asked = Parallel(tp_size=3, dp_size=2, dp_shard_size=2)
    with pytest.raises(
        ValueError,
        match=r"ckpt_0000002 \(saved at dp_shard 4 x tp 1\) cannot be resharded to dp_replicate 1 x "
        r"dp_shard 2 x tp 3: tensor parallel size 3 must divide n_head 4",
    ):
        checkpoint.check_reshardable(ckpt, config, asked)


def test_layouts_that_do_not_fit_the_world_name_the_values(monkeypatch):
    assert check_layout(8, tp=2, dp_shard=2) == 2  # dp_replicate: what is left over
    with pytest.raises(ValueError, match=r"--dp-shard 3 x --tp 1 = 3 must divide the world size 4"):
        check_layout(4, tp=1, dp_shard=3)
    with pytest.raises(ValueError, match=r"--dp-shard 4 x --tp 2 = 8 must divide the world size 4"):
        check_layout(4, tp=2, dp_shard=4)
    with pytest.raises(
        ValueError, match=r"--dp-replicate 3 x --dp-shard 2 x --tp 1 = 6 is not the world size 4"
    ):
        check_layout(4, tp=1, dp_shard=2, dp_replicate=3)
    with pytest.raises(
        ValueError, match=r"--dp-replicate 2 x --dp-shard 1 x --tp 1 = 2 is not the world size 4"
    ):
        check_layout(4, tp=1, dp_replicate=2)
    with pytest.raises(ValueError, match=r"--dp-shard must be at least 1, got 0"):
        train.TrainConfig(dp_shard=0)
    with pytest.raises(ValueError, match=r"--dp-replicate must be at least 1, got 0"):
        train.TrainConfig(dp_replicate=0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: FSDP needs torchrun's ranks
    with pytest.raises(ValueError, match=r"--dp-shard 2 x --tp 1 = 2 must divide the world size 1"):
        train.train(train.TrainConfig(dp_shard=2, device="cpu"))


@pytest.mark.interpreter
def test_the_fused_kernels_take_fsdps_gathered_float16_parameters():
    """One process, FSDP2 over a mesh of one rank (its gathers still copy each block's parameters,
    cast to float16, into FSDP's own buffers): the triton backend's loss and gradients within the
    suite's accuracy rule, against the float64 model, of the reference backend's under the same."""
    torch.manual_seed(0)
    config = train.model_config(
        train.TrainConfig(), {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 16}, 256
    )
    truth = GPT(config).double()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    truth.loss(idx, idx).backward()
    results = {"truth": [truth.loss(idx, idx)] + [p.grad for p in truth.parameters()]}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        one_rank = Parallel(dp_shard_size=2, fsdp_mesh=mesh)  # fsdp: the flag; the mesh: one rank
        for backend in ("reference", "triton"):
            model = GPT(config, backend)
            model.load_state_dict({k: v.float() for k, v in truth.state_dict().items()})
            loss_fn = fully_shard_gpt(model, one_rank, torch.float16)
            with torch.autocast("cpu", torch.float16):
                loss = loss_fn(idx, idx)
            loss.backward()
            results[backend] = [loss.detach()] + [p.grad.full_tensor() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    names = ["loss"] + [name for name, _ in truth.named_parameters()]
    for name, actual, want, baseline in zip(
        names, results["triton"], results["truth"], results["reference"], strict=True
    ):
        assert_close(name, actual, want, baseline)


# ----------------------------------------------------------------------------------------------
# In spawned processes
# ----------------------------------------------------------------------------------------------


CONFIG = train.model_config(train.TrainConfig(), GPT2, 256)
GLOBAL_BATCH = torch.randint(0, 256, (4, 31), generator=torch.Generator().manual_seed(0))


def _batch(parallel: Parallel) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's sequence of the global batch of 4: (input, target)."""
    rows = GLOBAL_BATCH[parallel.dp_rank :: parallel.dp_size]
    return rows[:, :-1], rows[:, 1:]


def _sharded(tp: int = 1, dp_shard: int = 1, **model_options) -> tuple[Parallel, GPT, object]:
    """(parallel, model, loss) of this rank in the layout: the trainer's model (built from the seed,
    split by tp) under data_parallel: DDP, or FSDP2 at dp_shard > 1."""
    parallel = init_from_env(tp=tp, device_type="cpu", dp_shard=dp_shard)  # a new mesh in the group
    cfg = train.TrainConfig(**model_options)
    model, loss_fn = train.make_model(cfg, CONFIG, "reference", parallel, "cpu", pretrained=False)
    return parallel, model, loss_fn


def _step_and_count(tp: int, dp_shard: int) -> dict[str, int]:
    """Bytes this rank holds, from its tensors, after one backward (gradients) and step (AdamW)."""
    parallel, model, loss_fn = _sharded(tp, dp_shard)
    optimizer = optim.make_optimizer(model, train.TrainConfig(), "cpu")
    loss_fn(*_batch(parallel)).backward()
    grads = state_bytes(model, optimizer)["gradients"]
    optim.optimizer_step(model, optimizer, LossScaler(enabled=False), 1.0, parallel)
    return state_bytes(model, optimizer) | {"gradients": grads}


def _bytes_per_rank() -> None:
    figures = {layout: _step_and_count(*layout) for layout in [(1, 1), (1, 4), (2, 1), (2, 2)]}
    for (tp, dp_shard), counts in figures.items():
        if dist.get_rank() == 0:
            print(
                f"rank 0, tp {tp} dp_shard {dp_shard}: {counts} = {sum(counts.values()):,} bytes", flush=True
            )
    for tp, dp_shard in [(1, 4), (2, 2)]:
        for kind in ("parameters", "gradients", "optimizer"):
            ratio = figures[tp, dp_shard][kind] / figures[tp, 1][kind]
            assert ratio == pytest.approx(1 / dp_shard, rel=0.1), (tp, dp_shard, kind, ratio)


def _whole_gradients() -> tuple[dict, torch.Tensor]:
    """The whole model's gradients of the loss on the global batch, on one process, and their norm."""
    # the trainer's default seed: the weights every layout starts from
    model = build_model(CONFIG, "reference", Parallel(), "cpu", seed=train.TrainConfig().seed)
    model.loss(GLOBAL_BATCH[:, :-1], GLOBAL_BATCH[:, 1:]).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return grads, torch.nn.utils.get_total_norm(list(grads.values()))


def _record_gradients_at_the_step(optimizer: torch.optim.Optimizer, model: GPT) -> dict:
    """A dict that optimizer.step() fills, before it steps, with model's gradients (each gathered
    whole from its FSDP shards)."""
    seen, step = {}, optimizer.step

    def recording_step():
        seen.update({name: p.grad.full_tensor() for name, p in model.named_parameters()})
        step()

    optimizer.step = recording_step
    return seen


def _norm_clipping_and_a_skip_over_shards() -> None:
    whole, whole_norm = _whole_gradients()
    for tp, dp_shard in [(1, 4), (2, 2)]:
        parallel, model, loss_fn = _sharded(tp, dp_shard)
        optimizer = optim.make_optimizer(model, train.TrainConfig(), "cpu")
        loss_fn(*_batch(parallel)).backward()
        norm = global_grad_norm(model.named_parameters(), parallel)
        torch.testing.assert_close(norm, whole_norm, rtol=1e-5, atol=0)
        seen = _record_gradients_at_the_step(optimizer, model)
        clip = whole_norm.item() / 4
        optim.optimizer_step(model, optimizer, LossScaler(enabled=False), clip, parallel)
        for name, grad in seen.items():  # the clipped gradients of this rank's tp shard
            expected = shard(whole[name], shard_spec(name, CONFIG), parallel.tp_rank, tp) * clip / whole_norm
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7, msg=name)
    # fp16's loss scaler on shards: a NaN in rank 1's rows only; every rank skips and halves its scale.
    parallel, model, loss_fn = _sharded(1, 4)
    optimizer = optim.make_optimizer(model, train.TrainConfig(), "cpu")
    scaler = LossScaler(init_scale=1024.0, growth_interval=1000, parallel=parallel, hysteresis=1)
    before = [local(p).clone() for p in model.parameters()]
    for poison in (True, False):
        scaler.scale(loss_fn(*_batch(parallel))).backward()
        if poison and dist.get_rank() == 1:
            local(model.blocks[0].mlp.c_fc.weight.grad)[0, 0] = float("nan")
        grad_norm, skipped = optim.optimizer_step(model, optimizer, scaler, 1.0, parallel)
        assert skipped == poison and scaler.get_scale() == 512.0
        assert math.isfinite(grad_norm) != poison  # the norm over the shards: NaN on every rank
        unchanged = all(torch.equal(local(p), q) for p, q in zip(model.parameters(), before, strict=True))
        assert unchanged == poison and bool(optimizer.state) != poison


def _mixed_precision_and_compiled_blocks() -> None:
    # FSDP2's MixedPrecisionPolicy: a block computes on bf16 gathers of the float32 shards, whose
    # gradients come back float32.
    parallel = init_from_env(device_type="cpu", dp_shard=4)
    model = build_model(CONFIG, "reference", parallel, "cpu", seed=0)
    loss_fn = fully_shard_gpt(model, parallel, torch.bfloat16)
    gathered = []
    model.blocks[0].mlp.c_fc.register_forward_pre_hook(lambda m, args: gathered.append(m.weight.dtype))
    loss_fn(*_batch(parallel)).backward()
    assert gathered == [torch.bfloat16]
    c_fc = model.blocks[0].mlp.c_fc.weight
    assert (c_fc.dtype, c_fc.grad.dtype, local(c_fc).shape) == (torch.float32, torch.float32, (64, 64))
    # The trainer's order under FSDP: activation checkpointing, then each block compiled, then
    # fully_shard. aot_eager traces without running a C++ compiler.
    compile_ = torch.compile
    torch.compile = lambda fn, **options: compile_(fn, backend="aot_eager", **options)
    results = []
    for options in ({}, {"compile": True, "activation_checkpointing": True}):
        parallel, model, loss_fn = _sharded(1, 4, **options)
        loss = loss_fn(*_batch(parallel))
        loss.backward()
        results.append((loss.detach(), global_grad_norm(model.named_parameters(), parallel)))
    torch.compile = compile_
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=0)


def _initial_weights_at_every_layout() -> None:
    # Each rank allocates and draws only its own rows and columns (the model built on the meta
    # device); gathered whole, every layout holds the tp=1 model's weights from the same seed, byte
    # for byte.
    whole = build_model(CONFIG, "reference", Parallel(), "cpu", seed=train.TrainConfig().seed)
    for tp, dp_shard in [(1, 1), (1, 4), (2, 2)]:
        parallel, model, _ = _sharded(tp, dp_shard)
        for name, param in model.named_parameters():
            tp_shard = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            pieces = [tp_shard]
            if tp > 1:
                pieces = [torch.empty_like(tp_shard) for _ in range(tp)]
                dist.all_gather(pieces, tp_shard, group=parallel.tp_group)
            gathered = unshard(pieces, shard_spec(name, CONFIG)) if tp > 1 else tp_shard
            assert torch.equal(gathered, whole.get_parameter(name)), (tp, dp_shard, name)


def _generation_on_fsdp_shards() -> None:
    # The end-of-run sample under FSDP: every rank generates in step with its shards (each forward
    # gathers the parameters), never holding the whole model; the tokens are the whole model's.
    whole = build_model(CONFIG, "reference", Parallel(), "cpu", seed=train.TrainConfig().seed)
    prompt = GLOBAL_BATCH[:1, :5]
    expected = generate(whole, prompt, 6, temperature=0)
    parallel, model, _ = _sharded(1, 4)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert torch.equal(generate(model, prompt, 6, temperature=0), expected)


def _init_from_slices_at_every_layout(path: Path) -> None:
    # --init-from a safetensors folder: each rank reads only its slices into the meta-built model;
    # gathered whole, tp1, dp_shard 2 (x dp_replicate 2), dp_shard 4 and tp2 x dp_shard 2 hold the
    # whole load's weights (from_pretrained) byte for byte, and the first losses are the whole model's.
    whole = weights.from_pretrained(path)
    config = weights.pretrained_config(path)
    cfg = train.TrainConfig(init_from=str(path))
    for tp, dp_shard in [(1, 1), (1, 2), (1, 4), (2, 2)]:
        parallel = init_from_env(tp=tp, device_type="cpu", dp_shard=dp_shard)
        model, loss_fn = train.make_model(cfg, config, "reference", parallel, "cpu", pretrained=True)
        for name, param in model.named_parameters():
            tp_shard = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            pieces = [tp_shard]
            if tp > 1:
                pieces = [torch.empty_like(tp_shard) for _ in range(tp)]
                dist.all_gather(pieces, tp_shard, group=parallel.tp_group)
            gathered = unshard(pieces, shard_spec(name, config)) if tp > 1 else tp_shard
            assert torch.equal(gathered, whole.get_parameter(name)), (tp, dp_shard, name)
        inputs, targets = (ids % config.vocab_used for ids in _batch(parallel))  # no padding ids
        with torch.no_grad():
            torch.testing.assert_close(loss_fn(inputs, targets), whole.loss(inputs, targets))


def test_init_from_a_safetensors_folder_reads_slices_into_every_layout(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=250, n_positions=30, n_embd=64, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
    )  # the vocabulary padded to 256: tp 2's second half ends in 6 zero rows
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path, max_shard_size="200KB")
    worker = functools.partial(_init_from_slices_at_every_layout, tmp_path)
    run_gloo_ranks(worker, 4)


def _run_all(workers: list[str]) -> None:
    for name in workers:
        globals()[name]()


def test_initial_weights_bytes_norm_clipping_skips_mixed_precision_compile_and_generation_over_shards():
    """One spawn of 4 ranks for all of them: starting the ranks costs more than the checks."""
    workers = [
        "_initial_weights_at_every_layout",
        "_bytes_per_rank",
        "_norm_clipping_and_a_skip_over_shards",
        "_mixed_precision_and_compiled_blocks",
        "_generation_on_fsdp_shards",
    ]
    run_gloo_ranks(functools.partial(_run_all, workers), 4)
