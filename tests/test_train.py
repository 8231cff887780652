"""horse.train: the loss falls, a resumed run repeats the uninterrupted one exactly, fp16 loss scaling
skips bad steps, checkpoints are atomic and checked, and bad flags are named."""

import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_close

from horse import checkpoint, cli, data, device, generate, optim, recipes, train
from horse.cli import parse_args
from horse.kernels import runtime
from horse.model import GPT, GPTConfig
from horse.optim import lr_at, optimizer_step
from horse.parallel import apply
from horse.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
# A smaller model than the tiny preset, so that a run takes a second or two.
SMALL = {"n_layer": 2, "d_model": 64, "n_head": 4, "block_size": 32}


def _cfg(tmp_path, **kwargs) -> TrainConfig:
    quick = dict(batch_size=8, max_steps=8, warmup_steps=2, eval_interval=4, eval_tokens=512, sample_tokens=0,
                 device="cpu")  # fmt: skip
    return TrainConfig(**({"out_dir": str(tmp_path / "run")} | quick | kwargs))


def test_loss_falls_on_the_builtin_corpus(tmp_path, capsys):
    records = train.train(
        _cfg(tmp_path, max_steps=40, eval_interval=40, eval_tokens=4096, sample_tokens=20), SMALL
    )
    losses = [r["loss"] for r in records]
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at initialisation
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0
    assert records[-1]["val_loss"] < losses[0] - 2.0
    out = capsys.readouterr().out
    assert "backend reference (on the CPU" in out and "precision fp32" in out
    assert "----- sample: 20 tokens" in out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 41))
    assert {"loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "mfu"} <= json.loads(lines[0]).keys()


def test_backend_defaults_to_the_kernels_only_on_gpus_they_have_configs_for(monkeypatch):
    assert device.pick_backend(None, "cpu")[0] == "reference"
    assert device.pick_backend("triton", "cpu") == ("triton", "")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "arch", lambda device: runtime.SM80)
    assert device.pick_backend(None, "cuda") == ("triton", "")
    monkeypatch.setattr(runtime, "arch", lambda device: runtime.arch_of_capability(7, 5, "Tesla T4"))
    backend, why = device.pick_backend(None, "cuda")
    assert backend == "reference" and "Tesla T4 is 7.5" in why
    assert device.pick_backend("reference", "cuda") == ("reference", "")
    with pytest.raises(RuntimeError, match=r"Tesla T4 is 7\.5"):
        device.pick_backend("triton", "cuda")


def test_device_defaults_to_a_visible_gpu_and_cuda_without_one_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.pick_device(None) == "cpu" and device.pick_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is visible"):
        device.pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.pick_device(None) == "cuda" and device.pick_device("cpu") == "cpu"


def test_resumed_run_repeats_the_uninterrupted_losses_exactly(tmp_path):
    full = train.train(_cfg(tmp_path, ckpt_interval=3, keep_last=0), SMALL)
    # The run "dies" after step 3: a fresh directory holding only that checkpoint.
    shutil.copytree(tmp_path / "run" / "ckpt_0000003", tmp_path / "resumed" / "ckpt_0000003")
    resumed = train.train(_cfg(tmp_path, out_dir=str(tmp_path / "resumed"), resume=True), SMALL)
    assert [r["step"] for r in resumed] == list(range(4, 9))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]  # bit for bit
    assert [r["val_loss"] for r in resumed if "val_loss" in r] == [
        r["val_loss"] for r in full[3:] if "val_loss" in r
    ]
    state = torch.load(tmp_path / "resumed" / "ckpt_0000008" / "state.pt", weights_only=True)
    assert state["step"] == 8 and (state["loader"]["epoch"], state["loader"]["position"]) == (0, 8 * 8)
    full_weights, resumed_weights = (_weights(tmp_path / d / "ckpt_0000008") for d in ("run", "resumed"))
    assert all(torch.equal(a, b) for a, b in zip(full_weights, resumed_weights, strict=True))


def _weights(ckpt: Path) -> list[torch.Tensor]:
    config, _ = checkpoint.read_metadata(ckpt)
    model = GPT(config)
    checkpoint.load_weights(ckpt, model)
    return list(model.state_dict().values())


def test_inf_gradient_skips_the_step_halves_the_scale_and_keeps_the_weights():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = train.LossScaler(init_scale=1024.0, growth_interval=2, hysteresis=1)
    idx = torch.randint(0, 64, (2, 8))

    def backward(poison: bool) -> None:
        with torch.autocast("cpu", torch.float16):
            loss = model.loss(idx, idx)
        scaler.scale(loss).backward()
        if poison:
            model.blocks[0].mlp.c_fc.weight.grad[0, 0] = float("inf")

    before = [p.detach().clone() for p in model.parameters()]
    backward(poison=True)
    grad_norm, skipped = optimizer_step(model, optimizer, scaler, grad_clip=1.0)
    assert skipped and not math.isfinite(grad_norm)
    assert scaler.get_scale() == 512.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not optimizer.state  # AdamW's moments untouched too
    for scale_after in (512.0, 1024.0):  # two clean steps, then the scale grows back
        backward(poison=False)
        _, skipped = optimizer_step(model, optimizer, scaler, grad_clip=1.0)
        assert not skipped and scaler.get_scale() == scale_after
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_a_nan_gradient_without_loss_scaling_skips_the_step_and_too_many_in_a_row_stop(autocast_dtype):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = train.LossScaler(enabled=False, max_skipped_steps=2)
    idx = torch.randint(0, 64, (2, 8))

    def step(poison: bool) -> tuple[float, bool]:
        with torch.autocast("cpu", autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = model.loss(idx, idx)
        loss.backward()
        if poison:
            model.blocks[0].mlp.c_fc.weight.grad[0, 0] = float("nan")
        grad_norm, skipped = optimizer_step(model, optimizer, scaler, grad_clip=1.0)
        scaler.check(1, loss.item())
        return grad_norm, skipped

    before = [p.detach().clone() for p in model.parameters()]
    grad_norm, skipped = step(poison=True)
    assert skipped and math.isnan(grad_norm) and scaler.state_dict() == {"skipped_steps": 1}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not optimizer.state  # AdamW's moments and step count untouched too
    assert step(poison=False)[1] is False and scaler.state_dict() == {"skipped_steps": 0}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    step(poison=True)
    gave_up = (
        r"training gave up at step 1: the last 2 steps were all skipped for inf/NaN gradients "
        r"\(--max-skipped-steps 2\), without loss scaling"
    )
    with pytest.raises(FloatingPointError, match=gave_up):
        step(poison=True)


def test_a_state_that_is_not_finite_is_never_saved(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.loss(*[torch.randint(0, 64, (2, 8))] * 2).backward()
    optimizer.step()
    checkpoint.save(tmp_path, 1, model, optimizer, {}, "bytes")
    assert json.loads((tmp_path / "ckpt_0000001" / checkpoint.MANIFEST).read_text())["checked_finite"]
    optimizer.state[model.blocks[0].mlp.c_fc.weight]["exp_avg_sq"][3, 1] = float("inf")
    with torch.no_grad():
        model.blocks[0].attn.c_proj.weight[0, 0] = float("nan")
    refused = (
        r"ckpt_0000002 could not be written: FloatingPointError: the state to save holds inf or NaN in "
        r"blocks.0.attn.c_proj.weight, exp_avg_sq of blocks.0.mlp.c_fc.weight; .* \(nothing of it is kept"
    )
    with pytest.raises(checkpoint.SaveError, match=refused):
        checkpoint.save(tmp_path, 2, model, optimizer, {}, "bytes")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt_0000001"]


def test_a_background_save_writes_the_state_of_its_step_while_training_changes_it(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.loss(*[torch.randint(0, 64, (2, 8))] * 2).backward()
    optimizer.step()
    at_the_step = {name: w.clone() for name, w in model.state_dict().items()}
    writing, may_finish = threading.Event(), threading.Event()
    save_file = checkpoint.save_file

    def slow_save_file(*args, **kwargs):  # a slow file system, held until the step has moved on
        writing.set()
        assert may_finish.wait(timeout=60)
        save_file(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", slow_save_file)
    saver = checkpoint.BackgroundSaver(train.Parallel())
    ckpt = checkpoint.save(tmp_path, 1, model, optimizer, {}, "bytes", saver=saver)
    assert writing.wait(timeout=60) and not ckpt.exists()
    with pytest.raises(RuntimeError, match="a checkpoint save is in flight: wait"):
        checkpoint.save(tmp_path, 2, model, optimizer, {}, "bytes", saver=saver)
    with torch.no_grad():  # the next step, in place
        for w in model.parameters():
            w.add_(1.0)
    may_finish.set()
    assert saver.wait() == ckpt and checkpoint.verify(ckpt) == []
    saved = checkpoint.full_weights(ckpt)
    assert all(torch.equal(saved[name], w) for name, w in at_the_step.items())


def test_ranks_on_the_cpu_share_the_cores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    try:
        torch.set_num_threads(8)
        for ranks, threads in [(1, 8), (3, 2), (4, 2), (16, 1), (2, 1)]:  # never more than it had
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
            assert train.share_the_cores() == threads == torch.get_num_threads(), ranks
    finally:
        torch.set_num_threads(before)


def test_fp16_run_on_the_cpu_logs_the_loss_scale(tmp_path):
    records = train.train(_cfg(tmp_path, max_steps=3, precision="fp16", loss_scale=256.0), SMALL)
    assert [r["loss_scale"] for r in records] == [256.0] * 3
    state = checkpoint.load_state(tmp_path / "run" / "ckpt_0000003")
    assert state["scaler"]["scale"] == 256.0


def test_checkpoints_rotate_and_a_torn_one_is_ignored(tmp_path):
    train.train(_cfg(tmp_path, max_steps=4, ckpt_interval=1, keep_last=2), SMALL)
    run = tmp_path / "run"
    assert [p.name for p in checkpoint.complete(run)] == ["ckpt_0000003", "ckpt_0000004"]
    (run / ".ckpt_0000005.tmp").mkdir()  # killed mid-write
    (run / "ckpt_0000006").mkdir()  # incomplete: no files
    assert checkpoint.latest(run).name == "ckpt_0000004"
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run .* --resume"):
        train.train(_cfg(tmp_path, max_steps=4), SMALL)
    # --out-dir and --resume alone bring back the run's own flags; flags given win.
    cfg, overrides = parse_args(["--out-dir", str(run), "--resume", "--max-steps", "6"])
    assert (cfg.batch_size, cfg.max_steps, cfg.resume, cfg.keep_last) == (8, 6, True, 2)
    assert overrides | SMALL == overrides and overrides["vocab_size"] == 256


def test_a_checkpoint_of_another_model_shape_is_a_clear_error(tmp_path):
    train.train(_cfg(tmp_path, max_steps=1), SMALL)
    with pytest.raises(ValueError, match=r"different model: n_layer 2 \(this run: 3\)"):
        train.train(_cfg(tmp_path, max_steps=2, resume=True), SMALL | {"n_layer": 3})
    model = GPT(GPTConfig(**(SMALL | {"d_model": 32, "vocab_size": 256})))
    with pytest.raises(
        ValueError, match=r"does not fit this model: .*wte.weight is \[256, 64\], the model's is \[256, 32\]"
    ):
        checkpoint.load_weights(tmp_path / "run" / "ckpt_0000001", model)


def test_flags_config_file_and_errors_that_name_the_argument(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"lr": 3e-4, "n_layer": 6, "batch_size": 4}))
    cfg, overrides = parse_args(
        [
            "--config",
            str(tmp_path / "run.json"),
            "--batch-size",
            "2",
            "--max-tokens",
            "1e6",
            "--norm",
            "rmsnorm",
            "--no-bias",
        ]
    )
    assert (cfg.lr, cfg.batch_size, cfg.max_tokens) == (3e-4, 2, 1_000_000)
    assert overrides == {"n_layer": 6, "norm": "rmsnorm", "bias": False}
    for argv, message in [
        (["--preset", "gpt5"], "--preset 'gpt5' is unknown"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--precision", "fp8"], "--precision: invalid choice"),
        (["--device", "tpu"], "--device: invalid choice"),
        (["--resume"], "--resume needs --out-dir"),
        (
            ["--config", str(tmp_path / "run.json"), "--config", str(tmp_path / "nope.json")],
            "--config .*nope.json",
        ),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message.split(".*")[0] in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"learning_rate": 1}))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "bad.json")])
    assert "unknown field 'learning_rate'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--seq-len 64 exceeds the model's block_size 32"):
        train.train(_cfg(tmp_path, seq_len=64), SMALL)
    with pytest.raises(ValueError, match="--vocab-size 100 is smaller than the data's vocabulary"):
        train.train(_cfg(tmp_path), SMALL | {"vocab_size": 100})


def test_learning_rate_schedule():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1) and lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(99, 100, cfg) == pytest.approx(0.1)
    assert lr_at(99, 100, TrainConfig(lr=1.0, warmup_steps=10, decay="linear", min_lr_ratio=0.0)) == 0.0
    halfway = lr_at(54, 100, TrainConfig(lr=1.0, warmup_steps=10, decay="cosine", min_lr_ratio=0.0))
    assert halfway == pytest.approx(0.5, abs=0.02)


def test_weight_decay_only_on_the_matrices():
    model = GPT(GPTConfig(**(SMALL | {"vocab_size": 256})))
    decay, no_decay = optim.make_optimizer(model, TrainConfig(weight_decay=0.1), "cpu").param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    linears = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert decayed == {f"blocks.{i}.{linear}.weight" for i in range(2) for linear in linears}
    assert {names[id(p)] for p in no_decay["params"]} == set(
        names.values()
    ) - decayed  # embeddings, norms, biases


def test_peak_flops_by_device_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 PCIe")
    assert device.peak_flops("cuda", None) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    assert device.peak_flops("cuda", None) == 989e12
    assert device.peak_flops("cpu", None) is None and device.peak_flops("cpu", 1.5) == 1.5e12


def _command(*args: str) -> subprocess.CompletedProcess:
    small = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args, *small], cwd=ROOT, env=env, capture_output=True, text=True)


def test_script_profile_trace_and_generate_command(tmp_path, capsys):
    out = tmp_path / "run"
    steps = [
        "--device=cpu",
        "--max-steps=4",
        "--batch-size=4",
        "--profile-steps=1",
        "--sample-tokens=8",
        "--sample-prompt=ROMEO:",
    ]
    result = _command("horse/train.py", f"--out-dir={out}", *steps)  # the script path, not -m
    assert result.returncode == 0, result.stderr
    assert "step 4/4" in result.stdout and "ROMEO:" in result.stdout
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    # 70 new tokens: past the 32-token block, so the cache is refilled on the way.
    generate.main(["--ckpt", str(out), "--prompt", "JULIET:", "--max-new-tokens", "70", "--num-samples", "2"])
    printed = capsys.readouterr().out
    assert printed.count("JULIET:") == 2 and "--- sample 2 ---" in printed
    bad = _command("-m", "horse.train", f"--out-dir={out}", "--seq-len=64")
    assert bad.returncode == 1 and "horse.train: error: --seq-len 64 exceeds" in bad.stderr


@pytest.mark.gpu
def test_fp16_training_on_the_gpu_with_the_kernels(tmp_path, capsys):
    records = train.train(_cfg(tmp_path, max_steps=30, ckpt_interval=15, device="cuda"), SMALL)
    out = capsys.readouterr().out
    assert "backend triton" in out and "precision fp16" in out
    assert all(r["loss_scale"] is not None for r in records)
    assert sum(r["loss"] for r in records[-5:]) / 5 < records[0]["loss"] - 1.5
    state = checkpoint.load_state(tmp_path / "run" / "ckpt_0000015")
    assert state["scaler"]["scale"] > 0 and state["rng"]["cuda"]


def test_presets_carry_their_recipe_and_flags_override_it(capsys):
    cfg, _ = parse_args(["--preset", "gpt2-124m", "--data", "d"])
    assert (cfg.lr, cfg.warmup_steps, cfg.batch_tokens) == (6e-4, 715, 524_288)  # GPT-3 Small's
    assert (cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.eval_tokens) == (0.1, 0.9, 0.95, 2**20)
    xl, _ = parse_args(["--preset", "gpt2-1.5b"])
    assert (xl.lr, xl.warmup_steps, xl.batch_tokens) == (2e-4, 358, 2**20)  # GPT-3 XL's
    cfg, _ = parse_args(["--preset", "gpt2-350m", "--lr", "1e-4", "--beta2", "0.99"])
    assert (cfg.lr, cfg.beta2, cfg.warmup_steps, cfg.batch_tokens) == (1e-4, 0.99, 715, 524_288)
    assert "--lr 0.0001 (the recipe's 0.0003), --warmup-steps 715, " in recipes.describe(cfg)
    # --grad-accum alone drops the recipe's tokens a step; the tiny recipe has none.
    assert parse_args(["--preset", "gpt2-124m", "--grad-accum", "4"])[0].batch_tokens is None
    assert parse_args([])[0].batch_tokens is None and parse_args([])[0].lr == 2e-3
    cfg = parse_args(["--preset", "gpt2-124m", "--batch-size", "16"])[0]
    assert recipes.grad_accum(cfg, 1024, dp_size=1) == 32 and recipes.grad_accum(cfg, 1024, dp_size=4) == 8
    with pytest.raises(
        ValueError, match="--batch-tokens 524,288 is not a multiple of --batch-size 16 x seq_len 1000"
    ):
        recipes.grad_accum(cfg, 1000, dp_size=1)
    given = ["--batch-size", "16", "--grad-accum", "4", "--batch-tokens", "524288"]
    cfg, _ = parse_args(["--preset", "gpt2-124m", *given])
    with pytest.raises(ValueError, match="--grad-accum 4 and --batch-tokens 524,288 disagree"):
        recipes.grad_accum(cfg, 1024, dp_size=1)


def test_a_gpt2_preset_without_data_says_what_to_prepare():
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--preset", "gpt2-124m", "--device", "cpu"])
    err = str(exit_.value.code)  # sys.exit's message, printed to stderr
    assert "--preset gpt2-124m trains on text tokenised with a BPE tokenizer" in err
    assert "python -m horse.data prepare CORPUS... --tokenizer tokenizer.json --out data/NAME" in err


def test_batch_tokens_accumulates_and_the_recipe_is_printed(tmp_path, capsys):
    accumulated = train.train(_cfg(tmp_path, max_steps=1, grad_accum=2), SMALL)
    by_tokens = train.train(_cfg(tmp_path, out_dir=str(tmp_path / "b"), max_steps=1, batch_tokens=512), SMALL)
    assert [r["loss"] for r in by_tokens] == [r["loss"] for r in accumulated]
    assert by_tokens[-1]["tokens"] == 512
    out = capsys.readouterr().out
    assert "recipe tiny (tuned on the built-in corpus): --lr 0.002, --warmup-steps 2 (the recipe's 30)" in out
    assert "--batch-tokens 512 (the recipe's none)" in out and "8 x 32 tokens x 2 x dp 1 = 512 tokens" in out


def test_rounded_vocabulary_masks_its_padding(tmp_path):
    cfg = _cfg(tmp_path)
    assert train.model_config(cfg, {}, 257) == dataclasses.replace(
        train.model_config(cfg, {}, 256), vocab_size=320, vocab_used=257
    )
    assert train.model_config(cfg, {}, 256).vocab_used is None
    assert train.model_config(cfg, {"vocab_size": 512}, 257).vocab_used == 257
    (tmp_path / "in.txt").write_text(data.builtin_text()[:50_000])
    data.prepare([tmp_path / "in.txt"], tmp_path / "data")
    records = train.train(_cfg(tmp_path, data=str(tmp_path / "data"), max_steps=1, lr=1e-9), SMALL)
    # Near-uniform logits at initialisation: over the 257 ids in use, not the 320 rows.
    assert records[0]["loss"] == pytest.approx(math.log(257), abs=0.05)


def test_eval_tokens_is_a_fixed_held_out_slice(tmp_path):
    _, val, _ = data.load_dataset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, vocab_size=256))
    held_out = data.HeldOut(val, 100, 32, batch_size=2)  # 3 windows: 96 tokens
    assert held_out.tokens == 96
    windows = [torch.from_numpy(val.shards[0][i * 32 : i * 32 + 33].astype("int64")) for i in range(3)]
    want = sum(model.loss(w[None, :-1], w[None, 1:]).item() for w in windows) / 3
    got = train.evaluate(model, held_out, contextlib.nullcontext, train.Parallel())
    assert got == pytest.approx(want, rel=1e-6) and got == train.evaluate(
        model, held_out, contextlib.nullcontext, train.Parallel()
    )
    ranks = [data.HeldOut(val, 100, 32, 2, dp_rank=r, dp_size=2).starts for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == held_out.starts and not set(ranks[0]) & set(ranks[1])
    with pytest.raises(ValueError, match="--eval-tokens 1,000,000: .* holds 3,485 windows of seq_len 32"):
        data.HeldOut(val, 1_000_000, 32, 2)
    cfg, _ = parse_args(["--eval-tokens", "4096"])
    assert cfg.eval_tokens == 4096


def _saved_tensors(fn) -> int:
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return loss, count[0]


def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients():
    torch.manual_seed(0)
    config = GPTConfig(**SMALL, vocab_size=256)
    plain, checkpointed = GPT(config), GPT(config)
    checkpointed.load_state_dict(plain.state_dict())
    apply.checkpoint_blocks(checkpointed)
    idx = torch.randint(0, 256, (2, 32))
    loss, saved = _saved_tensors(lambda: plain.loss(idx, idx))
    loss_ckpt, saved_ckpt = _saved_tensors(lambda: checkpointed.loss(idx, idx))
    assert saved_ckpt < saved / 2  # a block keeps its inputs only
    loss.backward()
    loss_ckpt.backward()
    assert torch.equal(loss, loss_ckpt)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # the checkpoints' names


@pytest.mark.interpreter
def test_compile_traces_the_kernels_in_one_graph():
    """fullgraph=True: a graph break is an error. The triton backend in float16 runs attention, the
    MLP and the norms through their custom ops (Triton's interpreter here; aot_eager traces them):
    loss and gradients within the suite's accuracy rule. With activation checkpointing too: the
    trainer's test below, on the reference backend."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32)
    model, baseline, truth = GPT(config, backend="triton"), GPT(config), GPT(config).double()
    for other in (baseline, truth):
        other.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 16))

    def loss_and_grads(loss_fn, m: GPT, dtype: torch.dtype | None) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype) if dtype else contextlib.nullcontext():
            loss = loss_fn(idx, idx)
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")
    results = [
        loss_and_grads(compiled, model, torch.float16),
        loss_and_grads(truth.loss, truth, None),
        loss_and_grads(baseline.loss, baseline, torch.float16),
    ]
    names = ["loss"] + [name for name, _ in model.named_parameters()]
    for name, actual, want, base in zip(names, *results, strict=True):
        assert_close(name, actual, want, base)


def test_compile_and_activation_checkpointing_in_the_trainer(tmp_path, monkeypatch):
    """The trainer compiles with fullgraph=True at tp=1: through the checkpointed blocks too."""
    eager = train.train(_cfg(tmp_path, max_steps=2, eval_interval=2), SMALL)
    compile_, checkpoint_whole, calls = torch.compile, apply.checkpoint_blocks, []

    def compile_quickly(fn, **kwargs):  # aot_eager: no C++ compiler run for the CPU
        calls.append(kwargs)
        return compile_(fn, **kwargs, backend="aot_eager")

    def checkpointed(model):
        calls.append("checkpoint_blocks")
        checkpoint_whole(model)

    monkeypatch.setattr(torch, "compile", compile_quickly)
    monkeypatch.setattr(apply, "checkpoint_blocks", checkpointed)
    torch._dynamo.reset()
    both = train.train(
        _cfg(tmp_path, out_dir=str(tmp_path / "c"), max_steps=2, eval_interval=2, compile=True,
             activation_checkpointing=True), SMALL)  # fmt: skip
    assert calls == ["checkpoint_blocks", {"fullgraph": True}]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in both] == pytest.approx([r[key] for r in eager], rel=1e-5)
    assert both[-1]["val_loss"] == pytest.approx(eager[-1]["val_loss"], rel=1e-5)
