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
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
)
from horse.kernels.attention.configs import AttnConfig, dkdv_outputs, head_dim_block
from horse.kernels.attention.decode import _attn_decode_kernel, _attn_decode_reduce_kernel
from horse.kernels.attention.forward import _attn_fwd_kernel

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


def _descriptors(tma: bool, packed: Packed | None):
    """(host_tma, launch) of a pass whose tiles move by TMA (tma) or not: descriptors made on the
    host for a padded batch; a packed batch's kernel builds its own on the device, bounded by each
    sequence (_sequence_view), and is launched with an allocator for them."""
    host_tma = tma and packed is None
    launch = runtime.launch_building_descriptors if tma and packed is not None else runtime.launch
    return host_tma, launch


def _pass_args(q, k, lse, causal, window, softmax_scale, packed: Packed | None) -> dict:
    """The launch arguments the forward and both backward passes share: a packed batch's offsets (lse,
    never read, when not packed), the scale, the sequence lengths (a packed batch's longest), the
    window and the mask, the head dims, and the compile options."""
    _, seqlen_q, seqlen_k, _, _, head_dim = _shape(q, k, packed)
    window, mask = _mask(causal, window, seqlen_q, seqlen_k)
    cu_seqlens = (lse, lse) if packed is None else (packed.cu_seqlens_q, packed.cu_seqlens_k)
    return dict(
        cu_seqlens=cu_seqlens,
        softmax_scale=softmax_scale,
        seqlens=(seqlen_q, seqlen_k),
        window=window,
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim_block(head_dim),
        MASK=mask,
        VARLEN=packed is not None,
        INLINE_PTX=runtime.inline_ptx(q),
        **runtime.COMPILE_OPTIONS,
    )


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    packed: Packed | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on validated inputs and a window normalized by :func:`normalize_mask`; returns out
    like q and lse float32: (batch, heads, seqlen_q), or (heads, total_q) for a packed batch."""
    batch, seqlen_q, _, heads, kv_heads, head_dim = _shape(q, k, packed)
    out = runtime.empty(q.shape, q.dtype, q.device)
    lse_shape = (batch, heads, seqlen_q) if packed is None else (heads, q.shape[0])
    lse = runtime.empty(lse_shape, torch.float32, q.device)
    cfg = configs.attn_config(
        configs.FWD_CONFIGS if packed is None else configs.PACKED_FWD_CONFIGS, head_dim, q.device
    )
    block_d = head_dim_block(head_dim)
    tma = tma_usable(cfg, q, k, v, out)
    cfg = cfg.loads(tma)
    host_tma, launch = _descriptors(tma, packed)
    q_tiles, out_tiles = (_operand(t, cfg.block_m, block_d, host_tma) for t in (q, out))
    k_tiles, v_tiles = (_operand(t, cfg.block_n, block_d, host_tma) for t in (k, v))
    programs = triton.cdiv(seqlen_q, cfg.block_m) * batch * heads  # a program per tile
    if programs == 0:  # a packed batch of empty sequences
        return out, lse
    args = _pass_args(q, k, lse, causal, window, softmax_scale, packed) | dict(
        sizes=(batch, heads, heads // kv_heads),
        strides=(_strides(q), _strides(k), _strides(v), _strides(out), _lse_strides(lse)),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    with runtime.device_guard(q):
        launch(_attn_fwd_kernel, (programs,), q_tiles, k_tiles, v_tiles, out_tiles, lse, **args)
    return out, lse


def decode_splits(programs: int, max_seqlen_k: int, block_n: int, num_sms: int) -> int:
    """Splits of the keys for a decode launch of ``programs`` (sequence, kv head, row tile) tiles:
    enough for two programs per SM, each split at least one key block."""
    return max(1, min(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_seqlen_k, block_n)))


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Attention of q (batch, seqlen_q, heads, head_dim) to the first seqlens_k[b] (int32 (batch,))
    keys of the caches (batch, seqlen_cache, kv_heads, head_dim): split over the keys, each split's
    partial output and lse reduced in a second pass. Returns out like q."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_cache, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = heads // kv_heads
    window, mask = _mask(causal, window, seqlen_q, seqlen_cache)
    block_d = head_dim_block(head_dim)
    cfg = configs.attn_config(configs.DECODE_CONFIGS, head_dim, q.device)
    rows = group_size * seqlen_q
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(rows)))
    row_tiles = triton.cdiv(rows, block_m)
    splits = decode_splits(batch * kv_heads * row_tiles, seqlen_cache, cfg.block_n, runtime.num_sms(q.device))
    keys_per_split = triton.cdiv(triton.cdiv(seqlen_cache, splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(seqlen_cache, keys_per_split)  # none left without keys by the rounding
    out = runtime.empty(q.shape, q.dtype, q.device)
    o_split = runtime.empty((splits, batch, heads, seqlen_q, head_dim), torch.float32, q.device)
    lse_split = runtime.empty((splits, batch, heads, seqlen_q), torch.float32, q.device)
    args = dict(
        softmax_scale=softmax_scale,
        seqlen_q=seqlen_q,
        keys_per_split=keys_per_split,
        window=window,
        sizes=(kv_heads, group_size),
        strides=(_strides(q), _strides(k_cache), _strides(v_cache)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        MASK=mask,
        INLINE_PTX=runtime.inline_ptx(q),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **runtime.COMPILE_OPTIONS,
    )
    out_rows = batch * heads * seqlen_q  # (batch, heads, seqlen_q): each the reduce of its splits
    reduce_args = dict(
        splits=splits,
        rows=out_rows,
        heads=heads,
        seqlen_q=seqlen_q,
        o_strides=_strides(out),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=configs.DECODE_REDUCE_BLOCK_S,
        num_warps=configs.DECODE_REDUCE_NUM_WARPS,
        **runtime.COMPILE_OPTIONS,
    )
    with runtime.device_guard(q):
        grid = (batch * kv_heads, splits, row_tiles)
        runtime.launch(_attn_decode_kernel, grid, q, k_cache, v_cache, o_split, lse_split, seqlens_k, **args)
        runtime.launch(_attn_decode_reduce_kernel, (out_rows,), o_split, lse_split, out, **reduce_args)
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


def _bwd_preprocess(out, dout, lse, dlse, args: dict, batch: int, heads: int, packed: Packed | None):
    """The backward's first pass: delta = rowsum(dO * O) - dlse and lse in log2 units (+inf where a
    row sees no key), the row statistics both gradient passes read. Returns (lse_log2, delta), each
    lse's shape (the kernels address them with lse's strides; lse, from the forward, is contiguous)."""
    seqlen_q, head_dim = args["seqlens"][0], args["HEAD_DIM"]
    delta, lse_log2 = (runtime.empty(lse.shape, torch.float32, lse.device) for _ in range(2))
    preprocess_args = dict(
        CU_SEQLENS_Q=args["cu_seqlens"][0],
        seqlen_q=seqlen_q,
        heads=heads,
        o_strides=_strides(out),
        do_strides=_strides(dout),
        lse_strides=_lse_strides(lse),
        HEAD_DIM=head_dim,
        BLOCK_D=head_dim_block(head_dim),
        BLOCK_M=configs.PREPROCESS_BLOCK_M,
        HAS_DLSE=dlse is not None,
        VARLEN=packed is not None,
        num_warps=configs.PREPROCESS_NUM_WARPS,
        **runtime.COMPILE_OPTIONS,
    )
    grid = (triton.cdiv(seqlen_q, configs.PREPROCESS_BLOCK_M) * batch * heads,)
    dlse_or_unread = dlse if dlse is not None else delta
    tensors = (out, dout, lse, dlse_or_unread, delta, lse_log2)
    runtime.launch(_attn_bwd_preprocess_kernel, grid, *tensors, **preprocess_args)
    return lse_log2, delta


def _bwd_dkdv(q, k, v, dout, row_stats, dk, dv, args: dict, shape: tuple, packed: Packed | None) -> None:
    """The pass per key block: dk and dv (of shape (batch, seqlen_k, kv_heads, head_dim)), a GQA
    group's query heads split over programs when there are too few (float32 partials, summed here)."""
    batch, _, seqlen_k, heads, kv_heads, head_dim = shape
    block_d = head_dim_block(head_dim)
    cfg = configs.attn_config(configs.BWD_DKDV_CONFIGS, head_dim, q.device)
    # dk and dv stand for the float32 partials of head splits: new, contiguous, as aligned.
    tma = tma_usable(cfg, q, k, v, dout, dk, dv)
    cfg = cfg.loads(tma)
    host_tma, launch = _descriptors(tma, packed)
    programs = triton.cdiv(seqlen_k, cfg.block_n) * batch * kv_heads
    heads_per_split, splits = dkdv_head_splits(programs, heads // kv_heads, bwd_num_sms(q.device))
    # Split: float32 partials (splits, *k.shape), the splits stacked on the first axis.
    dk_out, dv_out = dk, dv
    if splits > 1:
        partial_shape = (splits * k.shape[0], *k.shape[1:])
        dk_out, dv_out = (runtime.empty(partial_shape, torch.float32, k.device) for _ in range(2))
    q_tiles, do_tiles = (_operand(t, cfg.block_m, block_d, host_tma) for t in (q, dout))
    # Split outputs: K and V by pointers (see _attn_bwd_dkdv_kernel), each launch one gradient.
    k_tiles, v_tiles = (_operand(t, cfg.block_n, block_d, host_tma and not cfg.split_outputs) for t in (k, v))
    dk_tiles, dv_tiles = (_operand(t, cfg.block_n, block_d, host_tma) for t in (dk_out, dv_out))
    q_k_v_do_strides = (_strides(q), _strides(k), _strides(v), _strides(dout))
    lse_strides = _lse_strides(row_stats[0])
    dkdv_args = args | dict(
        sizes=(heads, kv_heads, heads // kv_heads, heads_per_split, k.shape[0]),
        strides=(*q_k_v_do_strides, _strides(dk_out), _strides(dv_out), lse_strides),
        BLOCK_D_OUT=block_d // cfg.column_splits,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grid = (programs, splits * cfg.column_splits)
    tensors = (q_tiles, k_tiles, v_tiles, do_tiles, row_stats, dk_tiles, dv_tiles)
    for output in dkdv_outputs(cfg):
        launch(_attn_bwd_dkdv_kernel, grid, *tensors, **dkdv_args, OUTPUT=output)
    if splits > 1:  # torch's sum over the splits: the same order every run
        dk.copy_(dk_out.view(splits, *k.shape).sum(0))
        dv.copy_(dv_out.view(splits, *v.shape).sum(0))


def _bwd_dq(q, k, v, dout, row_stats, dq, args: dict, shape: tuple, packed: Packed | None) -> None:
    """The pass per query block: dq (q's shape)."""
    batch, seqlen_q, _, heads, kv_heads, head_dim = shape
    block_d = head_dim_block(head_dim)
    cfg = configs.attn_config(configs.BWD_DQ_CONFIGS, head_dim, q.device)
    tma = tma_usable(cfg, q, k, v, dout, dq)
    host_tma, launch = _descriptors(tma, packed)
    q_tiles, do_tiles, dq_tiles = (_operand(t, cfg.block_m, block_d, host_tma) for t in (q, dout, dq))
    k_tiles, v_tiles = (_operand(t, cfg.block_n, block_d, host_tma) for t in (k, v))
    grid = (triton.cdiv(seqlen_q, cfg.block_m) * batch * heads,)
    q_k_v_do_strides = (_strides(q), _strides(k), _strides(v), _strides(dout))
    dq_args = args | dict(
        sizes=(heads, heads // kv_heads),
        strides=(*q_k_v_do_strides, _strides(dq), _lse_strides(row_stats[0])),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    tensors = (q_tiles, k_tiles, v_tiles, do_tiles, row_stats, dq_tiles)
    launch(_attn_bwd_dq_kernel, grid, *tensors, **dq_args)


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
    needs: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`attention_fwd`; dlse is the gradient of lse, or None. Returns dq, dk, dv;
    needs says whether dq and whether dk and dv are wanted: a pass nobody wants is not launched, its
    gradients empty tensors (frozen inputs). Three passes: the row statistics (:func:`_bwd_preprocess`),
    dk and dv (:func:`_bwd_dkdv`), dq (:func:`_bwd_dq`)."""
    shape = _shape(q, k, packed)
    batch, _, _, heads, _, _ = shape
    if dout.stride(-1) != 1:  # gradients can arrive expanded (stride 0) or transposed
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    dq = runtime.empty(q.shape if needs[0] else (0,), q.dtype, q.device)
    dk = runtime.empty(k.shape if needs[1] else (0,), k.dtype, k.device)
    dv = runtime.empty(v.shape if needs[1] else (0,), v.dtype, v.device)
    if q.shape[0] == 0 or k.shape[0] == 0 or not any(needs):  # nothing to compute
        return dq.zero_(), dk.zero_(), dv.zero_()
    args = _pass_args(q, k, lse, causal, window, softmax_scale, packed)
    with runtime.device_guard(q):
        lse_log2, delta = _bwd_preprocess(out, dout, lse, dlse, args, batch, heads, packed)
        if needs[1]:
            _bwd_dkdv(q, k, v, dout, (lse_log2, delta), dk, dv, args, shape, packed)
        if needs[0]:
            _bwd_dq(q, k, v, dout, (lse, delta), dq, args, shape, packed)
    return dq, dk, dv
