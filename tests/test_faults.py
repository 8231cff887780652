"""Faults survived, counted: each test runs horse/train.py (through tests/faulty_train.py, which
strikes at an exact step) on the CPU with a small model, in fp32, lets a fault strike, resumes, and
asserts how many steps were lost (at most the checkpoint interval, and the save still in flight;
none after SIGTERM) and that the resumed run's losses, gradient norms and validation losses equal
the uninterrupted run's bit for bit. Faults: kill -9 at seeded random steps (one in a save, one in
a background save on a slow file system), SIGTERM with and without a grace period (and with a
background save in flight), a second signal during the save, a failing write (ENOSPC mid-save,
--on-save-error stop and continue), a damaged newest checkpoint, and under torchrun (gloo, tp=2,
--max-restarts) a signal on one rank, a rank killed and one rank's failed save, and SIGTERM sent to
torchrun itself; with a stand-in all-reduce, a rank's own signal handled just after the ranks
agreed. A NaN gradient on one rank (loss finite) at --dp-shard 2 in bf16 and fp32: every rank skips
the step, and no checkpoint holds it; one damaged to hold a NaN is passed over."""

import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock
from helpers import command_line_flags
from safetensors import safe_open
from safetensors.torch import save_file

from horse import checkpoint, cli, hf, preemption, train

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "faulty_train.py"
STEPS, INTERVAL = 16, 4
RUN = dict(
    n_layer=2, d_model=64, n_head=4, block_size=32, batch_size=4, max_steps=STEPS, warmup_steps=2,
    eval_interval=8, eval_tokens=128, sample_tokens=0, ckpt_interval=INTERVAL, log_interval=100,
    precision="fp32", backend="reference", device="cpu",
)  # fmt: skip


def _command(run: Path, nproc: int = 0, launcher: tuple = (), **flags) -> list[str]:
    """The driver on run with these flags; nproc > 0: under torchrun with nproc CPU processes."""
    command = [sys.executable]
    if nproc:
        command += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *launcher]
    return command + [str(DRIVER), "--out-dir", str(run), *command_line_flags(RUN | flags)]


def _env(faults: str = "", write_delay: float = 0) -> dict:
    return os.environ | {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HORSE_FAULTS": faults,
        "HORSE_WRITE_DELAY": str(write_delay),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # see horse/train.py on restarts
    }


def _launch(
    run: Path, faults: str = "", nproc: int = 0, launcher: tuple = (), write_delay: float = 0, **flags
) -> tuple[int, str]:
    """(exit status, console output) of the driver on run with these faults and flags (write_delay:
    seconds each weights file's write sleeps first, a slow file system)."""
    command = _command(run, nproc, launcher, **flags)
    env = _env(faults, write_delay)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def _steps(run: Path) -> dict[int, tuple]:
    """(loss, gradient norm, validation loss) by step, from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"], r.get("val_loss")) for r in records}


def _resumed_from(out: str) -> int:
    """The step the launch resumed from (0: none, it started afresh)."""
    found = re.findall(r"resumed from ckpt_(\d+)", out)
    assert len(found) <= 1, out[-3000:]
    return int(found[0]) if found else 0


def _assert_finished_as(run: Path, reference: dict) -> None:
    """Every step logged once, each exactly as in the uninterrupted run; no unfinished save left."""
    assert _steps(run) == reference
    assert checkpoint.verify(checkpoint.latest(run)) == []
    assert not list(run.glob(".ckpt_*")), "a save's temporary directory was left behind"


def _ckpt(run: Path, step: int) -> Path:
    return run / f"ckpt_{step:07d}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run: its directory and its steps. Under xdist its workers share one, in
    their session's directory."""
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    with FileLock(shared / "faults-reference.lock"):
        run = shared / "faults-reference"
        if not (run / "done").exists():
            shutil.rmtree(run, ignore_errors=True)
            status, out = _launch(run)
            assert status == 0, out[-3000:]
            (run / "done").touch()
    return run, _steps(run)


def test_kill_9_at_seeded_steps_loses_at_most_an_interval_and_the_save_in_flight(reference, tmp_path):
    """--async-checkpoint: a kill while the newest save is still written in the background loses
    that save too, so up to an interval more is redone (never the one before: the newest save
    waited for it)."""
    rng = random.Random(27)
    in_save = rng.choice(range(INTERVAL, STEPS, INTERVAL))  # killed while writing this step's checkpoint
    others = rng.sample([s for s in range(1, STEPS) if s != in_save], 4)
    faults = sorted([(s, "kill") for s in others] + [(in_save, "kill-in-save")])
    run, previous = tmp_path / "run", None
    for step, kind in [*faults, (None, None)]:
        status, out = _launch(run, f"{kind}@{step}" if kind else "", resume=previous is not None)
        if previous is not None:  # the launch before was killed in step `previous`
            lost = previous - _resumed_from(out)
            assert 0 < lost < 2 * INTERVAL, f"killed in step {previous}, {out[-2000:]}"
        if kind is None:
            assert status == 0, out[-3000:]
            break
        assert status == -signal.SIGKILL, out[-3000:]
        assert f"kill -9{' during the save' if kind == 'kill-in-save' else ''} in step {step}" in out
        if kind == "kill-in-save":  # its save was cut short: a temporary directory, never a checkpoint
            assert not _ckpt(run, step).exists() and (run / f".ckpt_{step:07d}.tmp").is_dir()
        previous = step
    _assert_finished_as(run, reference[1])


def test_kill_9_during_a_background_save_leaves_the_previous_checkpoint_the_newest_good_one(
    reference, tmp_path
):
    """--async-checkpoint (the default) on a slow file system: the save of step 8 is written in a
    thread while steps 9 on train, and the process is killed in that write."""
    run, step = tmp_path / "run", 2 * INTERVAL
    status, out = _launch(run, f"kill-in-save@{step}", write_delay=1.0)
    assert status == -signal.SIGKILL and f"kill -9 during the save in step {step}" in out, out[-3000:]
    assert max(_steps(run)) > step  # training went on while the save was written
    assert not _ckpt(run, step).exists() and (run / f".ckpt_{step:07d}.tmp").is_dir()
    assert checkpoint.newest_good(run) == (_ckpt(run, INTERVAL), [])
    status, out = _launch(run, resume=True)
    assert status == 0 and _resumed_from(out) == INTERVAL, out[-3000:]
    _assert_finished_as(run, reference[1])


def test_sigterm_waits_for_the_background_save_in_flight_then_saves_its_step(tmp_path):
    run, step = tmp_path / "run", 2 * INTERVAL + 1  # step 8's save still being written
    status, out = _launch(run, f"term@{step}", write_delay=1.0)
    assert status == preemption.PREEMPTED, out[-3000:]
    assert f"preempted: SIGTERM during step {step}; step {step} finished and saved" in out
    saved = [INTERVAL, 2 * INTERVAL, step]
    assert checkpoint.candidates(run) == [_ckpt(run, s) for s in saved] and not list(run.glob(".ckpt_*"))
    assert all(checkpoint.verify(_ckpt(run, s)) == [] for s in saved)


def test_sigterm_with_a_grace_period_loses_no_step(reference, tmp_path):
    step = random.Random(28).choice([s for s in range(2, STEPS) if s % INTERVAL])
    run = tmp_path / "run"
    status, out = _launch(run, f"term@{step}")
    assert status == preemption.PREEMPTED, out[-3000:]
    assert f"preempted: SIGTERM during step {step}; step {step} finished and saved" in out
    assert max(_steps(run)) == step and checkpoint.latest(run) == _ckpt(run, step)
    status, out = _launch(run, resume=True)
    assert status == 0 and _resumed_from(out) == step, out[-3000:]  # nothing lost
    _assert_finished_as(run, reference[1])


def test_sigterm_without_a_grace_period_loses_at_most_an_interval(reference, tmp_path):
    """SIGKILL follows SIGTERM before the save it asked for is written."""
    step = random.Random(29).choice([s for s in range(2, STEPS) if s % INTERVAL])
    run = tmp_path / "run"
    status, out = _launch(run, f"term-nograce@{step}")
    assert status == -signal.SIGKILL and "kill -9 during the save" in out, out[-3000:]
    assert not _ckpt(run, step).exists()
    status, out = _launch(run, resume=True)
    assert status == 0 and 0 < step - _resumed_from(out) <= INTERVAL, out[-3000:]
    _assert_finished_as(run, reference[1])


def test_a_second_signal_aborts_the_save_and_keeps_the_older_checkpoints(reference, tmp_path):
    step = 2 * INTERVAL + 1
    run = tmp_path / "run"
    status, out = _launch(run, f"term-twice@{step}", keep_last=1)
    assert status == 128 + signal.SIGTERM and "SIGTERM again: aborting now" in out, out[-3000:]
    # Neither the aborted save nor its temporary directory; the one older checkpoint kept, whole.
    assert [p.name for p in checkpoint.candidates(run)] == [_ckpt(run, 2 * INTERVAL).name]
    assert checkpoint.verify(_ckpt(run, 2 * INTERVAL)) == [] and not list(run.glob(".ckpt_*"))
    status, out = _launch(run, resume=True)
    assert status == 0 and _resumed_from(out) == 2 * INTERVAL, out[-3000:]
    _assert_finished_as(run, reference[1])


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_full_disk_mid_save_keeps_the_older_checkpoints(reference, tmp_path, on_error):
    failing = 2 * INTERVAL
    run = tmp_path / "run"
    status, out = _launch(run, f"enospc@{failing}", keep_last=1, on_save_error=on_error)
    assert "ENOSPC during the save in step 8" in out
    cannot = (
        f"checkpoint ckpt_{failing:07d} could not be written: SafetensorError: Error while serializing: "
        "I/O error: No space left on device"
    )
    if on_error == "stop":
        assert status == 1 and f"horse.train: error: {cannot}" in out, out[-3000:]
        # Rotation (--keep-last 1) never ran: the older checkpoint is there, whole.
        assert checkpoint.candidates(run) == [_ckpt(run, INTERVAL)] and not list(run.glob(".ckpt_*"))
        assert checkpoint.verify(_ckpt(run, INTERVAL)) == []
        status, out = _launch(run, resume=True)
        assert status == 0 and _resumed_from(out) == INTERVAL, out[-3000:]
    else:
        assert status == 0, out[-3000:]
        assert f"warning: {cannot}" in out and f"next try: step {failing + INTERVAL}" in out
        assert checkpoint.candidates(run) == [_ckpt(run, STEPS)]
    _assert_finished_as(run, reference[1])


def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumes(reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference[0], run, ignore=shutil.ignore_patterns("done"))
    weights = _ckpt(run, STEPS) / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)  # a failed copy
    truncated = f"model.safetensors: {size // 2:,} bytes, the manifest says {size:,}"
    with pytest.raises(SystemExit) as exit_:
        hf.weights.main(["verify", str(run)])
    out = capsys.readouterr().out
    assert exit_.value.code == 1 and f"ckpt_{STEPS:07d}: DAMAGED: {truncated}" in out
    assert f"ckpt_{STEPS - INTERVAL:07d}: good (sizes and SHA-256 match, every tensor finite)" in out
    cfg, overrides = cli.parse_args(["--out-dir", str(run), "--resume", "--strict-resume"])
    with pytest.raises(ValueError, match=rf"ckpt_{STEPS:07d} is damaged: {truncated} \(--strict-resume\)"):
        train.train(cfg, overrides)
    status, out = _launch(run, resume=True)
    assert status == 0 and _resumed_from(out) == STEPS - INTERVAL, out[-3000:]
    assert f"warning: checkpoint ckpt_{STEPS:07d} is damaged, skipped: {truncated}" in out
    _assert_finished_as(run, reference[1])
    with pytest.raises(SystemExit) as exit_:
        hf.weights.main(["verify", str(run)])
    assert exit_.value.code == 0
    # Contents damaged at the same size, a file gone, a manifest cut short: each named.
    older = _ckpt(run, STEPS - INTERVAL)
    with open(older / "state.pt", "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    assert checkpoint.verify(older) == [
        "state.pt: its SHA-256 is not the manifest's (the contents are damaged)"
    ]
    (older / "model.safetensors").unlink()
    assert checkpoint.verify(older)[0] == "model.safetensors: missing"
    (older / "manifest.json").write_text('{"step": 12, "files": {"mod')
    assert checkpoint.verify(older)[0].startswith("manifest.json: unreadable (JSONDecodeError")
    shutil.copytree(older, tmp_path / "none-good" / older.name)
    with pytest.raises(ValueError, match=f"no good checkpoint in .*: checkpoint {older.name} is damaged"):
        checkpoint.newest_good(tmp_path / "none-good")


def test_save_on_signal_names_real_signals_and_empty_installs_none():
    assert preemption.parse_signals("SIGTERM SIGUSR1") == [signal.SIGTERM, signal.SIGUSR1]
    assert preemption.parse_signals("term,usr2") == [signal.SIGTERM, signal.SIGUSR2]
    with pytest.raises(ValueError, match="--save-on-signal: 'SIGKILL' is not a signal that can be caught"):
        train.TrainConfig(save_on_signal="SIGKILL")
    with pytest.raises(ValueError, match="'SIGNOPE' is not a signal"):
        preemption.parse_signals("SIGNOPE")
    before = signal.getsignal(signal.SIGTERM)
    with preemption.Preemption(preemption.parse_signals("")) as preempt:
        assert signal.getsignal(signal.SIGTERM) is before and preempt.agreed() is None
    with preemption.Preemption([signal.SIGUSR1, signal.SIGUSR2]) as preempt:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)  # before the save: the same request, as Slurm's and torchrun's
        assert preempt.agreed() == signal.SIGUSR1
        with pytest.raises(SystemExit) as aborted, preempt.saving():
            os.kill(os.getpid(), signal.SIGUSR2)
        assert aborted.value.code == 128 + signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_every_rank_returns_the_reduced_signal_whenever_its_handler_runs(monkeypatch):
    """A rank's handler runs once its main thread is back in Python, which can be just after the
    all-reduce of the signal (torchrun signals its workers one after the other): that rank must
    still return what the others got, and its own copy must not abort a save made for theirs."""
    world = {"others": 0}  # the other ranks' signal; "arrives_after": this rank's, sent late

    def all_reduce(flag, op):
        flag.fill_(max(int(flag), world["others"]))
        if late := world.pop("arrives_after", None):
            os.kill(os.getpid(), late)

    monkeypatch.setattr(preemption.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(preemption.dist, "all_reduce", all_reduce)
    with preemption.Preemption([signal.SIGUSR1]) as preempt:
        world["arrives_after"] = signal.SIGUSR1
        assert preempt.agreed() is None  # as on the others: no rank had one when they reduced
        assert preempt.agreed() == signal.SIGUSR1  # the next step's
    with preemption.Preemption([signal.SIGUSR1]) as preempt:
        world["others"] = signal.SIGUSR1
        assert preempt.agreed() == signal.SIGUSR1
        with preempt.saving():
            os.kill(os.getpid(), signal.SIGUSR1)  # this rank's first: the same request, no abort
        with pytest.raises(SystemExit) as aborted, preempt.saving():
            os.kill(os.getpid(), signal.SIGUSR1)  # its second
        assert aborted.value.code == 128 + signal.SIGUSR1


def test_torchrun_ranks_agree_on_a_signal_a_failed_save_and_restart_after_a_kill(tmp_path):
    """tp=2 on two processes, each writing its own shard, --on-save-error continue. First launch:
    rank 1 alone gets SIGUSR1 in step 3; both ranks save step 3 and exit 75, and torchrun starts
    them again. Second: rank 0 is killed in step 6, and torchrun starts them again. Third: rank 1's
    save of step 8 fails (ENOSPC); both ranks go on. They finish as an uninterrupted tp=2 run."""
    steps = dict(tp=2, max_steps=12, eval_interval=4, on_save_error="continue")
    status, out = _launch(tmp_path / "reference", nproc=2, **steps)
    assert status == 0, out[-3000:]
    run = tmp_path / "run"
    faults = "usr1@3:1:0,kill@6:0:1,enospc@8:1:2"
    status, out = _launch(run, faults, nproc=2, launcher=("--max-restarts=2",), **steps)
    assert status == 0, out[-5000:]
    assert "preempted: SIGUSR1 during step 3; step 3 finished and saved" in out
    assert "fault: kill -9 in step 6" in out
    resumed = [int(s) for s in re.findall(r"resumed from ckpt_(\d+)", out)]
    assert resumed == [3, INTERVAL]  # nothing lost to the signal; 2 steps to the kill
    assert "warning: checkpoint ckpt_0000008 could not be written: rank 1: SafetensorError" in out
    assert [p.name for p in checkpoint.candidates(run)] == ["ckpt_0000003", "ckpt_0000004", "ckpt_0000012"]
    _assert_finished_as(run, _steps(tmp_path / "reference"))


def test_sigterm_to_torchrun_reaches_every_worker_and_loses_no_step(tmp_path):
    """As Kubernetes or Slurm preempt: SIGTERM to torchrun itself, at whatever step the run is in.
    torchrun forwards it to its workers and waits for them; they save the step they were in."""
    run = tmp_path / "run"
    flags = dict(tp=2, max_steps=100_000, ckpt_interval=100_000, eval_interval=100_000)
    log = tmp_path / "console.log"  # a file, not a pipe that nobody reads until the end
    with (
        open(log, "w") as console,
        subprocess.Popen(
            _command(run, nproc=2, **flags), env=_env(), stdout=console, stderr=subprocess.STDOUT
        ) as launch,
    ):
        metrics, deadline = run / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert launch.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        launch.send_signal(signal.SIGTERM)
        launch.wait(timeout=120)
    out = log.read_text()
    assert "Sending process" in out and "closing signal SIGTERM" in out, out[-3000:]  # torchrun's own log
    step = max(_steps(run))
    assert f"preempted: SIGTERM during step {step}; step {step} finished and saved" in out, out[-3000:]
    assert checkpoint.latest(run) == _ckpt(run, step) and checkpoint.verify(_ckpt(run, step)) == []


def _poison(ckpt: Path, weights_file: str) -> str:
    """Write a NaN into the first tensor of one of ckpt's weights files, with the manifest's size
    and SHA-256 made to match (damage that no checksum finds, as a save without the finite check
    wrote it); returns that tensor's name."""
    path = ckpt / weights_file
    with safe_open(path, framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata=metadata)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest["files"][weights_file] = {
        "size": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return name


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_nan_gradient_on_one_rank_is_skipped_by_every_rank_and_never_saved(tmp_path, precision):
    """--dp-shard 2: rank 1's gradient gets a NaN in step 3 (its embedding's output gradient: one
    row, so one rank's shard). Both ranks skip the step (AdamW counts 5 of 6 steps in both pieces),
    the weights stay finite, every checkpoint verifies finite; then a NaN written into the newest
    one, checksums kept, makes the fallback take the one before it."""
    run, steps = tmp_path / "run", 6
    flags = dict(dp_shard=2, precision=precision, max_steps=steps, ckpt_interval=2, eval_interval=steps)
    status, out = _launch(run, "nan-grad@3:1", nproc=2, **flags)
    assert status == 0, out[-3000:]
    assert "fault: a NaN into the gradient of Embedding's output in step 3" in out
    assert "step 3/6 | loss" in out and "grad norm nan" in out and "(step skipped: inf/NaN gradients)" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [r["step"] == 3 for r in records] and len(records) == steps
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) != r["skipped"] for r in records)
    assert [p.name for p in checkpoint.candidates(run)] == ["ckpt_0000002", "ckpt_0000004", "ckpt_0000006"]
    for ckpt in checkpoint.candidates(run):
        assert (
            checkpoint.verify(ckpt) == []
            and json.loads((ckpt / checkpoint.MANIFEST).read_text())["checked_finite"]
        )
    for piece in (0, 1):  # each rank's own AdamW state: one step fewer than the run's
        optimizer = checkpoint.load_state(_ckpt(run, steps), 0, piece)["optimizer"]
        assert {int(entry["step"]) for entry in optimizer["state"].values()} == {steps - 1}
    name = _poison(_ckpt(run, steps), "model-fsdp01-of-02.safetensors")
    poisoned = f"model-fsdp01-of-02.safetensors: {name} hold inf or NaN (a poisoned state)"
    assert checkpoint.verify(_ckpt(run, steps)) == [poisoned]
    assert checkpoint.newest_good(run) == (
        _ckpt(run, 4),
        [f"checkpoint ckpt_0000006 is damaged, skipped: {poisoned}"],
    )
