"""Scaling beyond one GPU on paper: a model of tensor-parallel step time at tp = 1, 2, 4, 8, and of
DDP, FSDP2 and HSDP across nodes.

    python -m bench.scaling [--presets gpt2-124m gpt2-350m] [--sequence-parallel] [--json FILE]
    python -m bench.scaling --models llama-8b llama-70b --nodes 4

One training step of one model replica spread over tp GPUs (Megatron's plan, horse/parallel/)
costs, on each rank, its share of the compute plus the tensor-parallel collectives, with no overlap
between them (they sit on the critical path: each one's output is the next layer's input):

    step = compute(tp) + Σ collectives (ring bytes per GPU / NVLink bandwidth + latency)
           + the part of the node's data-parallel gradient all-reduce the backward does not hide

Compute per rank. On a GPU it is measured (:func:`rank_step`): one whole training step of
``parallelize(GPT(config, "triton"), Parallel(tp_size=tp))``, a tp rank's module (n_head / tp heads,
hidden / tp MLP units, vocab / tp embedding rows and logits, the vocab-parallel cross entropy, the
row-parallel bias adds), whose collectives are identities here because it has no process group;
float16 autocast, loss scaling and ``horse.train.train_step`` (unscale, clip, fused AdamW) as
the trainer takes them, timed with CUDA events (``bench.timing.time_gpu``). Its norms run on the
whole sequence, so under ``--sequence-parallel`` the measured compute misses what sequence
parallelism saves there. Without a GPU it is a roofline estimate, and the table says so in its
header (ESTIMATED, not measured): the GEMM and attention FLOPs at ``--efficiency`` × ``--peak-tflops``
(:func:`flops_per_rank`) plus the memory-bound work at the HBM bandwidth (:func:`memory_bytes_per_rank`):
the add+norms, which do not shrink with tp unless the sequence is split, the loss over the rank's
logits, the row-parallel bias adds and the optimizer. One efficiency at every tp makes the estimate
optimistic at large tp, where the sharded GEMMs shrink and run further from peak.

Communication per step (:func:`collectives`: the collectives of each tensor-parallel form that
``horse.parallel.GPT_PLAN`` gives a module, ``FORM_COLLECTIVES``), activations in float16, B·T
tokens per replica:

* each block: attention by heads (c_attn column-, c_proj row-parallel) and the MLP (first
  projection column-, second row-parallel): 2 all-reduces of (B·T, d_model) forward (closing each
  row-parallel branch), 2 backward (the conjugate of the identity before each column-parallel one);
* the vocab-parallel embedding: 1 all-reduce of (B·T, d_model) forward;
* the (tied, vocab-parallel) LM head: its replicated input's gradient, 1 all-reduce of
  (B·T, d_model) backward;
* the vocab-parallel cross entropy: the row max, (B·T,) float32, then its three sums (of the
  exponentials, the target logits and the logits) in one all-reduce of (3, B·T) float32: the bytes of
  4 all-reduces of (B·T,)
  in 2 calls;
* the optimizer step: 2 scalar all-reduces (the global gradient norm, the non-finite flag).

With sequence parallelism each block's and the LM head's all-reduces become an all-gather and a
reduce-scatter (one forward, its conjugate backward): the same bytes in twice the calls. The
embedding still all-reduces forward, then keeps its own sequence chunk, whose backward all-gathers
the gradient; and the replicated norms and biases, which then see one chunk each, have their
float32 gradients summed in one more all-reduce. A ring all-reduce sends 2·(tp − 1)/tp · size
bytes per GPU, an all-gather or reduce-scatter (tp − 1)/tp · size (:func:`ring_factor`). Not
modelled: the copy horse makes of each tensor it all-reduces (~6 µs for gpt2-124m's (8192, 768)
at 4.3 TB/s), contention between the tp and dp traffic on the same links.

Bandwidth. NVLink 4 (H100/H200) runs 18 links of 25 GB/s each way: 450 GB/s per direction per GPU,
the default. ANCHORS.md gives no NVLink figure; NCCL's maintainers put the effective ring
bandwidth after protocol overhead at ~370 GB/s (NVIDIA/nccl-tests#212), so ``--nvlink-gbps 370``
is the realistic setting and 450 the line rate. ``--latency-us`` (default 10 µs) is charged per call.

Data parallelism inside the node: the 8 / tp replicas average their float32 gradients with DDP, an
all-reduce over NVLink in 25 MiB buckets that overlaps the backward; only what exceeds the
backward (taken as 2/3 of the compute) is added to the step. Across nodes: not modelled.

Tokens/s per GPU is B·T / step / tp; per tp group (one replica) B·T / step; per 8-GPU node
B·T / step · 8 / tp. Efficiency is tokens/s per GPU at tp over that at tp = 1 (strong scaling of
one replica: the model does not grow with tp, unlike Megatron's weak-scaling 92/85/75 % at
tp 2/4/8, which grows the model with tp).

Data parallelism over --nodes nodes (a second table, always ESTIMATED: roofline compute, modelled
collectives), for the presets and Llama 3's 8B and 70B shapes (--models), in each layout of
``horse.parallel``'s mesh: DDP over the ranks left by tp; FSDP2 over the rest of a node, replicated
across nodes (HSDP); FSDP2 over every rank. Per GPU: the training state it holds (16 bytes a
parameter of float32 weight, gradient and AdamW moments, 1/dp_shard of that under FSDP, plus the
float16 root and two blocks FSDP keeps gathered; DDP adds its float32 bucket copy of the gradients;
activations not counted) against --hbm-gb; and the step: compute, the tp collectives, and the
data-parallel ones (:func:`data_parallel_collectives`: DDP's bucketed all-reduce; FSDP's float16
all-gather of each block before its forward and again before its backward, the float32
reduce-scatter of its gradients, HSDP's all-reduce of each shard over the replicas), over NVLink
when the group stays inside a node and over --internode-gbps (400 Gb/s InfiniBand a GPU: 50 GB/s)
when it spans nodes. Overlap (:func:`data_parallel_ms`): DDP's all-reduce hides behind the
backward; FSDP's traffic behind the neighbouring blocks' compute, except the first gathers and the
last reduce-scatters. For each model it names the layout of most tokens/s per GPU whose state fits.
Not modelled: activations, contention between the tp and dp traffic, NCCL's efficiency below line
rate.
"""

import argparse
import gc
import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import report, timing
from horse.model import GPT, PRESETS, GPTConfig, preset
from horse.parallel import (
    Parallel,
    check_divisible,
    column_parallel,
    parallelize,
    row_parallel,
    style_of,
    vocab_parallel,
    vocab_parallel_head,
)

DEFAULT_PRESETS = ("gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b")
TP_SIZES = (1, 2, 4, 8)
GPUS_PER_NODE = 8
NVLINK_GBPS = 450.0  # NVLink 4 (H100/H200): 18 links × 25 GB/s, per direction per GPU (line rate)
LATENCY_US = 10.0  # per collective: small-message NCCL latency inside a node
PEAK_TFLOPS = 989.0  # H200 (= H100) dense fp16 on paper (ANCHORS.md)
EFFICIENCY = 0.5  # of the peak, for the roofline estimate
HBM_GBPS = 4300.0  # a device-to-device copy measured on this workplace's H200 (ANCHORS.md)
ACTIVATION_BYTES = 2  # float16
LOSS_BYTES = 4  # the cross entropy's per-token statistics, in float32
GRAD_BYTES = 4  # float32 gradients of the float32 master weights
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket: one all-reduce each
BACKWARD_SHARE = 2 / 3  # of a step's compute, the backward (twice the forward's FLOPs)
REFERENCE_NODE_TOKENS_PER_S = 2.15e6  # Little Horse's reference: 8 NVLink GB300s, FP16 (ANCHORS.md)
REFERENCE_PER_H200 = 106e3  # the same at equal MFU on an H200 (ANCHORS.md)

# HBM bytes per element of the memory-bound work, counted from horse's code path (float16
# autocast, a float32 residual stream); the roofline charges them at HBM_GBPS.
# One add+norm per element of the (B·T, d_model) stream: forward casts the float16 branch output to
# float32 (6), the fused kernel reads it and the stream and writes the stream and the normalised
# output (16), the next GEMM casts that to float16 (6); the backward mirrors it (28).
NORM_BYTES = 56
# tp > 1 only (at tp = 1 the bias is fused into the GEMM): y + bias after a row-parallel
# projection reads and writes y (4), the bias gradient reads dy (2).
ROW_BIAS_BYTES = 6
# The loss per logit at tp = 1 (F.cross_entropy under autocast): cast to float32 (6), log-softmax
# (8), its gradient written (4), log-softmax backward (12), cast back to float16 (6).
LOSS_BYTES_PER_LOGIT = 36
# At tp > 1 (horse.parallel's vocab-parallel cross entropy): amax (2), cast (6), shift (8),
# exp (8), sum (4), divide (8); backward: scatter_add (8), times dloss (8), cast back (6).
VOCAB_PARALLEL_LOSS_BYTES_PER_LOGIT = 58
# Per parameter, horse.optim.optimizer_step: unscale reads and writes the gradient (8), the norm
# reads it (4), clipping reads and writes it (8), AdamW reads param, grad and both moments (16)
# and writes param and both moments (12).
OPTIMIZER_BYTES_PER_PARAM = 48


# ----------------------------------------------------------------------------------------------
# Communication
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of one kind, each over a tensor of ``size_bytes`` (the whole tensor)."""

    name: str
    kind: str  # all_reduce, all_gather or reduce_scatter
    size_bytes: int
    count: int


def ring_factor(kind: str, size: int) -> float:
    """Bytes each GPU sends in a ring collective over ``size`` GPUs, as a multiple of the tensor's size."""
    if kind == "all_reduce":
        return 2 * (size - 1) / size
    if kind in ("all_gather", "reduce_scatter"):
        return (size - 1) / size
    raise ValueError(f"unknown collective {kind!r}")


# What each of GPT_PLAN's tensor-parallel forms communicates per call of its module, in one forward
# and backward: (name, kind, what is communicated), without and with sequence parallelism. The
# tensors: "activation" (B·T, d_model) float16, "row_max" (B·T,) float32 and "sums" (3, B·T) float32
# (the vocab-parallel cross entropy's statistics). :func:`collectives` walks the plan over a model's
# modules, so a module the plan gives a form adds its collectives; a form not in this table is an
# error, and tests/test_bench_scaling.py counts the collectives of a real tp=2 step against it.
_COLUMN = {
    False: [("all_reduce", "activation")],  # backward: the gradient of the input every rank took whole
    True: [("all_gather", "activation"), ("reduce_scatter", "activation")],  # forward, its conjugate
}
_ROW = {
    False: [("all_reduce", "activation")],  # forward: the ranks' partial outputs summed
    True: [("reduce_scatter", "activation"), ("all_gather", "activation")],
}
FORM_COLLECTIVES = {
    column_parallel: {sp: [("blocks", *c) for c in _COLUMN[sp]] for sp in (False, True)},
    row_parallel: {sp: [("blocks", *c) for c in _ROW[sp]] for sp in (False, True)},
    # forward: the ranks' lookups summed; under sp the stream is then cut, its gradient all-gathered
    vocab_parallel: {
        False: [("embedding", "all_reduce", "activation")],
        True: [("embedding", "all_reduce", "activation")],
    },
    # the head's input taken whole (column-parallel), the loss's row max and sums; under sp the first
    # block's input is this rank's chunk, whose gradient the backward all-gathers
    vocab_parallel_head: {
        sp: [("lm_head_input", *c) for c in _COLUMN[sp]]
        + [("embedding_grad", "all_gather", "activation")] * sp
        + [("cross_entropy_max", "all_reduce", "row_max"), ("cross_entropy_sums", "all_reduce", "sums")]
        for sp in (False, True)
    },
}


def plan_collectives(config: GPTConfig, sequence_parallel: bool) -> Counter:
    """(name, kind, tensor) -> calls in one training step's forward and backward, by GPT_PLAN."""
    with torch.device("meta"):
        names = [name for name, _ in GPT(config).named_modules()]
    calls = Counter()
    for name in names:
        style = style_of(name)
        if style is not None and style.form is not None:
            calls.update(FORM_COLLECTIVES[style.form][sequence_parallel])
    return calls


def collectives(
    config: GPTConfig, tp: int, batch: int, seq: int, sequence_parallel: bool
) -> list[Collective]:
    """The tensor-parallel collectives of one training step of one replica (none at tp = 1): those
    of the plan's forms (:func:`plan_collectives`), then the optimizer step's."""
    if tp == 1:
        return []
    tokens = batch * seq
    size = {"activation": tokens * config.d_model * ACTIVATION_BYTES, "row_max": tokens * LOSS_BYTES}
    size["sums"] = 3 * tokens * LOSS_BYTES
    out = [
        Collective(name, kind, size[tensor], count)
        for (name, kind, tensor), count in plan_collectives(config, sequence_parallel).items()
    ]
    out.append(Collective("grad_norm_and_nonfinite", "all_reduce", LOSS_BYTES, 2))
    if sequence_parallel:
        grads = GRAD_BYTES * replicated_grad_params(config)
        out.append(Collective("replicated_grads", "all_reduce", grads, 1))
    return out


def replicated_grad_params(config: GPTConfig) -> int:
    """Parameters whose gradients sequence parallelism leaves partial on each rank: the norms and
    the biases after the row-parallel projections (the position table's gradient is whole)."""
    norm = config.d_model * (1 + int(config.bias)) if config.norm == "layernorm" else config.d_model
    row_biases = config.d_model * (int(config.bias) + int(config.bias and config.mlp != "swiglu"))
    return config.n_layer * (2 * norm + row_biases) + norm


def comm_bytes_per_gpu(config: GPTConfig, tp: int, batch: int, seq: int, sequence_parallel: bool) -> float:
    """Bytes each GPU sends over NVLink in one step's tensor-parallel collectives."""
    return sum(
        c.count * ring_factor(c.kind, tp) * c.size_bytes
        for c in collectives(config, tp, batch, seq, sequence_parallel)
    )


def comm_ms(
    config: GPTConfig,
    tp: int,
    batch: int,
    seq: int,
    sequence_parallel: bool,
    nvlink_gbps: float,
    latency_us: float,
) -> float:
    """Time of one step's tp collectives: bytes over the per-direction bandwidth plus a latency each."""
    calls = sum(c.count for c in collectives(config, tp, batch, seq, sequence_parallel))
    seconds = comm_bytes_per_gpu(config, tp, batch, seq, sequence_parallel) / (nvlink_gbps * 1e9)
    return seconds * 1e3 + calls * latency_us * 1e-3


def dp_allreduce_ms(config: GPTConfig, tp: int, nvlink_gbps: float, latency_us: float) -> float:
    """Time of the gradient all-reduce among a node's GPUS_PER_NODE / tp replicas (DDP: float32
    gradients of the rank's parameters, one ring all-reduce per 25 MiB bucket); 0 for one replica."""
    replicas = GPUS_PER_NODE // tp
    if replicas == 1:
        return 0.0
    size = GRAD_BYTES * local_params(config, tp)
    seconds = ring_factor("all_reduce", replicas) * size / (nvlink_gbps * 1e9)
    return seconds * 1e3 + math.ceil(size / DDP_BUCKET_BYTES) * latency_us * 1e-3


def exposed_dp_ms(dp_ms: float, compute_ms: float) -> float:
    """What of the dp all-reduce the backward (BACKWARD_SHARE of the compute) does not hide."""
    return max(0.0, dp_ms - BACKWARD_SHARE * compute_ms)


# ----------------------------------------------------------------------------------------------
# Compute: the roofline estimate
# ----------------------------------------------------------------------------------------------


def block_params(config: GPTConfig, tp: int) -> int:
    """Parameters of one block on a tp rank: sharded as horse.parallel.shard_spec, the rest replicated."""
    d, hidden, bias = config.d_model, config.hidden, int(config.bias)
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    norm = d * (1 + bias) if config.norm == "layernorm" else d
    mlp = 3 * d * hidden // tp if config.mlp == "swiglu" else 2 * d * hidden // tp + bias * (hidden // tp + d)
    attn = d * qkv // tp + bias * qkv // tp + config.n_head * config.head_dim * d // tp + bias * d
    return attn + mlp + 2 * norm


def root_params(config: GPTConfig, tp: int) -> int:
    """Parameters outside the blocks on a tp rank: the token embedding and, untied, the LM head (by
    vocabulary rows), the position table and the final norm (whole)."""
    d = config.d_model
    heads = 1 if config.tie_embeddings else 2
    positions = config.block_size * d if config.positions == "learned" else 0
    final_norm = d * (1 + int(config.bias)) if config.norm == "layernorm" else d
    return heads * config.vocab_size * d // tp + positions + final_norm


def local_params(config: GPTConfig, tp: int) -> int:
    """Parameters one tp rank holds."""
    return config.n_layer * block_params(config, tp) + root_params(config, tp)


def flops_per_rank(config: GPTConfig, tp: int, batch: int, seq: int) -> float:
    """Forward+backward FLOPs of one rank in one step: the sharded GEMMs (2·M·N·K, backward twice
    the forward), causal attention (4·B·heads·T²·hd halved, forward+backward 3.5×) and the LM head."""
    tokens, d = batch * seq, config.d_model
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    mlp_in = 2 * config.hidden if config.mlp == "swiglu" else config.hidden
    # Σ K·N of a block's GEMMs, each with d_model as K or N: c_attn, c_proj, the MLP's two
    gemm_k_n = d * (qkv + config.n_head * config.head_dim + mlp_in + config.hidden)
    block_gemms = 2 * tokens * gemm_k_n / tp
    attention = 4 * batch * (config.n_head / tp) * seq * seq * config.head_dim / 2
    lm_head = 2 * tokens * d * config.vocab_size / tp
    return config.n_layer * (3 * block_gemms + 3.5 * attention) + 3 * lm_head


def memory_bytes_per_rank(config: GPTConfig, tp: int, batch: int, seq: int, sequence_parallel: bool) -> float:
    """HBM bytes of one rank's memory-bound work in one step: 2·n_layer + 1 add+norms over the
    stream (its sequence chunk under sequence parallelism, else the whole of it at every tp), the
    row-parallel bias adds (tp > 1), the loss over (B·T, vocab / tp) logits and the optimizer."""
    tokens = batch * seq
    stream = tokens * config.d_model / (tp if sequence_parallel else 1)  # elements of (B·T, d_model)
    norms = (2 * config.n_layer + 1) * NORM_BYTES * stream
    # Per block, at tp > 1 only: attention's c_proj bias, and the MLP's second unless swiglu.
    biases = (int(config.bias) + int(config.bias and config.mlp != "swiglu")) if tp > 1 else 0
    row_biases = config.n_layer * biases * ROW_BIAS_BYTES * stream
    per_logit = LOSS_BYTES_PER_LOGIT if tp == 1 else VOCAB_PARALLEL_LOSS_BYTES_PER_LOGIT
    loss = tokens * config.vocab_size / tp * per_logit
    return norms + row_biases + loss + OPTIMIZER_BYTES_PER_PARAM * local_params(config, tp)


def estimate_compute_ms(
    config: GPTConfig,
    tp: int,
    batch: int,
    seq: int,
    sequence_parallel: bool,
    peak_tflops: float,
    efficiency: float,
    hbm_gbps: float,
) -> float:
    """Roofline compute time of one rank: FLOPs at efficiency × peak plus memory-bound bytes over HBM."""
    flops_s = flops_per_rank(config, tp, batch, seq) / (peak_tflops * 1e12 * efficiency)
    memory_s = memory_bytes_per_rank(config, tp, batch, seq, sequence_parallel) / (hbm_gbps * 1e9)
    return (flops_s + memory_s) * 1e3


# ----------------------------------------------------------------------------------------------
# Compute: measured on a GPU
# ----------------------------------------------------------------------------------------------


def rank_step(
    config: GPTConfig, tp: int, batch: int, seq: int, device: str
) -> tuple[Callable[[], tuple[torch.Tensor, bool]], GPT]:
    """A call that takes one training step of tp rank 0's shard, as horse.train takes it, on device,
    and the model it trains.

    The model is ``parallelize(GPT(config, "triton"), Parallel(tp_size=tp))``: the shapes, kernels and
    vocab-parallel loss of a rank, its collectives identities (no process group), so the call is the
    rank's compute alone. The step is bench.train's (:func:`bench.train.make_step`):
    ``horse.train.train_step`` in float16 with its loss scaler, one fixed random batch of (batch,
    seq) tokens.
    """
    from bench.train import make_step
    from horse.train import TrainConfig

    torch.manual_seed(0)
    with torch.device(device):  # built whole on the device, then sliced to rank 0's shard
        model = parallelize(GPT(config, "triton"), Parallel(tp_size=tp))
    cfg = TrainConfig(batch_size=batch, seq_len=seq, precision="fp16")
    return make_step(cfg, config, "triton", device, model), model


def measure_compute_ms(config: GPTConfig, tp: int, batch: int, seq: int) -> float:
    """Median GPU time of :func:`rank_step` (CUDA events; a few untimed steps first, where Triton
    compiles). One batch, not rotated: a step's weights and activations far exceed the L2 cache."""
    step, _ = rank_step(config, tp, batch, seq, "cuda")
    return timing.time_gpu(lambda _: step(), [None], warmup=3, repeats=10, batch=5).median_ms


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One (preset, tp) prediction; the times are None with a reason where it cannot be made."""

    preset: str
    tp: int
    compute_ms: float | None = None
    comm_ms: float | None = None  # tensor-parallel collectives, on the critical path
    dp_ms: float | None = None  # the node's dp gradient all-reduce, overlapped with the backward
    comm_bytes_per_gpu: float | None = None
    reason: str | None = None

    @property
    def dp_exposed_ms(self) -> float | None:
        return None if self.reason else exposed_dp_ms(self.dp_ms, self.compute_ms)

    @property
    def step_ms(self) -> float | None:
        return None if self.reason else self.compute_ms + self.comm_ms + self.dp_exposed_ms


def tokens_per_s(tokens_per_step: int, step_ms: float, tp: int) -> tuple[float, float, float]:
    """(per GPU, per tp group, per 8-GPU node of 8 / tp replicas) tokens/s of one replica's step."""
    per_group = tokens_per_step / (step_ms * 1e-3)
    return per_group / tp, per_group, per_group * (GPUS_PER_NODE // tp)


def predict_row(args: argparse.Namespace, name: str, tp: int, measured: bool) -> Row:
    """Preset name at tp: its compute measured on this GPU (else the roofline estimate), its
    collectives modelled; a Row with the reason where it cannot be made."""
    config = preset(name)
    try:
        check_divisible(config, tp)
    except ValueError as error:
        return Row(name, tp, reason=str(error))
    shape = (config, tp, args.batch_size, args.seq_len, args.sequence_parallel)
    if measured:
        try:
            compute = measure_compute_ms(config, tp, args.batch_size, args.seq_len)
        except torch.OutOfMemoryError:
            return Row(name, tp, reason=f"out of memory on one {torch.cuda.get_device_name()}")
        finally:  # the step's model, optimizer and activations, before the next one is built
            gc.collect()
            torch.cuda.empty_cache()
    else:
        compute = estimate_compute_ms(*shape, args.peak_tflops, args.efficiency, args.hbm_gbps)
    comm = comm_ms(*shape, args.nvlink_gbps, args.latency_us)
    dp = dp_allreduce_ms(config, tp, args.nvlink_gbps, args.latency_us)
    return Row(name, tp, compute, comm, dp, comm_bytes_per_gpu(*shape))


def row_dicts(rows: list[Row], tokens_per_step: int) -> list[dict]:
    """Rows with their derived columns, as printed and as written to --json."""
    base = {r.preset: r.step_ms for r in rows if r.tp == 1 and r.step_ms is not None}
    out = []
    for r in rows:
        entry = asdict(r) | {"dp_exposed_ms": r.dp_exposed_ms, "step_ms": r.step_ms}
        if r.step_ms is not None:
            per_gpu, per_group, per_node = tokens_per_s(tokens_per_step, r.step_ms, r.tp)
            entry |= {
                "tokens_per_s_per_gpu": per_gpu,
                "tokens_per_s_per_tp_group": per_group,
                "tokens_per_s_per_node": per_node,
                "efficiency": base[r.preset] / (r.tp * r.step_ms) if r.preset in base else None,
                "comm_fraction": (r.comm_ms + r.dp_exposed_ms) / r.step_ms,
            }
        out.append(entry)
    return out


TABLE_COLUMNS = (
    "preset",
    "tp",
    "compute ms",
    "tp comm ms",
    "dp ms",
    "step ms",
    "tok/s/GPU",
    "tok/s/group",
    "tok/s/node",
    "eff",
    "comm %",
)


def format_table(entries: list[dict], title: str) -> str:
    """The rows of row_dicts under their title, numbers right-aligned; a row that cannot be predicted
    says why after its preset and tp."""
    rows = [TABLE_COLUMNS]
    for e in entries:
        if e["reason"]:  # not predicted: the reason follows the row
            rows.append((e["preset"], e["tp"]))
            continue
        efficiency = "n/a" if e["efficiency"] is None else f"{e['efficiency']:.1%}"
        row = (
            e["preset"],
            e["tp"],
            f"{e['compute_ms']:.2f}",
            f"{e['comm_ms']:.2f}",
            f"{e['dp_ms']:.2f}",
            f"{e['step_ms']:.2f}",
            f"{e['tokens_per_s_per_gpu']:,.0f}",
            f"{e['tokens_per_s_per_tp_group']:,.0f}",
            f"{e['tokens_per_s_per_node']:,.0f}",
            efficiency,
            f"{e['comm_fraction']:.1%}",
        )
        rows.append(row)
    header, *lines = report.format_table(rows, right=True).splitlines()
    lines = [
        line + (f" n/a: {e['reason']}" if e["reason"] else "") for line, e in zip(lines, entries, strict=True)
    ]
    return "\n".join([title, header, "-" * len(header), *lines])


def best_node_line(entries: list[dict]) -> str:
    """The best 8-GPU-node prediction against the 2.15M tokens/s reference."""
    valid = [e for e in entries if e["reason"] is None]
    if not valid:
        return "no preset fits any tp: nothing to compare with the reference"
    best = max(valid, key=lambda e: e["tokens_per_s_per_node"])
    per_node = best["tokens_per_s_per_node"]
    h200_node = GPUS_PER_NODE * REFERENCE_PER_H200
    return (
        f"best 8-GPU node: {best['preset']} at tp {best['tp']}, {per_node / 1e6:.2f}M tokens/s = "
        f"{100 * per_node / REFERENCE_NODE_TOKENS_PER_S:.0f}% of the reference 2.15M tokens/s (8 NVLink "
        f"GB300s, FP16), {100 * per_node / h200_node:.0f}% of its H200 equivalent at equal MFU "
        f"({h200_node / 1e6:.2f}M)"
    )


# ----------------------------------------------------------------------------------------------
# Data parallelism over nodes: DDP, FSDP2 and HSDP, on paper
# ----------------------------------------------------------------------------------------------

INTERNODE_GBPS = 50.0  # one 400 Gb/s InfiniBand NIC per GPU (DGX H100/H200), per direction, line rate
HBM_GB = 141.0  # an H200's memory
GATHER_BYTES = 2  # FSDP2 gathers the parameters in the compute dtype (float16)
MASTER_BYTES = 16  # per parameter: the float32 weight, its float32 gradient, AdamW's two float32 moments
DDP_BUCKET_COPY_BYTES = 4  # DDP's buckets: a second float32 copy of the gradients, for its all-reduce
DP_MODELS = (*DEFAULT_PRESETS, "llama-8b", "llama-70b")
# Llama 3's shapes (its config.json: 8B and 70B): GQA with 8 kv heads, SwiGLU, RMSNorm, rotary,
# an untied head over a 128,256-token vocabulary; 8.03B and 70.55B parameters.
LLAMA_SHAPES = {
    "llama-8b": GPTConfig(
        vocab_size=128256,
        block_size=8192,
        n_layer=32,
        n_head=32,
        n_kv_heads=8,
        d_model=4096,
        mlp_hidden=14336,
        positions="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        rope_base=500000.0,
        tie_embeddings=False,
    ),
    "llama-70b": GPTConfig(
        vocab_size=128256,
        block_size=8192,
        n_layer=80,
        n_head=64,
        n_kv_heads=8,
        d_model=8192,
        mlp_hidden=28672,
        positions="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        rope_base=500000.0,
        tie_embeddings=False,
    ),
}


def model_config(name: str) -> GPTConfig:
    """A preset of horse.model, or one of the Llama shapes."""
    return LLAMA_SHAPES[name] if name in LLAMA_SHAPES else preset(name)


@dataclass(frozen=True)
class Layout:
    """How the ranks of a job split: tp inside a node, dp_shard FSDP2 ranks (1: DDP) next, then
    dp_replicate copies of that group (the rest), as ``horse.parallel.init_from_env`` lays them out."""

    tp: int
    dp_shard: int
    dp_replicate: int

    @property
    def world(self) -> int:
        return self.tp * self.dp_shard * self.dp_replicate

    def __str__(self) -> str:
        if self.dp_shard == 1:
            return f"tp {self.tp} x DDP {self.dp_replicate}"
        return f"tp {self.tp} x dp_shard {self.dp_shard} x dp_replicate {self.dp_replicate}"


def layouts(nodes: int) -> list[Layout]:
    """For each tp of one node: DDP over the rest; FSDP over the rest of a node, replicated across
    nodes (HSDP); and, on several nodes, FSDP over every rank."""
    world = nodes * GPUS_PER_NODE
    found = []
    for tp in TP_SIZES:
        found.append(Layout(tp, 1, world // tp))
        if GPUS_PER_NODE // tp > 1:
            found.append(Layout(tp, GPUS_PER_NODE // tp, nodes))
        if nodes > 1:
            found.append(Layout(tp, world // tp, 1))
    return found


def state_bytes_per_gpu(config: GPTConfig, layout: Layout) -> float:
    """Bytes of training state a GPU holds, activations aside: the float32 weights, gradients and
    AdamW moments of its tp shard (16 a parameter), plus DDP's bucket copy of the gradients, or
    with FSDP 1/dp_shard of the 16 plus the gathered float16 parameters of the root (kept from the
    forward to the backward) and of a block and the next (prefetched)."""
    local = local_params(config, layout.tp)
    if layout.dp_shard == 1:
        return (MASTER_BYTES + DDP_BUCKET_COPY_BYTES) * local
    gathered = GATHER_BYTES * (root_params(config, layout.tp) + 2 * block_params(config, layout.tp))
    return MASTER_BYTES * local / layout.dp_shard + gathered


@dataclass(frozen=True)
class DataParallelCollective(Collective):
    """A data-parallel collective: over which group, overlapping which part of the step."""

    group: str = "dp_shard"  # or "dp_replicate"
    phase: str = "backward"  # or "forward"


def data_parallel_collectives(config: GPTConfig, layout: Layout) -> list[DataParallelCollective]:
    """One step's data-parallel collectives on one GPU, as horse.parallel.data_parallel runs them.

    DDP: the float32 gradients all-reduced over the replicas, in 25 MiB buckets, during the
    backward. FSDP2 (``fully_shard_gpt``): before each block's forward an all-gather of its float16
    parameters, again before its backward (but the last block's, kept), and after it a
    reduce-scatter of its float32 gradients; the root's (embeddings, final norm, head) gathered
    once and reduce-scattered once; with dp_replicate > 1 (HSDP) each shard's gradients then
    all-reduced over the replicas.
    """
    local = local_params(config, layout.tp)
    if layout.dp_shard == 1:
        if layout.dp_replicate == 1:
            return []
        buckets = math.ceil(GRAD_BYTES * local / DDP_BUCKET_BYTES)
        size = GRAD_BYTES * local / buckets
        return [DataParallelCollective("ddp_grads", "all_reduce", size, buckets, group="dp_replicate")]
    block, root, n = block_params(config, layout.tp), root_params(config, layout.tp), config.n_layer
    out = [
        DataParallelCollective("root_gather", "all_gather", GATHER_BYTES * root, 1, phase="forward"),
        DataParallelCollective("block_gather", "all_gather", GATHER_BYTES * block, n, phase="forward"),
        DataParallelCollective("block_regather", "all_gather", GATHER_BYTES * block, n - 1),
        DataParallelCollective("block_grads", "reduce_scatter", GRAD_BYTES * block, n),
        DataParallelCollective("root_grads", "reduce_scatter", GRAD_BYTES * root, 1),
    ]
    if layout.dp_replicate > 1:
        shard = GRAD_BYTES / layout.dp_shard
        out.append(
            DataParallelCollective("block_replicas", "all_reduce", shard * block, n, group="dp_replicate")
        )
        out.append(
            DataParallelCollective("root_replicas", "all_reduce", shard * root, 1, group="dp_replicate")
        )
    return out


def collective_ms(
    c: DataParallelCollective, layout: Layout, nvlink_gbps: float, internode_gbps: float, latency_us: float
) -> float:
    """Time of one of c's calls: ring bytes over NVLink when its group is inside a node (tp x
    dp_shard consecutive ranks for dp_shard, every rank for dp_replicate), else over the slower
    links between nodes; plus a latency."""
    size = layout.dp_shard if c.group == "dp_shard" else layout.dp_replicate
    span = layout.tp * layout.dp_shard if c.group == "dp_shard" else layout.world
    gbps = nvlink_gbps if span <= GPUS_PER_NODE else internode_gbps
    return ring_factor(c.kind, size) * c.size_bytes / (gbps * 1e9) * 1e3 + latency_us * 1e-3


def data_parallel_ms(
    config: GPTConfig,
    layout: Layout,
    compute_ms: float,
    nvlink_gbps: float,
    internode_gbps: float,
    latency_us: float,
) -> tuple[float, float]:
    """(all of one step's data-parallel collectives, what of them the compute does not hide) in ms.

    DDP's all-reduce hides behind the backward (BACKWARD_SHARE of the compute). FSDP's gathers hide
    behind the forward's compute and its gathers and reduce-scatters behind the backward's, each
    overlapping a neighbouring block's compute, except the first gathers (the root's and block 0's,
    with nothing to compute before them) and the last reduce-scatters (block 0's and the root's,
    with nothing after them).
    """
    calls = data_parallel_collectives(config, layout)
    one = {c.name: collective_ms(c, layout, nvlink_gbps, internode_gbps, latency_us) for c in calls}
    total = sum(one[c.name] * c.count for c in calls)
    backward_compute = BACKWARD_SHARE * compute_ms
    if layout.dp_shard == 1:
        return total, max(0.0, total - backward_compute)
    unhidden = one["root_gather"] + one["block_gather"] + one["block_grads"] + one["root_grads"]
    unhidden += one.get("block_replicas", 0.0) + one.get("root_replicas", 0.0)
    forward = sum(one[c.name] * c.count for c in calls if c.phase == "forward")
    backward = total - forward
    hidden_forward = forward - one["root_gather"] - one["block_gather"]
    hidden_backward = backward - (unhidden - one["root_gather"] - one["block_gather"])
    exposed = max(0.0, hidden_forward - (compute_ms - backward_compute))
    exposed += max(0.0, hidden_backward - backward_compute)
    return total, unhidden + exposed


@dataclass(frozen=True)
class DataParallelRow:
    """One (model, layout) prediction; None times with the reason where the model cannot split."""

    model: str
    layout: Layout
    state_gb: float | None = None
    compute_ms: float | None = None
    tp_ms: float | None = None
    dp_ms: float | None = None
    dp_exposed_ms: float | None = None
    reason: str | None = None

    @property
    def step_ms(self) -> float | None:
        return None if self.reason else self.compute_ms + self.tp_ms + self.dp_exposed_ms


def predict_data_parallel_row(args: argparse.Namespace, name: str, layout: Layout) -> DataParallelRow:
    """Model name in layout: the roofline compute of a tp rank (its optimizer's memory-bound share
    over dp_shard under FSDP), the tensor-parallel collectives (not overlapped) and the
    data-parallel ones (overlapped, :func:`data_parallel_ms`)."""
    config = model_config(name)
    try:
        check_divisible(config, layout.tp)
    except ValueError as error:
        return DataParallelRow(name, layout, reason=str(error))
    shape = (config, layout.tp, args.batch_size, args.seq_len, args.sequence_parallel)
    compute = estimate_compute_ms(*shape, args.peak_tflops, args.efficiency, args.hbm_gbps)
    optimizer_bytes = OPTIMIZER_BYTES_PER_PARAM * local_params(config, layout.tp)
    compute -= optimizer_bytes * (1 - 1 / layout.dp_shard) / (args.hbm_gbps * 1e9) * 1e3
    tp = comm_ms(*shape, args.nvlink_gbps, args.latency_us)
    links = (args.nvlink_gbps, args.internode_gbps, args.latency_us)
    dp, exposed = data_parallel_ms(config, layout, compute, *links)
    state = state_bytes_per_gpu(config, layout) / 1e9
    return DataParallelRow(name, layout, state, compute, tp, dp, exposed)


DATA_PARALLEL_COLUMNS = (
    "model",
    "layout",
    "GB/GPU",
    "fits",
    "compute ms",
    "tp ms",
    "dp ms",
    "exposed",
    "step ms",
    "tok/s/GPU",
)


def data_parallel_entries(rows: list[DataParallelRow], tokens_per_step: int, hbm_gb: float) -> list[dict]:
    """Rows with their derived columns, as printed and as written to --json."""
    out = []
    for r in rows:
        entry = asdict(r) | {"layout": str(r.layout), "step_ms": r.step_ms}
        if r.reason is None:
            entry |= {
                "fits": r.state_gb <= hbm_gb,
                "tokens_per_s_per_gpu": tokens_per_step / (r.step_ms * 1e-3) / r.layout.tp,
            }
        out.append(entry)
    return out


def format_data_parallel_table(entries: list[dict], title: str) -> str:
    rows = [DATA_PARALLEL_COLUMNS]
    for e in entries:
        if e["reason"]:
            rows.append((e["model"], e["layout"]))
            continue
        rows.append(
            (
                e["model"],
                e["layout"],
                f"{e['state_gb']:.1f}",
                "yes" if e["fits"] else "no",
                f"{e['compute_ms']:.1f}",
                f"{e['tp_ms']:.1f}",
                f"{e['dp_ms']:.1f}",
                f"{e['dp_exposed_ms']:.1f}",
                f"{e['step_ms']:.1f}",
                f"{e['tokens_per_s_per_gpu']:,.0f}",
            )
        )
    header, *lines = report.format_table(rows, right=True).splitlines()
    lines = [
        line + (f" n/a: {e['reason']}" if e["reason"] else "") for line, e in zip(lines, entries, strict=True)
    ]
    return "\n".join([title, header, "-" * len(header), *lines])


def pick_lines(entries: list[dict], nodes: int) -> list[str]:
    """Per model, the layout of most tokens/s per GPU whose state fits; or that none fits."""
    lines = []
    for model in dict.fromkeys(e["model"] for e in entries):
        fitting = [e for e in entries if e["model"] == model and e["reason"] is None and e["fits"]]
        if not fitting:
            lines.append(f"{model} on {nodes} node(s): no layout fits its state in {HBM_GB:.0f} GB")
            continue
        best = max(fitting, key=lambda e: e["tokens_per_s_per_gpu"])
        lines.append(
            f"{model} on {nodes} node(s): {best['layout']} ({best['state_gb']:.1f} GB of state a GPU, "
            f"{best['tokens_per_s_per_gpu']:,.0f} tokens/s a GPU)"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    parser.add_argument("--tp", nargs="+", type=int, default=list(TP_SIZES))
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step per tp group")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--nvlink-gbps",
        type=float,
        default=NVLINK_GBPS,
        help="NVLink bandwidth per GPU per direction, GB/s (default: NVLink 4 line rate, 450; NCCL's "
        "effective ring bandwidth is ~370)",
    )
    parser.add_argument("--latency-us", type=float, default=LATENCY_US, help="per collective")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="roofline peak (no GPU)")
    parser.add_argument("--efficiency", type=float, default=EFFICIENCY, help="roofline fraction of peak")
    parser.add_argument("--hbm-gbps", type=float, default=HBM_GBPS, help="roofline memory bandwidth")
    parser.add_argument("--estimate", action="store_true", help="the roofline even where a GPU is present")
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(DP_MODELS),
        help="the data-parallel table's models: presets, llama-8b, llama-70b",
    )
    parser.add_argument("--nodes", type=int, default=2, help="the data-parallel table's nodes of 8 GPUs")
    parser.add_argument(
        "--internode-gbps",
        type=float,
        default=INTERNODE_GBPS,
        help="bandwidth between nodes per GPU per direction, GB/s (default: a 400 Gb/s NIC per GPU)",
    )
    parser.add_argument("--hbm-gb", type=float, default=HBM_GB, help="a GPU's memory, for the fits column")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and settings here")
    args = parser.parse_args(argv)
    for name in args.presets:
        preset(name)  # an unknown name fails here, before any timing
    for name in args.models:
        if name not in LLAMA_SHAPES and name not in PRESETS:
            parser.error(f"--models: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a Llama shape")
    for flag, names in (("--presets", args.presets), ("--models", args.models)):
        experts = [name for name in names if name in PRESETS and preset(name).moe_experts]
        if experts:
            parser.error(
                f"{flag}: {', '.join(experts)}: mixtures of experts; this model of a step counts dense MLPs"
            )
    if args.nodes < 1:
        parser.error(f"--nodes must be at least 1, got {args.nodes}")
    if any(tp < 1 or GPUS_PER_NODE % tp for tp in args.tp):
        parser.error(f"--tp sizes must divide {GPUS_PER_NODE}, got {args.tp}")
    if args.sequence_parallel and any(args.seq_len % tp for tp in args.tp):
        parser.error(f"--sequence-parallel needs every --tp to divide --seq-len {args.seq_len}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured = torch.cuda.is_available() and not args.estimate
    if measured:
        source = f"MEASURED compute (one rank's training step) on {torch.cuda.get_device_name()}"
    else:
        why = "--estimate" if torch.cuda.is_available() else "no GPU"
        source = (
            f"ESTIMATED ({why}: roofline at {100 * args.efficiency:.0f}% of {args.peak_tflops:.0f} "
            f"TFLOP/s peak, {args.hbm_gbps:.0f} GB/s HBM), not measured"
        )
    title = (
        f"Tensor-parallel step model, {source}\n"
        f"batch {args.batch_size} x seq {args.seq_len} per tp group; sequence parallel "
        f"{'on' if args.sequence_parallel else 'off'}; tp collectives: NVLink {args.nvlink_gbps:.0f} GB/s "
        f"per direction + {args.latency_us:.0f} us each, not overlapped\n"
        f"dp ms: the node's gradient all-reduce over {GPUS_PER_NODE}/tp replicas, hidden behind the "
        f"backward (taken as {100 * BACKWARD_SHARE:.0f}% of compute); only what sticks out counts in step ms"
    )
    rows = [predict_row(args, name, tp, measured) for name in args.presets for tp in args.tp]
    entries = row_dicts(rows, args.batch_size * args.seq_len)
    print(format_table(entries, title))
    print(best_node_line(entries))
    dp_title = (
        f"\nData parallelism over {args.nodes} node(s) of {GPUS_PER_NODE} GPUs: DDP, FSDP2 and HSDP, "
        f"ESTIMATED (roofline compute at {100 * args.efficiency:.0f}% of {args.peak_tflops:.0f} TFLOP/s, "
        "modelled collectives), not measured\n"
        f"batch {args.batch_size} x seq {args.seq_len} per tp group; collectives over NVLink "
        f"{args.nvlink_gbps:.0f} GB/s inside a node, {args.internode_gbps:.0f} GB/s per GPU between nodes, "
        f"{args.latency_us:.0f} us each\n"
        "GB/GPU: float32 weights, gradients and AdamW state (+ DDP's gradient buckets; FSDP: / dp_shard, "
        "+ the gathered float16 root and two blocks), activations not counted; "
        f"fits: under {args.hbm_gb:.0f} GB\n"
        "dp ms: every data-parallel collective; exposed: what compute does not hide (DDP's all-reduce behind "
        "the backward; FSDP's all-gathers and reduce-scatters behind the neighbouring blocks)"
    )
    dp_rows = [
        predict_data_parallel_row(args, name, layout)
        for name in args.models
        for layout in layouts(args.nodes)
    ]
    dp_entries = data_parallel_entries(dp_rows, args.batch_size * args.seq_len, args.hbm_gb)
    print(format_data_parallel_table(dp_entries, dp_title))
    print("\n".join(pick_lines(dp_entries, args.nodes)))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"} | {"measured": measured}
        machine = timing.machine_info(torch.device("cuda") if measured else None)
        document = {
            "settings": settings,
            "machine": machine,
            "title": title,
            "rows": entries,
            "data_parallel_title": dp_title,
            "data_parallel_rows": dp_entries,
        }
        Path(args.json).write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
