"""Train a GPT on one device: FP16 with float32 master weights and dynamic loss scaling (or bf16, fp32).

    python horse/train.py                      # tiny on the built-in corpus, a few minutes on a CPU,
                                               #   then a sample of generated text
    python -m horse.train --preset gpt2-124m --data DIR --batch-size 16 --grad-accum 32 \\
        --max-tokens 10_000_000_000 --lr 6e-4 --warmup-steps 700 --eval-interval 250 --ckpt-interval 1000
    python -m horse.train --config run.json --lr 3e-4      # flags from a JSON file; the command line wins
    python -m horse.train --out-dir runs/x --resume        # continue from the newest complete checkpoint,
                                                           #   with the flags in runs/x/config.json

Every field of TrainConfig below is a flag (``max_steps`` is ``--max-steps``), and so is every
field of ``horse.model.GPTConfig``, overriding the preset's value (``--n-layer 6``,
``--positions rotary``). On a GPU the defaults are float16 and the Triton kernels; on a CPU,
float32 and the plain-torch reference (the kernels would run in Triton's interpreter, far too
slowly to train).

Each step writes a line to OUT/metrics.jsonl; the console gets a progress bar and a log line
every --log-interval steps. Data, forward, backward and the optimizer step are NVTX ranges (see
them with ``nsys profile``); --profile-steps N records a torch.profiler trace to OUT/trace.json.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import re
import sys
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from tqdm import tqdm

from horse import checkpoint
from horse.data import BPETokenizer, Loader, load_dataset
from horse.generate import generate
from horse.model import GPT, PRESETS, GPTConfig, preset
from kernels import runtime

try:  # the nvtx package's ranges are the cheapest; torch.cuda.nvtx needs a CUDA build
    import nvtx
except ImportError:
    nvtx = None


@dataclass
class TrainConfig:
    """A training run. Every field is also a flag: --batch-size for batch_size, and so on.

    preset: model preset: tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b (model flags override its fields)
    data: a directory made by `python -m horse.data prepare`; empty: the built-in corpus as bytes
    out_dir: checkpoints, metrics.jsonl, config.json and traces; empty: runs/<preset>-<date>-<time>
    resume: continue from the newest complete checkpoint in --out-dir
    batch_size: sequences per micro-batch
    seq_len: tokens per sequence; default: the model's block_size
    grad_accum: micro-batches per optimizer step
    max_steps: optimizer steps
    max_tokens: token budget; when given it sets the number of steps instead of --max-steps
    lr: peak learning rate
    min_lr_ratio: learning rate at the last step, as a fraction of --lr
    warmup_steps: steps of linear warm-up from 0
    decay: cosine or linear decay to the minimum after warm-up, or constant
    weight_decay: AdamW weight decay of the matrices (norms, biases and embeddings get none)
    beta1: AdamW beta1
    beta2: AdamW beta2
    grad_clip: clip the gradients' global norm to this (0: no clipping)
    precision: fp16 (fp32 master weights, dynamic loss scaling), bf16 or fp32; default fp16 on a GPU, or fp32
    backend: triton (the fused kernels) or reference (plain torch); default triton on a GPU, else reference
    loss_scale: initial fp16 loss scale
    loss_scale_window: clean fp16 steps before the loss scale doubles (an inf/NaN gradient halves it, skips)
    seed: seeds the weights, the data order and the sample
    eval_interval: steps between validation losses (and one at the end)
    eval_steps: batches per validation loss
    log_interval: steps between console log lines (every step goes to metrics.jsonl)
    ckpt_interval: steps between checkpoints (and one at the end); 0: only at the end
    keep_last: complete checkpoints kept (0: all)
    peak_tflops: dense fp16/bf16 peak of the device for MFU; default: from the GPU's name
    profile_steps: record a torch.profiler trace of this many steps (after two warm-up steps): OUT/trace.json
    sample_tokens: tokens of generated text printed at the end (0: none)
    sample_prompt: the sample's prompt
    """

    preset: str = "tiny"
    data: str = ""
    out_dir: str = ""
    resume: bool = False
    batch_size: int = 32
    seq_len: int | None = None
    grad_accum: int = 1
    max_steps: int = 250
    max_tokens: int | None = None
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: Literal["fp16", "bf16", "fp32"] | None = None
    backend: Literal["triton", "reference"] | None = None
    loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    seed: int = 1337
    eval_interval: int = 100
    eval_steps: int = 10
    log_interval: int = 10
    ckpt_interval: int = 0
    keep_last: int = 3
    peak_tflops: float | None = None
    profile_steps: int = 0
    sample_tokens: int = 300
    sample_prompt: str = "\n"

    def __post_init__(self):
        at_least_1 = "batch_size grad_accum max_steps eval_interval eval_steps log_interval loss_scale_window"
        for name in at_least_1.split() + ["seq_len", "max_tokens"]:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{_flag(name)} must be at least 1, got {value}")
        for name in (
            "warmup_steps weight_decay grad_clip ckpt_interval keep_last profile_steps sample_tokens".split()
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must be at least 0, got {getattr(self, name)}")
        for name in ("lr", "loss_scale", "peak_tflops"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{_flag(name)} must be positive, got {value}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is unknown; choose from {', '.join(PRESETS)}")
        hints = typing.get_type_hints(TrainConfig)
        for name in ("decay", "precision", "backend"):
            choices = _flag_kwargs(hints[name])["choices"]
            if getattr(self, name) not in (*choices, None):
                raise ValueError(
                    f"{_flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if self.resume and not self.out_dir:
            raise ValueError("--resume needs --out-dir: the run to continue")


# ----------------------------------------------------------------------------------------------
# Flags from the dataclass fields, and the config file
# ----------------------------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def integer(text: str) -> int:
    """An int flag that also takes 1e9 (and, as int() does, 10_000_000)."""
    with contextlib.suppress(ValueError):
        return int(text)
    value = float(text)
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


def _flag_kwargs(hint) -> dict:
    """argparse keywords for a field's type: int, float, str, bool, a Literal of choices, or X | None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        return {"choices": typing.get_args(hint)}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    return {"type": {int: integer, float: float, str: str}[hint]}


def _docs(cls) -> dict[str, str]:
    """Field descriptions from the ``name: text`` lines of a dataclass's docstring."""
    return dict(re.findall(r"^ {4}(\w+): (.+)$", cls.__doc__, re.MULTILINE))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m horse.train",
        description=__doc__.split("\n\n")[0],
        argument_default=argparse.SUPPRESS,  # so that only what was given overrides the config file
    )
    parser.add_argument("--config", metavar="JSON", help="flags from a JSON object keyed by field name")
    for title, cls in (("training", TrainConfig), ("model (each overrides the preset's value)", GPTConfig)):
        group = parser.add_argument_group(title)
        docs, hints = _docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f" (default {f.default!r})" if cls is TrainConfig and f.default is not None else ""
            kwargs = _flag_kwargs(hints[f.name])
            group.add_argument(_flag(f.name), dest=f.name, help=docs.get(f.name, "") + default, **kwargs)
    return parser


def _from_json(path: str, parser: argparse.ArgumentParser) -> dict:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a JSON object of field names and values")
    hints = typing.get_type_hints(TrainConfig) | typing.get_type_hints(GPTConfig)
    for key, value in values.items():
        if key not in hints:
            parser.error(f"--config {path}: unknown field {key!r}")
        kwargs = _flag_kwargs(hints[key])
        ok = value is None if typing.get_origin(hints[key]) in (typing.Union, types.UnionType) else False
        if "choices" in kwargs:
            ok |= value in kwargs["choices"]
        elif "action" in kwargs:
            ok |= isinstance(value, bool)
        else:
            kind = kwargs["type"]
            ok |= isinstance(value, (int, float) if kind is float else str if kind is str else int)
            ok &= not isinstance(value, bool)
        if not ok:
            parser.error(f"--config {path}: {key} cannot be {value!r}")
    return values


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, dict]:
    """(TrainConfig, model overrides) from defaults < the resumed run's config.json < --config file <
    command line: ``--out-dir DIR --resume`` alone continues a run with the flags it was started with."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    values = _from_json(given.pop("config"), parser) if "config" in given else {}
    values |= given
    saved = Path(values.get("out_dir", "")) / "config.json"
    if values.get("resume") and values.get("out_dir") and saved.is_file():
        run = json.loads(saved.read_text())
        values = run["train"] | run["model"] | values
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        cfg = TrainConfig(**{k: v for k, v in values.items() if k in train_fields})
    except ValueError as e:
        parser.error(str(e))
    return cfg, {k: v for k, v in values.items() if k not in train_fields}


def model_config(cfg: TrainConfig, overrides: dict, data_vocab: int) -> GPTConfig:
    """The preset with the overrides; the vocabulary follows the data unless --vocab-size is given."""
    if "vocab_size" in overrides and overrides["vocab_size"] < data_vocab:
        raise ValueError(
            f"--vocab-size {overrides['vocab_size']} is smaller than the data's vocabulary ({data_vocab})"
        )
    # Rounded up to a multiple of 64 for the tensor cores; the extra rows are never a target.
    overrides = {"vocab_size": -(-data_vocab // 64) * 64, **overrides}
    return dataclasses.replace(preset(cfg.preset), **overrides)


# ----------------------------------------------------------------------------------------------
# Pieces of the loop
# ----------------------------------------------------------------------------------------------

# Dense float16/bfloat16 tensor-core peaks, TFLOP/s; the first name contained in the device's wins.
PEAK_TFLOPS = {
    "GB300": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "A100": 312.0,
}


def peak_flops(device: str, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def nvtx_range(name: str):
    """An NVTX range for Nsight Systems (the nvtx package, else torch's binding on a GPU), also
    labelled in torch.profiler traces."""
    stack = contextlib.ExitStack()
    if nvtx is not None:
        stack.enter_context(nvtx.annotate(name))
    elif torch.cuda.is_available():
        stack.enter_context(torch.cuda.nvtx.range(name))
    stack.enter_context(torch.profiler.record_function(name))
    return stack


def lr_at(step: int, max_steps: int, cfg: TrainConfig) -> float:
    """Learning rate of step (0-based): linear warm-up from 0, then decay to min_lr_ratio·lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - 1 - cfg.warmup_steps))
    remaining = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * remaining)


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: str) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only; PyTorch's fused kernel on a GPU."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in model.parameters() if p.dim() < 2 or id(p) in embeddings]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device == "cuda")


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, grad_clip: float
) -> tuple[float, bool]:
    """Unscale, clip and step; returns (gradient norm, skipped). With fp16 the scaler skips a step
    whose gradients hold an inf or NaN and halves the scale, and doubles it after enough clean steps."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), scaler.is_enabled() and scaler.get_scale() < scale


@torch.no_grad()
def evaluate(model: GPT, loader: Loader, steps: int, autocast) -> float:
    """Mean loss over the loader's first ``steps`` batches: the same batches at every evaluation."""
    model.eval()
    with autocast():
        losses = [model.loss(*loader.batch(i)).item() for i in range(steps)]
    model.train()
    return sum(losses) / len(losses)


def save_checkpoint(out_dir, step, model, optimizer, scaler, loader, cfg, tokenizer, keep_last) -> Path:
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
        "loader": loader.state_dict(),
        "train_config": dataclasses.asdict(cfg),
    }
    tokenizer_file = tokenizer.path if isinstance(tokenizer, BPETokenizer) else None
    return checkpoint.save(out_dir, step, model, state, tokenizer.name, tokenizer_file, keep_last)


def restore_checkpoint(ckpt: Path, model, optimizer, scaler, loader) -> int:
    """Load everything a checkpoint holds back into place; returns its step."""
    checkpoint.load_weights(ckpt, model)
    state = checkpoint.load_state(ckpt)
    optimizer.load_state_dict(state["optimizer"])
    if scaler.is_enabled() and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    loader.load_state_dict(state["loader"])
    return state["step"]


def _profiler(cfg: TrainConfig, out_dir: Path, device: str):
    if not cfg.profile_steps:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=cfg.profile_steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(out_dir / "trace.json")),
    )


def _si(x: float) -> str:
    return next(
        f"{x / s:.1f}{u}" for s, u in ((1e9, "G"), (1e6, "M"), (1e3, "K"), (1, "")) if x >= s or s == 1
    )


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def train(cfg: TrainConfig, overrides: dict | None = None) -> list[dict]:
    """Run cfg (model flags in overrides); returns this session's per-step metrics records."""
    start_time = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = cfg.precision or ("fp16" if device == "cuda" else "fp32")
    backend = cfg.backend or ("triton" if device == "cuda" else "reference")

    train_split, val_split, tokenizer = load_dataset(cfg.data)
    config = model_config(cfg, overrides or {}, tokenizer.vocab_size)
    seq_len = cfg.seq_len or config.block_size
    if seq_len > config.block_size:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's block_size {config.block_size} (see --block-size)"
        )
    if cfg.sample_tokens and not tokenizer.encode(cfg.sample_prompt):
        raise ValueError("--sample-prompt must not be empty when --sample-tokens is above 0")
    out_dir = Path(cfg.out_dir or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    ckpt = checkpoint.latest(out_dir)
    if ckpt is not None and not cfg.resume:
        raise ValueError(
            f"--out-dir {out_dir} holds checkpoints of an earlier run ({ckpt.name}): pass --resume to "
            "continue it, or choose another --out-dir"
        )
    if ckpt is not None:
        checkpoint.check_config(ckpt, config)

    torch.manual_seed(cfg.seed)
    model = GPT(config, backend).to(device)  # float32 master weights; autocast computes in fp16/bf16
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(
        device, init_scale=cfg.loss_scale, growth_interval=cfg.loss_scale_window, enabled=precision == "fp16"
    )
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    autocast = (lambda: torch.autocast(device, dtype)) if dtype else contextlib.nullcontext
    train_loader = Loader(train_split, cfg.batch_size, seq_len, cfg.seed, device)
    val_loader = Loader(val_split, cfg.batch_size, seq_len, cfg.seed, device)
    tokens_per_step = cfg.batch_size * seq_len * cfg.grad_accum
    max_steps = math.ceil(cfg.max_tokens / tokens_per_step) if cfg.max_tokens else cfg.max_steps
    step = restore_checkpoint(ckpt, model, optimizer, scaler, train_loader) if ckpt is not None else 0

    flops_per_step = model.flops_per_token(seq_len) * tokens_per_step
    peak = peak_flops(device, cfg.peak_tflops)
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    note = ""
    if device == "cpu" and backend == "reference" and not cfg.backend:
        note = " (no GPU: the Triton kernels would run only in Triton's interpreter, far too slowly to train)"
    elif device == "cpu" and backend == "triton" and not runtime.INTERPRET:
        note = " (no GPU and TRITON_INTERPRET unset: the fused layers run their float32 reference)"
    print(f"horse.train on {where} | backend {backend}{note} | precision {precision}")
    print(
        f"model {cfg.preset}: {model.num_params() / 1e6:.2f}M parameters, {config.n_layer} layers, d_model "
        f"{config.d_model}, {config.n_head} heads ({config.kv_heads} kv), vocabulary {config.vocab_size}, "
        f"{config.positions} positions, {config.norm}, {config.mlp} | "
        f"{flops_per_step / tokens_per_step / 1e9:.3f} GFLOP per token"
    )
    print(
        f"data {train_split.name}: {sum(map(len, train_split.shards)):,} train / "
        f"{sum(map(len, val_split.shards)):,} val tokens ({tokenizer.name}) | {cfg.batch_size} x {seq_len} "
        f"tokens x {cfg.grad_accum} = {tokens_per_step:,} tokens per step, {max_steps} steps"
    )
    print(f"out {out_dir}" + (f" | resumed from {ckpt.name}" if ckpt is not None else ""))

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(
        json.dumps({"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(config)}, indent=1) + "\n"
    )
    metrics_path = out_dir / "metrics.jsonl"
    kept = []
    if (
        ckpt is not None and metrics_path.exists()
    ):  # drop what the interrupted run logged after the checkpoint
        for line in metrics_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
    metrics_path.write_text("".join(kept))

    records = []
    last_ckpt = ckpt
    bar = tqdm(total=max_steps, initial=step, unit="step", disable=None, dynamic_ncols=True)
    with open(metrics_path, "a") as metrics, _profiler(cfg, out_dir, device) as profiler:
        while step < max_steps:
            t0 = time.perf_counter()
            lr = lr_at(step, max_steps, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for _ in range(cfg.grad_accum):
                with nvtx_range("data"):
                    x, y = train_loader.next()
                with nvtx_range("forward"), autocast():
                    loss = model.loss(x, y) / cfg.grad_accum
                with nvtx_range("backward"):
                    scaler.scale(loss).backward()
                loss_sum += loss.detach()
            with nvtx_range("optimizer"):
                grad_norm, skipped = optimizer_step(model, optimizer, scaler, cfg.grad_clip)
            loss = loss_sum.item()
            dt = time.perf_counter() - t0
            step += 1
            if not math.isfinite(loss) and not scaler.is_enabled():
                raise FloatingPointError(
                    f"loss is {loss} at step {step}: training diverged (try a lower --lr)"
                )

            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "loss_scale": scaler.get_scale() if scaler.is_enabled() else None,
                "skipped": skipped,
                "tokens": step * tokens_per_step,
                "tokens_per_s": tokens_per_step / dt,
                "mfu": flops_per_step / dt / peak if peak else None,
                "time_s": time.perf_counter() - start_time,
            }
            if step % cfg.eval_interval == 0 or step == max_steps:
                record["val_loss"] = evaluate(model, val_loader, cfg.eval_steps, autocast)
            if step % cfg.log_interval == 0 or step == max_steps or "val_loss" in record or skipped:
                line = (
                    f"step {step:>{len(str(max_steps))}}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                    f"grad norm {grad_norm:.3f} | {_si(record['tokens_per_s'])} tok/s"
                )
                if record["loss_scale"] is not None:
                    line += f" | scale {record['loss_scale']:g}"
                if skipped:
                    line += " (step skipped: inf/NaN gradients)"
                if record["mfu"] is not None:
                    line += f" | MFU {100 * record['mfu']:.1f}%"
                if "val_loss" in record:
                    line += f" | val loss {record['val_loss']:.4f}"
                tqdm.write(line)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            records.append(record)
            bar.set_postfix_str(f"loss {loss:.4f}")
            bar.update()
            if (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == max_steps:
                last_ckpt = save_checkpoint(
                    out_dir, step, model, optimizer, scaler, train_loader, cfg, tokenizer, cfg.keep_last
                )
            if profiler is not None:
                profiler.step()
    bar.close()

    print(f"done: {step} steps in {time.perf_counter() - start_time:.0f} s; checkpoint {last_ckpt}")
    if cfg.sample_tokens:
        model.eval()
        prompt = torch.tensor([tokenizer.encode(cfg.sample_prompt)], device=device)
        generator = torch.Generator(device).manual_seed(cfg.seed)
        with autocast():
            out = generate(model, prompt, cfg.sample_tokens, 0.8, 40, tokenizer.vocab_size, generator)
        print(f"----- sample: {cfg.sample_tokens} tokens, temperature 0.8, top-k 40 -----")
        print(tokenizer.decode(out[0].tolist()))
        print(f"----- more: python -m horse.generate --ckpt {out_dir} --prompt ...")
    return records


def main(argv: list[str] | None = None) -> None:
    cfg, overrides = parse_args(argv)
    try:
        train(cfg, overrides)
    except (ValueError, FileNotFoundError, ImportError) as e:
        sys.exit(f"horse.train: error: {e}")


if __name__ == "__main__":
    main()
