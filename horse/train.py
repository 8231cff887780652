"""Train a GPT: FP16 with float32 master weights and dynamic loss scaling (or bf16, fp32), on one
device or, under torchrun, tensor parallel inside a node and data parallel across.

    python horse/train.py                      # tiny on the built-in corpus, a few minutes on a CPU,
                                               #   then a sample of generated text
    python -m horse.train --preset gpt2-124m --data DIR --batch-size 16 --max-tokens 10e9 \\
        --eval-interval 250 --ckpt-interval 1000    # GPT-3's recipe for its size: printed at the start
    python -m horse.train --config run.json --lr 3e-4      # flags from a JSON file; the command line wins
    python -m horse.train --out-dir runs/x --resume        # continue from the newest complete checkpoint,
                                                           #   with the flags in runs/x/config.json
    torchrun --standalone --nproc-per-node 8 horse/train.py --tp 8 --sequence-parallel ...
    torchrun --standalone --nproc-per-node 8 horse/train.py --dp-shard 8 ...     # FSDP2
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id JOB --max-restarts 3 horse/train.py --tp 8 \\
        --out-dir /shared/runs/x ...

Parallel runs: --tp ranks (consecutive, so one node's) split each layer (``horse.parallel``); the
world size over tp is the data-parallel size, whose replicas read different slices of every
batch (--batch-size is per replica) and average their gradients with DDP, or, with --dp-shard N,
shard the parameters, gradients and optimizer state over N of them with FSDP2 (--dp-replicate
copies of that group: HSDP). Only rank 0 prints and writes metrics; checkpoints are written in
pieces, each rank its own, and reshard on resume to any layout (``horse.checkpoint``).
A job that torchrun restarts (--max-restarts) resumes from its newest complete checkpoint by
itself; without --out-dir the run directory is named after the launch's id, which a restart keeps.
Restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment: otherwise the
restarted workers share the rendezvous store with the failed ones and can read their stale
addresses (pytorch/pytorch#135712; on torch 2.13 with gloo, 2 of 3 restarted runs failed to
connect without it, none of 4 with it).

Every field of TrainConfig below is a flag (``max_steps`` is ``--max-steps``), and so is every
field of ``horse.model.GPTConfig``, overriding the preset's value (``--n-layer 6``,
``--positions rotary``): ``horse.cli`` makes them. The optimiser's settings, the tokens a step and
the held-out tokens come from the preset's recipe (``horse.recipes``) unless a flag gives them. On
a GPU the defaults are float16 and the Triton kernels; on a CPU, float32 and the plain-torch
reference (the kernels would run in Triton's interpreter, far too slowly to train).

Each step writes a line to OUT/metrics.jsonl; the console gets a progress bar and a log line
every --log-interval steps (tokens/s of the whole job, MFU per GPU). Data, forward, backward and
the optimizer step are NVTX ranges (see them with ``nsys profile``); --profile-steps N records a
torch.profiler trace to OUT/trace.json (``horse.device``). The optimizer and its schedule live in
``horse.optim``, the fp16 loss scaler in ``horse.loss_scale``, what a checkpoint holds in
``horse.checkpoint``: this module keeps the config and the run. A run is a :class:`Run`, its state,
which :func:`set_up` builds (data, model, optimizer, a checkpoint resumed from) and whose methods
are its steps: ``loop`` (train a step, evaluate, log, save, stop on a signal), then ``finish``
(the closing line and a sample).
"""

import os
import sys

# `python horse/train.py` puts horse/ itself first on sys.path, where its modules would stand in for
# top-level packages of their names: horse/kernels/ for Hugging Face's `kernels`, which transformers
# imports (then "cannot import name 'CUDAProperties' from 'kernels'"). The package is found as `horse`.
if __name__ == "__main__" and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)

import contextlib
import dataclasses
import json
import math
import signal
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from horse import checkpoint, hf, optim, preemption, recipes, run_log
from horse.data import (
    BPETokenizer,
    ByteTokenizer,
    HeldOut,
    Loader,
    Mixture,
    Split,
    load_dataset,
    load_mixture,
    parse_mixture,
)
from horse.device import nvtx_range, peak_flops, pick_backend, pick_device, profiler
from horse.generate import generate
from horse.hf.weights import weight_source
from horse.kernels import runtime
from horse.loss_scale import LossScaler
from horse.model import GPT, PRESETS, GPTConfig, flops_per_token, num_active_params, num_params, preset
from horse.parallel import (
    Parallel,
    allreduce_sequence_parallel_grads,
    check_divisible,
    dp_mean,
    init_from_env,
    parallelize_gpt,
)

TINY = recipes.RECIPES["tiny"]  # TrainConfig's defaults; the command line takes the preset's recipe


@dataclass
class TrainConfig:
    """A training run. Every field is also a flag: --batch-size for batch_size, and so on.

    preset: model preset: tiny, tiny-moe, gpt2-124m, moe-124m, gpt2-*, moe-1b-7b (python -m horse.model)
    data: a prepared directory, or a mixture DIR=WEIGHT,... (or a .json/.toml); empty: the built-in corpus
    out_dir: checkpoints, metrics.jsonl, config.json and traces; empty: runs/<preset>-<date>-<time>
    resume: continue from the newest good checkpoint in --out-dir (automatic after a torchrun restart)
    strict_resume: with --resume, a damaged newest checkpoint is an error, not a warning and an older one
    init_from: start from these weights (a Hugging Face folder, or a run or checkpoint); the model is theirs
    tp: tensor-parallel size: ranks that split each layer (under torchrun; divides the world size)
    dp_shard: data-parallel ranks that shard the parameters, gradients and optimizer state (FSDP2); 1: DDP
    dp_replicate: replicas of each --dp-shard group (HSDP); default: the data-parallel ranks left over
    sequence_parallel: with --tp, norms and residual adds run on sequence shards (T must divide by tp)
    batch_size: sequences per micro-batch, per data-parallel replica
    seq_len: tokens per sequence; default: the model's block_size
    grad_accum: micro-batches per optimizer step (set by --batch-tokens when that is given)
    batch_tokens: tokens per optimizer step, by gradient accumulation: batch_size x seq_len x grad_accum x dp
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
    backend: triton (fused kernels) or reference (plain torch); default triton on an sm_80+ GPU, or reference
    device: cuda or cpu (under torchrun: NCCL or gloo); default cuda where a GPU is visible
    fused_loss: the LM head fused with the loss, in row chunks (no logits held); --no-fused-loss: unfused
    loss_scale: initial fp16 loss scale
    loss_scale_window: clean fp16 steps before the loss scale doubles (an inf/NaN gradient halves it, skips)
    min_loss_scale: the fp16 loss scale never halves below this
    loss_scale_hysteresis: fp16 steps skipped in a row before the loss scale halves
    max_skipped_steps: stop with an error after this many steps in a row skipped for inf/NaN gradients
    seed: seeds the weights, the data order and the sample
    eval_interval: steps between validation losses (and one at the end)
    eval_tokens: validation loss over this many held-out tokens, the first of the val split, each once
    log_interval: steps between console log lines (every step goes to metrics.jsonl)
    ckpt_interval: steps between checkpoints (and one at the end); 0: only at the end
    keep_last: complete checkpoints kept (0: all)
    on_save_error: a save that fails (full disk, I/O): stop, or continue and retry at the next interval
    async_checkpoint: write checkpoints in a thread from host copies taken at the step (the last: at once)
    save_on_signal: signals that finish the step, save it and exit 75 (preempted, resumable); empty: none
    peak_tflops: dense fp16/bf16 peak of the device for MFU; default: from the GPU's name
    profile_steps: record a torch.profiler trace of this many steps (after two warm-up steps): OUT/trace.json
    sample_tokens: tokens of generated text printed at the end (0: none)
    sample_prompt: the sample's prompt
    compile: run the training loss under torch.compile (the kernels are custom ops: one graph at tp=1)
    activation_checkpointing: recompute each block in the backward instead of keeping its activations
    """

    preset: str = "tiny"
    data: str = ""
    out_dir: str = ""
    resume: bool = False
    strict_resume: bool = False
    init_from: str = ""
    tp: int = 1
    dp_shard: int = 1
    dp_replicate: int | None = None
    sequence_parallel: bool = False
    batch_size: int = 32
    seq_len: int | None = None
    grad_accum: int = 1
    batch_tokens: int | None = TINY.batch_tokens
    max_steps: int = 250
    max_tokens: int | None = None
    lr: float = TINY.lr
    min_lr_ratio: float = 0.1
    warmup_steps: int = TINY.warmup_steps
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = TINY.weight_decay
    beta1: float = TINY.beta1
    beta2: float = TINY.beta2
    grad_clip: float = 1.0
    precision: Literal["fp16", "bf16", "fp32"] | None = None
    backend: Literal["triton", "reference"] | None = None
    device: Literal["cuda", "cpu"] | None = None
    fused_loss: bool = True
    loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    loss_scale_hysteresis: int = 2
    max_skipped_steps: int = 100
    seed: int = 1337
    eval_interval: int = 100
    eval_tokens: int = TINY.eval_tokens
    log_interval: int = 10
    ckpt_interval: int = 0
    keep_last: int = 3
    on_save_error: Literal["stop", "continue"] = "stop"
    async_checkpoint: bool = True
    save_on_signal: str = "SIGTERM SIGUSR1"
    peak_tflops: float | None = None
    profile_steps: int = 0
    sample_tokens: int = 300
    sample_prompt: str = "\n"
    compile: bool = False
    activation_checkpointing: bool = False

    def __post_init__(self):
        at_least_1 = (
            "tp dp_shard batch_size grad_accum max_steps eval_interval eval_tokens log_interval "
            "loss_scale_window loss_scale_hysteresis max_skipped_steps"
        )
        for name in at_least_1.split() + ["dp_replicate", "seq_len", "max_tokens", "batch_tokens"]:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {value}")
        at_least_0 = "warmup_steps weight_decay grad_clip ckpt_interval keep_last profile_steps sample_tokens"
        for name in at_least_0.split():
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)} must be at least 0, got {getattr(self, name)}")
        for name in ("lr", "loss_scale", "min_loss_scale", "peak_tflops"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{flag(name)} must be positive, got {value}")
        if self.min_loss_scale > self.loss_scale:
            raise ValueError(f"--min-loss-scale {self.min_loss_scale} exceeds --loss-scale {self.loss_scale}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is unknown; choose from {', '.join(PRESETS)}")
        hints = typing.get_type_hints(TrainConfig)
        for name in ("decay", "precision", "backend", "device", "on_save_error"):
            choices = _choices(hints[name])
            if getattr(self, name) not in (*choices, None):
                raise ValueError(
                    f"{flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        preemption.parse_signals(self.save_on_signal)
        if self.resume and not self.out_dir:
            raise ValueError("--resume needs --out-dir: the run to continue")
        if not self.fused_loss and self.tp > 1:  # the vocabulary-parallel loss is the fused one
            raise ValueError(f"--no-fused-loss runs at --tp 1 only, got --tp {self.tp}")


def flag(name: str) -> str:
    """The command-line flag of a config field: max_steps -> --max-steps."""
    return "--" + name.replace("_", "-")


def _choices(hint) -> tuple:
    """The values a Literal field takes (of X in X | None)."""
    while typing.get_origin(hint) is not Literal:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_args(hint)


def model_config(cfg: TrainConfig, overrides: dict, data_vocab: int) -> GPTConfig:
    """The preset with the overrides; the vocabulary follows the data unless --vocab-size is given."""
    if "vocab_size" in overrides and overrides["vocab_size"] < data_vocab:
        raise ValueError(
            f"--vocab-size {overrides['vocab_size']} is smaller than the data's vocabulary ({data_vocab})"
        )
    # Rounded up to a multiple of 64 for the tensor cores; the extra rows are masked (vocab_used):
    # never a target, never sampled, no probability taken from the data's ids.
    rounded = overrides.get("vocab_size", -(-data_vocab // 64) * 64)
    used = data_vocab if rounded > data_vocab else None
    overrides = {"vocab_size": rounded, "vocab_used": used, **overrides}
    return dataclasses.replace(preset(cfg.preset), **overrides)


# ----------------------------------------------------------------------------------------------
# Pieces of the loop
# ----------------------------------------------------------------------------------------------


def train_step(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    cfg: TrainConfig,
    parallel: Parallel | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """One optimizer step of cfg.grad_accum micro-batches (next_batch() gives each (x, y)): forward
    under autocast, scaled backward, then ``horse.optim.optimizer_step``. loss_fn is model.loss or
    its DDP wrapper (``horse.parallel.data_parallel``), whose gradients are all-reduced in the last
    micro-batch's backward only; under FSDP2 every micro-batch's backward reduce-scatters into
    the sharded gradients. Returns (the mean loss over the data-parallel replicas, a CPU tensor;
    the mean of the load-balancing losses within it (``GPT.router_aux_loss``, before its
    coefficient; 0 without experts), likewise; gradient norm; skipped)."""
    parallel = parallel or Parallel()
    ddp = isinstance(loss_fn, nn.parallel.DistributedDataParallel)
    experts = model.config.moe_experts > 0
    sums = torch.zeros(2, device=next(model.parameters()).device)  # the loss, the load-balancing loss
    for micro in range(cfg.grad_accum):
        last = micro == cfg.grad_accum - 1
        sync = loss_fn.no_sync() if ddp and not last else contextlib.nullcontext()
        with nvtx_range("data"):
            x, y = next_batch()
        with sync:
            with nvtx_range("forward"), autocast():
                loss = loss_fn(x, y) / cfg.grad_accum
            with nvtx_range("backward"):
                scaler.scale(loss).backward()
        sums[0] += loss.detach()
        if experts:
            sums[1] += model.router_aux_loss / cfg.grad_accum
    with nvtx_range("optimizer"):
        allreduce_sequence_parallel_grads(model, parallel)
        # Copied to the host ahead of optimizer_step's host read of the gradient norm, which waits
        # for it: reading the loss after the step would wait for AdamW before the next step is queued.
        loss, router_aux_loss = dp_mean(sums, parallel).to("cpu", non_blocking=True)
        grad_norm, skipped = optim.optimizer_step(model, optimizer, scaler, cfg.grad_clip, parallel)
    return loss, router_aux_loss, grad_norm, skipped


@torch.no_grad()
def evaluate(model: GPT, held_out: HeldOut, autocast, parallel: Parallel) -> float:
    """Mean loss over the held-out tokens, each once: the same tokens at every evaluation."""
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
    batches = 0
    with autocast():
        for x, y in held_out.batches():
            total += torch.stack([model.loss(x, y).double() * y.numel(), torch.tensor(y.numel())])
            batches += 1
        if (
            parallel.fsdp
        ):  # FSDP's gathers are collectives: as many forwards as the busiest rank, the extra unused
            idle = torch.zeros(1, held_out.seq_len, dtype=torch.long, device=device)
            for _ in range(held_out.most_batches - batches):
                model.loss(idle, idle)
    model.train()
    if parallel.dp_size > 1:  # each replica evaluated its own windows
        dist.all_reduce(total, group=parallel.dp_group)
    return (total[0] / total[1]).item()


# ----------------------------------------------------------------------------------------------
# The run: its state, set up once, and the steps the loop takes on it
# ----------------------------------------------------------------------------------------------


def share_the_cores() -> int:
    """On the CPU: cap this process's torch intra-op threads at its share of the cores it may run on,
    so that this node's ranks (torchrun's LOCAL_WORLD_SIZE) x threads <= cores; returns the threads.
    Each rank of a launch that does not set OMP_NUM_THREADS (torchrun sets 1) would otherwise take
    every core, and the ranks would spend their time switching (tests/conftest.py does the same for
    pytest-xdist's workers)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(min(torch.get_num_threads(), max(1, cores // ranks)))
    return torch.get_num_threads()


def train(cfg: TrainConfig, overrides: dict | None = None) -> list[dict]:
    """Run cfg (model flags in overrides) on this process, or on every rank of a torchrun launch;
    returns this session's per-step metrics records."""
    device = pick_device(cfg.device)
    if device == "cpu":
        share_the_cores()
    parallel = init_from_env(cfg.tp, cfg.sequence_parallel, device, cfg.dp_shard, cfg.dp_replicate)
    try:
        run = set_up(cfg, overrides or {}, parallel, device)
        run.loop()
        run.finish()
        return run.records
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Run:
    """A training run on this process: what its steps read and change. :func:`set_up` builds it.

    cfg: the flags as given (config.json and the checkpoints keep them); step_cfg: train_step's,
        with the grad_accum that --batch-tokens sets
    config: the model's architecture; backend, precision, device: where and how it computes
    model: this rank's shard of the GPT (float32 master weights; under FSDP2 DTensors of its rows);
        loss_fn: what the steps call, model.loss or its compiled form, under DDP at dp > 1, or
        model.loss gathering what it needs under FSDP2 (``horse.parallel.data_parallel``)
    autocast: a fresh context for each forward: fp16/bf16 autocast, or a null context in fp32
    train_loader, held_out, tokenizer: the data, read by this rank's data-parallel replica
    max_steps, tokens_per_step, flops_per_step: the whole job's; peak_flops: one device's, for MFU
    restarts: torchrun's restart count (0: the first launch); start_time: perf_counter at the start
    preemption: the signal handler the loop installs (``horse.preemption``)
    step: optimizer steps done; resumed_from, last_ckpt: the checkpoint resumed from, the newest saved
    records: this session's metrics, one a step
    """

    cfg: TrainConfig
    step_cfg: TrainConfig
    config: GPTConfig
    backend: str
    precision: str
    device: str
    parallel: Parallel
    model: GPT
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    autocast: Callable[[], contextlib.AbstractContextManager]
    train_loader: Loader | Mixture
    held_out: HeldOut | dict[str, HeldOut]  # a mixture's: one per source
    tokenizer: ByteTokenizer | BPETokenizer
    out_dir: Path
    max_steps: int
    tokens_per_step: int
    flops_per_step: int
    peak_flops: float | None
    restarts: int
    start_time: float
    preemption: preemption.Preemption
    step: int = 0
    resumed_from: Path | None = None
    last_ckpt: Path | None = None
    records: list[dict] = dataclasses.field(default_factory=list)
    saver: checkpoint.BackgroundSaver | None = None  # the thread of --async-checkpoint, from the first save

    @property
    def main_rank(self) -> bool:
        """Rank 0: the only one that prints and writes metrics."""
        return self.parallel.rank == 0

    def log(self, text: str) -> None:
        if self.main_rank:
            print(text)

    # Checkpoints, both ways: the run's one place that saves and restores its state.

    def restore(self, ckpt: Path) -> None:
        """Continue from ckpt: weights, optimizer, loss scaler, RNGs and data position, resharded to
        this run's layout (``horse.checkpoint.restore_run``)."""
        self.step = checkpoint.restore_run(
            ckpt, self.model, self.optimizer, self.scaler, self.train_loader, self.parallel
        )
        self.resumed_from = self.last_ckpt = ckpt
        if self.train_loader.layout_change:
            self.log(self.train_loader.layout_change)

    def save(self, preempted: bool = False) -> None:
        """Write this step's checkpoint, once the save in flight is done: in the background with
        --async-checkpoint (``horse.checkpoint.BackgroundSaver``), except the last step's and a
        signal's, written before this returns. A second signal during a save (or the wait for one)
        aborts it. A save that fails stops the run, unless --on-save-error continue, the step is not
        the last and no signal asked for it: then the run goes on and tries again at the next
        interval. A background save's failure shows when the next save starts."""
        background = self.cfg.async_checkpoint and not preempted and self.step < self.max_steps
        if background and self.saver is None:
            self.saver = checkpoint.BackgroundSaver(self.parallel)
        with self.preemption.saving():
            self.wait_for_save()
            try:
                ckpt = checkpoint.save_run(
                    self.out_dir,
                    self.step,
                    self.model,
                    self.optimizer,
                    self.scaler,
                    self.train_loader,
                    self.cfg,
                    self.tokenizer,
                    self.cfg.keep_last,
                    self.parallel,
                    self.saver if background else None,
                )
            except checkpoint.SaveError as e:
                self.save_failed(e, self.step, last=self.step == self.max_steps or preempted)
                return
        if not background:
            self.last_ckpt = ckpt

    def wait_for_save(self) -> None:
        """Wait for the background save in flight, if any: every rank at the same step, each told
        the same outcome. Its failure is handled as a failure of a save at its step."""
        if self.saver is None:
            return
        try:
            ckpt = self.saver.wait()
        except checkpoint.SaveError as e:
            self.save_failed(e, self.saver.step, last=False)
            return
        self.last_ckpt = ckpt or self.last_ckpt

    @contextlib.contextmanager
    def save_in_flight_kept(self):
        """Around the loop: an error on this rank first lets the background save in flight finish
        (its own failure unsaid), so that a crash just after a save keeps that checkpoint for the
        restart. Its collectives run on their own group, beside the other ranks' training."""
        try:
            yield
        except Exception:
            with contextlib.suppress(checkpoint.SaveError):
                self.wait_for_save()
            raise

    def save_failed(self, error: checkpoint.SaveError, step: int, last: bool) -> None:
        """Raise error (--on-save-error stop, or the run's last save), or say when the next try is."""
        if self.cfg.on_save_error == "stop" or last:
            raise error
        interval = self.cfg.ckpt_interval
        retry = min(self.max_steps, (step // interval + 1) * interval)
        self.log(f"warning: {error}; training goes on (--on-save-error continue), next try: step {retry}")

    # The loop and its steps.

    def evaluate(self) -> dict:
        """The held-out loss; of a mixture, each source's too (the mean weighted as the mixture), and
        the epochs each source has gone through."""
        if isinstance(self.held_out, HeldOut):
            return {"val_loss": evaluate(self.model, self.held_out, self.autocast, self.parallel)}
        losses = {
            name: evaluate(self.model, held_out, self.autocast, self.parallel)
            for name, held_out in self.held_out.items()
        }
        val_loss = sum(self.train_loader.weights[name] * loss for name, loss in losses.items())
        return {
            "val_loss": val_loss,
            "val_loss_by_source": losses,
            "epochs_by_source": self.train_loader.epochs,
        }

    def loop(self) -> None:
        """Train from the step resumed (or 0) to max_steps: each step's record goes to
        OUT/metrics.jsonl, validation when due, a checkpoint when due and at the end. A signal of
        --save-on-signal saves the step it lands in and exits 75 (``horse.preemption``)."""
        cfg = self.cfg
        resumed_step = self.step if self.resumed_from is not None else None
        metrics_path = run_log.start(self.out_dir, cfg, self.config, resumed_step) if self.main_rank else None
        bar = tqdm(
            total=self.max_steps,
            initial=self.step,
            unit="step",
            disable=None if self.main_rank else True,
            dynamic_ncols=True,
        )
        metrics_file = open(metrics_path, "a") if self.main_rank else contextlib.nullcontext()  # noqa: SIM115
        profile = profiler(cfg.profile_steps, self.out_dir, self.device)
        with metrics_file as metrics, profile as trace, self.preemption, self.save_in_flight_kept():
            while self.step < self.max_steps:
                record = self.train_one_step()
                last = self.step == self.max_steps
                if self.step % cfg.eval_interval == 0 or last:
                    record |= self.evaluate()
                self.report(record, metrics, bar)
                signum = self.preemption.agreed()  # a collective: every rank stops after the same step
                if signum is not None:
                    self.stop_on_signal(signum)  # saves this step, then exits 75
                checkpoint_due = cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0
                if checkpoint_due or last:
                    self.save()
                if trace is not None:
                    trace.step()
        bar.close()

    def train_one_step(self) -> dict:
        """One optimizer step (:func:`train_step`) at the schedule's learning rate; returns its record."""
        t0 = time.perf_counter()
        lr = optim.lr_at(self.step, self.max_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, router_aux_loss, grad_norm, skipped = train_step(
            self.loss_fn,
            self.train_loader.next,
            self.model,
            self.optimizer,
            self.scaler,
            self.step_cfg,
            self.parallel,
            self.autocast,
        )
        loss = loss.item()
        dt = time.perf_counter() - t0
        self.step += 1
        if not math.isfinite(loss):  # fp16 too: no loss scale makes an inf forward finite
            raise FloatingPointError(
                f"loss is {loss} at step {self.step}: training diverged (try a lower --lr)"
            )
        self.scaler.check(self.step, loss)
        peak = self.peak_flops
        experts = {"router_aux_loss": router_aux_loss.item()} if self.config.moe_experts else {}
        return {
            "step": self.step,
            "loss": loss,
            **experts,
            "lr": lr,
            "grad_norm": grad_norm,
            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else None,
            "skipped": skipped,
            "tokens": self.step * self.tokens_per_step,
            "tokens_per_s": self.tokens_per_step / dt,
            "mfu": self.flops_per_step / dt / (peak * self.parallel.world_size) if peak else None,
            "time_s": time.perf_counter() - self.start_time,
        }

    def report(self, record: dict, metrics: typing.TextIO | None, bar: tqdm) -> None:
        """A step's record to metrics.jsonl and this session's records; a console line when due
        (every --log-interval steps, the last, an evaluation, a skipped step); the progress bar."""
        step = record["step"]
        if self.main_rank:
            due = step % self.cfg.log_interval == 0 or step == self.max_steps
            if due or "val_loss" in record or record["skipped"]:
                tqdm.write(run_log.line(record, self.max_steps))
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        self.records.append(record)
        bar.set_postfix_str(f"loss {record['loss']:.4f}")
        bar.update()

    def stop_on_signal(self, signum: signal.Signals) -> None:
        """Save the step just finished and exit 75 (``horse.preemption.Preempted``): resumable."""
        self.save(preempted=True)
        self.log(
            f"preempted: {signum.name} during step {self.step}; step {self.step} finished and saved in "
            f"{self.last_ckpt}; exiting {preemption.PREEMPTED} (continue with --resume)"
        )
        raise preemption.Preempted()

    def finish(self) -> None:
        """The closing log line, then, with --sample-tokens, a sample of the trained model's text."""
        elapsed = time.perf_counter() - self.start_time
        self.log(f"done: {self.step} steps in {elapsed:.0f} s; checkpoint {self.last_ckpt}")
        if self.cfg.sample_tokens:
            self.sample()

    def sample(self) -> None:
        """Print --sample-tokens tokens generated after --sample-prompt (temperature 0.8, top-k 40) by
        the model as trained, never assembled whole: on the main rank, or under FSDP on every rank in
        step (each forward gathers the parameters it needs), the main rank printing. Skipped, in one
        line, at --tp > 1."""
        cfg, model = self.cfg, self.model
        if self.parallel.tp_size > 1:
            self.log(
                f"no sample at --tp {self.parallel.tp_size}: generation needs the whole vocabulary's "
                f"logits, which the ranks hold in shards (python -m horse.generate --ckpt {self.out_dir})"
            )
            return
        if not (self.main_rank or self.parallel.fsdp):
            return
        model.eval()
        prompt = torch.tensor([self.tokenizer.encode(cfg.sample_prompt)], device=self.device)
        generator = torch.Generator(self.device).manual_seed(cfg.seed)
        vocab = self.tokenizer.vocab_size
        with self.autocast():
            out = generate(model, prompt, cfg.sample_tokens, 0.8, 40, vocab, generator)
        self.log(f"----- sample: {cfg.sample_tokens} tokens, temperature 0.8, top-k 40 -----")
        self.log(self.tokenizer.decode(out[0].tolist()))
        self.log(f"----- more: python -m horse.generate --ckpt {self.out_dir} --prompt ...")


# ----------------------------------------------------------------------------------------------
# Setting a run up
# ----------------------------------------------------------------------------------------------


def set_up(cfg: TrainConfig, overrides: dict, parallel: Parallel, device: str) -> Run:
    """Everything before the first step: the data, the model (this rank's tensor-parallel shard,
    then data parallel), the optimizer and loss scaler, and the state of the checkpoint resumed
    from, if any; the run's start is logged."""
    start_time = time.perf_counter()
    precision = cfg.precision or ("fp16" if device == "cuda" else "fp32")
    backend, backend_note = pick_backend(cfg.backend, device)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = print if parallel.rank == 0 else lambda text: None

    recipes.check_data(cfg)
    weights = parse_mixture(cfg.data)
    if weights is None:
        train_split, val_split, tokenizer = load_dataset(cfg.data)
    else:
        train_splits, val_splits, tokenizer = load_mixture(weights)
        # For the start's log line: the sources' shards together.
        mixture = ", ".join(f"{name} {weight:g}" for name, weight in weights.items())
        train_split, val_split = (
            Split(f"mixture {mixture} ({part})", [t for split in splits.values() for t in split.shards], 0)
            for part, splits in (("train", train_splits), ("val", val_splits))
        )
    config = _architecture(cfg, overrides, tokenizer)
    seq_len = cfg.seq_len or config.block_size
    if seq_len > config.block_size:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's block_size {config.block_size} (see --block-size)"
        )
    grad_accum = recipes.grad_accum(cfg, seq_len, parallel.dp_size)
    if cfg.sample_tokens and not tokenizer.encode(cfg.sample_prompt):
        raise ValueError("--sample-prompt must not be empty when --sample-tokens is above 0")
    # Under torchrun, named after the launch's id: the same on every rank and node, and after a restart.
    run_name = os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(cfg.out_dir or f"runs/{cfg.preset}-{run_name}")
    resume = cfg.resume or restarts > 0
    ckpt, damaged = checkpoint.resume_point(out_dir, resume, config, parallel, cfg.strict_resume)
    for warning in damaged:
        log(f"warning: {warning}")
    check_divisible(config, parallel.tp_size)  # a resumed checkpoint said so already, naming itself

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    pretrained = bool(cfg.init_from) and ckpt is None
    model, loss_fn = make_model(cfg, config, backend, parallel, device, pretrained, dtype, ckpt is not None)
    dp = {"dp_rank": parallel.dp_rank, "dp_size": parallel.dp_size}
    tokens_per_step = cfg.batch_size * seq_len * grad_accum * parallel.dp_size  # the whole job's
    if weights is None:
        train_loader = Loader(
            train_split, cfg.batch_size, seq_len, cfg.seed, device, **dp, grad_accum=grad_accum
        )
        held_out = HeldOut(val_split, cfg.eval_tokens, seq_len, cfg.batch_size, device, **dp)
    else:
        train_loader = Mixture(
            train_splits, weights, cfg.batch_size, seq_len, cfg.seed, device, **dp, grad_accum=grad_accum
        )
        held_out = {
            name: HeldOut(split, cfg.eval_tokens, seq_len, cfg.batch_size, device, **dp)
            for name, split in val_splits.items()
        }
    run = Run(
        cfg=cfg,
        step_cfg=dataclasses.replace(cfg, grad_accum=grad_accum),
        config=config,
        backend=backend,
        precision=precision,
        device=device,
        parallel=parallel,
        model=model,
        loss_fn=loss_fn,
        optimizer=optim.make_optimizer(model, cfg, device),
        scaler=LossScaler.from_config(cfg, precision == "fp16", parallel),
        autocast=(lambda: torch.autocast(device, dtype)) if dtype else contextlib.nullcontext,
        train_loader=train_loader,
        held_out=held_out,
        tokenizer=tokenizer,
        out_dir=out_dir,
        max_steps=math.ceil(cfg.max_tokens / tokens_per_step) if cfg.max_tokens else cfg.max_steps,
        tokens_per_step=tokens_per_step,
        flops_per_step=flops_per_token(config, seq_len) * tokens_per_step,  # the whole model's
        peak_flops=peak_flops(device, cfg.peak_tflops),
        restarts=restarts,
        start_time=start_time,
        preemption=preemption.Preemption(preemption.parse_signals(cfg.save_on_signal), device),
    )
    if ckpt is not None:
        run.restore(ckpt)
    _log_start(run, backend_note, train_split, val_split, seq_len)
    return run


def _architecture(cfg: TrainConfig, overrides: dict, tokenizer: ByteTokenizer | BPETokenizer) -> GPTConfig:
    """The model's config: --init-from's, or the preset's, with the model flags. Documents end at
    the data's end-of-text id (--eot-id), and --document-masking is on where the data has one."""
    overrides = dict(overrides)
    eot_id = overrides.pop("eot_id", tokenizer.eot_id)
    document_masking = overrides.pop("document_masking", eot_id is not None)
    if document_masking and eot_id is None:
        raise ValueError(
            f"--document-masking needs an end-of-text id, and the data's tokenizer ({tokenizer.name}) has "
            "none: prepare the data with `python -m horse.data prepare`, or give --eot-id"
        )
    if cfg.init_from:
        config = pretrained_config_for(cfg.init_from, overrides, tokenizer.vocab_size)
    else:
        config = model_config(cfg, overrides, tokenizer.vocab_size)
    return dataclasses.replace(config, document_masking=document_masking, eot_id=eot_id)


def pretrained_config_for(path: str | Path, overrides: dict, data_vocab: int) -> GPTConfig:
    """The config of path (``horse.hf.pretrained_config``) to fine-tune on data whose vocabulary is
    data_vocab: model flags (overrides) may only repeat its values, and the data's ids must fit."""
    config = hf.pretrained_config(path)
    differ = [
        f"--{name.replace('_', '-')} {value!r} (its {getattr(config, name)!r})"
        for name, value in overrides.items()
        if getattr(config, name) != value
    ]
    if differ:
        raise ValueError(f"--init-from {path} fixes the model; these model flags differ: {', '.join(differ)}")
    if data_vocab > (config.vocab_used or config.vocab_size):
        raise ValueError(
            f"--init-from {path}: the data's vocabulary ({data_vocab}) is larger than the model's "
            f"({config.vocab_used or config.vocab_size})"
        )
    return config


def make_model(
    cfg: TrainConfig,
    config: GPTConfig,
    backend: str,
    parallel: Parallel,
    device: str,
    pretrained: bool,
    compute_dtype: torch.dtype | None = None,
    resuming: bool = False,
) -> tuple[GPT, Callable]:
    """(this rank's shard of the model, what the training step calls): float32 master weights
    (autocast computes in fp16/bf16), after every parallel transform in its order
    (``horse.parallel.parallelize_gpt``: tensor parallelism, --activation-checkpointing, --compile,
    DDP or FSDP2). A fresh model is built on the meta device and each rank draws only its own part
    from --seed, the same weights at every layout; resuming, that part is left for the checkpoint to
    fill; pretrained, each rank reads only its part of --init-from's weights
    (``horse.hf.weights.weight_source``: slices of a safetensors folder)."""
    with torch.device("meta"):
        model = GPT(config, backend)
    model.fused_loss = cfg.fused_loss
    seed = None if resuming or pretrained else cfg.seed
    source = weight_source(cfg.init_from, config) if pretrained else None
    loss_fn = parallelize_gpt(
        model, parallel, device, cfg.activation_checkpointing, cfg.compile, compute_dtype, seed, source
    )
    return model, loss_fn


def _log_start(run: Run, backend_note: str, train_split: Split, val_split: Split, seq_len: int) -> None:
    """The run's first lines: where it computes, the recipe, the parallel layout, the model, the
    data and batch, the run directory."""
    cfg, config, parallel = run.cfg, run.config, run.parallel
    if run.device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"CPU ({torch.get_num_threads()} threads)"
    if run.device == "cpu" and run.backend == "triton" and not runtime.INTERPRET:
        backend_note = (
            " (on the CPU with TRITON_INTERPRET unset: the fused layers run their float32 reference)"
        )
    run.log(f"horse.train on {where} | backend {run.backend}{backend_note} | precision {run.precision}")
    run.log(recipes.describe(cfg))
    if parallel.distributed:
        sequence_parallel = " (sequence parallel)" if parallel.sequence_parallel else ""
        restart = f" | restart {run.restarts}" if run.restarts else ""
        fsdp = ""
        if parallel.fsdp:
            fsdp = f" (FSDP2: dp_replicate {parallel.dp_replicate_size} x dp_shard {parallel.dp_shard_size})"
        run.log(
            f"parallel: {parallel.world_size} processes ({dist.get_backend()}) = tp {parallel.tp_size}"
            f"{sequence_parallel} x dp {parallel.dp_size}{fsdp}{restart}"
        )
    experts = ""
    if config.moe_experts:
        experts = (
            f" ({num_active_params(config) / 1e6:.2f}M active: {config.moe_top_k} of {config.moe_experts} "
            f"experts of width {config.expert_hidden} a token)"
        )
    run.log(
        f"model {cfg.init_from or cfg.preset}: {num_params(config) / 1e6:.2f}M parameters{experts}, "
        f"{config.n_layer} layers, d_model "
        f"{config.d_model}, {config.n_head} heads ({config.kv_heads} kv), vocabulary {config.vocab_size}, "
        f"{config.positions} positions, {config.norm}, {config.mlp} | "
        f"{run.flops_per_step / run.tokens_per_step / 1e9:.3f} GFLOP per token"
    )
    train_tokens = sum(map(len, train_split.shards))
    held_out, each = run.held_out, ""
    if isinstance(held_out, dict):  # a mixture's, one per source, of the same length
        held_out, each = next(iter(held_out.values())), " of each source"
    val_tokens = sum(map(len, val_split.shards))
    run.log(
        f"data {train_split.name}: {train_tokens:,} train / {val_tokens:,} val tokens ({run.tokenizer.name}, "
        f"evaluated on the first {held_out.tokens:,}{each}; document masking "
        f"{'on' if config.document_masking else 'off'}) | {cfg.batch_size} x {seq_len} tokens x "
        f"{run.step_cfg.grad_accum} x dp {parallel.dp_size} = {run.tokens_per_step:,} tokens per step, "
        f"{run.max_steps} steps"
    )
    resumed = f" | resumed from {run.resumed_from.name}" if run.resumed_from is not None else ""
    run.log(f"out {run.out_dir}{resumed}")
    if warning := preemption.restart_store_warning():
        run.log(warning)


if __name__ == "__main__":
    from horse.cli import main  # the command line builds on this module

    main()
