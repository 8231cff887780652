"""Exact attention with an online softmax (FlashAttention-style), forward and backward.

    out = softmax(q kᵀ · softmax_scale + mask) v,    lse = log Σ_j exp(q kᵀ · softmax_scale + mask)

q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim) with heads a
multiple of kv_heads (grouped-query and multi-query attention); out like q; lse (batch, heads,
seqlen_q) float32. float16 or bfloat16, float32 accumulation, any strides with a unit stride in the
last dimension (nothing is copied). Head dims 1..256; those that are not powers of two are padded
to the next one inside the kernels and masked. The S×S score matrix never reaches memory.

Causal masking is aligned to the bottom-right corner: query i sees key j iff j <= i + seqlen_k -
seqlen_q, so a few new queries decode against a longer cache, and a query that sees no key (more
queries than keys) gets zeros and lse = -inf. A sliding window (local attention) ``(left, right)``
limits query i to keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right, -1 leaving
a side unbounded; causal is the window's right side at 0. Windowed passes visit only the key (or
query) blocks inside the window.

Packed batches (:func:`flash_attention_varlen`, flash-attn's varlen layout): q (total_q, heads,
head_dim) and k, v (total_k, kv_heads, head_dim) hold the sequences one after another, sequence b in
rows cu_seqlens[b]:cu_seqlens[b + 1]; the kernels address a sequence by its first row, with TMA by
descriptors of its rows alone that each pass builds on the device (pointers in the backward's
preprocess); the grid covers the longest sequence and tiles past a shorter one return at once.

Backward: a preprocess (delta = rowsum(dO·O) - dlse; lse in log2 units), a pass per key block that
accumulates dk and dv over every query block and query head of its group (under 2 programs per SM,
GQA/MQA split a group's heads over programs, float32 partials summed in a fixed order), a pass per
query block for dq. No atomics: the gradients are bit-identical run to run. Where holding dk and dv
together spills (head dim 256 on sm_90), dv and dk take a launch each (``split_outputs``).

Tiles move by TMA on Hopper and newer (sm_90+): descriptors whose loads read out-of-bounds rows and
head-dim columns as zeros and whose stores drop them. Unaligned inputs (start or strides not
multiples of 16 bytes), other GPUs, ``USE_TMA = False`` and table entries whose TMA tile spilled take
masked pointer loads (some at a tile of their own: ``AttnConfig.pointer``); one kernel serves both.
Causal forward and dq passes run their longest query blocks first, so the tail is short ones; the
forward can also run persistent (``programs_per_sm`` in its table), off until measured faster.

Tiles, warps and stages come from a table per pass with an entry per GPU family (A100-class sm80,
the 99-KiB sm86 chips, Hopper sm90, datacenter Blackwell sm100, AMD's MI300 series gfx942:
``horse.kernels.runtime.ARCHS``), each compiled clean for its family's target in the compile report;
NVIDIA GPUs below compute capability 8.0 and other AMD GPUs raise.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from horse.kernels import reference, runtime

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Tiles by TMA where tma_usable allows; False sends every pass down the pointer path (the bench's
# "ours-pointer" row measures the difference).
USE_TMA = True


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _key_range(
    start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, LOCAL: tl.constexpr,
):  # fmt: skip
    """Keys a query block [start_m, start_m + BLOCK_M) attends to, in key blocks from start:
    [unmasked_start, unmasked_end) are visible to every query of the block; [start, unmasked_start)
    (only with LOCAL: the window's left edge, see :func:`_local_masked_blocks`) and
    [unmasked_end, end) (the causal diagonal or the window's right edge, and the ragged last key
    block) need the mask."""
    causal_offset = seqlen_k - seqlen_q
    start = 0
    unmasked_start = 0
    if LOCAL:
        start = tl.maximum(start_m + causal_offset - window_left, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset + window_right)
        # Keys from the last query's left edge to the first query's right edge are seen by all.
        first_seen_by_all = tl.maximum(start_m + BLOCK_M - 1 + causal_offset - window_left, 0)
        unmasked_start = tl.maximum(tl.cdiv(first_seen_by_all, BLOCK_N) * BLOCK_N, start)
        last_seen_by_all = tl.minimum(start_m + causal_offset + window_right + 1, seqlen_k)
        unmasked_end = tl.maximum(tl.maximum(last_seen_by_all, 0) // BLOCK_N * BLOCK_N, unmasked_start)
    elif CAUSAL:
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset)
        # Keys up to start_m + causal_offset are visible to every query of the block.
        unmasked_end = tl.maximum(tl.minimum(start_m + causal_offset + 1, end), 0) // BLOCK_N * BLOCK_N
    else:
        end = seqlen_k
        unmasked_end = seqlen_k // BLOCK_N * BLOCK_N
    return start, unmasked_start, unmasked_end, end


@triton.jit
def _local_masked_blocks(start, unmasked_start, unmasked_end, end, BLOCK_N: tl.constexpr):
    """With LOCAL, the key blocks that need the mask lie on both sides of the unmasked ones: how
    many there are, and how many of them come before (from start). One loop takes both sides, as
    :func:`_masked_key_block` numbers them: a third loop spilled registers on sm_90."""
    before = tl.cdiv(tl.maximum(tl.minimum(unmasked_start, end) - start, 0), BLOCK_N)
    return before + tl.cdiv(tl.maximum(end - unmasked_end, 0), BLOCK_N), before


@triton.jit
def _masked_key_block(i, blocks, BLOCK_N: tl.constexpr):
    """Start of the i-th masked key block of :func:`_local_masked_blocks`; blocks is
    :func:`_key_loop`'s (start, before, unmasked_end)."""
    start, before, unmasked_end = blocks
    return tl.where(i < before, start + i * BLOCK_N, unmasked_end + (i - before) * BLOCK_N)


@triton.jit
def _key_loop(keys, masked: tl.constexpr, BLOCK_N: tl.constexpr, LOCAL: tl.constexpr):
    """(lo, hi, step, blocks) of a query block's loop over its unmasked key blocks (masked 0) or its
    masked ones (1) of :func:`_key_range`'s keys: key block starts, or with LOCAL and masked the
    masked blocks' numbers, which :func:`_masked_key_block` turns into starts. A pass calls it once
    per loop (``tl.static_range(2)``: two compiled loops), the masked count after the unmasked loop,
    so it is not live through it. The pass calls _key_range once, before both: called in here, the
    sm_90 head-dim-64 local forward took 254 registers instead of 250."""
    start, unmasked_start, unmasked_end, end = keys
    lo, hi, step, before = unmasked_start, unmasked_end, BLOCK_N, 0
    if masked:
        lo, hi = unmasked_end, end
    if masked and LOCAL:
        lo, step = 0, 1
        hi, before = _local_masked_blocks(start, unmasked_start, unmasked_end, end, BLOCK_N)
    return lo, hi, step, (start, before, unmasked_end)


@triton.jit
def _in_window(q_pos, k_pos, causal_offset, window_left, window_right, LOCAL: tl.constexpr):
    """Whether query q_pos sees key k_pos (broadcast shapes) under the causal mask, or with LOCAL
    the sliding window; keys past seqlen_k are the caller's to mask."""
    diagonal = q_pos + causal_offset
    if LOCAL:
        visible = (k_pos >= diagonal - window_left) & (k_pos <= diagonal + window_right)
    else:
        visible = k_pos <= diagonal
    return visible


@triton.jit
def _visible(
    offs_m, offs_n, seqlen_k, causal_offset, window_left, window_right, CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
):  # fmt: skip
    """(BLOCK_M, BLOCK_N) mask of the scores query offs_m may give key offs_n."""
    visible = offs_n[None, :] < seqlen_k
    if CAUSAL or LOCAL:
        visible = visible & _in_window(
            offs_m[:, None], offs_n[None, :], causal_offset, window_left, window_right, LOCAL
        )
    return visible


@triton.jit
def _causal_scores(
    qk, offs, start, causal_offset, BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr, INLINE_PTX: tl.constexpr
):
    """qk (queries offs x keys start + j) with -inf where the key lies past the query's diagonal; with
    TRANSPOSED, qk (keys offs x queries start + j) with -inf where the query comes before the key's
    first visible one. Keys past seqlen_k need no test: a query before seqlen_q sees none (j <= i +
    seqlen_k - seqlen_q) and the rows past seqlen_q are never stored. The column is the tile's index,
    the row's limit one subtraction: one compare and one select per score. LLVM's SLP vectorizer
    packs 32 of the compares into a bit vector, spent as 70 extra instructions of bit juggling per
    iteration; INLINE_PTX (NVIDIA) writes each pair as PTX it cannot pack (sm_90, head dim 128: the
    forward's diagonal loop 825 before the raw-score max, 693 plain, 625 with PTX; the dk/dv loop
    327 with tl.where on p, 291 with PTX)."""
    cols = tl.arange(0, BLOCK)[None, :]
    if TRANSPOSED:
        limit = (offs - (causal_offset + start))[:, None]  # the key's first visible query
    else:
        limit = (offs + (causal_offset - start))[:, None]  # the query's last visible key
    if INLINE_PTX:
        qk = tl.inline_asm_elementwise(
            "{ .reg .pred hidden; setp." + ("lt" if TRANSPOSED else "gt") + ".s32 hidden, $2, $3; "
            "selp.f32 $0, 0fFF800000, $1, hidden; }",
            "=r,r,r,r", [qk, cols, limit], dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        qk = tl.where((cols >= limit) if TRANSPOSED else (cols <= limit), qk, float("-inf"))
    return qk


@triton.jit
def _sequence(CU_SEQLENS, b, seqlen, VARLEN: tl.constexpr):
    """(seq, seqlen) of batch entry b. seq addresses its tiles: the batch index, or with VARLEN its
    first row in the packed tensor (cu_seqlens[b]; the launcher passes the row stride as the batch
    stride), seqlen then cu_seqlens[b + 1] - cu_seqlens[b]."""
    seq = b
    if VARLEN:
        seq = tl.load(CU_SEQLENS + b)
        seqlen = tl.load(CU_SEQLENS + b + 1) - seq
    return seq, seqlen


@triton.jit
def _load_tile(
    X, b, h, start, col, strides, seqlen, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """(BLOCK_S, BLOCK_C) tile of one (sequence b, head h): rows [start, + BLOCK_S) and head-dim
    columns [col, + BLOCK_C), zero past seqlen and HEAD_DIM. With TMA, X is a descriptor of the
    whole (batch, seqlen, heads, head_dim) tensor, whose loads fill out-of-bounds elements with
    zeros; otherwise X is the tensor's pointer and strides its (batch, seqlen, heads) strides, and
    rows are masked only with MASK (a block that may cross seqlen)."""
    if TMA:
        tile = X.load([b, start, h, col]).reshape(BLOCK_S, BLOCK_C)
    else:
        offs_s = start + tl.arange(0, BLOCK_S)
        offs_c = col + tl.arange(0, BLOCK_C)
        mask = offs_c[None, :] < HEAD_DIM
        if MASK:
            mask = mask & (offs_s[:, None] < seqlen)
        # 64-bit: batch * stride, and row * stride in a long sequence or a wide view, pass 2**31.
        base = X + b.to(tl.int64) * strides[0] + h.to(tl.int64) * strides[2]
        rows = offs_s.to(tl.int64)[:, None] * strides[1]
        tile = tl.load(base + rows + offs_c[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def _store_tile(
    X, tile, b, h, start, col, strides, seqlen, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Stores a (BLOCK_S, BLOCK_C) float32 tile where :func:`_load_tile` reads it, in X's dtype,
    dropping what lies past seqlen and HEAD_DIM."""
    if TMA:
        X.store([b, start, h, col], tile.to(X.dtype).reshape(1, BLOCK_S, 1, BLOCK_C))
    else:
        offs_s = start + tl.arange(0, BLOCK_S)
        offs_c = col + tl.arange(0, BLOCK_C)
        mask = (offs_s[:, None] < seqlen) & (offs_c[None, :] < HEAD_DIM)
        base = X + b.to(tl.int64) * strides[0] + h.to(tl.int64) * strides[2]
        rows = offs_s.to(tl.int64)[:, None] * strides[1]
        tl.store(base + rows + offs_c[None, :], tile.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _attn_fwd_block(
    acc, l_i, m_i, q, K, V, k_seq, kv_h, offs_m, start_n, k_strides, v_strides, seqlen_q, seqlen_k,
    window_left, window_right, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, TMA: tl.constexpr,
    INLINE_PTX: tl.constexpr,
):  # fmt: skip
    k = _load_tile(K, k_seq, kv_h, start_n, 0, k_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, MASK, TMA)
    qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N) raw scores
    if MASK and CAUSAL:
        qk = _causal_scores(qk, offs_m, start_n, seqlen_k - seqlen_q, BLOCK_N, False, INLINE_PTX)
    elif MASK:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = _visible(
            offs_m, offs_n, seqlen_k, seqlen_k - seqlen_q, window_left, window_right, CAUSAL, LOCAL
        )
        qk = tl.where(visible, qk, float("-inf"))
    # The row max is taken on the raw scores and scaled per row (qk_scale > 0 keeps it the max):
    # the scale then rides in the exponent's FFMA, qk * qk_scale - m, instead of an FMUL per score
    # before the max (sm_90, head dim 128: 128 -> 66 FMUL per iteration, the tutorial's).
    # FA4's lazy rescale (leave acc and m alone unless some row's max grew by over 2^8) was built
    # and compiled: Triton's branch needs the max growth of the whole block, a reduction across
    # warps through shared memory: 524 instructions per iteration against 488 (+3 BAR.SYNC, +3 LDS,
    # +3 STS, +7 SHFL), to skip 64 FMULs when the branch is not taken; it stalls the warpgroups
    # that otherwise overlap one's softmax with the other's wgmma. FA4 decides per warp; not here.
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    m_safe = m_new
    if MASK:  # a row that has seen no visible key yet keeps m = -inf: subtract 0 there, not -inf (NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_tile(V, k_seq, kv_h, start_n, 0, v_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, MASK, TMA)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_tile(
    Q, K, V, OUT, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, tile, m_blocks, seqlen_q, seqlen_k, window_left,
    window_right, heads, group_size, q_strides, k_strides, v_strides, o_strides, lse_strides, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, LOCAL: tl.constexpr, TMA: tl.constexpr, VARLEN: tl.constexpr,
    INLINE_PTX: tl.constexpr,
):  # fmt: skip
    """Output and lse of tile ``tile``: BLOCK_M queries of one (batch, head). Tiles go head-major,
    so the programs running together share their head's k and v in L2; causal ones go longest
    query block first, so the last tiles to run are the short ones."""
    batch_head = tile // m_blocks
    m_block = tile % m_blocks
    if CAUSAL:
        m_block = m_blocks - 1 - m_block
    start_m = m_block * BLOCK_M
    b = batch_head // heads
    h = batch_head % heads
    kv_h = h // group_size
    q_seq, seqlen_q = _sequence(CU_SEQLENS_Q, b, seqlen_q, VARLEN)
    k_seq, seqlen_k = _sequence(CU_SEQLENS_K, b, seqlen_k, VARLEN)
    q_tiles_seq = q_seq  # the sequence index of the Q and OUT tiles: 0 in a sequence's own descriptor
    if VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
        if TMA:  # descriptors of this sequence's rows alone (_sequence_descriptor): no tile reaches the next
            Q = _sequence_descriptor(Q, q_seq, seqlen_q, heads, q_strides, HEAD_DIM, BLOCK_M, BLOCK_D)
            OUT = _sequence_descriptor(OUT, q_seq, seqlen_q, heads, o_strides, HEAD_DIM, BLOCK_M, BLOCK_D)
            kv_heads = heads // group_size
            K = _sequence_descriptor(K, k_seq, seqlen_k, kv_heads, k_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
            V = _sequence_descriptor(V, k_seq, seqlen_k, kv_heads, v_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
            q_tiles_seq = 0
            k_seq = 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(Q, q_tiles_seq, h, start_m, 0, q_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, TMA)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    keys = _key_range(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, CAUSAL, LOCAL)
    # The unmasked key blocks, then the masked ones: masked is a constexpr, so each is a compiled loop of
    # its own, and the block's mask code is compiled into the second alone.
    for masked in tl.static_range(2):
        lo, hi, step, blocks = _key_loop(keys, masked, BLOCK_N, LOCAL)
        for n in range(lo, hi, step):
            start_n = _masked_key_block(n, blocks, BLOCK_N) if masked and LOCAL else n
            acc, l_i, m_i = _attn_fwd_block(
                acc, l_i, m_i, q, K, V, k_seq, kv_h, offs_m, start_n, k_strides, v_strides, seqlen_q,
                seqlen_k, window_left, window_right, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, masked, CAUSAL,
                LOCAL, TMA, INLINE_PTX,
            )  # fmt: skip
    # A query that sees no key: l = 0, so the output is 0 and lse = log 0 = -inf.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    _store_tile(OUT, out, q_tiles_seq, h, start_m, 0, o_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    if VARLEN:
        lse_row = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1]
    else:  # the same offset, in fewer registers: the strided sum spilled at head dim 128 on triton 3.9
        lse_row = batch_head.to(tl.int64) * seqlen_q
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit
def _attn_fwd_kernel(
    Q,  # (batch, seqlen_q, heads, head_dim)
    K,  # (batch, seqlen_k, kv_heads, head_dim)
    V,  # (batch, seqlen_k, kv_heads, head_dim)
    OUT,  # (batch, seqlen_q, heads, head_dim); Q, K, V, OUT are TMA descriptors with TMA (padded)
    LSE,  # (batch, heads, seqlen_q) float32, natural log
    CU_SEQLENS_Q,  # with VARLEN: (batch + 1,) int32, the sequences' first rows in packed Q, OUT, LSE
    CU_SEQLENS_K,  # with VARLEN: the same in packed K, V
    softmax_scale,
    seqlen_q,
    seqlen_k,
    window_left,  # with LOCAL: query i sees keys i + seqlen_k - seqlen_q - window_left ...
    window_right,  # ... to i + seqlen_k - seqlen_q + window_right
    batch,
    heads,
    group_size,
    q_strides,  # (batch, seqlen, heads) strides of Q, as _strides gives them; k_, v_, o_strides alike
    k_strides,
    v_strides,
    o_strides,
    lse_strides,  # (batch, heads) strides of LSE; packed, (1, head stride): a sequence by its first row
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    TMA: tl.constexpr,
    PERSISTENT: tl.constexpr,
    VARLEN: tl.constexpr,
    INLINE_PTX: tl.constexpr,  # an NVIDIA target: the causal mask as PTX (see _causal_scores)
):  # fmt: skip
    # grid = (cdiv(seqlen_q, BLOCK_M) * batch * heads,): a program per tile; or with PERSISTENT
    # (programs,), program p taking tiles p, p + programs, ... The loop is a constexpr choice: it
    # raises registers, and with the table's tiles only TMA at head dims 64 and 128 compiled without
    # spills (pointers spilled 80 and 312 bytes there), so no table entry is persistent until
    # `python -m bench.tune` measures it faster.
    m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    qk_scale = softmax_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    if PERSISTENT:
        tl.static_assert(not VARLEN, "a packed batch's tiles return early")
        for tile in range(tl.program_id(0), m_blocks * batch * heads, tl.num_programs(0)):
            _attn_fwd_tile(
                Q, K, V, OUT, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, tile, m_blocks, seqlen_q, seqlen_k,
                window_left, window_right, heads, group_size, q_strides, k_strides, v_strides, o_strides,
                lse_strides, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, LOCAL, TMA, VARLEN,
                INLINE_PTX,
            )  # fmt: skip
    else:
        _attn_fwd_tile(
            Q, K, V, OUT, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, tl.program_id(0), m_blocks, seqlen_q, seqlen_k,
            window_left, window_right, heads, group_size, q_strides, k_strides, v_strides, o_strides,
            lse_strides, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, LOCAL, TMA, VARLEN,
            INLINE_PTX,
        )  # fmt: skip


@triton.jit
def _attn_bwd_preprocess_kernel(
    OUT,  # (batch, seqlen_q, heads, head_dim)
    DO,  # (batch, seqlen_q, heads, head_dim)
    LSE,  # (batch, heads, seqlen_q) float32, natural log, from the forward
    DLSE,  # (batch, heads, seqlen_q) float32; read when HAS_DLSE
    DELTA,  # (batch, heads, seqlen_q) float32: rowsum(dO * O) - dlse
    LSE_LOG2,  # (batch, heads, seqlen_q) float32: lse in log2 units, +inf where lse = -inf
    CU_SEQLENS_Q,  # as in _attn_fwd_kernel
    seqlen_q,
    heads,
    o_strides,
    do_strides,
    lse_strides,  # as in _attn_fwd_kernel; DLSE, DELTA and LSE_LOG2 share them
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    VARLEN: tl.constexpr,
):
    # grid = (cdiv(seqlen_q, BLOCK_M) * batch * heads,): batch x heads on axis 0, whose 2**31 - 1
    # programs CUDA allows (65,535 on axis 1), a (batch, head)'s query blocks side by side.
    m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    batch_head = tl.program_id(0) // m_blocks
    b = batch_head // heads
    h = batch_head % heads
    start_m = tl.program_id(0) % m_blocks * BLOCK_M
    q_seq, seqlen_q = _sequence(CU_SEQLENS_Q, b, seqlen_q, VARLEN)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    o = _load_tile(OUT, q_seq, h, start_m, 0, o_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, False)
    do = _load_tile(DO, q_seq, h, start_m, 0, do_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1] + offs_m
    if HAS_DLSE:
        # d lse_i / d s_ij = p_ij, which folds into ds = p * (dp - delta) as a shift of delta.
        delta -= tl.load(DLSE + row, mask=offs_m < seqlen_q, other=0.0)
    tl.store(DELTA + row, delta, mask=offs_m < seqlen_q)
    # Converted once here, not in every (key block, query block) step of the dk/dv pass: there the
    # conversion cost 24 of 291 instructions per iteration (sm_90, head dim 128).
    lse = tl.load(LSE + row, mask=offs_m < seqlen_q, other=0.0)
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(LSE_LOG2 + row, lse_log2, mask=offs_m < seqlen_q)


@triton.jit
def _load_row_stats(LSE, DELTA, offs_m, seqlen_q):
    """lse in log2 units, +inf where a row sees no key or lies past seqlen_q, so that p = 0 there."""
    lse = tl.load(LSE + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = tl.load(DELTA + offs_m, mask=offs_m < seqlen_q, other=0.0)
    return lse, delta


@triton.jit
def _load_query_tile(
    X, b, h, start_m, col, strides, seqlen, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """:func:`_load_tile` of the query block at start_m, rows masked. Pointer loads move the block's
    first row into the base pointer, so that the per-row offsets are the same in every block (sm_90,
    head dim 128: 5 instructions fewer per iteration)."""
    if TMA:
        tile = _load_tile(X, b, h, start_m, col, strides, seqlen, HEAD_DIM, BLOCK_S, BLOCK_C, True, TMA)
    else:
        X += tl.cast(start_m, tl.int64) * strides[1]
        tile = _load_tile(X, b, h, 0, col, strides, seqlen - start_m, HEAD_DIM, BLOCK_S, BLOCK_C, True, TMA)
    return tile


@triton.jit
def _attn_bwd_dkdv_block(
    dk, dv, k, v, Q, DO, LSE_LOG2, DELTA, q_seq, h, offs_n, start_m, unmasked_m, col, q_strides, do_strides,
    seqlen_q, seqlen_k, window_left, window_right, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_D_OUT: tl.constexpr, MASK: tl.constexpr, LOCAL: tl.constexpr,
    TMA: tl.constexpr, INLINE_PTX: tl.constexpr, OUTPUT: tl.constexpr,
):  # fmt: skip
    # Works on the transposed scores (keys x queries) so dk and dv accumulate in (BLOCK_N, head-dim
    # columns [col, + BLOCK_D_OUT)): all of them, or a slice, q and dO then read twice. OUTPUT: "dkdv"
    # accumulates both, "dk" or "dv" one (the other is returned as it came).
    q = _load_query_tile(Q, q_seq, h, start_m, 0, q_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    do = _load_query_tile(DO, q_seq, h, start_m, 0, do_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    if BLOCK_D_OUT < BLOCK_D:
        tl.static_assert(not TMA, "a descriptor loads whole rows of the head dim")
        q_out = _load_query_tile(
            Q, q_seq, h, start_m, col, q_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D_OUT, TMA
        )
        do_out = _load_query_tile(
            DO, q_seq, h, start_m, col, do_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D_OUT, TMA
        )
    else:
        q_out = q
        do_out = do
    # lse in log2 units (+inf where a row sees no key: p = 0), addressed from the block's first row as
    # in _load_query_tile (16 IMAD.WIDE fewer per iteration). Rows past seqlen_q load 0: q and dO
    # load as zeros there, so p dO and ds q vanish.
    rows = tl.arange(0, BLOCK_M)
    lse = tl.load(LSE_LOG2 + start_m + rows, mask=rows < seqlen_q - start_m, other=0.0)
    delta = tl.load(DELTA + start_m + rows, mask=rows < seqlen_q - start_m, other=0.0)
    qk_t = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
    if MASK and not LOCAL:  # causal; keys past seqlen_k are dropped by the store
        if start_m < unmasked_m:  # a uniform branch: only the query blocks crossing the diagonal
            qk_t = _causal_scores(qk_t, offs_n, start_m, seqlen_k - seqlen_q, BLOCK_M, True, INLINE_PTX)
    p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    if MASK and LOCAL and OUTPUT == "dkdv":
        offs_m = start_m + tl.arange(0, BLOCK_M)
        visible = _in_window(
            offs_m[None, :], offs_n[:, None], seqlen_k - seqlen_q, window_left, window_right, LOCAL
        )
        p_t = tl.where(visible, p_t, 0.0)
    elif MASK and LOCAL:
        # Key i sees the block's queries [first_query, + window_left + window_right]: _in_window's test
        # moved to the key, a column index against a per-key bound as _causal_scores transposed. dv
        # alone at head dim 256 (sm_90): 681 -> 531 instructions per iteration, 24 bytes spilled before,
        # none. Not in the fused pass: on sm_80 its head-dim-32 packed tile spilled 8 bytes so.
        first_query = (offs_n - (seqlen_k - seqlen_q + start_m + window_right))[:, None]
        cols = tl.arange(0, BLOCK_M)[None, :]
        p_t = tl.where((cols >= first_query) & (cols <= first_query + (window_left + window_right)), p_t, 0.0)
    if OUTPUT != "dk":
        dv = tl.dot(p_t.to(do.dtype), do_out, dv)
    if OUTPUT != "dv":
        if OUTPUT == "dkdv":
            dp_t = tl.dot(v, tl.trans(do)) - delta[None, :]
        else:  # delta as the accumulator's start: dk alone at 64x128 spilled 16 bytes (causal) without
            dp_t = tl.dot(v, tl.trans(do), tl.zeros_like(p_t) - delta[None, :])
        dk = tl.dot((p_t * dp_t).to(q.dtype), q_out, dk)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,  # as in the forward; DO like Q
    LSE_LOG2,
    DELTA,  # (batch, heads, seqlen_q) float32, from _attn_bwd_preprocess_kernel; LSE_LOG2 likewise
    DK,
    DV,  # like K, V, or float32 partials of head_splits such stacked on the batch (rows, packed) axis
    CU_SEQLENS_Q,
    CU_SEQLENS_K,  # as in _attn_fwd_kernel; Q, K, V, DO, DK, DV are TMA descriptors with TMA (padded)
    softmax_scale,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,  # as in _attn_fwd_kernel
    heads,
    kv_heads,
    group_size,
    heads_per_split,  # query heads of a group per program: group_size, or fewer with head splits
    split_seqs,  # with head splits, how far apart the splits' partials lie: batch (packed: total keys)
    q_strides,
    k_strides,
    v_strides,
    do_strides,
    dk_strides,
    dv_strides,
    lse_strides,  # as in _attn_fwd_kernel; LSE_LOG2 and DELTA share them
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,
    INLINE_PTX: tl.constexpr,  # as in _attn_fwd_kernel
    OUTPUT: tl.constexpr,  # "dkdv", or one of them: "dk", "dv" (AttnConfig.split_outputs)
):
    # grid = (cdiv(seqlen_k, BLOCK_N) * batch * kv_heads, head_splits * BLOCK_D // BLOCK_D_OUT): one
    # key block, query heads [split * heads_per_split, + heads_per_split) of its group, dk and/or dv
    # columns [column * BLOCK_D_OUT, + BLOCK_D_OUT). Batch x heads goes on axis 0 (2**31 - 1
    # programs; 65,535 on axis 1), a (batch, head)'s key blocks side by side, so the programs running
    # together share its queries in L2. With head splits (GQA/MQA grids too small for the GPU), each
    # split writes its partial dk and dv to its own slice of DK and DV (seq), summed afterwards
    # in a fixed order: no atomics.
    n_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    start_n = tl.program_id(0) % n_blocks * BLOCK_N
    batch_kv_head = tl.program_id(0) // n_blocks
    b = batch_kv_head // kv_heads
    kv_h = batch_kv_head % kv_heads
    q_seq, seqlen_q = _sequence(CU_SEQLENS_Q, b, seqlen_q, VARLEN)
    k_seq, seqlen_k = _sequence(CU_SEQLENS_K, b, seqlen_k, VARLEN)
    if VARLEN and start_n >= seqlen_k:  # the grid covers the longest sequence
        return
    columns = BLOCK_D // BLOCK_D_OUT
    col = tl.program_id(1) % columns * BLOCK_D_OUT
    split = tl.program_id(1) // columns
    q_tiles_seq = q_seq  # the sequence index of the Q and DO tiles: 0 in a sequence's own descriptor
    if VARLEN and TMA:
        # Descriptors of this sequence's rows alone, as in the forward; DK's and DV's of its rows in this
        # split's slice (below), built here: after the loop, dk alone spilled 24 bytes (sm_90, head dim 256).
        Q = _sequence_descriptor(Q, q_seq, seqlen_q, heads, q_strides, HEAD_DIM, BLOCK_M, BLOCK_D)
        DO = _sequence_descriptor(DO, q_seq, seqlen_q, heads, do_strides, HEAD_DIM, BLOCK_M, BLOCK_D)
        q_tiles_seq = 0
        out_seq = k_seq + split * split_seqs
        if OUTPUT != "dv":
            DK = _sequence_descriptor(DK, out_seq, seqlen_k, kv_heads, dk_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
        if OUTPUT != "dk":
            DV = _sequence_descriptor(DV, out_seq, seqlen_k, kv_heads, dv_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
    first_head = split * heads_per_split
    last_head = tl.minimum(first_head + heads_per_split, group_size)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # One output: K and V come by pointers (the launcher passes no descriptors for them). Triton feeds
    # wgmma its A operand from shared memory only when it comes straight from a load; a descriptor's
    # tile comes out of its reshape in registers (64 each at 64 rows of head dim 256), and dk alone
    # at 64x128 spilled 488-512 bytes so.
    KV_TMA: tl.constexpr = TMA and OUTPUT == "dkdv"
    kv_tiles_seq = k_seq  # pointer K and V address the packed tensor by the sequence's first row
    if VARLEN and KV_TMA:
        K = _sequence_descriptor(K, k_seq, seqlen_k, kv_heads, k_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
        V = _sequence_descriptor(V, k_seq, seqlen_k, kv_heads, v_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
        kv_tiles_seq = 0
    k = _load_tile(
        K, kv_tiles_seq, kv_h, start_n, 0, k_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, True, KV_TMA
    )
    v = k  # dv alone never reads V
    if OUTPUT != "dv":
        v = _load_tile(
            V, kv_tiles_seq, kv_h, start_n, 0, v_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, True, KV_TMA
        )
    dk = tl.zeros([BLOCK_N, BLOCK_D_OUT], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D_OUT], dtype=tl.float32)
    qk_scale = softmax_scale * 1.4426950408889634
    # Queries before the first that sees key start_n (causal or local), and after the last (local),
    # contribute nothing. Causal: one loop, the mask behind a uniform branch taken by the query blocks
    # before unmasked_m (those crossing the diagonal); two loops (masked, unmasked) spilled 32-64 bytes
    # outside the loops at head dim 128, 8-264 before the PTX mask, and 264 with a window at 64.
    causal_offset = seqlen_k - seqlen_q
    # A packed batch's causal dk launch by TMA runs as the window (-1, 0), the causal mask itself: its
    # causal build spilled 8 bytes (sm_90, head dims 192 and 256: the addresses of the descriptors
    # built on the device take registers that a padded batch's host descriptors leave free).
    WINDOW: tl.constexpr = LOCAL or (CAUSAL and VARLEN and TMA and OUTPUT == "dk")
    if WINDOW and not LOCAL:
        window_left = seqlen_q + seqlen_k  # reaches past every key, as _mask's unbounded side
        window_right = 0
    lo = 0
    hi = seqlen_q
    if WINDOW:
        lo = tl.maximum(start_n - causal_offset - window_right, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(start_n + BLOCK_N - causal_offset + window_left, seqlen_q)
    elif CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
    # Causal: query blocks from unmasked_m on see every key of the block (none crosses the diagonal).
    unmasked_m = tl.cdiv(start_n + BLOCK_N - 1 - causal_offset, BLOCK_M) * BLOCK_M
    for g in range(first_head, last_head):
        h = kv_h * group_size + g
        row0 = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1]
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _attn_bwd_dkdv_block(
                dk, dv, k, v, Q, DO, LSE_LOG2 + row0, DELTA + row0, q_tiles_seq, h, offs_n, start_m,
                unmasked_m, col, q_strides, do_strides, seqlen_q, seqlen_k, window_left, window_right,
                qk_scale, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D_OUT, CAUSAL or LOCAL, WINDOW, TMA, INLINE_PTX,
                OUTPUT,
            )  # fmt: skip
    seq = k_seq + split * split_seqs  # with head splits, the first row of this split's float32 partials
    if VARLEN and TMA:  # DK's and DV's descriptors start there, bounded by the sequence's keys
        seq = 0
    if OUTPUT != "dv":
        dk *= softmax_scale
        _store_tile(
            DK, dk, seq, kv_h, start_n, col, dk_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D_OUT, TMA
        )
    if OUTPUT != "dk":
        _store_tile(
            DV, dv, seq, kv_h, start_n, col, dv_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D_OUT, TMA
        )


@triton.jit
def _attn_bwd_dq_block(
    dq, q, do, lse, delta, K, V, k_seq, kv_h, offs_m, start_n, k_strides, v_strides, seqlen_q, seqlen_k,
    window_left, window_right, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, TMA: tl.constexpr,
    INLINE_PTX: tl.constexpr,
):  # fmt: skip
    k = _load_tile(K, k_seq, kv_h, start_n, 0, k_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, MASK, TMA)
    v = _load_tile(V, k_seq, kv_h, start_n, 0, v_strides, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, MASK, TMA)
    qk = tl.dot(q, tl.trans(k))
    if MASK and CAUSAL:
        qk = _causal_scores(qk, offs_m, start_n, seqlen_k - seqlen_q, BLOCK_N, False, INLINE_PTX)
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASK and not CAUSAL:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = _visible(
            offs_m, offs_n, seqlen_k, seqlen_k - seqlen_q, window_left, window_right, CAUSAL, LOCAL
        )
        p = tl.where(visible, p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,  # as in _attn_bwd_dkdv_kernel
    DQ,  # like Q; Q, K, V, DO, DQ are TMA descriptors with TMA (padded)
    CU_SEQLENS_Q,
    CU_SEQLENS_K,  # as in _attn_fwd_kernel
    softmax_scale,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,  # as in _attn_fwd_kernel
    heads,
    group_size,
    q_strides,
    k_strides,
    v_strides,
    do_strides,
    dq_strides,
    lse_strides,  # as in _attn_fwd_kernel; DELTA shares them
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,
    INLINE_PTX: tl.constexpr,  # as in _attn_fwd_kernel
):
    # grid = (cdiv(seqlen_q, BLOCK_M) * batch * heads,): as the preprocess, batch x heads on axis 0.
    m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    m_block = tl.program_id(0) % m_blocks
    if CAUSAL:  # the longest query blocks first, as in the forward
        m_block = m_blocks - 1 - m_block
    start_m = m_block * BLOCK_M
    batch_head = tl.program_id(0) // m_blocks
    b = batch_head // heads
    h = batch_head % heads
    kv_h = h // group_size
    q_seq, seqlen_q = _sequence(CU_SEQLENS_Q, b, seqlen_q, VARLEN)
    k_seq, seqlen_k = _sequence(CU_SEQLENS_K, b, seqlen_k, VARLEN)
    if VARLEN and start_m >= seqlen_q:  # the grid covers the longest sequence
        return
    q_tiles_seq = q_seq  # the sequence index of the Q, DO and DQ tiles: 0 in a sequence's own descriptor
    if VARLEN and TMA:  # descriptors of this sequence's rows alone, as in the forward
        Q = _sequence_descriptor(Q, q_seq, seqlen_q, heads, q_strides, HEAD_DIM, BLOCK_M, BLOCK_D)
        DO = _sequence_descriptor(DO, q_seq, seqlen_q, heads, do_strides, HEAD_DIM, BLOCK_M, BLOCK_D)
        kv_heads = heads // group_size
        K = _sequence_descriptor(K, k_seq, seqlen_k, kv_heads, k_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
        V = _sequence_descriptor(V, k_seq, seqlen_k, kv_heads, v_strides, HEAD_DIM, BLOCK_N, BLOCK_D)
        q_tiles_seq = 0
        k_seq = 0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(Q, q_tiles_seq, h, start_m, 0, q_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, TMA)
    do = _load_tile(
        DO, q_tiles_seq, h, start_m, 0, do_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, True, TMA
    )
    row0 = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1]
    lse, delta = _load_row_stats(LSE + row0, DELTA + row0, offs_m, seqlen_q)
    qk_scale = softmax_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    keys = _key_range(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, CAUSAL, LOCAL)
    for masked in tl.static_range(2):  # the unmasked key blocks, then the masked ones, as in the forward
        lo, hi, step, blocks = _key_loop(keys, masked, BLOCK_N, LOCAL)
        for n in range(lo, hi, step):
            start_n = _masked_key_block(n, blocks, BLOCK_N) if masked and LOCAL else n
            dq = _attn_bwd_dq_block(
                dq, q, do, lse, delta, K, V, k_seq, kv_h, offs_m, start_n, k_strides, v_strides, seqlen_q,
                seqlen_k, window_left, window_right, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, masked, CAUSAL,
                LOCAL, TMA, INLINE_PTX,
            )  # fmt: skip
    dq *= softmax_scale
    if VARLEN and TMA:
        DQ = _sequence_descriptor(DQ, q_seq, seqlen_q, heads, dq_strides, HEAD_DIM, BLOCK_M, BLOCK_D)
    _store_tile(DQ, dq, q_tiles_seq, h, start_m, 0, dq_strides, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)


@triton.jit
def _attn_decode_kernel(
    Q,  # (batch, seqlen_q, heads, head_dim)
    K,  # (batch, seqlen_cache, kv_heads, head_dim): the cache, the new keys already appended
    V,  # like K
    O_SPLIT,  # (splits, batch, heads, seqlen_q, head_dim) float32: each split's normalized output
    LSE_SPLIT,  # (splits, batch, heads, seqlen_q) float32: each split's lse, -inf where it saw no key
    SEQLENS_K,  # (batch,) int32: the keys of each sequence, its cache's length after the append
    softmax_scale,
    seqlen_q,
    keys_per_split,  # a multiple of BLOCK_N: no key block straddles two splits
    window_left,
    window_right,  # with LOCAL, as in _attn_fwd_kernel
    kv_heads,
    group_size,
    q_strides,
    k_strides,
    v_strides,  # as in _attn_fwd_kernel
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    INLINE_PTX: tl.constexpr,
):
    # grid = (batch * kv_heads, splits, cdiv(group_size * seqlen_q, BLOCK_M)): keys
    # [split * keys_per_split, + keys_per_split) of one sequence against BLOCK_M rows of its query
    # heads sharing kv head kv_h, row r being query r % seqlen_q of head kv_h * group_size + r //
    # seqlen_q: a GQA group's heads fill the tile that one decoded token would leave 1/16 full.
    b = tl.program_id(0) // kv_heads  # batch x kv heads on axis 0: it may pass axis 1's 65,535
    kv_h = tl.program_id(0) % kv_heads
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group_size * seqlen_q
    i = rows % seqlen_q
    h = kv_h * group_size + rows // seqlen_q
    seqlen_k = tl.load(SEQLENS_K + b)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = Q + b.to(tl.int64) * q_strides[0] + i.to(tl.int64) * q_strides[1] + h.to(tl.int64) * q_strides[2]
    q = tl.load(
        q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0
    )
    # Each row's position among the keys: the queries are the sequence's last seqlen_q tokens.
    positions = i + seqlen_k - seqlen_q
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seqlen_k)
    if LOCAL:  # the window's first key block, for the first query
        start = tl.maximum(start, tl.maximum(seqlen_k - seqlen_q - window_left, 0) // BLOCK_N * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = softmax_scale * 1.4426950408889634
    # The forward's block with the rows' positions as query indices (and seqlen_q = seqlen_k: the
    # diagonal offset is 0); every block masked: the pass is bound by reading the cache.
    for start_n in range(start, end, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_block(
            acc, l_i, m_i, q, K, V, b, kv_h, positions, start_n, k_strides, v_strides, seqlen_k, seqlen_k,
            window_left, window_right, qk_scale, HEAD_DIM, BLOCK_N, BLOCK_D, True, CAUSAL, LOCAL, False,
            INLINE_PTX,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    has_key = l_i > 0.0
    lse = tl.where(
        has_key, (m_i + tl.math.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf")
    )
    # Row (split, b, h, i) of the (splits, batch, heads, seqlen_q) partial outputs.
    batch = tl.num_programs(0) // kv_heads
    split_row = ((split * batch + b).to(tl.int64) * (kv_heads * group_size) + h) * seqlen_q + i
    tl.store(LSE_SPLIT + split_row, lse, mask=row_ok)
    o_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(O_SPLIT + split_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=o_mask)


@triton.jit
def _attn_decode_reduce_kernel(
    O_SPLIT,  # (splits, rows, head_dim) float32, rows = batch * heads * seqlen_q
    LSE_SPLIT,  # (splits, rows) float32
    OUT,  # (batch, seqlen_q, heads, head_dim)
    splits,
    rows,
    heads,
    seqlen_q,
    o_strides,  # as in _attn_fwd_kernel
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # grid = (rows,): out = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s), BLOCK_S splits
    # at a time in split order: a pass for the largest lse, a pass for the weighted sum.
    row = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for first in range(0, splits, BLOCK_S):
        offs_s = first + tl.arange(0, BLOCK_S)
        m = tl.maximum(
            m,
            tl.load(LSE_SPLIT + offs_s.to(tl.int64) * rows + row, mask=offs_s < splits, other=float("-inf")),
        )
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no split saw a key: every weight is 0
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(0, splits, BLOCK_S):
        offs_s = first + tl.arange(0, BLOCK_S)
        split_rows = offs_s.to(tl.int64) * rows + row
        lse_s = tl.load(LSE_SPLIT + split_rows, mask=offs_s < splits, other=float("-inf"))
        weights = tl.math.exp(lse_s - m_max)
        o_s = tl.load(
            O_SPLIT + split_rows[:, None] * HEAD_DIM + offs_d[None, :],
            mask=(offs_s[:, None] < splits) & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )
        total += weights
        acc += tl.sum(o_s * weights[:, None], axis=0)
    out = acc / tl.maximum(tl.sum(total, axis=0), 1e-30)
    i = row % seqlen_q
    bh = (row // seqlen_q).to(tl.int64)
    base = OUT + (bh // heads) * o_strides[0] + i.to(tl.int64) * o_strides[1] + (bh % heads) * o_strides[2]
    tl.store(base + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _sequence_descriptor(
    X, first_row, seqlen, heads, strides, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """A TMA descriptor, built on the device, of one sequence of a packed (total, heads, head_dim)
    tensor: its rows [first_row, + seqlen) as a (1, seqlen, heads, HEAD_DIM) tensor that
    :func:`_load_tile` and :func:`_store_tile` address as sequence 0. Bounded by the sequence, its
    loads past the end read zeros and its stores there are dropped, so a tile never touches the next
    sequence's rows (a descriptor of the whole packed tensor would). strides are X's (row, row,
    head) strides, as :func:`_strides` gives a packed tensor's; the launch needs Triton's allocator
    for the descriptors' global memory (runtime.launch_building_descriptors)."""
    return tl.make_tensor_descriptor(
        X + first_row.to(tl.int64) * strides[1],
        shape=[1, seqlen, heads, HEAD_DIM],
        strides=[strides[0], strides[1], strides[2], 1],
        block_shape=[1, BLOCK_S, 1, BLOCK_C],
    )


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnConfig:
    """Tile of one attention pass: BLOCK_M queries by BLOCK_N keys, its warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    column_splits: int = 1  # dk/dv pass: its head-dim columns shared among this many programs
    tma: bool = True  # q/k/v/o tiles by TMA (tensor descriptors) where the GPU and strides allow
    # Forward: 0 launches a program per tile; n > 0 launches n per SM, each looping over tiles.
    programs_per_sm: int = 0
    # The config taken when tiles move by pointers (None: this one), for entries whose TMA tile spills there.
    pointer: "AttnConfig | None" = None
    # dk/dv pass: dv and dk by two launches of their own, one accumulator live in each (5 GEMMs against
    # the fused pass's 4: the scores computed twice).
    split_outputs: bool = False

    def loads(self, tma: bool) -> "AttnConfig":
        """The config a launch takes with TMA loads (tma) or with pointers."""
        return self if tma or self.pointer is None else self.pointer


# Per GPU family (runtime.arch), pass and padded head dim. Every entry compiles for its family's
# target with tensor-core instructions, no spills and within its shared memory, in both dtypes and
# every mask, with pointer loads, on packed batches, and on sm_90 and sm_100 where tma is set with
# TMA loads: python -m bench.compile_report --filter attn builds them all, and its output is the
# record of how each builds. The sm_90 entries, here, are chosen for speed. The other families'
# (horse/kernels/configs/attention.json) are the first candidates, from sm_90's tile down, that compile
# clean there on triton 3.6 and 3.9 (python -m bench.tune attention --compile-only --arch FAMILY
# --start-from sm90; sm86's also for sm_89 and sm_120 with --capability 86 89 120); none is
# measured yet (python -m bench.tune attention on such a GPU refines them).
#
# sm_90: clean on triton 3.6 and 3.9, but the forward's TMA tiles at head dims 128 and 256, checked
# on 3.6 only; those entries take smaller key blocks with pointers (pointer), whose larger
# tiles spilled. TMA took fewer registers in most entries (221 against 255 in the 128x128
# head-dim-128 forward) and less shared memory (197 against 229 KB there); which is faster is for
# the bench to measure ("ours" against "ours-pointer").
_TABLES = runtime.load_configs("attention", AttnConfig)
FWD_CONFIGS = {
    "sm90": {
        16: AttnConfig(128, 64, 4, 3),
        32: AttnConfig(128, 64, 4, 3),
        64: AttnConfig(128, 64, 4, 3),
        # 128x128 by TMA, as the tutorial: clean at 221-255 registers, 192 KiB (triton 3.6; padded and
        # packed, every mask). Pointers keep 128x64: 128x128 spilled 8 bytes (head dim 128) and 48 (96)
        # there with a window once the offsets went 64-bit. bench.sass_loops, non-causal loop: 128x64
        # took 336 instructions, 66 FMUL, 12 HGMMA per 64 keys (641 per MFLOP); 128x128 takes 488, 66,
        # 16x 64x128x16 per 128 keys (465 per MFLOP; the tutorial 491, 66: 468); causal diagonal 625.
        128: AttnConfig(128, 128, 8, 3, pointer=AttnConfig(128, 64, 8, 3)),
        # 128x64 by TMA, K and V through shared memory as FA3's 128x80 (which fills it; Triton's
        # tiles are powers of two): bench.sass_loops, non-causal loop, 16x 64x64x16 + 4x 64x256x16
        # HGMMA, 442 instructions (422 per MFLOP), where the 128x32 pointer tile issued 16x 64x32x16
        # + 2x 64x256x16 in 376 (717 per MFLOP); 250-255 registers, no spill, 128 KiB (triton 3.6).
        # Pointers keep 128x32: 128x64 spilled 8-48 bytes there (head dims 192, 256 local), as it
        # did on triton 3.9 with TMA and at 192 causal with pointers.
        256: AttnConfig(128, 64, 8, 2, pointer=AttnConfig(128, 32, 8, 2)),
    },
    **_TABLES["FWD_CONFIGS"],
}
# Packed batches' forward: the padded entries, TMA descriptors built on the device per sequence (the
# 128x128 head-dim-128 tile compiles as the padded one: 221-255 registers, no spill; its pointer
# tile, 128x64, is the one the packed batches took before at 180-234). The backward passes share the
# padded tables, by TMA with descriptors built on the device too (see BWD_DKDV_CONFIGS' 256). A dict
# of its own per family: tuning one table (bench.tune) never edits the other.
PACKED_FWD_CONFIGS = {arch: dict(table) for arch, table in FWD_CONFIGS.items()}
# block_n is the key block each program owns (dk, dv accumulate there); block_m the query step.
BWD_DKDV_CONFIGS = {
    # At head dim 256 no tile held dk and dv whole without spilling (808 bytes at 64x64, 8 warps),
    # so two programs share each key block's columns, recomputing the scores: 1.5x this pass's
    # FLOPs. At 128 the TMA variant of this tile spills 16-32 bytes (only block_m 16 did not).
    "sm90": {
        16: AttnConfig(64, 128, 8, 2),
        32: AttnConfig(64, 128, 8, 2),
        # Per iteration (python -m bench.sass_loops attn_bwd_dkdv, fp16) after lse in log2 units from
        # the preprocess, block-relative query rows and the causal mask in PTX, before -> after:
        # 64 (TMA): full 327 -> 266, causal 369 -> 301; 128: full 291 -> 261 (555 -> 498 per MFLOP),
        # causal 329 -> 291 (628 -> 555), local 369 -> 341.
        # Causal, the mask behind a uniform branch (only query blocks crossing the diagonal), the loop's
        # two paths (diagonal / off-diagonal, against non-causal): 128: 291 -> 286 / 253 (261); 64: 301
        # -> 303 / 269 (266); 32: 476 -> 478 / 412 (409); 16: 473 -> 475 / 409 (406). Registers: 128
        # causal 244-254 -> 245-255, clean; two loops instead (masked, then unmasked) spilled 32-64 bytes.
        64: AttnConfig(32, 128, 8, 2),
        # 2 stages spilled 8 bytes packed with the local mask (64-bit rows, flat grid; triton 3.6);
        # 1 stage compiled at 226-235 registers, clean, in the local and causal masks.
        128: AttnConfig(32, 128, 8, 1, tma=False),
        # Split outputs: dv, then dk, each a launch of its own holding one accumulator (64 registers a
        # thread at 8 warps, against 128 for both), the scores computed in both: 5 GEMMs against 4
        # (1.25x; the column split it replaces recomputed 1.5x). 64 queries x 128 keys at 8 warps, a
        # warpgroup per 64 keys: no GEMM split over N. bench.sass_loops (triton 3.6, fp16), per
        # iteration, dv / dk: full 356 / 486 instructions, causal 413 / 539, local 531 / 638; HGMMA 16x
        # 64x64x16 + 4x 64x256x16 / 32x 64x64x16 + 4x 64x256x16 (smallest N 64); 340 / 309 per MFLOP,
        # the pair 321 (401 per MFLOP of the fused pass's work). Before: 16x64, 2 column splits, 437
        # instructions, 64x 64x8x16 + 2x 64x64x16 (N 8, 1,334 per MFLOP issued, 2,001 of the work).
        # Compile report: 230-247 registers (dv), 255 (dk), no spill, 128 / 192 KiB shared, both dtypes,
        # head dims 256 and 192, every mask, float32 partials; q and dO by TMA, K and V by pointers (see
        # _attn_bwd_dkdv_kernel). Not taken (spill bytes): 2 stages 8-312 (dk 257 KiB), 64x64 at 4 warps
        # 8 (dk, window), pointer q and dO 104-184 at 64x128, both outputs in one launch (a program
        # each, both paths in one kernel; built before delta went into dk's accumulator and the per-key
        # window bound) 16 at 64x128, 176-248 at 64x64; earlier, fused: 64x64 456-656
        # (N 32), 128x64 888-1,320, scores by query 128x64 264-320. Pointer loads (unaligned inputs)
        # keep the fused column split: with q and dO by pointers no N >= 64 tile was clean. Checked on
        # triton 3.6 only. Packed batches take this tile by TMA too (descriptors built per sequence on
        # the device; before, the pointer tile: full 436 instructions, 64x 64x8x16 + 2x 64x64x16, 1,331
        # per MFLOP issued): dv / dk full 290 / 446 (277 / 284 per MFLOP), causal 369 / 598 (352 / 380;
        # the dk launch as the window (-1, 0): causal spilled 8 bytes), local 470 / 599 (448 / 381),
        # the same HGMMA; 231-245 registers (dv), 255 (dk), no spill, 128 / 192 KiB shared.
        256: AttnConfig(64, 128, 8, 1, split_outputs=True, pointer=AttnConfig(16, 64, 8, 2, column_splits=2)),
    },
    **_TABLES["BWD_DKDV_CONFIGS"],
}
BWD_DQ_CONFIGS = {
    # At 256 the TMA variant compiles clean on triton 3.6 (250 registers) but spilled 544 bytes on 3.9.
    "sm90": {
        16: AttnConfig(128, 64, 8, 3),
        32: AttnConfig(128, 64, 8, 3),
        64: AttnConfig(128, 64, 8, 3),
        128: AttnConfig(128, 64, 8, 2),
        256: AttnConfig(64, 32, 8, 2, tma=False),
    },
    **_TABLES["BWD_DQ_CONFIGS"],
}
# Decode (flash_attention_with_kvcache): BLOCK_M query rows (a GQA group's heads x the new tokens)
# by BLOCK_N cached keys, pointer loads (the rows are gathered across heads), the same rule on every
# family; a tile of 16 rows (the smallest tl.dot) when the group's rows fit in it.
# At head dim 256 a 64-row tile spilled 96 bytes with the window (sm_80, sm_86, sm_90): 16 rows.
DECODE_CONFIGS = {
    arch: {
        block_d: AttnConfig(16, 32, 4, 2, tma=False)
        if block_d == 256
        else AttnConfig(64, 64, 4, 2, tma=False)
        for block_d in (16, 32, 64, 128, 256)
    }
    for arch in ("sm80", "sm86", "sm90", "sm100", "gfx942")
}
DECODE_REDUCE_NUM_WARPS = 8  # at 4 the head-dim-256 reduce spilled 8 bytes on sm_80
DECODE_REDUCE_BLOCK_S = 16  # splits the reduce loads at a time: up to 2 per SM, 264 on an H200
# Above this many new tokens a query tile fills without packing heads or splitting keys: a prompt
# of equal-length sequences takes the prefill kernel (TMA, its tuned tiles) on the cache's rows.
DECODE_MAX_SEQLEN_Q = 16
# Small, unequal tiles in the interpreter: quick there, and several blocks cross every boundary.
INTERPRETER_BLOCKS = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1, "pointer": None}
PREPROCESS_BLOCK_M = 64
INTERPRETER_NUM_SMS = 132  # an H200's: see bwd_num_sms
# At 4 warps the 64 x 128 tiles of o and dO spilled 8-32 bytes on sm_100 (at 48-56 registers).
PREPROCESS_NUM_WARPS = 8


def head_dim_block(head_dim: int) -> int:
    """Head dims are padded to a power of two of at least 16, the smallest tl.dot reduction."""
    return max(16, triton.next_power_of_2(head_dim))


def attn_config(table: dict, head_dim: int, device: torch.device) -> AttnConfig:
    """The entry of table (FWD_CONFIGS, ...) for head_dim on device's GPU family."""
    cfg = table[runtime.arch(device).name][head_dim_block(head_dim)]
    return dataclasses.replace(cfg, **INTERPRETER_BLOCKS) if runtime.INTERPRET else cfg


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
    _sequence_descriptor), as one of the whole packed tensor would let a tile's store spill into the
    next sequence's rows."""
    return USE_TMA and cfg.tma and runtime.tma_compatible(*tensors)


def _operand(t: torch.Tensor, block_s: int, block_d: int, tma: bool):
    """t, or a descriptor of it loading (block_s rows, block_d head-dim columns) of one (batch, head)."""
    return runtime.tma_operand(t, (1, block_s, 1, block_d), tma)


def _mask(causal: bool, window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int, dict]:
    """The kernels' window arguments and mask constexprs for a normalized (causal, window): a window
    side of -1 reaches past every key."""
    local = window != (-1, -1)
    unbounded = seqlen_q + seqlen_k
    left, right = (unbounded if side < 0 else side for side in window)
    return left, right, {"CAUSAL": causal and not local, "LOCAL": local}


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
    sequence (_sequence_descriptor), and is launched with an allocator for them."""
    host_tma = tma and packed is None
    launch = runtime.launch_building_descriptors if tma and packed is not None else runtime.launch
    return host_tma, launch


def _pass_args(q, k, v, lse, causal, window, softmax_scale, packed: Packed | None) -> dict:
    """The launch arguments the forward and both backward passes share: a packed batch's offsets (lse,
    never read, when not packed), the scale, the mask, the heads, the strides of q, k, v and lse (the
    backward's delta and lse_log2 share lse's) and the head dims."""
    _, seqlen_q, seqlen_k, heads, kv_heads, head_dim = _shape(q, k, packed)
    window_left, window_right, mask = _mask(causal, window, seqlen_q, seqlen_k)
    cu_q, cu_k = (lse, lse) if packed is None else (packed.cu_seqlens_q, packed.cu_seqlens_k)
    return dict(
        CU_SEQLENS_Q=cu_q, CU_SEQLENS_K=cu_k, softmax_scale=softmax_scale, seqlen_q=seqlen_q,
        seqlen_k=seqlen_k, window_left=window_left, window_right=window_right, heads=heads,
        group_size=heads // kv_heads, q_strides=_strides(q), k_strides=_strides(k), v_strides=_strides(v),
        lse_strides=_lse_strides(lse), HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim),
        VARLEN=packed is not None, **mask, INLINE_PTX=runtime.inline_ptx(q), **runtime.COMPILE_OPTIONS,
    )  # fmt: skip


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
    batch, seqlen_q, _, heads, _, head_dim = _shape(q, k, packed)
    out = runtime.empty(q.shape, q.dtype, q.device)
    lse_shape = (batch, heads, seqlen_q) if packed is None else (heads, q.shape[0])
    lse = runtime.empty(lse_shape, torch.float32, q.device)
    cfg = attn_config(FWD_CONFIGS if packed is None else PACKED_FWD_CONFIGS, head_dim, q.device)
    block_d = head_dim_block(head_dim)
    tma = tma_usable(cfg, q, k, v, out)
    cfg = cfg.loads(tma)
    host_tma, launch = _descriptors(tma, packed)
    q_tiles, out_tiles = (_operand(t, cfg.block_m, block_d, host_tma) for t in (q, out))
    k_tiles, v_tiles = (_operand(t, cfg.block_n, block_d, host_tma) for t in (k, v))
    tiles = triton.cdiv(seqlen_q, cfg.block_m) * batch * heads
    persistent = cfg.programs_per_sm > 0 and packed is None
    programs = min(tiles, cfg.programs_per_sm * runtime.num_sms(q.device)) if persistent else tiles
    if programs == 0:  # a packed batch of empty sequences
        return out, lse
    with runtime.device_guard(q):
        launch(
            _attn_fwd_kernel, (programs,),
            q_tiles, k_tiles, v_tiles, out_tiles, lse, batch=batch, o_strides=_strides(out),
            **_pass_args(q, k, v, lse, causal, window, softmax_scale, packed),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma, PERSISTENT=persistent,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
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
    window_left, window_right, mask = _mask(causal, window, seqlen_q, seqlen_cache)
    block_d = head_dim_block(head_dim)
    cfg = attn_config(DECODE_CONFIGS, head_dim, q.device)
    rows = group_size * seqlen_q
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(rows)))
    row_tiles = triton.cdiv(rows, block_m)
    splits = decode_splits(batch * kv_heads * row_tiles, seqlen_cache, cfg.block_n, runtime.num_sms(q.device))
    keys_per_split = triton.cdiv(triton.cdiv(seqlen_cache, splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(seqlen_cache, keys_per_split)  # none left without keys by the rounding
    out = runtime.empty(q.shape, q.dtype, q.device)
    o_split = runtime.empty((splits, batch, heads, seqlen_q, head_dim), torch.float32, q.device)
    lse_split = runtime.empty((splits, batch, heads, seqlen_q), torch.float32, q.device)
    with runtime.device_guard(q):
        runtime.launch(
            _attn_decode_kernel, (batch * kv_heads, splits, row_tiles),
            q, k_cache, v_cache, o_split, lse_split, seqlens_k, softmax_scale=softmax_scale,
            seqlen_q=seqlen_q, keys_per_split=keys_per_split, window_left=window_left,
            window_right=window_right, kv_heads=kv_heads, group_size=group_size, q_strides=_strides(q),
            k_strides=_strides(k_cache), v_strides=_strides(v_cache), HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, **mask, INLINE_PTX=runtime.inline_ptx(q),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **runtime.COMPILE_OPTIONS,
        )  # fmt: skip
        runtime.launch(
            _attn_decode_reduce_kernel, (batch * heads * seqlen_q,),
            o_split, lse_split, out, splits, batch * heads * seqlen_q, heads, seqlen_q, _strides(out),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=DECODE_REDUCE_BLOCK_S,
            num_warps=DECODE_REDUCE_NUM_WARPS, **runtime.COMPILE_OPTIONS,
        )  # fmt: skip
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


def dkdv_outputs(cfg: AttnConfig) -> tuple[str, ...]:
    """The dk/dv pass's launches under cfg, by their OUTPUT: one for both, or one each."""
    return ("dv", "dk") if cfg.split_outputs else ("dkdv",)


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
    gradients empty tensors (frozen inputs)."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim = _shape(q, k, packed)
    if dout.stride(-1) != 1:  # gradients can arrive expanded (stride 0) or transposed
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    block_d = head_dim_block(head_dim)
    # The kernels address both with lse's strides (lse, from the forward, is contiguous).
    delta, lse_log2 = (runtime.empty(lse.shape, torch.float32, q.device) for _ in range(2))
    dq = runtime.empty(q.shape if needs[0] else (0,), q.dtype, q.device)
    dk = runtime.empty(k.shape if needs[1] else (0,), k.dtype, k.device)
    dv = runtime.empty(v.shape if needs[1] else (0,), v.dtype, v.device)
    if q.shape[0] == 0 or k.shape[0] == 0 or not any(needs):  # nothing to compute
        return dq.zero_(), dk.zero_(), dv.zero_()
    args = _pass_args(q, k, v, lse, causal, window, softmax_scale, packed) | {"do_strides": _strides(dout)}
    with runtime.device_guard(q):
        grid = (triton.cdiv(seqlen_q, PREPROCESS_BLOCK_M) * batch * heads,)
        runtime.launch(
            _attn_bwd_preprocess_kernel, grid,
            out, dout, lse, dlse if dlse is not None else delta, delta, lse_log2, args["CU_SEQLENS_Q"],
            seqlen_q, heads, _strides(out), _strides(dout), args["lse_strides"],
            HEAD_DIM=head_dim, BLOCK_D=block_d, VARLEN=packed is not None, BLOCK_M=PREPROCESS_BLOCK_M,
            HAS_DLSE=dlse is not None, num_warps=PREPROCESS_NUM_WARPS, **runtime.COMPILE_OPTIONS,
        )  # fmt: skip
        if needs[1]:
            cfg = attn_config(BWD_DKDV_CONFIGS, head_dim, q.device)
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
            k_tiles, v_tiles = (
                _operand(t, cfg.block_n, block_d, host_tma and not cfg.split_outputs) for t in (k, v)
            )
            dk_tiles, dv_tiles = (_operand(t, cfg.block_n, block_d, host_tma) for t in (dk_out, dv_out))
            for output in dkdv_outputs(cfg):
                launch(
                    _attn_bwd_dkdv_kernel, (programs, splits * cfg.column_splits),
                    q_tiles, k_tiles, v_tiles, do_tiles, lse_log2, delta, dk_tiles, dv_tiles, **args,
                    kv_heads=kv_heads, heads_per_split=heads_per_split, split_seqs=k.shape[0],
                    dk_strides=_strides(dk_out), dv_strides=_strides(dv_out),
                    BLOCK_D_OUT=block_d // cfg.column_splits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                    TMA=tma, OUTPUT=output, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                )  # fmt: skip
            if splits > 1:  # torch's sum over the splits: the same order every run
                dk.copy_(dk_out.view(splits, *k.shape).sum(0))
                dv.copy_(dv_out.view(splits, *v.shape).sum(0))
        if needs[0]:
            cfg = attn_config(BWD_DQ_CONFIGS, head_dim, q.device)
            tma = tma_usable(cfg, q, k, v, dout, dq)
            host_tma, launch = _descriptors(tma, packed)
            q_tiles, do_tiles, dq_tiles = (_operand(t, cfg.block_m, block_d, host_tma) for t in (q, dout, dq))
            k_tiles, v_tiles = (_operand(t, cfg.block_n, block_d, host_tma) for t in (k, v))
            grid = (triton.cdiv(seqlen_q, cfg.block_m) * batch * heads,)
            launch(
                _attn_bwd_dq_kernel, grid,
                q_tiles, k_tiles, v_tiles, do_tiles, lse, delta, dq_tiles, **args, dq_strides=_strides(dq),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )  # fmt: skip
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd
# ----------------------------------------------------------------------------------------------


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packed | None:
    return None if cu_seqlens_q is None else Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _attn_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, cu_seqlens_q, *_):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens_q is None else (q.shape[1], q.shape[0])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, cu_q, cu_k, max_q, max_k = inputs
    # O(seqlen) tensors only (q, k, v, out, lse): the scores are recomputed in the backward, never saved.
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
    ctx.mask_args = (causal, softmax_scale, window_left, window_right)
    ctx.max_seqlens = (max_q, max_k)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    # dq, and dk with dv (one pass), only where an input wants them (frozen inputs launch nothing).
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]]
    grads = _attn_bwd_op(dout, dlse, q, k, v, out, lse, *ctx.mask_args, cu_q, cu_k, *ctx.max_seqlens, needs)
    return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=False)), *[None] * 8


# The arguments both ops take after their tensors, in torch's schema language: the mask and the packed
# batch's sequences (None and 0 when not packed) as plain values, which custom ops take.
_MASK_AND_SEQUENCES = (
    "bool causal, float softmax_scale, SymInt window_left, SymInt window_right, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k"
)


@runtime.custom_op(
    "flash_attn_fwd", _attn_fwd_fake, _backward, _setup_context,
    schema=f"(Tensor q, Tensor k, Tensor v, {_MASK_AND_SEQUENCES}) -> (Tensor, Tensor)",
)  # fmt: skip
def _attn_fwd_op(q, k, v, causal, softmax_scale, window_left, window_right, *sequences):
    return attention_fwd(q, k, v, causal, softmax_scale, (window_left, window_right), _packed(*sequences))


def _attn_bwd_fake(dout, dlse, q, k, v, *args):
    needs_dq, needs_dkdv = args[-1]
    wanted = (needs_dq, needs_dkdv, needs_dkdv)
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((q, k, v), wanted, strict=True))


@runtime.custom_op(
    "flash_attn_bwd", _attn_bwd_fake,
    schema="(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"{_MASK_AND_SEQUENCES}, bool[] needs) -> (Tensor, Tensor, Tensor)",
)  # fmt: skip
def _attn_bwd_op(dout, dlse, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, *rest):
    *sequences, needs = rest
    window = (window_left, window_right)
    return attention_bwd(
        dout, dlse, q, k, v, out, lse, causal, softmax_scale, window, _packed(*sequences), needs
    )


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def _validate(q, k, v, fn: str, packed: bool) -> None:
    layout = "(total_tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != (3 if packed else 4):
            raise ValueError(f"{fn}: {name} must be {layout}, got shape {list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} is {t.dtype} but q is {q.dtype}; q, k and v must share a dtype")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{fn}: {name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}"
            )
    heads, head_dim = q.shape[-2:]
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if k.shape[-1] != head_dim or (not packed and k.shape[0] != q.shape[0]):
        what = f"head_dim {head_dim}" if packed else f"batch {q.shape[0]} and head_dim {head_dim}"
        raise ValueError(f"{fn}: k and v must match q's {what}, got shape {list(k.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    kv_heads = k.shape[-2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{fn}: q's heads ({heads}) must be a multiple of k and v's heads ({kv_heads})")
    if not packed and (q.shape[1] == 0 or k.shape[1] == 0 or q.shape[0] == 0):
        raise ValueError(
            f"{fn}: batch and sequence lengths must be at least 1, got q {list(q.shape)}, k {list(k.shape)}"
        )


def _validate_sequences(q, k, packed: Packed) -> None:
    """The packed batch's cu_seqlens and maxima. Their values are read only from CPU tensors in
    eager mode: on a GPU that would wait for the device at every call, and in a torch.compile graph
    it would break the graph."""
    fn = "flash_attention_varlen"
    cu_q, cu_k = packed.cu_seqlens_q, packed.cu_seqlens_k
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            got = (
                f"{cu.dtype} of shape {list(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            )
            raise ValueError(f"{fn}: {name} must be an int32 tensor of batch + 1 >= 2 offsets, got {got}")
        if cu.device != q.device:
            raise ValueError(f"{fn}: {name} is on {cu.device} but q is on {q.device}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"{fn}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_q.numel()} and {cu_k.numel()}"
        )
    for name, value in (("max_seqlen_q", packed.max_seqlen_q), ("max_seqlen_k", packed.max_seqlen_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{fn}: {name} must be an int >= 0, got {value!r}")
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_q, q.shape[0], packed.max_seqlen_q),
        ("cu_seqlens_k", cu_k, k.shape[0], packed.max_seqlen_k),
    ):
        lengths = cu.diff()
        if cu[0] != 0 or cu[-1] != total or (lengths < 0).any():
            raise ValueError(f"{fn}: {name} must rise from 0 to {total} (the packed rows), got {cu.tolist()}")
        if lengths.max() > longest:
            max_name = name.replace("cu_seqlens", "max_seqlen")
            raise ValueError(f"{fn}: {max_name} is {longest} but a sequence has {lengths.max().item()} rows")


def _runs_triton(q: torch.Tensor, fn: str, inputs: str = "q, k and v") -> bool:
    """Whether the Triton kernels run (:func:`runtime.runs_triton`); they take 16-bit inputs only."""
    if runtime.runs_triton(q) and q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {inputs} must be float16 or bfloat16 on the Triton path, got {q.dtype}")
    return runtime.runs_triton(q)


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int, fn: str) -> float:
    """softmax_scale, 1 / sqrt(head_dim) by default. It must be positive: the kernels take the row
    maximum of the raw scores and scale it, which a negative scale would turn into the minimum."""
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not scale > 0 or math.isinf(scale):
        raise ValueError(f"{fn}: softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    return scale


def normalize_mask(causal: bool, window_size, fn: str = "flash_attention") -> tuple[bool, tuple[int, int]]:
    """(causal, window) with the window validated and causal folded into it: causal is the right
    side at 0, a window of (-1, 0) is plain causal, and a returned window other than (-1, -1) is
    never causal (its right side says it)."""
    sides = window_size if isinstance(window_size, (tuple, list)) else ()
    if len(sides) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= -1 for n in sides):
        raise ValueError(
            f"{fn}: window_size must be two ints (left, right), each >= 0 or -1 for "
            f"unbounded, got {window_size!r}"
        )
    left, right = window_size
    if causal:
        right = 0
    if left == -1 and right == 0:
        return True, (-1, -1)
    return (False, (left, right)) if (left, right) != (-1, -1) else (causal, (-1, -1))


def _attention(fn: str, q, k, v, packed: Packed | None, causal, softmax_scale, return_lse, window_size):
    """:func:`flash_attention`, or with packed :func:`flash_attention_varlen`, after their arguments."""
    q, k, v = runtime.autocast(q, k, v)
    _validate(q, k, v, fn, packed=packed is not None)
    if packed is not None:
        _validate_sequences(q, k, packed)
    causal, window = normalize_mask(causal, window_size, fn)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1], fn)
    sequences = (None, None, 0, 0)
    if packed is not None:
        cu_q, cu_k = packed.cu_seqlens_q.contiguous(), packed.cu_seqlens_k.contiguous()
        sequences = (cu_q, cu_k, packed.max_seqlen_q, packed.max_seqlen_k)
    if _runs_triton(q, fn):
        out, lse = _attn_fwd_op(q, k, v, causal, scale, *window, *sequences)
    elif packed is None:
        out, lse = reference.attention(q, k, v, causal, scale, window_size=window)
    else:
        out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale, window_size=window)
    out = out.to(q.dtype)  # the reference's float32 back to q's dtype
    return (out, lse) if return_lse else out


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention, FlashAttention-style, differentiable in q, k, v (and through lse).

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, kv_heads, head_dim), heads a
    multiple of kv_heads; float16 or bfloat16 (float32 only on the CPU reference path); head_dim at
    most 256; any strides with a unit stride in the last dimension. causal masks to the
    bottom-right corner (query i sees keys j <= i + seqlen_k - seqlen_q; a query that sees none
    gets zeros). window_size (left, right) is a sliding window, as flash-attn's: query i sees keys
    i + seqlen_k - seqlen_q - left to i + seqlen_k - seqlen_q + right, -1 for an unbounded side;
    with causal the right side is 0. softmax_scale (> 0) defaults to 1 / sqrt(head_dim). Every argument
    after v is keyword-only: flash-attn's fourth positional argument is dropout_p, which this
    function does not take, so ``flash_attention(q, k, v, 0.1)`` raises rather than runs causal.

    Under torch.autocast the inputs are cast to its dtype first, as a matmul's would be.

    Returns out (batch, seqlen_q, heads, head_dim) in q's dtype, or (out, lse) with return_lse,
    lse (batch, heads, seqlen_q) float32 the natural log-sum-exp of each row's scaled scores.
    """
    return _attention("flash_attention", q, k, v, None, causal, softmax_scale, return_lse, window_size)


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_attention` over a packed batch of variable-length sequences, flash-attn's varlen
    layout: no padding, each sequence attending only within itself.

    q: (total_q, heads, head_dim), k, v: (total_k, kv_heads, head_dim), the sequences one after
    another: sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and its keys rows
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v (int32, batch + 1 offsets rising from 0 to the
    total; a sequence may be empty). max_seqlen_q and max_seqlen_k bound the lengths: they size the
    launch without reading the offsets back from the device, so on a GPU the offsets and maxima are
    trusted, as flash-attn trusts them (on the CPU they are checked). causal, window_size and
    softmax_scale as in :func:`flash_attention`, per sequence (causal aligned to each one's
    bottom-right corner). Returns out like q, or (out, lse) with return_lse, lse (heads, total_q).
    """
    packed = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attention(
        "flash_attention_varlen", q, k, v, packed, causal, softmax_scale, return_lse, window_size
    )


def flash_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Attention of a few new queries to a KV cache, appending the new keys and values to it in
    place first: flash-attn's ``flash_attn_with_kvcache``, for decoding.

    q: (batch, seqlen_q, heads, head_dim); k_cache, v_cache: (batch, seqlen_cache, kv_heads,
    head_dim), heads a multiple of kv_heads; cache_seqlens: the tokens already cached per sequence,
    an int or an int32 tensor (batch,) (None: the whole cache). k, v (batch, seqlen_new, kv_heads,
    head_dim), both or neither, are written to the caches at positions cache_seqlens[b] ..
    cache_seqlens[b] + seqlen_new - 1; sequence b then attends to its first cache_seqlens[b] +
    seqlen_new keys. causal and window_size align to each sequence's bottom-right corner, as in
    :func:`flash_attention`: query i is at position i + seqlen_k - seqlen_q, so the new tokens see
    the cache and the new tokens before them. float16 or bfloat16 (float32 only on the CPU reference
    path), the caches in q's dtype; a unit stride in the last dimension. The keys are split among
    programs (two per SM) and a GQA group's query heads share one tile; a second pass reduces the
    splits. The lengths are trusted on a GPU (checked on the CPU). Returns out like q.
    """
    fn = "flash_attention_with_kvcache"
    q = runtime.autocast(q)[0]
    _validate(q, k_cache, v_cache, fn, packed=False)
    batch, seqlen_q, _, head_dim = q.shape
    seqlen_cache = k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v must be given together (the new keys and values), or neither")
    seqlen_new = 0
    if k is not None:
        k, v = (t.to(q.dtype) for t in (k, v))
        seqlen_new = k.shape[1]
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(
                f"{fn}: k and v must be (batch, seqlen_new, kv_heads, head_dim) = ({batch}, *, "
                f"{k_cache.shape[2]}, {head_dim}), got {list(k.shape)} and {list(v.shape)}"
            )
    if cache_seqlens is None:
        cache_seqlens = seqlen_cache - seqlen_new
    is_int = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
    if not is_int:
        if not isinstance(cache_seqlens, torch.Tensor):
            raise ValueError(f"{fn}: cache_seqlens must be an int or an int32 tensor, got {cache_seqlens!r}")
        if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
            raise ValueError(
                f"{fn}: cache_seqlens must be an int or an int32 tensor ({batch},), got "
                f"{cache_seqlens.dtype} of shape {list(cache_seqlens.shape)}"
            )
        if cache_seqlens.device != q.device:
            raise ValueError(f"{fn}: cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    # A tensor's lengths are read only on the CPU in eager mode: no wait for the GPU, no graph break.
    if is_int or (q.device.type == "cpu" and not torch.compiler.is_compiling()):
        values = [cache_seqlens] if is_int else cache_seqlens.tolist()
        if not all(0 <= n <= seqlen_cache - seqlen_new for n in values):
            raise ValueError(
                f"{fn}: cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache's length), "
                f"got cache_seqlens {cache_seqlens if is_int else values} and seqlen_new {seqlen_new}"
            )
    lengths = cache_seqlens
    if is_int:
        lengths = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    causal, window = normalize_mask(causal, window_size, fn)
    scale = resolve_softmax_scale(softmax_scale, head_dim, fn)
    if k is not None:
        if is_int:
            k_cache[:, cache_seqlens : cache_seqlens + seqlen_new] = k
            v_cache[:, cache_seqlens : cache_seqlens + seqlen_new] = v
        else:  # each sequence's rows at its own length: one scatter per cache
            rows = (lengths[:, None] + torch.arange(seqlen_new, device=q.device)).long()  # (batch, new)
            sequences = torch.arange(batch, device=q.device)[:, None]
            k_cache[sequences, rows] = k
            v_cache[sequences, rows] = v
        lengths = lengths + seqlen_new
    if _runs_triton(q, fn, "q and the caches"):
        if seqlen_q > DECODE_MAX_SEQLEN_Q and is_int:  # a prompt: the prefill kernel
            end = cache_seqlens + seqlen_new
            return attention_fwd(q, k_cache[:, :end], v_cache[:, :end], causal, scale, window)[0]
        return attention_decode(q, k_cache, v_cache, lengths, causal, scale, window)
    return reference.attention_kvcache(q, k_cache, v_cache, lengths, causal, scale, window).to(q.dtype)
