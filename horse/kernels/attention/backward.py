"""The backward passes: a preprocess of the rows (delta and lse in log2 units), a pass per key block
for dk and dv, a pass per query block for dq. No atomics: every gradient is bit-identical run to run.
"""

import triton
import triton.language as tl

from horse.kernels.attention.masks import (
    _causal_scores,
    _in_window,
    _key_loop,
    _key_range,
    _masked_key_block,
    _visible,
)
from horse.kernels.attention.tiles import _load_tile, _sequence, _sequence_descriptor, _store_tile


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
