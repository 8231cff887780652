"""The host launchers of the attention passes: validate nothing (the public functions have), flatten,
pick the table entry, allocate, launch on the input's device, return what the backward needs.
"""

from dataclasses import dataclass

import torch
import triton

from horse.kernels import runtime
from horse.kernels.attention import configs
from horse.kernels.attention.backward import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dkdv_split_outputs_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
)
from horse.kernels.attention.configs import AttnConfig, head_dim_block
from horse.kernels.attention.decode import _attn_decode_kernel, _attn_decode_reduce_kernel
from horse.kernels.attention.forward import _attn_fwd_kernel
from horse.kernels.runtime import Plan

# Tiles by TMA where tma_usable allows; False sends every pass down the pointer path (the bench's
# "ours-pointer" row measures the difference).
USE_TMA = True
INTERPRETER_NUM_SMS = 132  # an H200's: see bwd_num_sms


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seqlen, heads) strides; the head_dim stride is 1, checked by the public function. A
    packed (total, heads, head_dim) tensor gives its row stride as the batch stride too: its kernels
    address a sequence by its first row (see _sequence)."""
    if t.dim() == 3:
        return t.stride(0), t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(lse: torch.Tensor) -> tuple[int, int]:
    """(batch, heads) strides of lse (batch, heads, seqlen_q), or of a packed batch's (heads, total_q),
    addressed by a sequence's first row: a batch stride of 1."""
    return (1, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1))


def tma_usable(cfg: AttnConfig, *tensors: torch.Tensor) -> bool:
    """Whether a pass with cfg moves its tiles by TMA: ``USE_TMA`` and the table entry allow it and
    :func:`runtime.tma_compatible` holds (odd head dims and unaligned views take the pointer path).
    Packed batches too: every pass builds a descriptor per sequence on the device for them (see
    _sequence_view), as one of the whole packed tensor would let a tile's store spill into the next
    sequence's rows."""
    return USE_TMA and cfg.tma and runtime.tma_compatible(*tensors)


def _operand(t: torch.Tensor, block_s: int, block_d: int, tma: bool):
    """t, or a descriptor of it loading (block_s rows, block_d head-dim columns) of one (batch, head)."""
    return runtime.tma_operand(t, (1, block_s, 1, block_d), tma)


def _mask(causal: bool, window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[tuple[int, int], str]:
    """The kernels' window (left, right) and MASK ("full", "causal" or "local") for a normalized
    (causal, window): a window side of -1 reaches past every key."""
    unbounded = seqlen_q + seqlen_k
    sides = tuple(unbounded if side < 0 else side for side in window)
    if window != (-1, -1):
        return sides, "local"
    return sides, "causal" if causal else "full"


def document_first_keys(document_starts: torch.Tensor, window_left: int) -> torch.Tensor:
    """Each query's first key under document masking, (batch, seqlen) int32 contiguous: its document's
    first column, or with a window (window_left >= 0) the later of that and i - window_left; both
    rise along a row, so the kernels' tiles keep their two-sided structure (masks.py)."""
    first_keys = document_starts
    if window_left >= 0:
        columns = torch.arange(document_starts.shape[1], device=document_starts.device, dtype=torch.int32)
        first_keys = torch.maximum(first_keys, columns - window_left)
    return first_keys.to(torch.int32).contiguous()


def document_last_queries(first_keys: torch.Tensor) -> torch.Tensor:
    """Each key's last query under document masking, (batch, seqlen) int32 contiguous: the last i
    with first_keys[i] <= j (first_keys rise along a row, so the queries that see key j are j to that
    one), found on the device without a read back."""
    columns = torch.arange(first_keys.shape[1], device=first_keys.device, dtype=first_keys.dtype)
    keys = columns.expand_as(first_keys).contiguous()
    return (torch.searchsorted(first_keys, keys, right=True) - 1).to(torch.int32)


@dataclass(frozen=True)
class Packed:
    """A packed (variable-length) batch: sequence b's queries are rows cu_seqlens_q[b] to
    cu_seqlens_q[b + 1] of q, its keys the same rows of cu_seqlens_k in k and v; no sequence is
    longer than max_seqlen_q queries or max_seqlen_k keys."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _shape(q: torch.Tensor, k: torch.Tensor, packed: Packed | None) -> tuple[int, int, int, int, int, int]:
    """(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim); a packed batch's seqlens are its maxima."""
    if packed is None:
        batch, seqlen_q, heads, head_dim = q.shape
        return batch, seqlen_q, k.shape[1], heads, k.shape[2], head_dim
    batch = packed.cu_seqlens_q.numel() - 1
    return batch, packed.max_seqlen_q, packed.max_seqlen_k, q.shape[1], k.shape[1], q.shape[2]


def _launch(tma: bool, packed: Packed | None):
    """How a pass is launched: a packed batch's kernel with TMA loads builds its descriptors on the
    device, bounded by each sequence (_sequence_view), and is launched with an allocator for them."""
    return runtime.launch_building_descriptors if tma and packed is not None else runtime.launch


def _pass_args(q, k, lse, causal, window, softmax_scale, packed: Packed | None) -> dict:
    """The named values the forward and both backward passes share, for their plans to pack: a packed
    batch's offsets (lse, never read, when not packed), the sequence lengths (a packed batch's
    longest), the window, whether the causal mask is built by PTX (a constexpr in the mask tuple);
    and the mask, the scale and the compile options."""
    _, seqlen_q, seqlen_k, _, _, _ = _shape(q, k, packed)
    (window_left, window_right), mask = _mask(causal, window, seqlen_q, seqlen_k)
    cu_seqlens = (lse, lse) if packed is None else (packed.cu_seqlens_q, packed.cu_seqlens_k)
    values = dict(
        CU_SEQLENS_Q=cu_seqlens[0],
        CU_SEQLENS_K=cu_seqlens[1],
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        window_left=window_left,
        window_right=window_right,
        INLINE_PTX=triton.language.constexpr(runtime.inline_ptx(q)),
    )
    launch_args = dict(softmax_scale=softmax_scale, **runtime.COMPILE_OPTIONS)
    return dict(values=values, mask=mask, launch_args=launch_args)


# The tuple arguments every pass takes: the sequences, and the mask (its kind, the window, and
# whether the causal mask is built by PTX).
PASS_TUPLES = {
    "cu_seqlens": ("CU_SEQLENS_Q", "CU_SEQLENS_K"),
    "seqlens": ("seqlen_q", "seqlen_k"),
    "mask": ("MASK", "window", "INLINE_PTX"),
    "window": ("window_left", "window_right"),
}


def _tile_plan(kernel, grid, cfg: AttnConfig, head_dim, mask, tma, packed, by_query, by_key, tuples, **more):
    """A plan of a pass tiled by cfg's BLOCK_M along the queries (arguments by_query) and BLOCK_N along
    the keys (by_key); a padded batch's TMA tiles by descriptors built on the host (a packed batch's
    kernel builds its own, one per sequence)."""
    block_d = head_dim_block(head_dim)
    constexprs = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        MASK=mask,
        TMA=tma,
        VARLEN=packed,
    )
    block_rows = dict.fromkeys(by_query, cfg.block_m) | dict.fromkeys(by_key, cfg.block_n)
    descriptors = {a: (1, rows, 1, block_d) for a, rows in block_rows.items()} if tma and not packed else {}
    tuples = PASS_TUPLES | tuples
    return Plan(
        kernel,
        grid,
        constexprs | more.pop("constexprs", {}),
        cfg.num_warps,
        cfg.num_stages,
        tuples,
        descriptors,
        **more,
    )


def fwd_plan(
    entry: AttnConfig,
    shape: tuple,
    mask: str,
    tma: bool,
    packed: bool,
    softcap: float | None = None,
    sinks: bool = False,
    documents: bool = False,
) -> Plan:
    """The forward's plan with table entry ``entry`` at shape (batch, seqlen_q, seqlen_k, heads,
    kv_heads, head_dim; a packed batch's longest seqlens), by TMA or pointer loads: a program per
    query tile. softcap (None: off) and sinks are the score modifications: without them the kernel's
    SOFTCAP and SINKS are constexpr None and their code is pruned (the plain kernel compiles as
    before them). documents: document masking (mask "causal", the launch passes FIRST_KEYS), else
    FIRST_KEYS is the constexpr None."""
    batch, seqlen_q, _, heads, _, head_dim = shape
    cfg = entry.loads(tma)
    grid = (triton.cdiv(seqlen_q, cfg.block_m) * batch * heads,)
    tuples = {
        "layout": ("sizes", "strides"),
        "sizes": ("batch", "heads", "group_size"),
        "strides": ("q_strides", "k_strides", "v_strides", "o_strides", "lse_strides"),
        "score_mods": ("SOFTCAP", "SINKS", "FIRST_KEYS"),
    }
    modifications = dict(SOFTCAP=softcap) | ({} if sinks else dict(SINKS=None))
    modifications |= {} if documents else dict(FIRST_KEYS=None)
    return _tile_plan(
        _attn_fwd_kernel,
        grid,
        cfg,
        head_dim,
        mask,
        tma,
        packed,
        ("Q", "OUT"),
        ("K", "V"),
        tuples,
        constexprs=modifications,
    )


def dkdv_plans(
    entry: AttnConfig,
    shape: tuple,
    mask: str,
    tma: bool,
    packed: bool,
    splits: int,
    softcap: float | None = None,
    documents: bool = False,
) -> list[Plan]:
    """The dk/dv pass's plans with table entry ``entry`` at shape (as :func:`fwd_plan`'s), a GQA group's
    query heads split over ``splits`` programs per key block (more than one: float32 partials): one
    launch of _attn_bwd_dkdv_kernel, or with split outputs a launch for dv, then one for dk, of
    _attn_bwd_dkdv_split_outputs_kernel (K and V by pointers). softcap as in :func:`fwd_plan` (the
    sinks change neither gradient pass: lse holds them), by the fused kernel alone: with the softcap on
    the launchers pass the entry's softcap tile (configs.attn_config). documents: document masking (the
    launch passes LAST_QUERIES, else the constexpr None), by the fused kernel alone: a split-output
    entry's documents take its pointer tile (_bwd_dkdv)."""
    batch, _, seqlen_k, _, kv_heads, head_dim = shape
    cfg = entry.loads(tma)
    grid = (triton.cdiv(seqlen_k, cfg.block_n) * batch * kv_heads, splits * cfg.column_splits)
    tuples = {
        "row_stats": ("LSE_LOG2", "DELTA"),
        "layout": ("sizes", "strides"),
        "sizes": ("heads", "kv_heads", "group_size", "heads_per_split", "split_seqs"),
        "strides": (
            "q_strides",
            "k_strides",
            "v_strides",
            "do_strides",
            "dk_strides",
            "dv_strides",
            "lse_strides",
        ),
    }
    partials = ("DK", "DV") if splits > 1 else ()
    if cfg.split_outputs:
        assert not (documents or softcap), "document masking and the softcap take the fused dk/dv kernel"
        return [
            _tile_plan(
                _attn_bwd_dkdv_split_outputs_kernel,
                grid,
                cfg,
                head_dim,
                mask,
                tma,
                packed,
                ("Q", "DO"),
                ("DK", "DV"),
                tuples,
                constexprs=dict(OUTPUT=output),
                partials=partials,
            )
            for output in ("dv", "dk")
        ]
    block_d_out = head_dim_block(head_dim) // cfg.column_splits
    return [
        _tile_plan(
            _attn_bwd_dkdv_kernel,
            grid,
            cfg,
            head_dim,
            mask,
            tma,
            packed,
            ("Q", "DO"),
            ("K", "V", "DK", "DV"),
            tuples | {"score_mods": ("SOFTCAP", "LAST_QUERIES")},
            constexprs=dict(BLOCK_D_OUT=block_d_out, SOFTCAP=softcap)
            | ({} if documents else dict(LAST_QUERIES=None)),
            partials=partials,
        )
    ]


def dq_plan(
    entry: AttnConfig,
    shape: tuple,
    mask: str,
    tma: bool,
    packed: bool,
    softcap: float | None = None,
    documents: bool = False,
) -> Plan:
    """The dq pass's plan with table entry ``entry`` at shape (as :func:`fwd_plan`'s): a program per
    query tile; softcap as in :func:`dkdv_plans`, documents as in :func:`fwd_plan`."""
    batch, seqlen_q, _, heads, _, head_dim = shape
    cfg = entry.loads(tma)
    grid = (triton.cdiv(seqlen_q, cfg.block_m) * batch * heads,)
    tuples = {
        "row_stats": ("LSE_LOG2", "DELTA"),
        "layout": ("sizes", "strides"),
        "sizes": ("heads", "group_size"),
        "strides": ("q_strides", "k_strides", "v_strides", "do_strides", "dq_strides", "lse_strides"),
        "score_mods": ("SOFTCAP", "FIRST_KEYS"),
    }
    return _tile_plan(
        _attn_bwd_dq_kernel,
        grid,
        cfg,
        head_dim,
        mask,
        tma,
        packed,
        ("Q", "DO", "DQ"),
        ("K", "V"),
        tuples,
        constexprs=dict(SOFTCAP=softcap) | ({} if documents else dict(FIRST_KEYS=None)),
    )


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    packed: Packed | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    first_keys: torch.Tensor | None = None,
    entry: AttnConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on validated inputs and a window normalized by :func:`normalize_mask`; returns out
    like q and lse float32: (batch, heads, seqlen_q), or (heads, total_q) for a packed batch. softcap
    (> 0, None: off) and sinks ((heads,) float32 or None) as flash_attention takes them; lse holds
    the sinks. first_keys: document masking, with causal and no window, of a padded batch: (batch,
    seqlen) int32, contiguous, query i's first key (its document's first column, a window's left edge
    folded in), as :func:`document_first_keys` gives them. entry: the config to launch with instead
    of the table's (bench.tune's candidates)."""
    batch, seqlen_q, _, heads, kv_heads, head_dim = _shape(q, k, packed)
    out = runtime.empty(q.shape, q.dtype, q.device)
    lse_shape = (batch, heads, seqlen_q) if packed is None else (heads, q.shape[0])
    lse = runtime.empty(lse_shape, torch.float32, q.device)
    entry = entry or configs.attn_config(
        configs.FWD_CONFIGS if packed is None else configs.PACKED_FWD_CONFIGS, head_dim, q.device, softcap
    )
    shared = _pass_args(q, k, lse, causal, window, softmax_scale, packed)
    tma = tma_usable(entry, q, k, v, out)
    plan = fwd_plan(
        entry,
        _shape(q, k, packed),
        shared["mask"],
        tma,
        packed is not None,
        softcap,
        sinks is not None,
        first_keys is not None,
    )
    if plan.grid[0] == 0:  # a packed batch of empty sequences
        return out, lse
    values = shared["values"] | dict(
        batch=batch,
        heads=heads,
        group_size=heads // kv_heads,
        q_strides=_strides(q),
        k_strides=_strides(k),
        v_strides=_strides(v),
        o_strides=_strides(out),
        lse_strides=_lse_strides(lse),
        SINKS=sinks,
        FIRST_KEYS=first_keys,
    )
    tensors = [plan.operand(name, t) for name, t in (("Q", q), ("K", k), ("V", v), ("OUT", out))]
    with runtime.device_guard(q):
        _launch(tma, packed)(
            plan.kernel,
            plan.grid,
            *tensors,
            lse,
            **plan.pack(values),
            **shared["launch_args"],
            **plan.options(),
        )
    return out, lse


def decode_splits(programs: int, max_seqlen_k: int, block_n: int, num_sms: int) -> int:
    """Splits of the keys for a decode launch of ``programs`` (sequence, kv head, row tile) tiles:
    enough for two programs per SM, each split at least one key block."""
    return max(1, min(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_seqlen_k, block_n)))


def decode_plan(
    entry: AttnConfig, shape: tuple, mask: str, num_sms: int, softcap: float | None = None
) -> tuple[Plan, int]:
    """(plan, keys per split) of the decode pass with table entry ``entry`` at shape (batch, seqlen_q,
    seqlen_cache, heads, kv_heads, head_dim): a program per (sequence and kv head, split of the keys,
    tile of a GQA group's rows), the tile the smaller of the entry's and the least power of two of at
    least 16 that holds the group's rows. softcap as in :func:`fwd_plan`."""
    batch, seqlen_q, seqlen_cache, heads, kv_heads, head_dim = shape
    rows = heads // kv_heads * seqlen_q
    block_m = min(entry.block_m, max(16, triton.next_power_of_2(rows)))
    row_tiles = triton.cdiv(rows, block_m)
    splits = decode_splits(batch * kv_heads * row_tiles, seqlen_cache, entry.block_n, num_sms)
    keys_per_split = triton.cdiv(triton.cdiv(seqlen_cache, splits), entry.block_n) * entry.block_n
    splits = triton.cdiv(seqlen_cache, keys_per_split)  # none left without keys by the rounding
    constexprs = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim_block(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=entry.block_n,
        MASK=mask,
        SOFTCAP=softcap,
    )
    tuples = {
        "window": PASS_TUPLES["window"],
        "sizes": ("kv_heads", "group_size"),
        "strides": ("q_strides", "k_strides", "v_strides"),
    }
    grid = (batch * kv_heads, splits, row_tiles)
    return Plan(
        _attn_decode_kernel, grid, constexprs, entry.num_warps, entry.num_stages, tuples, {}
    ), keys_per_split


def decode_reduce_plan(rows: int, head_dim: int, sinks: bool = False) -> Plan:
    """The plan of the decode's reduce of the splits' partial outputs and lse: a program per output row
    of (batch, heads, seqlen_q) ``rows``, DECODE_REDUCE_BLOCK_S splits at a time; with sinks, the launch
    passes SINKS, (heads,) float32, else SINKS is the constexpr None (its code pruned)."""
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), BLOCK_S=configs.DECODE_REDUCE_BLOCK_S
    ) | ({} if sinks else {"SINKS": None})
    return Plan(
        _attn_decode_reduce_kernel, (rows,), constexprs, configs.DECODE_REDUCE_NUM_WARPS, num_stages=1
    )


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q (batch, seqlen_q, heads, head_dim) to the first seqlens_k[b] (int32 (batch,))
    keys of the caches (batch, seqlen_cache, kv_heads, head_dim): split over the keys, each split's
    partial output and lse reduced in a second pass, which adds the sinks. softcap and sinks as in
    :func:`attention_fwd`. Returns out like q."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_cache, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = heads // kv_heads
    (window_left, window_right), mask = _mask(causal, window, seqlen_q, seqlen_cache)
    entry = configs.attn_config(configs.DECODE_CONFIGS, head_dim, q.device)
    shape = (batch, seqlen_q, seqlen_cache, heads, kv_heads, head_dim)
    plan, keys_per_split = decode_plan(entry, shape, mask, runtime.num_sms(q.device), softcap)
    splits = plan.grid[1]
    out = runtime.empty(q.shape, q.dtype, q.device)
    o_split = runtime.empty((splits, batch, heads, seqlen_q, head_dim), torch.float32, q.device)
    lse_split = runtime.empty((splits, batch, heads, seqlen_q), torch.float32, q.device)
    values = dict(
        window_left=window_left,
        window_right=window_right,
        kv_heads=kv_heads,
        group_size=group_size,
        q_strides=_strides(q),
        k_strides=_strides(k_cache),
        v_strides=_strides(v_cache),
    )
    args = dict(
        softmax_scale=softmax_scale,
        seqlen_q=seqlen_q,
        keys_per_split=keys_per_split,
        **plan.pack(values),
        INLINE_PTX=runtime.inline_ptx(q),
        **plan.options(),
        **runtime.COMPILE_OPTIONS,
    )
    # (batch, heads, seqlen_q) rows: each the reduce of its splits
    reduce = decode_reduce_plan(batch * heads * seqlen_q, head_dim, sinks is not None)
    reduce_args = dict(
        splits=splits,
        rows=reduce.grid[0],
        heads=heads,
        seqlen_q=seqlen_q,
        o_strides=_strides(out),
        **({} if sinks is None else {"SINKS": sinks}),
        **reduce.options(),
        **runtime.COMPILE_OPTIONS,
    )
    with runtime.device_guard(q):
        runtime.launch(plan.kernel, plan.grid, q, k_cache, v_cache, o_split, lse_split, seqlens_k, **args)
        runtime.launch(reduce.kernel, reduce.grid, o_split, lse_split, out, **reduce_args)
    return out


def bwd_num_sms(device: torch.device) -> int:
    """SMs the dk/dv pass fills: the GPU's, or an H200's in the interpreter (its tests then split
    query heads as on a GPU)."""
    return runtime.num_sms(device) if device.type == "cuda" else INTERPRETER_NUM_SMS


def dkdv_head_splits(programs: int, group_size: int, num_sms: int) -> tuple[int, int]:
    """(heads_per_split, splits): a GQA group's query heads shared among splits programs per key
    block, at least enough for two programs per SM when ``programs`` (batch x kv heads x key
    blocks) are fewer and the group has the heads, none without a head (MQA with 16 heads, batch 1,
    4K keys on an H200: 32 programs at head dim 128, 16 splits of one head, 512 programs)."""
    wanted = max(1, min(group_size, triton.cdiv(2 * num_sms, programs)))
    heads_per_split = group_size // wanted
    return heads_per_split, triton.cdiv(group_size, heads_per_split)


def preprocess_plan(
    batch: int, seqlen_q: int, heads: int, head_dim: int, has_dlse: bool, packed: bool
) -> Plan:
    """The backward preprocess's plan for batch sequences (padded, or packed: seqlen_q the longest) of
    heads query heads: a program per configs.preprocess_block_m rows of a (sequence, head), reading dlse
    or not."""
    block_m = configs.preprocess_block_m(head_dim)
    constexprs = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim_block(head_dim),
        BLOCK_M=block_m,
        HAS_DLSE=has_dlse,
        VARLEN=packed,
    )
    grid = (triton.cdiv(seqlen_q, block_m) * batch * heads,)
    return Plan(_attn_bwd_preprocess_kernel, grid, constexprs, configs.PREPROCESS_NUM_WARPS, num_stages=1)


def _bwd_preprocess(out, dout, lse, dlse, args: dict, batch: int, heads: int, packed: Packed | None):
    """The backward's first pass: delta = rowsum(dO * O) - dlse and lse in log2 units (+inf where a
    row sees no key), the row statistics both gradient passes read. Returns (lse_log2, delta), each
    lse's shape (the kernels address them with lse's strides; lse, from the forward, is contiguous)."""
    seqlen_q, head_dim = args["values"]["seqlen_q"], out.shape[-1]
    plan = preprocess_plan(batch, seqlen_q, heads, head_dim, dlse is not None, packed is not None)
    delta, lse_log2 = (runtime.empty(lse.shape, torch.float32, lse.device) for _ in range(2))
    preprocess_args = dict(
        CU_SEQLENS_Q=args["values"]["CU_SEQLENS_Q"],
        seqlen_q=seqlen_q,
        heads=heads,
        o_strides=_strides(out),
        do_strides=_strides(dout),
        lse_strides=_lse_strides(lse),
        **plan.options(),
        **runtime.COMPILE_OPTIONS,
    )
    dlse_or_unread = dlse if dlse is not None else delta
    tensors = (out, dout, lse, dlse_or_unread, delta, lse_log2)
    runtime.launch(plan.kernel, plan.grid, *tensors, **preprocess_args)
    return lse_log2, delta


def _bwd_values(q, k, v, dout, row_stats, args: dict, shape: tuple) -> dict:
    """The named values both gradient passes' plans pack, but for their gradients' strides."""
    _, _, _, heads, kv_heads, _ = shape
    return args["values"] | dict(
        LSE_LOG2=row_stats[0],
        DELTA=row_stats[1],
        heads=heads,
        kv_heads=kv_heads,
        group_size=heads // kv_heads,
        q_strides=_strides(q),
        k_strides=_strides(k),
        v_strides=_strides(v),
        do_strides=_strides(dout),
        lse_strides=_lse_strides(row_stats[0]),
    )


def _bwd_dkdv(
    q,
    k,
    v,
    dout,
    row_stats,
    dk,
    dv,
    args: dict,
    shape: tuple,
    packed: Packed | None,
    entry: AttnConfig | None,
) -> None:
    """The pass per key block: dk and dv (of shape (batch, seqlen_k, kv_heads, head_dim)), a GQA
    group's query heads split over programs when there are too few (float32 partials, summed here);
    by entry, or the table's when None."""
    batch, _, seqlen_k, heads, kv_heads, head_dim = shape
    entry = entry or configs.attn_config(configs.BWD_DKDV_CONFIGS, head_dim, q.device, args["softcap"])
    last_queries = args["last_queries"]
    # dk and dv stand for the float32 partials of head splits: new, contiguous, as aligned. Document
    # masking takes the fused kernel: a split-output entry's pointer tile.
    tma = tma_usable(entry, q, k, v, dout, dk, dv) and not (last_queries is not None and entry.split_outputs)
    programs = triton.cdiv(seqlen_k, entry.loads(tma).block_n) * batch * kv_heads
    heads_per_split, splits = dkdv_head_splits(programs, heads // kv_heads, bwd_num_sms(q.device))
    documents = last_queries is not None
    plans = dkdv_plans(
        entry, shape, args["mask"], tma, packed is not None, splits, args["softcap"], documents
    )
    # Split: float32 partials (splits, *k.shape), the splits stacked on the first axis.
    dk_out, dv_out = dk, dv
    if plans[0].partials:
        partial_shape = (splits * k.shape[0], *k.shape[1:])
        dk_out, dv_out = (runtime.empty(partial_shape, torch.float32, k.device) for _ in range(2))
    values = _bwd_values(q, k, v, dout, row_stats, args, shape) | dict(
        heads_per_split=heads_per_split,
        split_seqs=k.shape[0],
        dk_strides=_strides(dk_out),
        dv_strides=_strides(dv_out),
        LAST_QUERIES=last_queries,
    )
    for plan in plans:
        operands = (("Q", q), ("K", k), ("V", v), ("DO", dout))
        q_k_v_do = [plan.operand(name, t) for name, t in operands]
        dk_dv = [plan.operand(name, t) for name, t in (("DK", dk_out), ("DV", dv_out))]
        tuples = plan.pack(values)
        _launch(tma, packed)(
            plan.kernel,
            plan.grid,
            *q_k_v_do,
            tuples.pop("row_stats"),
            *dk_dv,
            **tuples,
            **args["launch_args"],
            **plan.options(),
        )
    if splits > 1:  # torch's sum over the splits: the same order every run
        dk.copy_(dk_out.view(splits, *k.shape).sum(0))
        dv.copy_(dv_out.view(splits, *v.shape).sum(0))


def _bwd_dq(
    q, k, v, dout, row_stats, dq, args: dict, shape: tuple, packed: Packed | None, entry: AttnConfig | None
) -> None:
    """The pass per query block: dq (q's shape); by entry, or the table's when None."""
    head_dim = shape[-1]
    entry = entry or configs.attn_config(configs.BWD_DQ_CONFIGS, head_dim, q.device, args["softcap"])
    tma = tma_usable(entry, q, k, v, dout, dq)
    first_keys = args["first_keys"]
    plan = dq_plan(
        entry, shape, args["mask"], tma, packed is not None, args["softcap"], first_keys is not None
    )
    values = _bwd_values(q, k, v, dout, row_stats, args, shape) | dict(
        dq_strides=_strides(dq), FIRST_KEYS=first_keys
    )
    q_k_v_do = [plan.operand(name, t) for name, t in (("Q", q), ("K", k), ("V", v), ("DO", dout))]
    tuples = plan.pack(values)
    _launch(tma, packed)(
        plan.kernel,
        plan.grid,
        *q_k_v_do,
        tuples.pop("row_stats"),
        plan.operand("DQ", dq),
        **tuples,
        **args["launch_args"],
        **plan.options(),
    )


def attention_bwd(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    packed: Packed | None = None,
    needs: tuple[bool, bool, bool] = (True, True, False),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    first_keys: torch.Tensor | None = None,
    dkdv_entry: AttnConfig | None = None,
    dq_entry: AttnConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`attention_fwd`; dlse is the gradient of lse, or None. Returns dq, dk, dv and
    dsinks; needs says whether dq, whether dk and dv, and whether dsinks are wanted: a pass nobody
    wants is not launched, its gradients empty tensors (frozen inputs). Three passes: the row
    statistics (:func:`_bwd_preprocess`), dk and dv (:func:`_bwd_dkdv`), dq (:func:`_bwd_dq`); then
    the sinks' gradient from the row statistics (:func:`_sinks_grad`). first_keys as in
    :func:`attention_fwd`; the dk/dv pass reads each key's last query (:func:`document_last_queries`).
    dkdv_entry and dq_entry: the configs of those passes instead of the tables' (bench.tune's
    candidates)."""
    shape = _shape(q, k, packed)
    batch, _, _, heads, _, _ = shape
    if dout.stride(-1) != 1:  # gradients can arrive expanded (stride 0) or transposed
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    dq = runtime.empty(q.shape if needs[0] else (0,), q.dtype, q.device)
    dk = runtime.empty(k.shape if needs[1] else (0,), k.dtype, k.device)
    dv = runtime.empty(v.shape if needs[1] else (0,), v.dtype, v.device)
    dsinks = torch.zeros(sinks.shape if needs[2] else (0,), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or k.shape[0] == 0 or not any(needs):  # nothing to compute
        if needs[2] and dlse is not None and q.shape[0]:  # no key: out = 0, so delta = -dlse
            dsinks = _sinks_grad(sinks, lse, -dlse)
        return dq.zero_(), dk.zero_(), dv.zero_(), dsinks
    last_queries = None if first_keys is None or not needs[1] else document_last_queries(first_keys)
    documents = dict(first_keys=first_keys, last_queries=last_queries)
    args = _pass_args(q, k, lse, causal, window, softmax_scale, packed) | dict(softcap=softcap) | documents
    with runtime.device_guard(q):
        row_stats = _bwd_preprocess(out, dout, lse, dlse, args, batch, heads, packed)  # (lse_log2, delta)
        if needs[1]:
            _bwd_dkdv(q, k, v, dout, row_stats, dk, dv, args, shape, packed, dkdv_entry)
        if needs[0]:
            _bwd_dq(q, k, v, dout, row_stats, dq, args, shape, packed, dq_entry)
        if needs[2]:
            dsinks = _sinks_grad(sinks, lse, row_stats[1])
    return dq, dk, dv, dsinks


def _sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d sink_h = -Σ_rows exp(sink_h - lse_row) · delta_row: the sink's probability in each row of head
    h (lse holds the sink) times d lse - rowsum(dO · O), as ds of a key whose value is 0. lse and delta
    (batch, heads, seqlen_q), or a packed batch's (heads, total_q); torch's sums in a fixed order, so
    the gradient is the same every run (no atomics)."""
    per_head = sinks[:, None] if lse.dim() == 2 else sinks[None, :, None]
    dims = (1,) if lse.dim() == 2 else (0, 2)
    return -(torch.exp(per_head - lse) * delta).sum(dims)
