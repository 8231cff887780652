"""The backward passes: a preprocess of the rows (delta and lse in log2 units), a pass per key block
for dk and dv, a pass per query block for dq. No atomics: every gradient is bit-identical run to run.

The kernels' arguments come in groups, as :func:`horse.kernels.attention.launch.dkdv_plans` and
:func:`~horse.kernels.attention.launch.dq_plan` name them (``cu_seqlens``, ``seqlens``, ``mask`` and
``score_mods`` as in the forward; ``row_stats``, the preprocess's outputs; ``layout``, the head counts
(sizes) and a strides tuple per tensor); the tensors a launch may pass as TMA descriptors stay
arguments of their own. The device helpers take views of the tensors (``tiles.py``) and are called by
keyword.
"""

import triton
import triton.language as tl

from horse.kernels.attention.masks import (
    _causal_scores,
    _document_first_keys,
    _document_scores,
    _document_scores_transposed,
    _in_window,
    _key_loop,
    _key_range,
    _masked_key_block,
    _visible,
)
from horse.kernels.attention.scores import _softcapped_scores
from horse.kernels.attention.tiles import _load_tile, _sequence, _sequence_view, _store_tile


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
    q_seq, seqlen_q = _sequence(CU_SEQLENS_Q, b=b, seqlen=seqlen_q, VARLEN=VARLEN)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    o = _load_tile(
        (OUT, q_seq, o_strides, seqlen_q),
        head=h,
        row=start_m,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_M,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=True,
        TMA=False,
    )
    do = _load_tile(
        (DO, q_seq, do_strides, seqlen_q),
        head=h,
        row=start_m,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_M,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=True,
        TMA=False,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1] + offs_m
    if HAS_DLSE:
        # d lse_i / d s_ij = p_ij, which folds into ds = p * (dp - delta) as a shift of delta.
        delta -= tl.load(DLSE + row, mask=offs_m < seqlen_q, other=0.0)
    tl.store(DELTA + row, delta, mask=offs_m < seqlen_q)
    # Converted once here, not in every (key block, query block) step of the dk/dv pass (TUNING.md).
    lse = tl.load(LSE + row, mask=offs_m < seqlen_q, other=0.0)
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(LSE_LOG2 + row, lse_log2, mask=offs_m < seqlen_q)


@triton.jit
def _load_row_stats(LSE_LOG2, DELTA, offs_m, seqlen_q):
    """lse in log2 units as the preprocess stored it (+inf where a row sees no key), +inf past seqlen_q
    too, so that p = 0 there; and delta."""
    lse = tl.load(LSE_LOG2 + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(DELTA + offs_m, mask=offs_m < seqlen_q, other=0.0)
    return lse, delta


@triton.jit
def _load_query_tile(
    view,
    head,
    start_m,
    col,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TMA: tl.constexpr,
):
    """:func:`_load_tile` of the query block at start_m, rows masked. Pointer loads move the block's
    first row into the base pointer, so that the per-row offsets are the same in every block (fewer
    instructions an iteration: TUNING.md)."""
    if TMA:
        tile = _load_tile(
            view,
            head=head,
            row=start_m,
            col=col,
            HEAD_DIM=HEAD_DIM,
            BLOCK_S=BLOCK_S,
            BLOCK_C=BLOCK_C,
            MASK_ROWS=True,
            TMA=TMA,
        )
    else:
        X, seq, strides, seqlen = view
        from_first_row = (X + tl.cast(start_m, tl.int64) * strides[1], seq, strides, seqlen - start_m)
        tile = _load_tile(
            from_first_row,
            head=head,
            row=0,
            col=col,
            HEAD_DIM=HEAD_DIM,
            BLOCK_S=BLOCK_S,
            BLOCK_C=BLOCK_C,
            MASK_ROWS=True,
            TMA=TMA,
        )
    return tile


@triton.jit
def _attn_bwd_dkdv_block(
    grads,
    keys,
    queries,
    start_m,
    unmasked_m,
    col,
    seqlens,
    window,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
    MASKED: tl.constexpr,
    LOCAL: tl.constexpr,
    TMA: tl.constexpr,
    INLINE_PTX: tl.constexpr,
    OUTPUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    documents=None,
):
    """grads (dk, dv) after the query block at start_m: keys is the key block's (k, v, offs_n), its
    tiles and its keys; queries (q_view, do_view, (LSE_LOG2, DELTA) at the head's first row, head).
    Works on the transposed scores (keys x queries) so dk and dv accumulate in (BLOCK_N, head-dim
    columns [col, + BLOCK_D_OUT)): all of them, or a slice, q and dO then read twice. OUTPUT: "dkdv"
    accumulates both, "dk" or "dv" one (the other is returned as it came). MASKED: the causal mask, or
    with LOCAL the window. SOFTCAP: as in the forward's block, ds times the softcap's derivative 1 -
    tanh². documents (None: off): document masking's (last_queries, all_seen_end), the key block's last
    queries (masks.py) and the end of the query blocks that see every key of it, past which, or before
    unmasked_m, a query block needs the mask."""
    dk, dv = grads
    k, v, offs_n = keys
    q_view, do_view, row_stats, h = queries
    LSE_LOG2, DELTA = row_stats
    seqlen_q, seqlen_k = seqlens
    window_left, window_right = window
    q = _load_query_tile(
        q_view, head=h, start_m=start_m, col=0, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D, TMA=TMA
    )
    do = _load_query_tile(
        do_view, head=h, start_m=start_m, col=0, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D, TMA=TMA
    )
    if BLOCK_D_OUT < BLOCK_D:
        tl.static_assert(not TMA, "a descriptor loads whole rows of the head dim")
        q_out = _load_query_tile(
            q_view,
            head=h,
            start_m=start_m,
            col=col,
            HEAD_DIM=HEAD_DIM,
            BLOCK_S=BLOCK_M,
            BLOCK_C=BLOCK_D_OUT,
            TMA=TMA,
        )
        do_out = _load_query_tile(
            do_view,
            head=h,
            start_m=start_m,
            col=col,
            HEAD_DIM=HEAD_DIM,
            BLOCK_S=BLOCK_M,
            BLOCK_C=BLOCK_D_OUT,
            TMA=TMA,
        )
    else:
        q_out = q
        do_out = do
    # lse in log2 units (+inf where a row sees no key: p = 0), addressed from the block's first row as
    # in _load_query_tile. Rows past seqlen_q load 0: q and dO load as zeros there, so p dO and ds q
    # vanish.
    rows = tl.arange(0, BLOCK_M)
    lse = tl.load(LSE_LOG2 + start_m + rows, mask=rows < seqlen_q - start_m, other=0.0)
    delta = tl.load(DELTA + start_m + rows, mask=rows < seqlen_q - start_m, other=0.0)
    qk_t = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M)
    if SOFTCAP is not None:
        qk_t, tanh_t = _softcapped_scores(qk_t, qk_scale, SOFTCAP=SOFTCAP)
    if MASKED and documents is not None:
        last_queries, all_seen_end = documents
        if (start_m < unmasked_m) | (start_m + BLOCK_M > all_seen_end):  # uniform, as the causal branch
            offs_m = start_m + tl.arange(0, BLOCK_M)
            qk_t = _document_scores_transposed(
                qk_t, offs_n=offs_n, offs_m=offs_m, last_queries=last_queries, fill=float("-inf")
            )
    elif MASKED and not LOCAL:  # causal; keys past seqlen_k are dropped by the store
        if start_m < unmasked_m:  # a uniform branch: only the query blocks crossing the diagonal
            qk_t = _causal_scores(
                qk_t,
                offs=offs_n,
                start=start_m,
                causal_offset=seqlen_k - seqlen_q,
                BLOCK=BLOCK_M,
                TRANSPOSED=True,
                INLINE_PTX=INLINE_PTX,
            )
    p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    if MASKED and LOCAL and OUTPUT == "dkdv":
        offs_m = start_m + tl.arange(0, BLOCK_M)
        visible = _in_window(
            q_pos=offs_m[None, :],
            k_pos=offs_n[:, None],
            causal_offset=seqlen_k - seqlen_q,
            window=window,
            LOCAL=LOCAL,
        )
        p_t = tl.where(visible, p_t, 0.0)
    elif MASKED and LOCAL:
        # Key i sees the block's queries [first_query, + window_left + window_right]: _in_window's test
        # moved to the key, a column index against a per-key bound as _causal_scores transposed: fewer
        # instructions and no spill for dv alone at head dim 256, a spill in the fused pass (TUNING.md).
        first_query = (offs_n - (seqlen_k - seqlen_q + start_m + window_right))[:, None]
        cols = tl.arange(0, BLOCK_M)[None, :]
        p_t = tl.where((cols >= first_query) & (cols <= first_query + (window_left + window_right)), p_t, 0.0)
    if OUTPUT != "dk":
        dv = tl.dot(p_t.to(do.dtype), do_out, dv)
    if OUTPUT != "dv":
        if OUTPUT == "dkdv":
            dp_t = tl.dot(v, tl.trans(do)) - delta[None, :]
        else:  # delta as the accumulator's start: dk alone spilled without (TUNING.md)
            dp_t = tl.dot(v, tl.trans(do), tl.zeros_like(p_t) - delta[None, :])
        ds_t = p_t * dp_t
        if SOFTCAP is not None:
            ds_t *= 1.0 - tanh_t * tanh_t
        dk = tl.dot(ds_t.to(q.dtype), q_out, dk)
    return dk, dv


@triton.jit
def _key_block_program(cu_seqlens, seqlens, kv_heads, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr):
    """The key block of a dk/dv program (axis 0 of its grid): (b, kv_h, start_n, q_seq, k_seq,
    (seqlen_q, seqlen_k)), its batch entry, kv head and first key, and its sequences as _sequence
    gives them. With VARLEN, start_n may lie past its sequence: the program has nothing to do."""
    seqlen_q, seqlen_k = seqlens
    n_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    start_n = tl.program_id(0) % n_blocks * BLOCK_N
    batch_kv_head = tl.program_id(0) // n_blocks
    b = batch_kv_head // kv_heads
    kv_h = batch_kv_head % kv_heads
    q_seq, seqlen_q = _sequence(cu_seqlens[0], b=b, seqlen=seqlen_q, VARLEN=VARLEN)
    k_seq, seqlen_k = _sequence(cu_seqlens[1], b=b, seqlen=seqlen_k, VARLEN=VARLEN)
    return b, kv_h, start_n, q_seq, k_seq, (seqlen_q, seqlen_k)


@triton.jit
def _query_range(
    start_n,
    seqlens,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
):
    """(lo, hi, unmasked_m) of the key block at start_n: the query blocks from lo to hi see some of its
    keys (queries before the first that sees key start_n, causal or local, and after the last, local,
    contribute nothing); causal, those from unmasked_m on see every key of it (none crosses the
    diagonal)."""
    seqlen_q, seqlen_k = seqlens
    window_left, window_right = window
    causal_offset = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_q
    if LOCAL:
        lo = tl.maximum(start_n - causal_offset - window_right, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(start_n + BLOCK_N - causal_offset + window_left, seqlen_q)
    elif CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
    unmasked_m = tl.cdiv(start_n + BLOCK_N - 1 - causal_offset, BLOCK_M) * BLOCK_M
    return lo, hi, unmasked_m


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,  # as in the forward; DO like Q
    row_stats,  # (LSE_LOG2, DELTA): (batch, heads, seqlen_q) float32, from _attn_bwd_preprocess_kernel
    DK,
    DV,  # like K, V, or float32 partials of head_splits such stacked on the batch (rows, packed) axis
    cu_seqlens,  # as in _attn_fwd_kernel; Q, K, V, DO, DK, DV are TMA descriptors with TMA (padded)
    softmax_scale,
    seqlens,
    mask,  # as in _attn_fwd_kernel
    layout,  # (sizes, strides): sizes (heads, kv_heads, group_size, heads_per_split, split_seqs), with
    # head splits a program takes heads_per_split query heads of its group (else group_size), its
    # partials split_seqs rows (batch; packed: total keys) after the previous split's; strides (q, k, v,
    # do, dk, dv, lse), as in _attn_fwd_kernel; LSE_LOG2 and DELTA share lse's
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,
    score_mods,  # (SOFTCAP, LAST_QUERIES): SOFTCAP as in _attn_fwd_kernel; LAST_QUERIES None, or with
    # MASK "causal" (batch, seqlen) int32: key j's last query (document masking)
):
    # grid = (cdiv(seqlen_k, BLOCK_N) * batch * kv_heads, head_splits * BLOCK_D // BLOCK_D_OUT): one
    # key block, query heads [split * heads_per_split, + heads_per_split) of its group, dk and dv
    # columns [column * BLOCK_D_OUT, + BLOCK_D_OUT) (AttnConfig.column_splits). Batch x heads goes on
    # axis 0 (2**31 - 1 programs; 65,535 on axis 1), a (batch, head)'s key blocks side by side, so the
    # programs running together share its queries in L2. With head splits (GQA/MQA grids too small for
    # the GPU), each split writes its partial dk and dv to its own slice of DK and DV (seq), summed
    # afterwards in a fixed order: no atomics. dk or dv alone: _attn_bwd_dkdv_split_outputs_kernel.
    MASK: tl.constexpr = mask[0]
    window = mask[1]
    INLINE_PTX: tl.constexpr = mask[2]
    sizes, strides = layout
    SOFTCAP: tl.constexpr = score_mods[0]
    LAST_QUERIES = score_mods[1]
    CAUSAL: tl.constexpr = MASK == "causal"
    LOCAL: tl.constexpr = MASK == "local"
    LSE_LOG2, DELTA = row_stats
    heads, kv_heads, group_size, heads_per_split, split_seqs = sizes
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, lse_strides = strides
    b, kv_h, start_n, q_seq, k_seq, seqlens = _key_block_program(
        cu_seqlens, seqlens=seqlens, kv_heads=kv_heads, BLOCK_N=BLOCK_N, VARLEN=VARLEN
    )
    seqlen_q, seqlen_k = seqlens
    if VARLEN and start_n >= seqlen_k:  # the grid covers the longest sequence
        return
    columns = BLOCK_D // BLOCK_D_OUT
    col = tl.program_id(1) % columns * BLOCK_D_OUT
    split = tl.program_id(1) // columns
    q_view = (Q, q_seq, q_strides, seqlen_q)
    do_view = (DO, q_seq, do_strides, seqlen_q)
    if VARLEN and TMA:
        # Views of this sequence's rows alone, as in the forward; DK's and DV's of its rows in this
        # split's slice, built here: after the loop they spilled (TUNING.md).
        q_view = _sequence_view(q_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
        do_view = _sequence_view(do_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
        out_seq = k_seq + split * split_seqs
        dk_view = _sequence_view(
            (DK, out_seq, dk_strides, seqlen_k),
            heads=kv_heads,
            HEAD_DIM=HEAD_DIM,
            BLOCK_S=BLOCK_N,
            BLOCK_C=BLOCK_D,
        )
        dv_view = _sequence_view(
            (DV, out_seq, dv_strides, seqlen_k),
            heads=kv_heads,
            HEAD_DIM=HEAD_DIM,
            BLOCK_S=BLOCK_N,
            BLOCK_C=BLOCK_D,
        )
    first_head = split * heads_per_split
    last_head = tl.minimum(first_head + heads_per_split, group_size)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_view = (K, k_seq, k_strides, seqlen_k)
    v_view = (V, k_seq, v_strides, seqlen_k)
    if VARLEN and TMA:
        k_view = _sequence_view(k_view, heads=kv_heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_N, BLOCK_C=BLOCK_D)
        v_view = _sequence_view(v_view, heads=kv_heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_N, BLOCK_C=BLOCK_D)
    k = _load_tile(
        k_view,
        head=kv_h,
        row=start_n,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=True,
        TMA=TMA,
    )
    v = _load_tile(
        v_view,
        head=kv_h,
        row=start_n,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=True,
        TMA=TMA,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D_OUT], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D_OUT], dtype=tl.float32)
    qk_scale = softmax_scale * 1.4426950408889634
    # Causal: one loop, the mask behind a uniform branch taken by the query blocks before unmasked_m
    # (those crossing the diagonal); two loops (masked, unmasked) spilled (TUNING.md).
    lo, hi, unmasked_m = _query_range(
        start_n, seqlens=seqlens, window=window, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, LOCAL=LOCAL
    )
    documents = None
    if LAST_QUERIES is not None:
        # Document masking: the queries from the block's first key to its last key's last query; those
        # before the first key's last query see every key of the block from unmasked_m on (masks.py).
        last_queries = tl.load(
            LAST_QUERIES + b.to(tl.int64) * seqlen_k + offs_n, mask=offs_n < seqlen_k, other=seqlen_q - 1
        )
        hi = tl.minimum(tl.max(last_queries) + 1, seqlen_q)
        documents = (last_queries, tl.min(last_queries) + 1)
    for g in range(first_head, last_head):
        h = kv_h * group_size + g
        row0 = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1]
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _attn_bwd_dkdv_block(
                grads=(dk, dv),
                keys=(k, v, offs_n),
                queries=(q_view, do_view, (LSE_LOG2 + row0, DELTA + row0), h),
                start_m=start_m,
                unmasked_m=unmasked_m,
                col=col,
                seqlens=seqlens,
                window=window,
                qk_scale=qk_scale,
                HEAD_DIM=HEAD_DIM,
                BLOCK_M=BLOCK_M,
                BLOCK_D=BLOCK_D,
                BLOCK_D_OUT=BLOCK_D_OUT,
                MASKED=CAUSAL or LOCAL,
                LOCAL=LOCAL,
                TMA=TMA,
                INLINE_PTX=INLINE_PTX,
                OUTPUT="dkdv",
                SOFTCAP=SOFTCAP,
                documents=documents,
            )
    seq = k_seq + split * split_seqs  # with head splits, the first row of this split's float32 partials
    if not (VARLEN and TMA):  # (with both, views of DK's and DV's descriptors of those rows, above)
        dk_view = (DK, seq, dk_strides, seqlen_k)
        dv_view = (DV, seq, dv_strides, seqlen_k)
    dk *= softmax_scale
    _store_tile(
        dk_view,
        dk,
        head=kv_h,
        row=start_n,
        col=col,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D_OUT,
        TMA=TMA,
    )
    _store_tile(
        dv_view,
        dv,
        head=kv_h,
        row=start_n,
        col=col,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D_OUT,
        TMA=TMA,
    )


@triton.jit
def _output_view(outputs, seq, strides, seqlen_k, OUTPUT: tl.constexpr):
    """The view (tiles.py) of the sequence at row seq of DK or DV (outputs), by OUTPUT."""
    DK, DV = outputs
    dk_strides, dv_strides = strides
    if OUTPUT == "dk":
        view = (DK, seq, dk_strides, seqlen_k)
    else:
        view = (DV, seq, dv_strides, seqlen_k)
    return view


@triton.jit
def _attn_bwd_dkdv_split_outputs_kernel(
    Q,
    K,
    V,
    DO,
    row_stats,
    DK,
    DV,  # as in _attn_bwd_dkdv_kernel; K and V by pointers, DK or DV unwritten (OUTPUT)
    cu_seqlens,
    softmax_scale,
    seqlens,
    mask,
    layout,  # as in _attn_bwd_dkdv_kernel
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,
    OUTPUT: tl.constexpr,  # "dk" or "dv"
):
    # grid = (cdiv(seqlen_k, BLOCK_N) * batch * kv_heads, head_splits): _attn_bwd_dkdv_kernel's program
    # with one accumulator, dk's or dv's (AttnConfig.split_outputs: a launch each, the scores computed in
    # both), whole rows of the head dim. K and V come by pointers, which feeds wgmma from shared memory
    # (TUNING.md); dv alone never reads V.
    MASK: tl.constexpr = mask[0]
    window = mask[1]
    INLINE_PTX: tl.constexpr = mask[2]
    sizes, strides = layout
    CAUSAL: tl.constexpr = MASK == "causal"
    LOCAL: tl.constexpr = MASK == "local"
    LSE_LOG2, DELTA = row_stats
    window_left, window_right = window
    heads, kv_heads, group_size, heads_per_split, split_seqs = sizes
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, lse_strides = strides
    b, kv_h, start_n, q_seq, k_seq, seqlens = _key_block_program(
        cu_seqlens, seqlens=seqlens, kv_heads=kv_heads, BLOCK_N=BLOCK_N, VARLEN=VARLEN
    )
    seqlen_q, seqlen_k = seqlens
    if VARLEN and start_n >= seqlen_k:  # the grid covers the longest sequence
        return
    split = tl.program_id(1)
    q_view = (Q, q_seq, q_strides, seqlen_q)
    do_view = (DO, q_seq, do_strides, seqlen_q)
    if VARLEN and TMA:  # as in _attn_bwd_dkdv_kernel, the output's view built before the loop
        q_view = _sequence_view(q_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
        do_view = _sequence_view(do_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
        out_view = _output_view(
            (DK, DV),
            seq=k_seq + split * split_seqs,
            strides=(dk_strides, dv_strides),
            seqlen_k=seqlen_k,
            OUTPUT=OUTPUT,
        )
        out_view = _sequence_view(
            out_view, heads=kv_heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_N, BLOCK_C=BLOCK_D
        )
    first_head = split * heads_per_split
    last_head = tl.minimum(first_head + heads_per_split, group_size)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(
        (K, k_seq, k_strides, seqlen_k),
        head=kv_h,
        row=start_n,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=True,
        TMA=False,
    )
    v = k  # unread by dv
    if OUTPUT == "dk":
        v = _load_tile(
            (V, k_seq, v_strides, seqlen_k),
            head=kv_h,
            row=start_n,
            col=0,
            HEAD_DIM=HEAD_DIM,
            BLOCK_S=BLOCK_N,
            BLOCK_C=BLOCK_D,
            MASK_ROWS=True,
            TMA=False,
        )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    qk_scale = softmax_scale * 1.4426950408889634
    # A packed batch's causal dk launch by TMA runs as the window (-1, 0), the causal mask itself: its
    # causal build spilled (TUNING.md).
    WINDOW: tl.constexpr = LOCAL or (CAUSAL and VARLEN and TMA and OUTPUT == "dk")
    if WINDOW and not LOCAL:
        window_left = seqlen_q + seqlen_k  # reaches past every key, as _mask's unbounded side
        window_right = 0
    lo, hi, unmasked_m = _query_range(
        start_n,
        seqlens=seqlens,
        window=(window_left, window_right),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        CAUSAL=CAUSAL,
        LOCAL=WINDOW,
    )
    for g in range(first_head, last_head):
        h = kv_h * group_size + g
        row0 = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1]
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _attn_bwd_dkdv_block(
                grads=(dk, dv),
                keys=(k, v, offs_n),
                queries=(q_view, do_view, (LSE_LOG2 + row0, DELTA + row0), h),
                start_m=start_m,
                unmasked_m=unmasked_m,
                col=0,
                seqlens=seqlens,
                window=(window_left, window_right),
                qk_scale=qk_scale,
                HEAD_DIM=HEAD_DIM,
                BLOCK_M=BLOCK_M,
                BLOCK_D=BLOCK_D,
                BLOCK_D_OUT=BLOCK_D,
                MASKED=CAUSAL or LOCAL,
                LOCAL=WINDOW,
                TMA=TMA,
                INLINE_PTX=INLINE_PTX,
                OUTPUT=OUTPUT,
                SOFTCAP=None,  # never with the softcap: AttnConfig.scored takes a fused tile then
            )
    if not (VARLEN and TMA):  # with head splits, from the first row of this split's float32 partials
        out_view = _output_view(
            (DK, DV),
            seq=k_seq + split * split_seqs,
            strides=(dk_strides, dv_strides),
            seqlen_k=seqlen_k,
            OUTPUT=OUTPUT,
        )
    if OUTPUT == "dk":
        grad = dk * softmax_scale
    else:
        grad = dv
    _store_tile(
        out_view,
        grad,
        head=kv_h,
        row=start_n,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D,
        TMA=TMA,
    )


@triton.jit
def _attn_bwd_dq_block(
    dq,
    queries,
    kv,
    kv_h,
    offs_m,
    start_n,
    seqlens,
    window,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    TMA: tl.constexpr,
    INLINE_PTX: tl.constexpr,
    SOFTCAP: tl.constexpr,
    first_keys=None,
):
    """dq after the key block at start_n (kv, K's and V's views, read in head kv_h): queries is the
    query block's (q, do, lse, delta), lse in log2 units; MASKED, SOFTCAP and first_keys as in the
    forward's block."""
    q, do, lse, delta = queries
    k_view, v_view = kv
    seqlen_q, seqlen_k = seqlens
    k = _load_tile(
        k_view,
        head=kv_h,
        row=start_n,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=MASKED,
        TMA=TMA,
    )
    v = _load_tile(
        v_view,
        head=kv_h,
        row=start_n,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_N,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=MASKED,
        TMA=TMA,
    )
    qk = tl.dot(q, tl.trans(k))
    if SOFTCAP is not None:
        qk, tanh = _softcapped_scores(qk, qk_scale, SOFTCAP=SOFTCAP)
    if MASKED and first_keys is not None:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        qk = _document_scores(qk, offs_m=offs_m, offs_n=offs_n, first_keys=first_keys, fill=float("-inf"))
    elif MASKED and CAUSAL:
        qk = _causal_scores(
            qk,
            offs=offs_m,
            start=start_n,
            causal_offset=seqlen_k - seqlen_q,
            BLOCK=BLOCK_N,
            TRANSPOSED=False,
            INLINE_PTX=INLINE_PTX,
        )
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASKED and not CAUSAL:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = _visible(
            offs_m=offs_m,
            offs_n=offs_n,
            seqlen_k=seqlen_k,
            causal_offset=seqlen_k - seqlen_q,
            window=window,
            CAUSAL=CAUSAL,
            LOCAL=LOCAL,
        )
        p = tl.where(visible, p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    if SOFTCAP is not None:
        ds *= 1.0 - tanh * tanh
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    row_stats,  # (LSE_LOG2, DELTA): as in _attn_bwd_dkdv_kernel
    DQ,  # like Q; Q, K, V, DO, DQ are TMA descriptors with TMA (padded)
    cu_seqlens,  # as in _attn_fwd_kernel
    softmax_scale,
    seqlens,
    mask,  # as in _attn_fwd_kernel
    layout,  # (sizes, strides): sizes (heads, group_size); strides (q, k, v, do, dq, lse), as in
    # _attn_fwd_kernel; DELTA shares lse's
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,
    score_mods,  # (SOFTCAP, FIRST_KEYS), as in _attn_fwd_kernel
):
    # grid = (cdiv(seqlen_q, BLOCK_M) * batch * heads,): as the preprocess, batch x heads on axis 0.
    MASK: tl.constexpr = mask[0]
    window = mask[1]
    INLINE_PTX: tl.constexpr = mask[2]
    sizes, strides = layout
    SOFTCAP: tl.constexpr = score_mods[0]
    FIRST_KEYS = score_mods[1]
    CAUSAL: tl.constexpr = MASK == "causal"
    LOCAL: tl.constexpr = MASK == "local"
    LSE_LOG2, DELTA = row_stats
    seqlen_q, seqlen_k = seqlens
    heads, group_size = sizes
    q_strides, k_strides, v_strides, do_strides, dq_strides, lse_strides = strides
    m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    m_block = tl.program_id(0) % m_blocks
    if CAUSAL:  # the longest query blocks first, as in the forward
        m_block = m_blocks - 1 - m_block
    start_m = m_block * BLOCK_M
    batch_head = tl.program_id(0) // m_blocks
    b = batch_head // heads
    h = batch_head % heads
    kv_h = h // group_size
    q_seq, seqlen_q = _sequence(cu_seqlens[0], b=b, seqlen=seqlen_q, VARLEN=VARLEN)
    k_seq, seqlen_k = _sequence(cu_seqlens[1], b=b, seqlen=seqlen_k, VARLEN=VARLEN)
    if VARLEN and start_m >= seqlen_q:  # the grid covers the longest sequence
        return
    q_view = (Q, q_seq, q_strides, seqlen_q)
    do_view = (DO, q_seq, do_strides, seqlen_q)
    dq_view = (DQ, q_seq, dq_strides, seqlen_q)
    k_view = (K, k_seq, k_strides, seqlen_k)
    v_view = (V, k_seq, v_strides, seqlen_k)
    if VARLEN and TMA:  # views of this sequence's rows alone, as in the forward
        q_view = _sequence_view(q_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
        do_view = _sequence_view(do_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
        kv_heads = heads // group_size
        k_view = _sequence_view(k_view, heads=kv_heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_N, BLOCK_C=BLOCK_D)
        v_view = _sequence_view(v_view, heads=kv_heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_N, BLOCK_C=BLOCK_D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(
        q_view,
        head=h,
        row=start_m,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_M,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=True,
        TMA=TMA,
    )
    do = _load_tile(
        do_view,
        head=h,
        row=start_m,
        col=0,
        HEAD_DIM=HEAD_DIM,
        BLOCK_S=BLOCK_M,
        BLOCK_C=BLOCK_D,
        MASK_ROWS=True,
        TMA=TMA,
    )
    row0 = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1]
    lse, delta = _load_row_stats(
        LSE_LOG2=LSE_LOG2 + row0, DELTA=DELTA + row0, offs_m=offs_m, seqlen_q=seqlen_q
    )
    qk_scale = softmax_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seqlens = (seqlen_q, seqlen_k)
    first_keys = None
    tile_first_keys = None
    if FIRST_KEYS is not None:  # document masking, as in the forward
        first_keys, tile_first_keys = _document_first_keys(
            FIRST_KEYS, b=b, start_m=start_m, offs_m=offs_m, seqlen_q=seqlen_q, BLOCK_M=BLOCK_M
        )
    TWO_SIDED: tl.constexpr = LOCAL or FIRST_KEYS is not None
    keys = _key_range(
        start_m,
        seqlens=seqlens,
        window=window,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        CAUSAL=CAUSAL,
        LOCAL=LOCAL,
        first_keys=tile_first_keys,
    )
    for masked in tl.static_range(2):  # the unmasked key blocks, then the masked ones, as in the forward
        lo, hi, step, blocks = _key_loop(keys, masked=masked, BLOCK_N=BLOCK_N, LOCAL=TWO_SIDED)
        for n in range(lo, hi, step):
            start_n = _masked_key_block(n, blocks=blocks, BLOCK_N=BLOCK_N) if masked and TWO_SIDED else n
            dq = _attn_bwd_dq_block(
                dq=dq,
                queries=(q, do, lse, delta),
                kv=(k_view, v_view),
                kv_h=kv_h,
                offs_m=offs_m,
                start_n=start_n,
                seqlens=seqlens,
                window=window,
                qk_scale=qk_scale,
                HEAD_DIM=HEAD_DIM,
                BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D,
                MASKED=masked,
                CAUSAL=CAUSAL,
                LOCAL=LOCAL,
                TMA=TMA,
                INLINE_PTX=INLINE_PTX,
                SOFTCAP=SOFTCAP,
                first_keys=first_keys,
            )
    dq *= softmax_scale
    if VARLEN and TMA:
        dq_view = _sequence_view(dq_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
    _store_tile(
        dq_view, dq, head=h, row=start_m, col=0, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D, TMA=TMA
    )
