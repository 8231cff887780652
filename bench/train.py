"""Training throughput: tokens/s, MFU and peak memory of whole training steps, the fused kernels
against the reference model under torch.compile.

    python -m bench.train                        # gpt2-124m, fp16, 16 x 1024 tokens: triton vs compile
    python -m bench.train --backends triton reference-compile reference --steps 500 --seconds 60 --gate
    python -m bench.train --preset gpt2-350m --batch-size 8 --grad-accum 4 --precision bf16
    python -m bench --only train                 # the same steps in the bench suite, under pytest-benchmark

A step is one optimizer step as ``horse.train`` takes it, by its own ``train_step``:
``--grad-accum`` micro-batches of forward and backward under ``torch.autocast`` (in fp16 the loss
scaled by its LossScaler), then unscale, clip the gradient norm to 1.0, PyTorch's fused AdamW from
``horse.optim.make_optimizer`` on the float32 master weights, zero the gradients. Every step reads
one fixed random batch made on the GPU beforehand: data loading is not measured. The backends run
the same weights, from one seed:

* ``triton``: ``GPT(config, "triton")``, the fused norms with their residual adds, flash attention,
  the fused MLP and the LM head fused with the loss;
* ``reference-compile``: ``GPT(config, "reference", fused_loss=False)``, plain PyTorch (logits, then
  F.cross_entropy), with its loss (forward and cross-entropy) under ``torch.compile`` (default mode,
  static shapes); the optimizer step stays as on the others;
* ``reference``: the same model, eager.

Each backend first takes ``--warmup`` untimed steps (Triton and torch.compile compile there, the
loss scale settles), then up to ``--steps`` steps, each between its own pair of CUDA events; with
``--seconds`` a backend stops early once its share (seconds / backends) has passed; with
``--deadline S`` each backend stops by its share of what is left of S seconds from the start, its
warm-up and compilation included (the device check's time limit). The step
synchronizes once, as the trainer's does (it reads the gradient norm), so the events also hold the
time the GPU waits for the host to launch kernels, as in training. Reported per backend: the median
step time and its quartiles; tokens/s = tokens per step / median step time; TFLOP/s and MFU from the
training FLOPs per token ``6·N + 12·L·d_model·T`` (``GPT.flops_per_token``) over the GPU's dense
fp16/bf16 peak (``horse.device.peak_flops``, ``--peak-tflops`` for other GPUs), and as a fraction of
the float16 matmul throughput measured here; peak memory (``torch.cuda.max_memory_allocated`` over
the timed steps: weights, gradients, AdamW state, activations); steps the loss scaler skipped; and
the speedup of triton over each other backend. Writes ``train.json`` (machine, results, gate
verdicts) to ``--out`` (default ``bench/results/<date>-<gpu>/``). ``--gate`` exits 1 if the triton
step misses a ``train_step`` gate of ``bench/gates.toml``.

Without a GPU it says that timing needs one, runs two steps of the tiny preset on the CPU on each
backend to check the harness end to end (no timings), and exits 0 if every loss is finite.
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench import report, suite, timing
from horse.device import peak_flops
from horse.kernels import runtime
from horse.loss_scale import LossScaler
from horse.model import GPT, PRESETS, GPTConfig, flops_per_token, preset
from horse.optim import make_optimizer
from horse.train import TrainConfig, train_step

BACKENDS = ("triton", "reference-compile", "reference")
# The bench suite's implementation names, which bench/gates.toml's baselines use.
IMPLEMENTATIONS = {"triton": "ours", "reference-compile": "compile", "reference": "eager"}
KERNEL = "train_step"
# (preset, batch size) of the bench suite's cases, at the preset's block size (1024).
SUITE_CASES = (("gpt2-124m", 16), ("gpt2-350m", 8))
CPU_BATCH, CPU_STEPS = 4, 2
# Largest difference of a backend's fp32 losses from the reference's over CPU_STEPS steps on the
# CPU; measured: at most 5e-7 (the fused norms in float32, tiny, two steps).
LOSS_TOLERANCE = 1e-4


# ----------------------------------------------------------------------------------------------
# One training step
# ----------------------------------------------------------------------------------------------


def make_step(
    cfg: TrainConfig,
    config: GPTConfig,
    backend: str,
    device: str,
    model: GPT | None = None,
    document_length: int | None = None,
) -> Callable[[], tuple[torch.Tensor, bool]]:
    """A call that takes one optimizer step of horse.train's loop on ``backend`` and returns (the
    step's loss, whether the loss scaler skipped it). Model (unless given: bench.scaling's tp rank),
    optimizer, scaler and a fixed random batch of cfg.batch_size x seq_len tokens are made here, on
    device, from cfg.seed; with document_length, config.eot_id ends a document every that many
    tokens of each row (the rest of the ids drawn never being it)."""
    torch.manual_seed(cfg.seed)
    triton = backend == "triton"
    if model is None:
        model = GPT(config, "triton" if triton else "reference", fused_loss=triton).to(device)  # fp32 weights
    optimizer = make_optimizer(model, cfg, device)
    scaler = LossScaler.from_config(cfg, enabled=cfg.precision == "fp16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.precision)
    autocast = (lambda: torch.autocast(device, dtype)) if dtype else contextlib.nullcontext
    loss_fn = model.loss
    if backend == "reference-compile":
        # On a CPU, aot_eager: dynamo and AOTAutograd capture the model as on a GPU, without
        # Inductor's C++ code generation (25 s for the tiny preset on two cores), which is not
        # what a GPU runs anyway.
        loss_fn = suite.compiled(model.loss, backend="inductor" if device == "cuda" else "aot_eager")()
    seq_len = cfg.seq_len or config.block_size
    x, y = torch.randint(config.vocab_size, (2, cfg.batch_size, seq_len), device=device)  # (B, T) each
    if document_length is not None:
        x[x == config.eot_id] = (config.eot_id + 1) % config.vocab_size
        x[:, document_length - 1 :: document_length] = config.eot_id

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return x, y  # the same batch every step: data loading is not measured

    def step() -> tuple[torch.Tensor, bool]:
        loss, _, _, skipped = train_step(loss_fn, batch, model, optimizer, scaler, cfg, autocast=autocast)
        return loss, skipped

    return step


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def model_flops_utilization(tokens_per_s: float, flops_per_token: int, peak: float | None) -> float | None:
    """MFU: achieved training FLOP/s over the device's dense peak FLOP/s (None when it is unknown)."""
    return tokens_per_s * flops_per_token / peak if peak else None


def case_params(cfg: TrainConfig, config: GPTConfig) -> dict:
    """The shape of a training step, in numbers (the suite's tables, plots and gates take numbers)."""
    return {
        "layers": config.n_layer,
        "d_model": config.d_model,
        "batch": cfg.batch_size,
        "seq_len": cfg.seq_len or config.block_size,
        "grad_accum": cfg.grad_accum,
    }


def step_result(
    cfg: TrainConfig,
    config: GPTConfig,
    backend: str,
    times_ms: list[float],
    peak_memory_bytes: int,
    skipped_steps: int,
    loss: float,
    peak: float | None,
) -> suite.Result:
    """A backend's timed steps as a bench-suite result, the training metrics in ``extra``."""
    seq_len = cfg.seq_len or config.block_size
    tokens_per_step = cfg.batch_size * seq_len * cfg.grad_accum
    per_token = flops_per_token(config, seq_len)
    q1_ms, median_ms, q3_ms = statistics.quantiles(times_ms, n=4, method="inclusive")
    tokens_per_s = tokens_per_step / (median_ms * 1e-3)
    extra = {
        "backend": backend,
        "preset": cfg.preset,
        "precision": cfg.precision,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": per_token,
        "tokens_per_s": tokens_per_s,
        "mfu": model_flops_utilization(tokens_per_s, per_token, peak),
        "peak_flops": peak,
        "peak_memory_bytes": peak_memory_bytes,
        "skipped_steps": skipped_steps,
        "loss": loss,
    }
    return suite.Result(
        KERNEL,
        case_params(cfg, config),
        "forward+backward",
        IMPLEMENTATIONS[backend],
        unit="flop",
        work=per_token * tokens_per_step,
        median_ms=median_ms,
        q1_ms=q1_ms,
        q3_ms=q3_ms,
        rounds=len(times_ms),
        # A step of ours (triton) whose loss is inf or NaN fails every gate.
        correct=math.isfinite(loss) if backend == "triton" else None,
        extra=extra,
        samples_ms=times_ms,
    )


# ----------------------------------------------------------------------------------------------
# On the GPU
# ----------------------------------------------------------------------------------------------


def time_steps(
    step: Callable[[], tuple[torch.Tensor, bool]],
    warmup: int,
    steps: int,
    seconds: float | None,
    stop_at: float | None = None,
) -> tuple[list[float], int, int, float]:
    """GPU times (ms) of up to ``steps`` steps after ``warmup`` untimed ones, stopping after
    ``seconds`` of timing or at ``stop_at`` (a ``time.perf_counter()``: warm-up included), whichever
    comes first, but after at least 2 steps; returns (times, peak memory in bytes, skipped steps,
    last loss)."""
    begin = time.perf_counter()  # only to stop on the budget and say where the time went
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    print(f"    {warmup} warm-up steps (compilation included): {time.perf_counter() - begin:.1f} s")
    torch.cuda.reset_peak_memory_stats()
    starts, ends, skipped = [], [], 0
    begin = time.perf_counter()  # every time reported is from events
    while len(starts) < steps:
        starts.append(torch.cuda.Event(enable_timing=True))
        ends.append(torch.cuda.Event(enable_timing=True))
        starts[-1].record()
        loss, was_skipped = step()
        ends[-1].record()
        skipped += was_skipped
        now = time.perf_counter()
        over_budget = seconds is not None and now - begin > seconds
        if (over_budget or (stop_at is not None and now > stop_at)) and len(starts) >= 2:
            break
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    return times, torch.cuda.max_memory_allocated(), skipped, loss.item()


def measure(
    cfg: TrainConfig,
    config: GPTConfig,
    backend: str,
    warmup: int,
    steps: int,
    seconds: float | None,
    stop_at: float | None = None,
    document_length: int | None = None,
) -> suite.Result:
    """One backend's result on the current GPU; frees its model, optimizer and compiled graphs after."""
    try:
        host_start = time.perf_counter()
        # Only time_steps holds the step (model, optimizer): they are freed as it returns.
        step = make_step(cfg, config, backend, "cuda", document_length=document_length)
        timed = time_steps(step, warmup, steps, seconds, stop_at)
        result = step_result(cfg, config, backend, *timed, peak_flops("cuda", cfg.peak_tflops))
        # Printed now, so that a run stopped by a time limit still shows the backends it finished.
        print(
            f"  {backend}: {result.rounds} steps timed after {warmup} warm-up steps "
            f"({time.perf_counter() - host_start:.0f} s in all): median {result.median_ms:.2f} ms, "
            f"{result.extra['tokens_per_s']:,.0f} tokens/s"
        )
        return result
    finally:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def format_table(results: list[suite.Result]) -> str:
    """A row per backend: step time, tokens/s, TFLOP/s, MFU, fraction of matmul, memory, speedups; then
    a line per backend with its tokens/s, MFU and peak memory."""
    others = [r.extra["backend"] for r in results if r.implementation != "ours"]
    columns = (
        "backend",
        "step ms",
        "q1-q3 ms",
        "tokens/s",
        "TFLOP/s",
        "MFU",
        "of matmul",
        "peak GiB",
        "skipped",
        *(f"vs {name}" for name in others),
    )
    rows, lines = [columns], []
    for r in results:
        x = r.extra
        speedups = [r.speedups.get(IMPLEMENTATIONS[name]) for name in others]
        mfu = "" if x["mfu"] is None else f"{x['mfu']:.1%}"
        gib = f"{x['peak_memory_bytes'] / 2**30:.2f}"
        row = (
            x["backend"],
            f"{r.median_ms:.2f}",
            f"{r.q1_ms:.2f}-{r.q3_ms:.2f}",
            f"{x['tokens_per_s']:,.0f}",
            f"{r.throughput:.1f}",
            mfu,
            f"{r.ceiling_fraction:.1%}",
            gib,
            str(x["skipped_steps"]),
            *("" if s is None else f"{s:.2f}x" for s in speedups),
        )
        rows.append(row)
        line = f"{KERNEL} {x['preset']} {x['precision']} {x['backend']}: {x['tokens_per_s']:,.0f} tokens/s"
        lines.append(line + (f", MFU {mfu}" if mfu else "") + f", peak memory {gib} GiB")
    return "\n".join([report.format_table(rows), "", *lines])


def gpu_main(args, cfg: TrainConfig, config: GPTConfig) -> int:
    device, machine = timing.announce_machine()
    ceilings = {"matmul_tflops": timing.matmul_tflops(device)}
    peak = peak_flops("cuda", cfg.peak_tflops)
    peak_text = "unknown (--peak-tflops)" if peak is None else f"{peak / 1e12:.0f} TFLOP/s"
    print(
        f"ceilings: float16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s measured, dense peak {peak_text}"
    )
    seq_len = cfg.seq_len or config.block_size
    print(
        f"{cfg.preset} in {cfg.precision}: {cfg.batch_size} x {seq_len} tokens x {cfg.grad_accum} per step, "
        f"{flops_per_token(config, seq_len) / 1e9:.3f} GFLOP per token; one fixed batch on the GPU "
        "(data loading not measured)"
    )
    budget = args.seconds / len(args.backends) if args.seconds else None
    deadline = time.perf_counter() + args.deadline if args.deadline else None
    results, broken = [], []
    for i, backend in enumerate(args.backends):
        now = time.perf_counter()  # this backend's share of what is left, its compilation included
        stop_at = None if deadline is None else now + (deadline - now) / (len(args.backends) - i)
        try:
            timing_args = (args.warmup, args.steps, budget, stop_at, args.document_length)
            results.append(measure(cfg, config, backend, *timing_args))
        except torch.cuda.OutOfMemoryError:
            print(f"  {backend}: out of memory at this batch size; no result")
            if IMPLEMENTATIONS[backend] == "ours":  # ours running out of memory is broken, never skipped
                broken.append(backend)
        except KeyboardInterrupt:  # a time limit's SIGINT (bench/device_check.sh): keep what was measured
            print(f"  {backend}: interrupted; no result, and the backends after it do not run")
            broken.append(backend)
            break
        except Exception:  # an error in one backend (an Inductor failure, say) costs only its result
            traceback.print_exc()
            print(f"  {backend}: failed (traceback above); no result")
            broken.append(backend)
    # A gate of ours never passes for lack of a result: "not measured" where triton got none.
    expected = step_cases(cfg, config, args.backends)
    failed = suite.save_and_gate(
        args.out, "train.json", machine, ceilings, results, suite.load_gates(), expected, format_table
    )
    if broken:
        print(f"no result from {', '.join(broken)}: failed or interrupted")
    return 1 if broken or (args.gate and failed) else 0


# ----------------------------------------------------------------------------------------------
# Without a GPU
# ----------------------------------------------------------------------------------------------


def cpu_losses(backends, precision: str) -> dict[str, list[float]]:
    """The losses of CPU_STEPS training steps of the tiny preset on the CPU, per backend, one seed."""
    cfg = TrainConfig(preset="tiny", batch_size=CPU_BATCH, precision=precision)
    config = preset("tiny")
    losses = {}
    for backend in backends:
        step = make_step(cfg, config, backend, "cpu")
        losses[backend] = [step()[0].item() for _ in range(CPU_STEPS)]
    return losses


def cpu_main(args) -> int:
    print(
        f"No CUDA device: timing needs a GPU. Checking the harness instead: {CPU_STEPS} training steps of\n"
        f"the tiny preset ({CPU_BATCH} x 64 tokens) in {args.precision} on the CPU on each backend, from one "
        "seed.\nNo timings; --preset, --batch-size, --seq-len, --grad-accum, --steps and --seconds do not "
        "apply."
    )
    if "triton" in args.backends and not runtime.INTERPRET:
        print("(TRITON_INTERPRET unset: the triton backend's fused layers run their float32 reference)")
    losses = cpu_losses(args.backends, args.precision)
    width = max(map(len, losses))
    for backend, values in losses.items():
        print(f"  {backend:<{width}}  losses " + " -> ".join(f"{v:.4f}" for v in values))
    finite = all(math.isfinite(v) for values in losses.values() for v in values)
    print("harness ok: every loss is finite" if finite else "FAIL: a loss is inf or NaN")
    return 0 if finite else 1


# ----------------------------------------------------------------------------------------------
# The bench suite's family interface (bench/__main__.py)
# ----------------------------------------------------------------------------------------------


def step_cases(cfg: TrainConfig, config: GPTConfig, backends) -> list[suite.Case]:
    """The bench suite's cases of cfg's training step, one per backend."""
    seq_len = cfg.seq_len or config.block_size
    work = flops_per_token(config, seq_len) * cfg.batch_size * seq_len * cfg.grad_accum
    return suite.family_cases(
        KERNEL,
        case_params(cfg, config),
        {IMPLEMENTATIONS[b]: b for b in backends},
        ["forward+backward"],
        work=lambda d: work,
        unit="flop",
        setup=lambda name, b, d: functools.partial(make_step, cfg, config, b, "cuda"),
    )


def cases(quick: bool) -> list[suite.Case]:
    """The training step of each SUITE_CASES preset in fp16 on every backend (quick: the first)."""
    result = []
    for name, batch in SUITE_CASES[:1] if quick else SUITE_CASES:
        cfg = TrainConfig(preset=name, batch_size=batch, precision="fp16")
        result += step_cases(cfg, preset(name), BACKENDS)
    return result


def interpreter_checks() -> list[tuple[str, dict, bool]]:
    """Each backend's fp32 losses over CPU_STEPS steps of the tiny preset against the reference's."""
    losses = cpu_losses(BACKENDS, "fp32")
    checks = []
    for backend in (b for b in BACKENDS if b != "reference"):
        error = max(abs(a - b) for a, b in zip(losses[backend], losses["reference"], strict=True))
        label = f"{KERNEL} tiny fp32, {CPU_STEPS} steps: {backend} against reference"
        checks.append((label, {"loss": error}, error <= LOSS_TOLERANCE))
    return checks


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> tuple[argparse.Namespace, TrainConfig, GPTConfig]:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-124m", choices=PRESETS)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence; default: the preset's block size")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--backends", nargs="+", default=BACKENDS[:2], choices=BACKENDS)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per backend")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per backend, at most")
    parser.add_argument("--seconds", type=float, help="stop timing after this, shared by the backends")
    parser.add_argument(
        "--deadline",
        type=float,
        help="stop timing by this many seconds after the start, warm-up and compilation included: each "
        "backend stops at its share of what is left (after 2 timed steps at least)",
    )
    parser.add_argument("--peak-tflops", type=float, help="dense fp16/bf16 peak for MFU (default: by GPU)")
    parser.add_argument("--out", type=Path, help="train.json goes here (default bench/results/<date>-<gpu>)")
    parser.add_argument("--gate", action="store_true", help="exit 1 if triton misses a train_step gate")
    parser.add_argument(
        "--document-length",
        type=int,
        help="document masking on, an end of text every this many tokens of a row (on the CPU: the "
        "reference step's time with and without masking)",
    )
    args = parser.parse_args(argv)
    positive = all(getattr(args, name) is None or getattr(args, name) > 0 for name in ("seconds", "deadline"))
    positive &= args.document_length is None or args.document_length > 0
    if args.warmup < 0 or args.steps < 2 or not positive:
        parser.error(
            "--warmup must be at least 0, --steps at least 2, --seconds, --deadline and --document-length "
            "positive"
        )
    args.backends = list(dict.fromkeys(args.backends))
    config_flags = ("preset", "batch_size", "seq_len", "grad_accum", "precision", "peak_tflops")
    try:
        cfg = TrainConfig(**{name: getattr(args, name) for name in config_flags})
    except ValueError as e:
        parser.error(str(e))
    config = preset(cfg.preset)
    if args.document_length is not None:  # id 0 ends the documents
        config = dataclasses.replace(config, document_masking=True, eot_id=0)
    if (cfg.seq_len or config.block_size) > config.block_size:
        parser.error(f"--seq-len {cfg.seq_len} exceeds {cfg.preset}'s block size {config.block_size}")
    return args, cfg, config


def cpu_document_masking(args, cfg: TrainConfig, config: GPTConfig) -> int:
    """Wall-clock step times (median and quartiles, ms) of the reference backend in float32 on the
    CPU without document masking and with it (an end of text every --document-length tokens): a
    benchmark of what the block-diagonal mask costs the reference path."""
    cfg = dataclasses.replace(cfg, precision="fp32")
    seq_len = cfg.seq_len or config.block_size
    print(
        f"CPU reference path, fp32, {cfg.preset}: {cfg.batch_size} x {seq_len} tokens a step, documents of "
        f"{args.document_length} tokens; {args.warmup} warm-up and {args.steps} timed steps each"
    )
    rows = []
    for masking in (False, True):
        masked = dataclasses.replace(config, document_masking=masking)
        step = make_step(
            cfg, masked, "reference", "cpu", document_length=args.document_length if masking else None
        )
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - start))
        q1, median, q3 = statistics.quantiles(times, n=4)
        rows.append(["on" if masking else "off", f"{median:.1f}", f"{q1:.1f} - {q3:.1f}"])
    print(report.format_table([["document masking", "median ms", "quartiles"], *rows]))
    return 0


def main(argv=None) -> int:
    args, cfg, config = parse_args(argv)
    if torch.cuda.is_available():
        return gpu_main(args, cfg, config)
    if args.document_length is not None:
        return cpu_document_masking(args, cfg, config)
    return cpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
