"""Tune the attention tables on a GPU: measure neighbours of each table entry, keep what is faster.

    python -m bench.tune [--passes fwd bwd_dkdv bwd_dq] [--head-dims 128] [--seqlen 4096]
                         [--seconds 240] [--json PATH]

For each pass and head dim, starts from the entry of kernels.attention's table (the prediction)
and descends. Every neighbour of the current best (block_m or block_n halved or doubled, num_warps
4 <-> 8, num_stages one up or down, TMA on or off, and for the forward the programs per SM of a
persistent launch one up or down) is compiled for sm_90 first (``bench.compile_report``: skipped
if it spills or exceeds shared memory), checked against the float32 reference on a ragged shape,
then timed with CUDA events on the bench's shape (16K tokens, heads · head_dim = 2048, float16,
causal and not; the same inputs every call, each tensor 64 MiB at head dim 128, past the L2). The
fastest neighbour, by the time summed over both modes, becomes the best if it gains more than
MIN_GAIN, and its neighbours are next. The forward pass times ``attention_fwd``; a backward pass
times the whole backward with only that pass's entry changed. Stops at --seconds and prints every
measurement, the table's entry and the best found; --json keeps them. Tables are changed by hand
from what this measured, never at run time.
"""

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Callable

import torch

PASSES = {  # --passes name: (compile report pass, table in kernels.attention)
    "fwd": ("attn_fwd", "FWD_CONFIGS"),
    "bwd_dkdv": ("attn_bwd_dkdv", "BWD_DKDV_CONFIGS"),
    "bwd_dq": ("attn_bwd_dq", "BWD_DQ_CONFIGS"),
}
MIN_GAIN = 0.02  # a neighbour must be this much faster to move: below it, timing noise decides
TILE_RANGE = (16, 256)
WARPS = (4, 8)
STAGES = (1, 5)
PROGRAMS_PER_SM = 2  # persistent forward: 0 (a program per tile) to this many programs per SM
CHECK_SEQLEN = 333  # the correctness check's ragged length


@dataclasses.dataclass
class Measurement:
    config: dict
    compiled: bool  # no spills, shared memory in budget on sm_90
    correct: bool | None = None
    ms: dict = dataclasses.field(default_factory=dict)  # "full" / "causal" -> median ms
    tflops: dict = dataclasses.field(default_factory=dict)  # the same keys, ANCHORS FLOP counts
    note: str = ""

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values()) if self.correct and self.ms else math.inf


def neighbours(cfg, persistent: bool = False) -> list:
    """Configs one change away from cfg (an AttnConfig): a tile dimension halved or doubled within
    TILE_RANGE, the other warp count, one pipeline stage more or less, TMA toggled, and with
    persistent (the forward) one program per SM more or fewer, up to PROGRAMS_PER_SM."""
    out = []
    for field in ("block_m", "block_n"):
        for value in (getattr(cfg, field) // 2, getattr(cfg, field) * 2):
            if TILE_RANGE[0] <= value <= TILE_RANGE[1]:
                out.append(dataclasses.replace(cfg, **{field: value}))
    out += [dataclasses.replace(cfg, num_warps=w) for w in WARPS if w != cfg.num_warps]
    for stages in (cfg.num_stages - 1, cfg.num_stages + 1):
        if STAGES[0] <= stages <= STAGES[1]:
            out.append(dataclasses.replace(cfg, num_stages=stages))
    if cfg.column_splits == 1:  # a split dk/dv pass has no TMA variant
        out.append(dataclasses.replace(cfg, tma=not cfg.tma))
    if persistent:
        for programs in (cfg.programs_per_sm - 1, cfg.programs_per_sm + 1):
            if 0 <= programs <= PROGRAMS_PER_SM:
                out.append(dataclasses.replace(cfg, programs_per_sm=programs))
    return out


def descend(
    start,
    measure: Callable[[object], Measurement],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    persistent: bool = False,
) -> tuple[object, list[Measurement]]:
    """Best-improvement descent from start over :func:`neighbours`, each config measured once,
    until no neighbour gains MIN_GAIN or the clock passes deadline. Returns (best, measurements)."""
    measured = {start: measure(start)}
    best = start
    while clock() < deadline:
        candidates = []
        for cfg in neighbours(best, persistent):
            if clock() >= deadline:
                break
            if cfg not in measured:
                measured[cfg] = measure(cfg)
            candidates.append(cfg)
        fastest = min(candidates, key=lambda c: measured[c].total_ms, default=None)
        if fastest is None or not measured[fastest].total_ms < (1 - MIN_GAIN) * measured[best].total_ms:
            break
        best = fastest
    return best, list(measured.values())


def compiles_clean(pass_name: str, cfg, head_dim: int) -> tuple[bool, str]:
    """Whether cfg compiles for sm_90 without spills and within shared memory, in both causal modes."""
    from bench import compile_report

    configs = [
        compile_report.attention_pass_config(pass_name, cfg, head_dim, torch.float16, causal, cfg.tma)
        for causal in (False, True)
    ]
    try:  # in this process: a forked worker of a process that holds a CUDA context is unsafe
        results = [compile_report.compile_config(c) for c in configs]
    except Exception as error:  # a config Triton cannot compile at all
        return False, f"does not compile: {' '.join(str(error).split())[:200]}"
    bad = compile_report.failures(results)
    regs = "/".join(str(r.registers) for r in results)
    return not bad, "; ".join(bad) if bad else f"registers {regs}"


def gpu_measure(pass_name: str, table: dict, block_d: int, head_dim: int, seqlen: int) -> Callable:
    """A measure(cfg) for :func:`descend`: compile check, correctness check, then CUDA-event timing
    of the pass on the bench shape, with table[block_d] = cfg for the duration."""
    from bench import attention as bench_attention

    shape = bench_attention.benchmark_shape(seqlen, head_dim)
    device = torch.device("cuda")

    def measure(cfg) -> Measurement:
        compiled, note = compiles_clean(pass_name, cfg, head_dim)
        result = Measurement(dataclasses.asdict(cfg), compiled, note=note)
        if not compiled:
            return result
        previous, table[block_d] = table[block_d], cfg
        try:
            check_shape = bench_attention.Shape(1, CHECK_SEQLEN, 2, head_dim)
            result.correct = all(bench_attention.check(check_shape, c, "cuda")[1] for c in (False, True))
            direction = "forward" if pass_name == "attn_fwd" else "backward"
            for causal in (False, True) if result.correct else ():
                mode = "causal" if causal else "full"
                result.ms[mode] = _time_pass(pass_name, shape, causal, device)
                flops = bench_attention.direction_flops(direction, shape, causal)
                result.tflops[mode] = flops / (result.ms[mode] * 1e-3) / 1e12
        except Exception as error:  # e.g. out of resources at launch: this config is out
            result.correct, result.note = False, " ".join(str(error).split())[:200]
        finally:
            table[block_d] = previous
            torch.cuda.empty_cache()
        return result

    return measure


def _time_pass(pass_name: str, shape, causal: bool, device) -> float:
    from bench import attention as bench_attention
    from bench import timing
    from kernels import attention

    scale = 1 / math.sqrt(shape.head_dim)
    q, k, v = bench_attention.make_qkv(shape, device)
    if pass_name == "attn_fwd":
        call = lambda _: attention.attention_fwd(q, k, v, causal, scale)  # noqa: E731
    else:
        out, lse = attention.attention_fwd(q, k, v, causal, scale)
        dout = torch.randn_like(out)
        call = lambda _: attention.attention_bwd(dout, None, q, k, v, out, lse, causal, scale)  # noqa: E731
    return timing.time_gpu(call, [None], warmup=5, repeats=30).median_ms


def tune(passes, head_dims, seqlen: int, seconds: float) -> dict:
    from kernels import attention

    deadline = time.monotonic() + seconds
    report = {"seqlen": seqlen, "passes": {}}
    for (name, head_dim), pass_deadline in zip(
        itertools.product(passes, head_dims), _split(deadline, len(passes) * len(head_dims)), strict=True
    ):
        pass_name, table_name = PASSES[name]
        table = getattr(attention, table_name)
        block_d = attention.head_dim_block(head_dim)
        start = table[block_d]
        measure = gpu_measure(pass_name, table, block_d, head_dim, seqlen)
        best, measurements = descend(start, measure, pass_deadline, persistent=name == "fwd")
        report["passes"][f"{name} d={head_dim}"] = {
            "table": dataclasses.asdict(start),
            "best": dataclasses.asdict(best),
            "measurements": [
                dataclasses.asdict(m) | {"total_ms": m.total_ms if m.total_ms < math.inf else None}
                for m in measurements
            ],
        }
        print(format_pass(f"{name} d={head_dim}", start, best, measurements), flush=True)
    return report


def _split(deadline: float, parts: int) -> list[float]:
    """Deadlines that share the time until deadline equally among parts, in order."""
    now = time.monotonic()
    return [now + (deadline - now) * (i + 1) / parts for i in range(parts)]


def format_pass(title: str, table_cfg, best, measurements: list[Measurement]) -> str:
    """The table's entry, the best found, and every measurement, fastest first."""
    lines = [
        f"== {title}: table {_short(dataclasses.asdict(table_cfg))}, best {_short(dataclasses.asdict(best))}"
    ]
    for m in sorted(measurements, key=lambda m: m.total_ms):
        times = " ".join(f"{mode} {ms:.3f} ms {m.tflops[mode]:.0f} TFLOP/s" for mode, ms in m.ms.items())
        status = "ok" if m.correct else ("WRONG" if m.correct is False else "not compiled")
        lines.append(f"  {_short(m.config):28s} {status:12s} {times}  {m.note}".rstrip())
    return "\n".join(lines)


def _short(c: dict) -> str:
    split = f" split{c['column_splits']}" if c["column_splits"] > 1 else ""
    tma = " tma" if c["tma"] else ""
    persistent = f" persistent{c['programs_per_sm']}" if c["programs_per_sm"] else ""
    return f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}{split}{tma}{persistent}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", nargs="+", choices=sorted(PASSES), default=list(PASSES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[128])
    parser.add_argument(
        "--seqlen", type=int, default=4096, help="the bench shape's seqlen (16K tokens a batch)"
    )
    parser.add_argument("--seconds", type=float, default=240, help="time budget, shared by the passes")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tuning times kernels on a GPU; this machine has none")
    report = tune(args.passes, args.head_dims, args.seqlen, args.seconds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
