"""horse.train under torchrun on the CPU (gloo, fp32, the reference backend): tp=2 x dp=2 trains the
weights one process trains on the whole batch; sharded checkpoints reshard tp=2 <-> tp=1; a job
that torchrun restarts after an injected failure finishes as an uninterrupted one; an inf gradient
on one rank makes every rank skip the step, with fp16's scaler and without; an exported checkpoint
is the whole model."""

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
import torch.multiprocessing as mp
from helpers import command_line_flags, free_port
from safetensors.torch import load_file

from horse import checkpoint, generate, optim, train
from horse.hf import weights
from horse.model import GPT
from horse.parallel import Parallel, init_from_env, parallelize

# Under pytest-xdist the multi-process tests run one after another in one worker: the module's runs
# fixture is built once, and their ranks do not compete with each other for the two cores.
pytestmark = pytest.mark.xdist_group("multiprocess")
ROOT = Path(__file__).resolve().parents[1]
# A small model and 3 steps: a 4-process launch takes ~13 s on two cores, mostly importing torch.
SMALL = {"n_layer": 2, "d_model": 64, "n_head": 4, "block_size": 32}
QUICK = dict(
    max_steps=3,
    warmup_steps=1,
    eval_interval=100,
    eval_tokens=64,
    sample_tokens=0,
    ckpt_interval=2,
    keep_last=0,
    precision="fp32",
    backend="reference",
    device="cpu",  # gloo, also where a GPU is visible
)
GLOBAL_BATCH = 4  # sequences per step, over all data-parallel replicas


def _torchrun(nproc: int, out_dir: Path, *launcher: str, faults: str = "", **kwargs) -> str:
    """Run horse/train.py on nproc CPU processes (with faults: tests/faulty_train.py, HORSE_FAULTS
    faults); returns the console output."""
    # --standalone: the rendezvous on a port the OS picks free (localhost:0), so launches run side by side.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    script = ROOT / "tests" / "faulty_train.py" if faults else ROOT / "horse" / "train.py"
    command += [*launcher, str(script), "--out-dir", str(out_dir)]
    command += command_line_flags(QUICK | SMALL | kwargs)
    # Without the variable a restart can read the failed workers' addresses (see horse/train.py).
    env = os.environ | {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "HORSE_FAULTS": faults,
    }
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def _records(run: Path) -> dict[int, tuple[float, float]]:
    """(loss, gradient norm) by step, from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


def _assert_same_steps(actual: dict, expected: dict) -> None:
    """The same steps with the same loss and gradient norm, up to summation order. The norm is the
    sharp test: AdamW's update (and clipping) ignores the gradients' scale, the norm does not."""
    assert actual.keys() == expected.keys()
    for step in actual:
        assert actual[step] == pytest.approx(expected[step], rel=1e-5), f"step {step}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same 3 steps twice, checkpoints at steps 2 and 3: one process on the whole batch, and
    torchrun tp=2 x dp=2 with half the batch per replica."""
    tmp = tmp_path_factory.mktemp("runs")
    cfg = train.TrainConfig(out_dir=str(tmp / "single"), batch_size=GLOBAL_BATCH, **QUICK)
    train.train(cfg, SMALL)
    out = _torchrun(4, tmp / "tp2dp2", tp=2, batch_size=GLOBAL_BATCH // 2)
    assert "4 processes (gloo) = tp 2 x dp 2" in out and "128 tokens per step" in out
    return {"single": tmp / "single", "tp2dp2": tmp / "tp2dp2"}


def test_tp2_dp2_takes_the_steps_of_one_process_on_the_whole_batch(runs):
    single, parallel = runs["single"], runs["tp2dp2"]
    _assert_same_steps(_records(parallel), _records(single))
    ckpt = parallel / "ckpt_0000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["tp_size"] == 2
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([*manifest["files"], "manifest.json"])
    state = torch.load(ckpt / "state-tp01-of-02.pt", weights_only=True)
    assert "blocks.0.mlp.c_fc.weight" in state["optimizer"]["state"]  # keyed by name, for resharding
    weights = checkpoint.full_weights(ckpt)
    assert weights["blocks.0.mlp.c_fc.weight"].shape == (256, 64)  # gathered whole
    for name, expected in load_file(single / "ckpt_0000003" / "model.safetensors").items():
        # AdamW moves each weight by up to lr = 2e-3 a step, whatever its gradient's size: where a
        # gradient is near 0, summation order alone moves the update by a few percent of that.
        torch.testing.assert_close(
            weights[name], expected, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    # A checkpoint missing a shard is torn: never picked up.
    (parallel / "ckpt_0000003" / "model-tp01-of-02.safetensors").rename(parallel / "aside")
    try:
        assert checkpoint.latest(parallel).name == "ckpt_0000002"
    finally:
        (parallel / "aside").rename(parallel / "ckpt_0000003" / "model-tp01-of-02.safetensors")


def _resume_from(run: Path, step: int, to: Path) -> None:
    shutil.copytree(run / f"ckpt_{step:07d}", to / f"ckpt_{step:07d}")


def test_checkpoints_reshard_from_tp2_to_tp1_and_back(runs, tmp_path):
    expected = _records(runs["single"])[3]
    # tp=2 -> tp=1: the tp=2 x dp=2 run's step-2 checkpoint, continued by one process.
    _resume_from(runs["tp2dp2"], 2, tmp_path / "tp1")
    cfg = train.TrainConfig(out_dir=str(tmp_path / "tp1"), resume=True, batch_size=GLOBAL_BATCH, **QUICK)
    (record,) = train.train(cfg, SMALL)
    _assert_same_steps({record["step"]: (record["loss"], record["grad_norm"])}, {3: expected})
    # tp=1 -> tp=2 (sequence parallel): one process's step-2 checkpoint, continued by two tp ranks.
    _resume_from(runs["single"], 2, tmp_path / "tp2")
    out = _torchrun(2, tmp_path / "tp2", tp=2, sequence_parallel=True, resume=True, batch_size=GLOBAL_BATCH)
    assert "resumed from ckpt_0000002" in out and "tp 2 (sequence parallel) x dp 1" in out
    _assert_same_steps(_records(tmp_path / "tp2"), {3: expected})


def test_a_checkpoint_from_before_tensor_parallelism_loads_at_any_tp_size(tmp_path, capsys):
    cfg = train.TrainConfig(
        out_dir=str(tmp_path / "run"), batch_size=GLOBAL_BATCH, **(QUICK | {"max_steps": 2})
    )
    train.train(cfg, SMALL)
    ckpt = tmp_path / "run" / "ckpt_0000002"
    config, _ = checkpoint.read_metadata(ckpt)

    def restored(parallel: Parallel) -> tuple[list[str], dict]:
        """(parameter names by optimizer position, the optimizer's state_dict) after loading ckpt."""
        model = parallelize(GPT(config, "reference"), parallel)
        optimizer = optim.make_optimizer(model, cfg, "cpu")
        checkpoint.load(ckpt, model, optimizer, parallel)
        names = {id(p): name for name, p in model.named_parameters()}
        return [names[id(p)] for g in optimizer.param_groups for p in g["params"]], optimizer.state_dict()

    order, whole = restored(Parallel())
    i = order.index("blocks.0.mlp.c_fc.weight")  # (hidden, d_model), split by rows
    # A manifest from before FSDP and checksums: its files a list, no dp_shard, no tensors table.
    files = sorted(json.loads((ckpt / checkpoint.MANIFEST).read_text())["files"])
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps({"step": 2, "tp_size": 1, "files": files}))
    assert checkpoint.verify(ckpt) == [] and checkpoint.layout(ckpt) == (1, 1)
    moments = restored(Parallel(tp_rank=1, tp_size=2))[1]["state"][i]
    assert torch.equal(moments["exp_avg_sq"], whole["state"][i]["exp_avg_sq"].chunk(2)[1])
    # What the trainer wrote before tensor parallelism: no manifest, the optimizer by position.
    torch.save(checkpoint.load_state(ckpt) | {"optimizer": whole}, ckpt / checkpoint.STATE)
    (ckpt / checkpoint.MANIFEST).unlink()
    assert checkpoint.latest(tmp_path / "run") == ckpt
    assert torch.equal(restored(Parallel())[1]["state"][0]["exp_avg"], whole["state"][0]["exp_avg"])
    # At tp=2 each rank takes its slice of AdamW's moments (loading needs no process group).
    for rank in (0, 1):
        moments = restored(Parallel(tp_rank=rank, tp_size=2))[1]["state"][i]
        assert torch.equal(moments["exp_avg_sq"], whole["state"][i]["exp_avg_sq"].chunk(2)[rank])
    # The export of it, in a directory of its own, is what horse.generate --ckpt DIR takes.
    checkpoint.export(tmp_path / "run", tmp_path / "exported" / "model.safetensors")
    assert checkpoint.resolve(tmp_path / "exported") == tmp_path / "exported"
    generate.main(["--ckpt", str(tmp_path / "exported"), "--prompt", "ROMEO:", "--max-new-tokens", "4"])
    assert "ROMEO:" in capsys.readouterr().out


def test_torchrun_restart_resumes_from_the_newest_checkpoint(runs, tmp_path):
    out = _torchrun(
        2, tmp_path / "restarted", "--max-restarts=1", faults="raise@3:1", tp=2, batch_size=GLOBAL_BATCH
    )
    assert "fault: RuntimeError in step 3" in out and "RuntimeError: injected failure in step 3" in out
    assert "restart 1" in out and "resumed from ckpt_0000002" in out and "warning" not in out
    # Steps 1 and 2 once each, though the first attempt logged them before failing in step 3.
    _assert_same_steps(_records(tmp_path / "restarted"), _records(runs["single"]))


# ----------------------------------------------------------------------------------------------
# In spawned processes
# ----------------------------------------------------------------------------------------------


def _spawn(worker, world: int, tp: int, *args) -> None:
    """Run worker(parallel, *args) on world gloo ranks; a failure on any rank fails here."""
    mp.spawn(_rank_main, args=(world, tp, free_port(), worker, args), nprocs=world)


def _rank_main(rank: int, world: int, tp: int, port: int, worker, args) -> None:
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1"}
    os.environ.update({k: str(v) for k, v in (env | {"MASTER_PORT": port}).items()})
    torch.set_num_threads(1)
    parallel = init_from_env(tp=tp, device_type="cpu")
    try:
        worker(parallel, *args)
    finally:
        dist.destroy_process_group()


def _inf_on_one_rank(parallel) -> None:
    """dp=2: rank 1 alone gets a NaN gradient (no DDP to spread it); both ranks skip and keep their
    weights; with fp16's scaler both halve the scale, without (bf16, fp32) rank 0's finite
    gradient norm does not make it step."""
    for fp16 in (True, False):
        torch.manual_seed(0)
        model = GPT(train.model_config(train.TrainConfig(), SMALL, 256))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = train.LossScaler(1024.0, 1000, fp16, parallel, hysteresis=1)
        idx = torch.randint(0, 256, (2, 8))
        before = [p.detach().clone() for p in model.parameters()]
        for poison in (True, False):
            scaler.scale(model.loss(idx, idx)).backward()
            if poison and parallel.rank == 1:
                model.blocks[0].mlp.c_fc.weight.grad[0, 0] = float("nan")
            grad_norm, skipped = optim.optimizer_step(model, optimizer, scaler, 1.0, parallel)
            assert skipped == poison and scaler.get_scale() == (512.0 if fp16 else 1.0)
            assert math.isfinite(grad_norm) == (not poison or parallel.rank == 0)
            unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
            assert unchanged == poison and bool(optimizer.state) != poison


def test_an_inf_gradient_on_one_rank_makes_every_rank_skip():
    _spawn(_inf_on_one_rank, 2, 1)


def _shards_match_export(parallel, ckpt: Path, exported: Path) -> None:
    config, _ = checkpoint.read_metadata(ckpt)
    model = parallelize(GPT(config, "reference"), parallel)
    checkpoint.load_weights(ckpt, model, parallel)  # this rank's own file
    whole = GPT(config)
    whole.load_state_dict(load_file(exported))
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(idx)  # (B, T, vocab / tp)
        parts = [torch.empty_like(logits) for _ in range(parallel.tp_size)]
        dist.all_gather(parts, logits, group=parallel.tp_group)
        torch.testing.assert_close(torch.cat(parts, dim=-1), whole(idx), rtol=1e-5, atol=1e-5)


def test_export_is_the_whole_model_of_a_sharded_checkpoint(runs, tmp_path, capsys):
    exported = tmp_path / "model.safetensors"
    weights.main(["export", str(runs["tp2dp2"]), "--out", str(exported)])
    assert "ckpt_0000003 (saved at tp=2)" in capsys.readouterr().out
    config, tokenizer = checkpoint.read_metadata(exported)
    assert config.d_model == 64 and tokenizer == "bytes"
    plain = GPT(config)
    checkpoint.load_weights(exported, plain)  # as horse.generate loads it
    _spawn(_shards_match_export, 2, 2, runs["tp2dp2"] / "ckpt_0000003", exported)
