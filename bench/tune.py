"""Tune the kernel tables on a GPU: measure neighbours of each table entry, keep what is faster.

    python -m bench.tune attention [--passes fwd bwd_dkdv bwd_dq] [--head-dims 128] [--seqlen 4096]
    python -m bench.tune mlp [--gemms fwd gated_fwd dh_bwd gated_dh_bwd] [--shape-classes large medium]
    (either with --seconds 240 --json PATH)
    python -m bench.tune attention|mlp --compile-only --arch sm86 [--start-from sm90] [--jobs N]
        [--capability 86 89 120] [--write]

A target is one table entry: an attention pass at a head dim (horse.kernels.attention; the forward's
packed table too), or an MLP GEMM at a shape class (horse.kernels.mlp). Starting from the entry (the
prediction), the tuner descends. Every neighbour of the current best (block_m, block_n or block_k
halved or doubled, num_warps 4 <-> 8, num_stages one up or down, TMA on or off (sm_90+), the
epilogue split halved or doubled) is compiled for this GPU's family first (``bench.compile_report``:
skipped if it spills or exceeds shared memory), checked against the float32 reference, then timed with CUDA
events (the same inputs every call; each is tens of MiB, past the L2). The fastest neighbour, by
the time summed over the target's modes, becomes the best if it gains more than MIN_GAIN, and its
neighbours are next.

What is timed: an attention forward times ``attention_fwd`` on the bench shape (16K tokens, heads ·
head_dim = 2048, float16), causal and not, and the packed forward the bench's nine documents (16K
tokens, causal); a backward pass the whole backward with only that pass's entry changed. An MLP
GEMM times its launcher alone on the bench shape that falls in its class (GPT-2 1.3B or LLaMA 7B at
16K tokens for large; 124M at 1K tokens or 7B at 512 for medium). The candidate reaches the
launchers as an argument (``attention_fwd``'s entry, ``attention_bwd``'s dkdv_entry and dq_entry, the
MLP's ``_fwd_gemm`` and ``_dh_act_bwd``'s entry), so the check and the timing run it while every table
stays as it is. The entries tuned are those of this GPU's family (horse.kernels.runtime.arch). Stops
at --seconds (shared by the targets in order) and prints every measurement with TFLOP/s, the table's
entry and the best found; --json keeps them. The kernel tables are changed by hand from what this
measured, never at run time.

With --compile-only nothing runs on a GPU: for each entry of the family --arch, the first of its
candidates (the entry, or --start-from's, then smaller tiles from the largest down) that compiles
clean for that family in every variant ``bench.compile_report`` builds of an entry, and why each
candidate before it failed. --capability builds each variant for each of several GPUs that take the
family's entries instead (``--arch sm86 --capability 86 89 120``: Ampere, Ada, consumer Blackwell).
--write puts the entries found into the family's config file (:func:`config_file`: attention's
horse/kernels/attention/configs.json, mlp's horse/kernels/mlp/configs.json, which the kernels' tables
load), one a line and the rest of the file as it was; the padded and packed forward are then one
entry, clean in both's variants.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch

from bench import correctness, timing
from bench.compile_report import compiler, gate
from bench.compile_report.attention import ATTENTION_MASKS, attention_entry_configs, attention_pass_configs
from bench.compile_report.config import check_capabilities
from bench.compile_report.mlp import mlp_entry_configs, mlp_gemm_config
from bench.report import format_table
from horse.kernels import reference, runtime
from horse.kernels.attention import configs as attention_configs
from horse.kernels.attention.launch import Packed, attention_bwd, attention_fwd
from horse.kernels.mlp import configs as mlp_tables
from horse.kernels.mlp import launch as mlp_launch

ATTENTION_PASSES = {  # --passes name: (compile report pass, table in horse.kernels.attention.configs)
    "fwd": ("attn_fwd", "FWD_CONFIGS"),
    "bwd_dkdv": ("attn_bwd_dkdv", "BWD_DKDV_CONFIGS"),
    "bwd_dq": ("attn_bwd_dq", "BWD_DQ_CONFIGS"),
}
# MLP GEMM shapes per (gemm, shape class): (model name in bench.mlp.MODELS, tokens).
MLP_SHAPES = {
    ("fwd", "large"): ("1.3B", 16384),
    ("fwd", "medium"): ("124M", 1024),
    ("gated_fwd", "large"): ("7B", 16384),
    ("gated_fwd", "medium"): ("7B", 512),
    ("dh_bwd", "large"): ("1.3B", 16384),
    ("dh_bwd", "medium"): ("124M", 1024),
    ("gated_dh_bwd", "large"): ("7B", 16384),
    ("gated_dh_bwd", "medium"): ("7B", 512),
}
SHAPE_CLASSES = ("large", "medium", "small")  # the GEMM tables' keys (horse.kernels.mlp.configs.shape_class)
MIN_GAIN = 0.02  # a neighbour must be this much faster to move: below it, timing noise decides
TILE_RANGE = (16, 256)
WARPS = (4, 8)
STAGES = (1, 5)
EPILOGUE_SPLITS = (1, 2, 4)
CHECK_SEQLEN = 333  # the attention check's ragged length
DEVICE = "cuda"  # where targets check and time; the CPU tests run them in the interpreter


@dataclasses.dataclass
class Target:
    """One table entry to tune, and how to compile, check and time a candidate for it: each takes the
    candidate, which the launchers run in place of the table's entry."""

    title: str
    entry: object  # the table's entry, where the descent starts
    compile_configs: Callable[[object], list]  # candidate -> bench.compile_report KernelConfig list
    check: Callable[[object], bool]  # candidate -> ours with it correct (on the GPU)
    calls: Callable[[object], dict]  # candidate -> {mode: (zero-argument call, FLOPs a call does)}
    tma: bool = True  # candidates toggle TMA (the GPU has it: sm_90+)


@dataclasses.dataclass
class Measurement:
    config: dict
    compiled: bool  # no spills, shared memory in budget on the GPU's family
    correct: bool | None = None
    ms: dict = dataclasses.field(default_factory=dict)  # mode -> median ms
    tflops: dict = dataclasses.field(default_factory=dict)  # the same modes
    note: str = ""

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values()) if self.correct and self.ms else math.inf


def neighbours(cfg, tma: bool = True) -> list:
    """Configs one change away from cfg (an AttnConfig or a GemmConfig): a tile dimension halved or
    doubled within TILE_RANGE, the other warp count, a pipeline stage more or fewer, with tma TMA
    toggled (not for a split dk/dv pass), and the epilogue split halved or doubled (GEMMs)."""
    out = []
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(cfg, name, None)
        for new in (value // 2, value * 2) if value else ():
            if TILE_RANGE[0] <= new <= TILE_RANGE[1]:
                out.append(dataclasses.replace(cfg, **{name: new}))
    out += [dataclasses.replace(cfg, num_warps=w) for w in WARPS if w != cfg.num_warps]
    for stages in (cfg.num_stages - 1, cfg.num_stages + 1):
        if STAGES[0] <= stages <= STAGES[1]:
            out.append(dataclasses.replace(cfg, num_stages=stages))
    if tma and getattr(cfg, "column_splits", 1) == 1:
        out.append(dataclasses.replace(cfg, tma=not cfg.tma))
    split = getattr(cfg, "epilogue_split", None)
    for new in (split // 2, split * 2) if split else ():
        if new in EPILOGUE_SPLITS and cfg.block_n % new == 0:
            out.append(dataclasses.replace(cfg, epilogue_split=new))
    return out


def descend(
    start,
    measure: Callable[[object], Measurement],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    tma: bool = True,
) -> tuple[object, list[Measurement]]:
    """Best-improvement descent from start over :func:`neighbours`, each config measured once,
    until no neighbour gains MIN_GAIN or the clock passes deadline. Returns (best, measurements)."""
    measured = {start: measure(start)}
    best = start
    while clock() < deadline:
        candidates = []
        for cfg in neighbours(best, tma):
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


def compile_failures(configs: list, compile_batch: Callable[[list], list]) -> tuple[list, list[str]]:
    """The CompileResults of configs (bench.compile_report KernelConfigs) built by compile_batch, and
    a line per config that spills, exceeds shared memory or misses the tensor cores (gate.failures); a
    config Triton cannot compile at all is the one line."""
    try:
        results = compile_batch(configs)
    except Exception as error:
        return [], [f"does not compile: {' '.join(str(error).split())[:200]}"]
    return results, gate.failures(results)


def compiles_clean(configs: list) -> tuple[bool, str]:
    """Whether every KernelConfig compiles clean for its GPU family; the reason, or
    the registers, as a note."""
    # In this process: a forked worker of a process that holds a CUDA context is unsafe.
    results, bad = compile_failures(configs, compiler.compile_configs)
    return not bad, "; ".join(bad) if bad else "registers " + "/".join(str(r.registers) for r in results)


def gpu_measure(target: Target) -> Callable[[object], Measurement]:
    """A measure(cfg) for :func:`descend`: compile check, correctness check, then CUDA-event timing
    of the target's calls, each given cfg (no table is changed)."""

    def measure(cfg) -> Measurement:
        compiled, note = compiles_clean(target.compile_configs(cfg))
        result = Measurement(dataclasses.asdict(cfg), compiled, note=note)
        if not compiled:
            return result
        try:
            result.correct = target.check(cfg)
            for mode, (call, flops) in target.calls(cfg).items() if result.correct else ():
                result.ms[mode] = timing.time_gpu(lambda c: c(), [call], warmup=5, repeats=30).median_ms
                result.tflops[mode] = flops / (result.ms[mode] * 1e-3) / 1e12
        except Exception as error:  # e.g. out of resources at launch: this config is out
            result.correct, result.note = False, " ".join(str(error).split())[:200]
        finally:
            torch.cuda.empty_cache()
        return result

    return measure


# ----------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------


def attention_targets(passes, head_dims, seqlen: int, arch: runtime.Arch = runtime.SM90) -> list[Target]:
    """The entries of arch's attention tables for the passes at the head dims; for the forward the
    packed table's too, timed on the bench's documents (causal, as packed documents are trained) and
    checked on three ragged ones, TMA descriptors built on the device per sequence, no persistence."""
    from bench import attention as bench_attention

    def variants(pass_name: str, head_dim: int, packed: bool) -> Callable[[object], list]:
        return lambda cfg: [
            config
            for mask in ATTENTION_MASKS
            for config in attention_pass_configs(
                pass_name, cfg, head_dim, torch.float16, mask, cfg.tma, packed, arch.name
            )
        ]

    targets = []
    for name, head_dim in itertools.product(passes, head_dims):
        pass_name, table_name = ATTENTION_PASSES[name]
        shape = bench_attention.benchmark_shape(seqlen, head_dim)
        for packed in (False, True) if name == "fwd" else (False,):  # packed documents: a table of their own
            table = getattr(attention_configs, "PACKED_FWD_CONFIGS" if packed else table_name)[arch.name]
            target = Target(
                title=f"attention {name}{' packed' if packed else ''} d={head_dim} ({arch.name})",
                entry=table[attention_configs.head_dim_block(head_dim)],
                compile_configs=variants(pass_name, head_dim, packed),
                check=functools.partial(_attention_check, pass_name, head_dim, packed),
                calls=functools.partial(_attention_calls, pass_name, shape, packed),
                tma=arch.tma,
            )
            targets.append(target)
    return targets


def _forward(q, k, v, causal: bool, packed: Packed | None, entries: dict):
    """attention_fwd at the default scale, by entries ({compile report pass: config}) where they name
    the forward, else by its table: (out, lse)."""
    scale = 1 / math.sqrt(q.shape[-1])
    return attention_fwd(q, k, v, causal, scale, packed=packed, entry=entries.get("attn_fwd"))


def _backward(dout, q, k, v, out, lse, causal: bool, packed: Packed | None, entries: dict):
    """attention_bwd of :func:`_forward`, each gradient pass by entries where they name it, else by
    its table: (dq, dk, dv, dsinks)."""
    scale = 1 / math.sqrt(q.shape[-1])
    passes = dict(dkdv_entry=entries.get("attn_bwd_dkdv"), dq_entry=entries.get("attn_bwd_dq"))
    return attention_bwd(dout, None, q, k, v, out, lse, causal, scale, packed=packed, **passes)


class _Attention(torch.autograd.Function):
    """flash_attention's forward and backward by :func:`_forward` and :func:`_backward`: a candidate
    checked as the public function runs, passed to the launchers, not put into a table."""

    @staticmethod
    def forward(ctx, causal: bool, packed: Packed | None, entries: dict, q, k, v):
        out, lse = _forward(q, k, v, causal, packed, entries)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (causal, packed, entries)
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv, _ = _backward(dout, *ctx.saved_tensors, *ctx.options)
        return None, None, None, dq, dk, dv


def _attention_check(pass_name: str, head_dim: int, packed: bool, cfg) -> bool:
    """Ours with cfg for the pass against the float32 reference at head_dim, forward and backward:
    CHECK_SEQLEN long, full and causal, or packed, three ragged documents."""
    from bench import attention as bench_attention

    entries = {pass_name: cfg}
    if packed:

        def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
            batch = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            return _Attention.apply(causal, batch, entries, q, k, v)

        lengths = (CHECK_SEQLEN, 1, CHECK_SEQLEN // 3)
        return bench_attention.check_packed(lengths, 2, head_dim, DEVICE, varlen)[1]
    shape = bench_attention.Shape(1, CHECK_SEQLEN, 2, head_dim)
    return all(
        bench_attention.check(
            shape, causal, DEVICE, functools.partial(_Attention.apply, causal, None, entries)
        )[1]
        for causal in (False, True)
    )


def _attention_calls(pass_name: str, shape, packed: bool, cfg) -> dict:
    """The pass with cfg on shape, full and causal: the forward alone, or the whole backward of one
    forward (the table's); packed, the forward on the bench's documents at shape's heads and head dim,
    causal."""
    from bench import attention as bench_attention

    entries = {pass_name: cfg}
    if packed:
        lengths = bench_attention.PACKED_LENGTHS
        documents = bench_attention.Shape(1, sum(lengths), shape.heads, shape.head_dim)
        q, k, v = (t[0] for t in bench_attention.make_qkv(documents, DEVICE))  # (tokens, heads, head_dim)
        cu = bench_attention.offsets(lengths, DEVICE)
        batch = Packed(cu, cu, max(lengths), max(lengths))
        call = functools.partial(_forward, q, k, v, True, batch, entries)
        return {"causal": (call, bench_attention.packed_flops(lengths, shape.heads, shape.head_dim))}
    direction = "forward" if pass_name == "attn_fwd" else "backward"
    q, k, v = bench_attention.make_qkv(shape, torch.device(DEVICE))
    calls = {}
    for causal in (False, True):
        call = functools.partial(_forward, q, k, v, causal, None, entries)
        if direction == "backward":
            out, lse = call()
            dout = torch.randn_like(out)
            call = functools.partial(_backward, dout, q, k, v, out, lse, causal, None, entries)
        flops = bench_attention.direction_flops(direction, shape, causal)
        calls["causal" if causal else "full"] = (call, flops)
    return calls


def mlp_targets(gemms, shape_classes, arch: runtime.Arch = runtime.SM90) -> list[Target]:
    """The entries of arch's GEMM tables for the GEMMs at the shape classes."""
    from bench import mlp as bench_mlp

    models = {m.name: m for m in bench_mlp.MODELS}
    targets = []
    for gemm, shape_class in itertools.product(gemms, shape_classes):
        model, tokens = models[MLP_SHAPES[gemm, shape_class][0]], MLP_SHAPES[gemm, shape_class][1]
        if mlp_tables.shape_class(tokens, model.hidden) != shape_class:
            raise ValueError(f"MLP_SHAPES: {model.name} at {tokens} tokens is not {shape_class}")
        target = Target(
            title=f"mlp {gemm} {shape_class} ({model.name}, {tokens} tokens; {arch.name})",
            entry=mlp_tables.GEMM_CONFIGS[arch.name][gemm][shape_class],
            compile_configs=lambda cfg, g=gemm, c=shape_class, a=model.activation: [
                mlp_gemm_config(g, c, cfg, torch.float16, a, cfg.tma, arch.name)
            ],
            check=functools.partial(_mlp_check, gemm, model, tokens),
            calls=functools.partial(_mlp_calls, gemm, model, tokens),
            tma=arch.tma,
        )
        targets.append(target)
    return targets


def _mlp_tensors(gemm: str, model, tokens: int) -> dict:
    """The GEMM's inputs by name, from the model's tensors (bench.mlp.make_inputs); the dh GEMM's dy
    and its saved pre (and up, gated) random."""
    from bench import mlp as bench_mlp

    t = bench_mlp.make_inputs(model, tokens, torch.device(DEVICE))
    if gemm == "fwd":
        return {name: t[name] for name in ("x", "w_in", "b_in")}
    if gemm == "gated_fwd":
        return {name: t[name] for name in ("x", "w_gate", "w_up")}
    gated = gemm == "gated_dh_bwd"
    pre = torch.randn(tokens, model.hidden, dtype=t["x"].dtype, device=t["x"].device)
    tensors = {"dy": torch.randn_like(t["x"]), "w_out": t["w_down"] if gated else t["w_out"], "pre": pre}
    return tensors | ({"up": torch.randn_like(pre)} if gated else {})


def _mlp_gemm(gemm: str, activation: str, cfg, t: dict) -> torch.Tensor:
    """The GEMM's launcher with cfg on the tensors t (:func:`_mlp_tensors`): the forward's y, or the dh
    GEMM's dpre."""
    if gemm == "fwd":
        return mlp_launch._fwd_gemm(t["x"], t["w_in"], None, t["b_in"], activation, False, cfg)[0]
    if gemm == "gated_fwd":
        return mlp_launch._fwd_gemm(t["x"], t["w_gate"], t["w_up"], None, activation, False, cfg)[0]
    has_bias = gemm == "dh_bwd"  # the GPT-2 MLP's b_in; the gated MLP has none
    dh_act = mlp_launch._dh_act_bwd(
        t["dy"], t["w_out"], t["pre"], t.get("up"), activation, has_bias, entry=cfg
    )
    return dh_act[0]


def _mlp_reference(gemm: str, activation: str, t: dict) -> torch.Tensor:
    """:func:`_mlp_gemm`'s output by the float32 reference: y, or dpre, the gradient of h = act(pre)
    (⊙ up, gated: [dgate | dup]) for dh = dy W_out."""
    if gemm == "fwd":
        return reference.linear_act(t["x"], t["w_in"], t["b_in"], activation=activation)
    if gemm == "gated_fwd":
        return reference.gated_linear(t["x"], t["w_gate"], t["w_up"], activation=activation)
    saved = [t[name].requires_grad_() for name in ("pre", "up") if name in t]
    h = reference.apply_activation(saved[0], activation) * (t["up"] if "up" in t else 1)
    return torch.cat(torch.autograd.grad(h, saved, t["dy"] @ t["w_out"]), dim=1)


def _mlp_check(gemm: str, model, tokens: int, cfg) -> bool:
    """The GEMM's launcher with cfg on the model's tensors against the float32 reference
    (:func:`bench.correctness.check`)."""
    from bench import mlp as bench_mlp

    torch.manual_seed(0)
    tensors = _mlp_tensors(gemm, model, tokens)
    return correctness.check(
        lambda *ts: _mlp_gemm(gemm, model.activation, cfg, dict(zip(tensors, ts, strict=True))),
        lambda *ts: _mlp_reference(gemm, model.activation, dict(zip(tensors, ts, strict=True))),
        list(tensors.values()),
        ["y" if gemm.endswith("fwd") else "dpre"],
        bench_mlp.TOLERANCE,
    )[1]


def _mlp_calls(gemm: str, model, tokens: int, cfg) -> dict:
    """The GEMM's launcher alone with cfg on the model's tensors: {"gemm": (call, 2·M·N·K per GEMM)}."""
    from bench import mlp as bench_mlp

    # (tokens, d_model) x (d_model, hidden), twice in the gated forward; dh = dy W_out is the same.
    flops = (2 if gemm == "gated_fwd" else 1) * bench_mlp.gemm_flops(tokens, model.hidden, model.d_model)
    call = functools.partial(_mlp_gemm, gemm, model.activation, cfg, _mlp_tensors(gemm, model, tokens))
    return {"gemm": (call, flops)}


# ----------------------------------------------------------------------------------------------
# Compile-only search (no GPU)
# ----------------------------------------------------------------------------------------------

ATTENTION_TILES = (128, 64, 32, 16)  # block_m and block_n
ATTENTION_STAGES = (3, 2, 1)
COLUMN_SPLITS = {256: (1, 2), 512: (1, 2, 4)}  # the dk/dv pass's, by padded head dim
GEMM_TILES = ((128, 64), (256, 128, 64), (64, 32))  # block_m, block_n, block_k
GEMM_STAGES = (4, 3, 2)


@dataclasses.dataclass
class EntrySearch:
    """One table entry of a GPU family to search by compiling alone: candidates in order of
    preference, and every KernelConfig a candidate must compile clean in."""

    title: str
    table_entry: object  # the family's entry now
    candidates: list  # the start first
    variants: Callable[[object], list]
    # Where --write puts the entry found: (table, family, key...) in the family's config_file.
    entry: tuple = ()


def attention_candidates(pass_name: str, start, block_d: int, tma: bool) -> list:
    """start, then every tile no larger: block_m and block_n in ATTENTION_TILES (the forward and dq
    passes loop over key blocks, so block_n <= block_m; dk/dv over query blocks, block_m <= block_n),
    8 or 4 warps, ATTENTION_STAGES, the dk/dv pass at head dim 256 also with 2 column splits and at 512
    with 2 or 4 (COLUMN_SPLITS; not with split outputs, whose kernel takes whole rows), TMA (tma: the
    family has it) and pointers. Largest tile first, then the longest side, fewer splits, start's
    warps, more stages, TMA before pointers."""
    by_queries = pass_name == "attn_bwd_dkdv"
    tiles = [
        (m, n)
        for m, n in itertools.product(ATTENTION_TILES, repeat=2)
        if (m <= n if by_queries else n <= m) and m * n <= start.block_m * start.block_n
    ]
    splits = (1,)
    if pass_name == "attn_bwd_dkdv" and not start.split_outputs:
        splits = COLUMN_SPLITS.get(block_d, (1,))
    out = [
        dataclasses.replace(start, block_m=m, block_n=n, num_warps=w, num_stages=st, column_splits=sp, tma=t)
        for (m, n), w, st, sp, t in itertools.product(tiles, WARPS, ATTENTION_STAGES, splits, (tma, False))
    ]
    out.sort(
        key=lambda c: (
            -c.block_m * c.block_n,
            -max(c.block_m, c.block_n),
            c.column_splits,
            c.num_warps != start.num_warps,
            -c.num_stages,
            not c.tma,
        )
    )
    return list(dict.fromkeys([start, *out]))


def gemm_candidates(start, tma: bool) -> list:
    """start, then every GEMM tile of GEMM_TILES with no more outputs than start's, 8 or 4 warps,
    GEMM_STAGES, an epilogue split of EPILOGUE_SPLITS leaving 32 columns or more, TMA (tma: the
    family has it) and pointers, start's group. Largest tile first, start's shape first among equals,
    then the deepest pipeline (block_k times stages), fewer splits, start's warps, TMA first."""
    out = [
        dataclasses.replace(
            start, block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=st, epilogue_split=sp, tma=t
        )
        for m, n, k in itertools.product(*GEMM_TILES)
        if m * n <= start.block_m * start.block_n
        for w, st, sp, t in itertools.product(WARPS, GEMM_STAGES, EPILOGUE_SPLITS, (tma, False))
        if n // sp >= 32
    ]
    out.sort(
        key=lambda c: (
            -c.block_m * c.block_n,
            (c.block_m, c.block_n) != (start.block_m, start.block_n),
            -c.block_k * c.num_stages,
            c.epilogue_split,
            c.num_warps != start.num_warps,
            not c.tma,
        )
    )
    return list(dict.fromkeys([start, *out]))


def attention_searches(passes, head_dims, arch: runtime.Arch, start_from: runtime.Arch | None = None) -> list:
    """An EntrySearch per attention table entry of arch for the passes (the forward's packed table
    too) at the head dims, starting from start_from's entry (default: arch's own)."""
    tma, searches = arch.tma, []
    block_dims = list(dict.fromkeys(attention_configs.head_dim_block(d) for d in head_dims))
    for name, block_d in itertools.product(passes, block_dims):
        pass_name, padded_table = ATTENTION_PASSES[name]
        for table_name in (padded_table, "PACKED_FWD_CONFIGS") if name == "fwd" else (padded_table,):
            table = getattr(attention_configs, table_name)
            start = table[(start_from or arch).name][block_d]
            # Without TMA the family starts from the entry's pointer tile, which its candidates then vary.
            start = start if tma else dataclasses.replace(start.loads(False), tma=False)
            batch = " packed" if table_name.startswith("PACKED") else ""
            search = EntrySearch(
                title=f"attention {name}{batch} d={block_d} ({arch.name})",
                table_entry=table[arch.name][block_d],
                candidates=attention_candidates(pass_name, start, block_d, tma),
                variants=lambda cfg, t=table_name, b=block_d: attention_entry_configs(t, cfg, b, arch),
                entry=(padded_table, arch.name, str(block_d)),  # the packed forward reads the padded entries
            )
            searches.append(search)
    return searches


def mlp_searches(gemms, shape_classes, arch: runtime.Arch, start_from: runtime.Arch | None = None) -> list:
    """An EntrySearch per GEMM table entry of arch for the GEMMs at the shape classes, starting from
    start_from's entry (default: arch's own)."""
    tma, searches = arch.tma, []
    for gemm, shape_class in itertools.product(gemms, shape_classes):
        start = mlp_tables.GEMM_CONFIGS[(start_from or arch).name][gemm][shape_class]
        start = start if tma else dataclasses.replace(start, tma=False)
        search = EntrySearch(
            title=f"mlp {gemm} {shape_class} ({arch.name})",
            table_entry=mlp_tables.GEMM_CONFIGS[arch.name][gemm][shape_class],
            candidates=gemm_candidates(start, tma),
            variants=lambda cfg, g=gemm, c=shape_class: mlp_entry_configs(g, c, cfg, arch),
            entry=("GEMM_CONFIGS", arch.name, gemm, shape_class),
        )
        searches.append(search)
    return searches


def built_for(search: EntrySearch, capabilities: list[int]) -> EntrySearch:
    """search, its candidates to compile clean for each GPU of capabilities (86 for 8.6) rather than
    their family's own: every variant for each GPU in turn, so a search still meets the variant
    likeliest to fail first."""

    def variants(cfg) -> list:
        return [dataclasses.replace(v, capability=c) for v in search.variants(cfg) for c in capabilities]

    title = f"{search.title[:-1]} as sm_{'/sm_'.join(map(str, capabilities))})"
    return dataclasses.replace(search, title=title, variants=variants)


def one_per_entry(searches: list[EntrySearch]) -> list[EntrySearch]:
    """searches, those that find the same file entry (the padded and the packed forward: the packed
    table copies the padded one) as one, its candidates clean in the variants of each."""
    merged = {}
    for search in searches:
        first = merged.setdefault(search.entry, search)
        if first is not search:
            merged[search.entry] = dataclasses.replace(
                first, variants=lambda cfg, a=first.variants, b=search.variants: a(cfg) + b(cfg)
            )
    return list(merged.values())


def config_file(family: str) -> pathlib.Path:
    """The config file of kernel family ("attention", "mlp") that its tables load and --write updates."""
    return {"attention": attention_configs.CONFIG_FILE, "mlp": mlp_tables.CONFIG_FILE}[family]


def entry_fields(cfg) -> dict:
    """cfg (an AttnConfig or a GemmConfig) as a config file holds it: its fields not at
    their defaults, a config inside it (AttnConfig.pointer) likewise."""
    fields = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.default is dataclasses.MISSING or getattr(cfg, f.name) != f.default
    }
    return {name: entry_fields(v) if dataclasses.is_dataclass(v) else v for name, v in fields.items()}


def format_configs(node: dict, indent: str = "") -> str:
    """A config file's tables as the config files lay them out: a key a line, an entry on one,
    so that a diff shows only the entries that changed."""
    if not all(isinstance(value, dict) for value in node.values()):  # an entry (pointer inside: one line)
        return json.dumps(node)
    inner = indent + "  "
    lines = [f"{inner}{json.dumps(key)}: {format_configs(value, inner)}" for key, value in node.items()]
    return "{\n" + ",\n".join(lines) + f"\n{indent}}}"


def write_entries(path, entries: dict) -> None:
    """Set entries ({(table, family, key...): config}) in the config file at path, keeping the order
    and layout of the rest."""
    tables = json.loads(path.read_text())
    for (*keys, last), cfg in entries.items():
        node = tables
        for key in keys:
            node = node.setdefault(key, {})
        node[last] = entry_fields(cfg)
    path.write_text(format_configs(tables) + "\n")


def first_failure(configs: list, compile_batch: Callable[[list], list], batch: int) -> str | None:
    """Why configs (bench.compile_report KernelConfigs) do not all compile clean, or None if they do;
    compiled batch at a time (compile_batch: configs -> CompileResults), stopping at the first
    batch that fails."""
    for i in range(0, len(configs), batch):
        _, bad = compile_failures(configs[i : i + batch], compile_batch)
        if bad:
            return bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
    return None


def search_entries(
    searches: list[EntrySearch],
    compile_batch: Callable[[list], list],
    batch: int = 2,
    seconds: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """For each search the first candidate that compiles clean in every variant, with the reason
    each earlier candidate failed; stops at seconds. The report as a dict (null: none found)."""
    deadline = clock() + seconds
    report = {}
    for search in searches:
        clean, rejected = None, []
        for cfg in search.candidates:
            if clock() >= deadline:
                break
            reason = first_failure(search.variants(cfg), compile_batch, batch)
            if reason is None:
                clean = cfg
                break
            rejected.append({"config": dataclasses.asdict(cfg), "reason": reason})
        report[search.title] = {
            "table": dataclasses.asdict(search.table_entry),
            "start": dataclasses.asdict(search.candidates[0]),
            "clean": dataclasses.asdict(clean) if clean else None,
            "rejected": rejected,
        }
        print(format_search(search.title, report[search.title]), flush=True)
    return report


def format_search(title: str, result: dict) -> str:
    """The start, the first clean candidate against the table's entry, and every rejection."""
    clean = _short(result["clean"]) if result["clean"] else "none"
    same = " (the table's)" if result["clean"] == result["table"] else f", table {_short(result['table'])}"
    rows = [(_short(r["config"]), r["reason"]) for r in result["rejected"]]
    return _section(f"== {title}: from {_short(result['start'])}, first clean {clean}{same}", rows)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def tune(targets: list[Target], seconds: float, make_measure=gpu_measure) -> dict:
    """Descend from each target's table entry within its share of the time; the report as a dict."""
    deadline = time.monotonic() + seconds
    report = {}
    for index, target in enumerate(targets):
        now = time.monotonic()
        target_deadline = now + (deadline - now) / (len(targets) - index)
        start = target.entry
        best, measurements = descend(start, make_measure(target), target_deadline, tma=target.tma)
        result = report[target.title] = {
            "table": dataclasses.asdict(start),
            "best": dataclasses.asdict(best),
            "measurements": [
                dataclasses.asdict(m) | {"total_ms": m.total_ms if m.total_ms < math.inf else None}
                for m in measurements
            ],
        }
        print(format_target(target.title, result["table"], result["best"], measurements), flush=True)
    return report


def format_target(title: str, table: dict, best: dict, measurements: list[Measurement]) -> str:
    """The table's entry, the best found (as dicts), and every measurement, fastest first."""
    rows = []
    for m in sorted(measurements, key=lambda m: m.total_ms):
        times = " ".join(f"{mode} {ms:.3f} ms {m.tflops[mode]:.0f} TFLOP/s" for mode, ms in m.ms.items())
        status = "ok" if m.correct else ("WRONG" if m.correct is False else "not compiled")
        rows.append((_short(m.config), status, times, m.note))
    return _section(f"== {title}: table {_short(table)}, best {_short(best)}", rows)


def _section(title: str, rows: list[tuple]) -> str:
    """A title line, then the rows as an indented table (bench.report.format_table)."""
    return "\n".join([title, *("  " + line for line in format_table(rows).splitlines())])


def _short(c: dict) -> str:
    """A config in a few words: tiles, warps, stages, and whatever is not the default."""
    words = ["x".join(str(c[k]) for k in ("block_m", "block_n", "block_k") if k in c)]
    words += [f"w{c['num_warps']}", f"s{c['num_stages']}"]
    if c.get("column_splits", 1) > 1:
        words.append(f"split{c['column_splits']}")
    if c.get("epilogue_split", 1) > 1:
        words.append(f"epilogue{c['epilogue_split']}")
    if c["tma"]:
        words.append("tma")
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    families = parser.add_subparsers(dest="family", required=True)
    attn_cli = families.add_parser("attention", help="the tables of horse.kernels.attention")
    attn_cli.add_argument("--passes", nargs="+", choices=ATTENTION_PASSES, default=list(ATTENTION_PASSES))
    attn_cli.add_argument("--head-dims", nargs="+", type=int, help="default: 128; with --compile-only all")
    attn_cli.add_argument("--seqlen", type=int, default=4096, help="the bench shape's (16K tokens a batch)")
    mlp_cli = families.add_parser("mlp", help="the GEMM table of horse.kernels.mlp.configs")
    gemms = list(dict.fromkeys(g for g, _ in MLP_SHAPES))
    mlp_cli.add_argument("--gemms", nargs="+", choices=gemms, default=gemms)
    mlp_cli.add_argument(
        "--shape-classes",
        nargs="+",
        choices=SHAPE_CLASSES,
        help="default: large medium; with --compile-only all (small has no bench shape to time)",
    )
    for family in (attn_cli, mlp_cli):
        family.add_argument(
            "--seconds",
            type=float,
            help="time budget, shared by the targets (default: 240; with --compile-only none)",
        )
        family.add_argument("--json", help="write every measurement here")
        family.add_argument(
            "--compile-only",
            action="store_true",
            help="no GPU: for each entry of --arch, the first candidate (largest tile first) that compiles "
            "clean in every variant the compile report builds",
        )
        family.add_argument("--arch", choices=list(runtime.ARCHS), help="with --compile-only: the family")
        family.add_argument(
            "--start-from",
            choices=list(runtime.ARCHS),
            help="with --compile-only: start from this family's entries (default: --arch's own)",
        )
        family.add_argument(
            "--jobs", type=int, default=os.cpu_count(), help="with --compile-only: parallel compilations"
        )
        family.add_argument(
            "--write",
            action="store_true",
            help="with --compile-only: put each entry found into the family's config file "
            "(horse/kernels/attention/configs.json, horse/kernels/mlp/configs.json)",
        )
        family.add_argument(
            "--capability",
            nargs="+",
            type=int,
            help="with --compile-only: clean when built for each of these GPUs that take --arch's entries, "
            "e.g. 86 89 120 for sm86 (default: the family's own)",
        )
    args = parser.parse_args(argv)
    report = _compile_only(parser, args) if args.compile_only else _tune(parser, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    # Exits 1 where a compile-only search found no clean candidate for an entry.
    return 0 if all(r.get("clean", True) for r in report.values()) else 1


def _tune(parser: argparse.ArgumentParser, args) -> dict:
    """The descent on this machine's GPU: its family's entries."""
    if args.arch or args.start_from or args.capability or args.write:
        parser.error(
            "--arch, --start-from, --capability and --write go with --compile-only: a GPU tunes its "
            "own family's entries"
        )
    if not torch.cuda.is_available():
        parser.error("tuning times kernels on a GPU; this machine has none (--compile-only needs none)")
    if "small" in (args.shape_classes or ()):
        parser.error("--shape-classes small has no bench shape to time; --compile-only searches it")
    arch = runtime.arch(torch.device(DEVICE))
    try:
        if args.family == "attention":
            targets = attention_targets(args.passes, args.head_dims or [128], args.seqlen, arch)
        else:
            targets = mlp_targets(args.gemms, args.shape_classes or ["large", "medium"], arch)
    except ValueError as error:  # a head dim or seqlen the bench shape cannot take
        parser.error(str(error))
    return tune(targets, 240 if args.seconds is None else args.seconds)


def _compile_only(parser: argparse.ArgumentParser, args) -> dict:
    """The compile-only search of --arch's entries, with --write put into its config file."""
    if args.arch is None:
        parser.error("--compile-only: name the GPU family to search with --arch")
    arch, start_from = runtime.ARCHS[args.arch], args.start_from and runtime.ARCHS[args.start_from]
    if args.family == "attention":
        head_dims = args.head_dims or sorted(attention_configs.FWD_CONFIGS[arch.name])
        if max(head_dims) > attention_configs.MAX_HEAD_DIM or min(head_dims) < 1:
            parser.error(f"--head-dims: 1 to {attention_configs.MAX_HEAD_DIM}, got {head_dims}")
        searches = attention_searches(args.passes, head_dims, arch, start_from)
    else:
        searches = mlp_searches(args.gemms, args.shape_classes or SHAPE_CLASSES, arch, start_from)
    if args.capability:
        check_capabilities(parser, args.capability, arch.name)
        searches = [built_for(search, args.capability) for search in searches]
    path = config_file(args.family)
    if args.write:
        if args.arch not in next(iter(json.loads(path.read_text()).values())):
            parser.error(f"--write: {path} holds no {args.arch} entries")
        searches = one_per_entry(searches)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    jobs, seconds = max(1, args.jobs), math.inf if args.seconds is None else args.seconds
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        report = search_entries(searches, lambda c: compiler.compile_in_pool(pool, c, jobs), jobs, seconds)
    if args.write:
        found = {s.entry: report[s.title]["clean"] for s in searches if report[s.title]["clean"]}
        write_entries(path, {entry: type(searches[0].table_entry)(**cfg) for entry, cfg in found.items()})
        print(f"wrote {len(found)} entries to {path}")
    return report


if __name__ == "__main__":
    sys.exit(main())
