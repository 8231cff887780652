"""Scaling beyond one GPU on paper: a model of tensor-parallel step time at tp = 1, 2, 4, 8.

    python -m bench.scaling [--presets gpt2-124m gpt2-350m] [--sequence-parallel] [--json FILE]

One training step of one model replica spread over tp GPUs (Megatron's plan, see horse/parallel.py)
costs, on each rank, its share of the compute plus the tensor-parallel collectives, with no overlap
between them (the critical path of a step that overlaps nothing):

    step = compute(tp) + Σ collectives (ring bytes per GPU / NVLink bandwidth + latency)

Compute per rank. On a GPU it is measured: forward+backward of one block at its sharded widths
(:func:`measure_compute_ms`) × n_layer, plus the vocab-parallel LM head and cross entropy, plus a
fused AdamW step over the rank's parameters. Without a GPU it is a roofline estimate,
FLOPs / (peak × efficiency) plus the optimizer's bytes over the HBM bandwidth, and the table says
so in its header: ESTIMATED, not measured. The roofline keeps one efficiency at every tp, so it is
optimistic for large tp, where the sharded GEMMs shrink and run further from peak.

Communication per step (:func:`collectives`), activations in float16, B·T tokens per replica:

* each block: attention by heads (c_attn column-, c_proj row-parallel) and the MLP (first
  projection column-, second row-parallel): 2 all-reduces of (B·T, d_model) forward, 2 backward;
* the vocab-parallel embedding: 1 all-reduce of (B·T, d_model) forward, none backward;
* the (tied, vocab-parallel) LM head: its replicated input needs 1 all-reduce of its gradient,
  (B·T, d_model), backward (Megatron's copy-to-tensor-parallel-region before the output layer);
* vocab-parallel cross entropy (horse.parallel): the row max, (B·T,) float32, then the sums of
  exponentials and the target logits in one all-reduce of (2, B·T) float32: the bytes of 3
  all-reduces of (B·T,) in 2 calls;
* the optimizer step: 2 scalar all-reduces (the global gradient norm, the non-finite flag).

With sequence parallelism every activation all-reduce becomes an all-gather plus a reduce-scatter
(one of them in the forward, its conjugate in the backward): the same bytes, twice the latencies;
and the gradients of the replicated norms and biases, which then see one sequence chunk each, are
summed in one more all-reduce (float32).
A ring all-reduce sends 2·(tp − 1)/tp · size bytes per GPU, an all-gather or reduce-scatter
(tp − 1)/tp · size (:func:`ring_factor`). The data-parallel gradient all-reduce between the 8/tp
replicas of a node is left out: DDP overlaps it with the backward.

Tokens/s per GPU is B·T / step / tp; per 8-GPU node B·T / step · 8/tp. Efficiency is tokens/s per
GPU at tp over that at tp = 1 (strong scaling of one replica: the model does not grow with tp, so
it is not Megatron's weak-scaling 92/85/75 % at tp 2/4/8, which grows the model with tp).
"""

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

import torch

from horse.model import GPTConfig, preset
from horse.parallel import check_divisible

DEFAULT_PRESETS = ("gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b")
TP_SIZES = (1, 2, 4, 8)
GPUS_PER_NODE = 8
NVLINK_GBPS = 450.0  # NVLink 4 (H100/H200): 18 links, 900 GB/s both ways, 450 GB/s each way per GPU
LATENCY_US = 10.0  # per collective, small-message NCCL latency inside a node
PEAK_TFLOPS = 989.0  # H200 (= H100) dense fp16 on paper
EFFICIENCY = 0.5  # of the peak, for the roofline estimate
HBM_GBPS = 4300.0  # a device-to-device copy measured on this workplace's H200 (ANCHORS.md)
ADAMW_BYTES_PER_PARAM = 28  # fp32 param, grad, exp_avg, exp_avg_sq read (16); param, both avgs written (12)
ACTIVATION_BYTES = 2  # float16
LOSS_BYTES = 4  # the cross entropy's per-token statistics in float32
REFERENCE_NODE_TOKENS_PER_S = 2.15e6  # Little Horse's reference: 8 NVLink GB300s, FP16 (ANCHORS.md)


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of one kind, each over a tensor of ``size_bytes`` (the full tensor)."""

    name: str
    kind: str  # all_reduce, all_gather or reduce_scatter
    size_bytes: int
    count: int


def ring_factor(kind: str, tp: int) -> float:
    """Bytes each GPU sends in a ring collective over tp GPUs, as a multiple of the tensor's size."""
    if kind == "all_reduce":
        return 2 * (tp - 1) / tp
    if kind in ("all_gather", "reduce_scatter"):
        return (tp - 1) / tp
    raise ValueError(f"unknown collective {kind!r}")


def collectives(
    config: GPTConfig, tp: int, batch: int, seq: int, sequence_parallel: bool
) -> list[Collective]:
    """The tensor-parallel collectives of one training step of one replica (none at tp = 1)."""
    if tp == 1:
        return []
    tokens = batch * seq
    activation = tokens * config.d_model * ACTIVATION_BYTES  # (B·T, d_model) float16
    activation_all_reduces = {
        "blocks": 4 * config.n_layer,  # attention and MLP, each 1 forward + 1 backward
        "embedding": 1,  # forward
        "lm_head_input": 1,  # backward
    }
    out = []
    for name, count in activation_all_reduces.items():
        if sequence_parallel:
            out.append(Collective(name, "all_gather", activation, count))
            out.append(Collective(name, "reduce_scatter", activation, count))
        else:
            out.append(Collective(name, "all_reduce", activation, count))
    out.append(Collective("cross_entropy_max", "all_reduce", tokens * LOSS_BYTES, 1))
    out.append(Collective("cross_entropy_sums", "all_reduce", 2 * tokens * LOSS_BYTES, 1))
    out.append(Collective("grad_norm_and_nonfinite", "all_reduce", LOSS_BYTES, 2))
    if sequence_parallel:
        out.append(Collective("replicated_grads", "all_reduce", 4 * replicated_grad_params(config), 1))
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
    """Time of one step's collectives: bytes over the per-direction bandwidth plus a latency each."""
    calls = collectives(config, tp, batch, seq, sequence_parallel)
    n_calls = sum(c.count for c in calls)
    seconds = comm_bytes_per_gpu(config, tp, batch, seq, sequence_parallel) / (nvlink_gbps * 1e9)
    return seconds * 1e3 + n_calls * latency_us * 1e-3


def local_params(config: GPTConfig, tp: int) -> int:
    """Parameters one tp rank holds: sharded as horse.parallel.shard_spec, the rest replicated."""
    d, hidden, bias = config.d_model, config.hidden, int(config.bias)
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    norm = d * (1 + bias) if config.norm == "layernorm" else d
    if config.mlp == "swiglu":
        mlp = 3 * d * hidden // tp
    else:
        mlp = 2 * d * hidden // tp + bias * (hidden // tp + d)
    attn = d * qkv // tp + bias * qkv // tp + config.n_head * config.head_dim * d // tp + bias * d
    block = attn + mlp + 2 * norm
    positions = config.block_size * d if config.positions == "learned" else 0
    return config.n_layer * block + config.vocab_size * d // tp + positions + norm


def flops_per_rank(config: GPTConfig, tp: int, batch: int, seq: int) -> float:
    """Forward+backward FLOPs of one rank in one step: the sharded GEMMs (2·M·N·K, backward twice
    the forward), causal attention (4·B·heads·T²·hd halved, forward+backward 3.5×) and the LM head."""
    tokens, d = batch * seq, config.d_model
    width_q = config.n_head * config.head_dim
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    mlp_in = 2 * config.hidden if config.mlp == "swiglu" else config.hidden
    gemm_k_n = d * qkv + width_q * d + d * mlp_in + config.hidden * d  # Σ K·N of a block's GEMMs
    block_gemms = 2 * tokens * gemm_k_n / tp
    attention = 4 * batch * (config.n_head / tp) * seq * seq * config.head_dim / 2
    lm_head = 2 * tokens * d * config.vocab_size / tp
    return config.n_layer * (3 * block_gemms + 3.5 * attention) + 3 * lm_head


def estimate_compute_ms(
    config: GPTConfig, tp: int, batch: int, seq: int, peak_tflops: float, efficiency: float
) -> float:
    """Roofline compute time of one rank: FLOPs at efficiency × peak, plus AdamW's bytes over HBM."""
    flops_s = flops_per_rank(config, tp, batch, seq) / (peak_tflops * 1e12 * efficiency)
    optimizer_s = ADAMW_BYTES_PER_PARAM * local_params(config, tp) / (HBM_GBPS * 1e9)
    return (flops_s + optimizer_s) * 1e3


def measure_compute_ms(config: GPTConfig, tp: int, batch: int, seq: int) -> float:
    """Measured GPU time of one rank's step: one block × n_layer + LM head and loss + AdamW.

    A rank's block is not a smaller GPT (a GPTConfig with n_head / tp heads would also shrink
    d_model, and c_attn's input is the full d_model), so the block is built from its pieces at the
    shapes a rank holds: the two norms at full width (replicated), c_attn (B·T, C) → (B·T, qkv / tp),
    flash attention over n_head / tp heads, c_proj (C / tp → C), the fused MLP C → hidden / tp → C.
    Backend triton, float16 autocast, forward+backward with fixed output gradients. The head: the
    final norm, the logits (B·T, V / tp) against the rank's vocabulary rows and the cross entropy
    over them (the local work of the vocab-parallel loss). One input, not rotated: a block's
    weights and activations far exceed the L2 cache at these sizes.
    """
    import torch.nn.functional as F  # noqa: N812

    import kernels
    from bench.timing import time_gpu
    from horse.model import MLP, add_norm, make_norm

    device = torch.device("cuda")
    d, hd = config.d_model, config.head_dim
    heads, kv_heads = config.n_head // tp, config.kv_heads // tp
    with device:
        norm_1, norm_2, norm_f = (make_norm(config, "triton") for _ in range(3))
        c_attn = torch.nn.Linear(d, (heads + 2 * kv_heads) * hd, bias=config.bias)
        c_proj = torch.nn.Linear(heads * hd, d, bias=config.bias)
        mlp = MLP(dataclasses.replace(config, mlp_hidden=config.hidden // tp), "triton")
        wte = torch.nn.Parameter(torch.randn(config.vocab_size // tp, d) * 0.02)
        x = torch.randn(batch, seq, d, dtype=torch.float16, requires_grad=True)
        h = torch.randn(batch, seq, d, requires_grad=True)
        grad_x, grad_h = torch.randn_like(x), torch.randn_like(h)
        targets = torch.randint(0, config.vocab_size // tp, (batch * seq,))

    def block(inputs):
        x, h = inputs
        with torch.autocast("cuda", dtype=torch.float16):
            y, h = add_norm(norm_1, x, h)
            q, k, v = c_attn(y).split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
            shape = (batch, seq, -1, hd)
            a = kernels.flash_attention(q.view(shape), k.view(shape), v.view(shape), causal=True)
            y, h = add_norm(norm_2, c_proj(a.reshape(batch, seq, heads * hd)), h)
            out = mlp(y)
        torch.autograd.backward([out, h], [grad_x.to(out.dtype), grad_h])

    def head(inputs):
        x, h = inputs
        with torch.autocast("cuda", dtype=torch.float16):
            y, _ = add_norm(norm_f, x, h)
            logits = F.linear(y, wte).flatten(0, 1)  # (B·T, V / tp)
            loss = F.cross_entropy(logits.float(), targets)
        loss.backward()

    with device:
        flat = torch.zeros(local_params(config, tp), requires_grad=True)
        flat.grad = torch.randn_like(flat)
        optimizer = torch.optim.AdamW([flat], lr=1e-4, fused=True)
    block_ms = time_gpu(block, [(x, h)], warmup=5, repeats=30, batch=10).median_ms
    head_ms = time_gpu(head, [(x, h)], warmup=5, repeats=30, batch=10).median_ms
    optimizer_ms = time_gpu(lambda _: optimizer.step(), [None], warmup=3, repeats=20, batch=10).median_ms
    return config.n_layer * block_ms + head_ms + optimizer_ms


@dataclass(frozen=True)
class Row:
    """One (preset, tp) prediction; the times are None with a reason where tp cannot split it."""

    preset: str
    tp: int
    compute_ms: float | None = None
    comm_ms: float | None = None
    comm_bytes_per_gpu: float | None = None
    reason: str | None = None

    @property
    def step_ms(self) -> float | None:
        return None if self.reason else self.compute_ms + self.comm_ms


def tokens_per_s(tokens_per_step: int, step_ms: float, tp: int) -> tuple[float, float]:
    """(tokens/s per GPU, tokens/s per 8-GPU node of 8 / tp replicas) of one replica's step."""
    per_replica = tokens_per_step / (step_ms * 1e-3)
    return per_replica / tp, per_replica * (GPUS_PER_NODE // tp)


def predict(args: argparse.Namespace, measured: bool) -> list[Row]:
    rows = []
    for name in args.presets:
        config = preset(name)
        for tp in args.tp:
            try:
                check_divisible(config, tp)
            except ValueError as error:
                rows.append(Row(name, tp, reason=str(error)))
                continue
            if measured:
                compute = measure_compute_ms(config, tp, args.batch_size, args.seq_len)
            else:
                compute = estimate_compute_ms(
                    config, tp, args.batch_size, args.seq_len, args.peak_tflops, args.efficiency
                )
            shape = (config, tp, args.batch_size, args.seq_len, args.sequence_parallel)
            comm = comm_ms(*shape, args.nvlink_gbps, args.latency_us)
            rows.append(Row(name, tp, compute, comm, comm_bytes_per_gpu(*shape)))
    return rows


def row_dicts(rows: list[Row], tokens_per_step: int) -> list[dict]:
    """Rows with their derived columns, as printed and as written to --json."""
    base = {r.preset: r.step_ms for r in rows if r.tp == 1 and r.step_ms is not None}
    out = []
    for r in rows:
        entry = dataclasses.asdict(r) | {"step_ms": r.step_ms}
        if r.step_ms is not None:
            per_gpu, per_node = tokens_per_s(tokens_per_step, r.step_ms, r.tp)
            entry |= {
                "tokens_per_s_per_gpu": per_gpu,
                "tokens_per_s_per_node": per_node,
                "efficiency": base[r.preset] / (r.tp * r.step_ms) if r.preset in base else None,
                "comm_fraction": r.comm_ms / r.step_ms,
            }
        out.append(entry)
    return out


def format_table(entries: list[dict], title: str) -> str:
    header = (
        f"{'preset':<10} {'tp':>2} {'compute ms':>10} {'comm ms':>8} {'step ms':>8} "
        f"{'tok/s/GPU':>10} {'tok/s/node':>11} {'eff':>6} {'comm %':>6}"
    )
    lines = [title, header, "-" * len(header)]
    for e in entries:
        if e["reason"]:
            lines.append(f"{e['preset']:<10} {e['tp']:>2} n/a: {e['reason']}")
            continue
        efficiency = f"{100 * e['efficiency']:5.1f}%" if e["efficiency"] is not None else "   n/a"
        lines.append(
            f"{e['preset']:<10} {e['tp']:>2} {e['compute_ms']:>10.2f} {e['comm_ms']:>8.2f} "
            f"{e['step_ms']:>8.2f} {e['tokens_per_s_per_gpu']:>10,.0f} {e['tokens_per_s_per_node']:>11,.0f} "
            f"{efficiency} {100 * e['comm_fraction']:5.1f}%"
        )
    return "\n".join(lines)


def best_node_line(entries: list[dict]) -> str:
    """The best 8-GPU-node prediction against the 2.15M tokens/s reference."""
    valid = [e for e in entries if e["reason"] is None]
    if not valid:
        return "no preset fits any tp: nothing to compare with the reference"
    best = max(valid, key=lambda e: e["tokens_per_s_per_node"])
    ratio = best["tokens_per_s_per_node"] / REFERENCE_NODE_TOKENS_PER_S
    return (
        f"best 8-GPU node: {best['preset']} at tp {best['tp']}, {best['tokens_per_s_per_node'] / 1e6:.2f}M "
        f"tokens/s = {100 * ratio:.0f}% of the reference 2.15M tokens/s (8 NVLink GB300s, FP16; "
        f"a GB300 has ~2.5x an H200's dense fp16 peak)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    parser.add_argument("--tp", nargs="+", type=int, default=list(TP_SIZES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--nvlink-gbps",
        type=float,
        default=NVLINK_GBPS,
        help="NVLink bandwidth per GPU per direction, GB/s (default: NVLink 4, H100/H200, 450)",
    )
    parser.add_argument("--latency-us", type=float, default=LATENCY_US, help="per collective")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="roofline peak (no GPU)")
    parser.add_argument("--efficiency", type=float, default=EFFICIENCY, help="roofline fraction of peak")
    parser.add_argument("--estimate", action="store_true", help="the roofline even where a GPU is present")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and settings here")
    args = parser.parse_args(argv)
    for name in args.presets:
        preset(name)  # an unknown name fails here, before any timing
    if any(tp < 1 or GPUS_PER_NODE % tp for tp in args.tp):
        parser.error(f"--tp sizes must divide {GPUS_PER_NODE}, got {args.tp}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured = torch.cuda.is_available() and not args.estimate
    if measured:
        source = f"MEASURED compute on {torch.cuda.get_device_name()}"
    else:
        source = (
            f"ESTIMATED (no GPU: roofline at {100 * args.efficiency:.0f}% of {args.peak_tflops:.0f} "
            "TFLOP/s peak), not measured"
        )
    title = (
        f"Tensor-parallel step model, {source}; batch {args.batch_size} x seq {args.seq_len} per replica; "
        f"comm: NVLink {args.nvlink_gbps:.0f} GB/s per direction + {args.latency_us:.0f} us per collective, "
        f"not overlapped; sequence parallel {'on' if args.sequence_parallel else 'off'}"
    )
    entries = row_dicts(predict(args, measured), args.batch_size * args.seq_len)
    print(format_table(entries, title))
    print(best_node_line(entries))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"} | {"measured": measured}
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "title": title, "rows": entries}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
