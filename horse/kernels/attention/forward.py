"""The forward pass: a program per BLOCK_M queries of one (batch, head), an online softmax over
the key blocks that the mask leaves visible, out and lse stored once.

The kernel's arguments come in groups, as :func:`horse.kernels.attention.launch.fwd_plan` names
them: ``cu_seqlens`` (CU_SEQLENS_Q, CU_SEQLENS_K), ``seqlens`` (seqlen_q, seqlen_k), ``mask`` (MASK,
window (left, right), INLINE_PTX), ``layout`` (sizes (batch, heads, group_size), strides (q, k, v, o,
lse strides)) and ``score_mods`` (SOFTCAP, SINKS, FIRST_KEYS); the tensors the launch may pass as TMA
descriptors stay arguments of their own (Triton 3.6 launches no descriptor inside a tuple). The device
helpers take views of the tensors (``tiles.py``) and are called by keyword.
"""

import triton
import triton.language as tl

from horse.kernels.attention.masks import (
    _causal_scores,
    _document_first_keys,
    _document_scores,
    _key_loop,
    _key_range,
    _masked_key_block,
    _visible,
)
from horse.kernels.attention.scores import _softcapped_scores
from horse.kernels.attention.tiles import _load_tile, _sequence, _sequence_view, _store_tile


@triton.jit
def _attn_fwd_block(
    acc,
    l_i,
    m_i,
    queries,
    start_n,
    kv,
    kv_h,
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
    """The online softmax's step over the key block at start_n: acc, l_i and m_i (the output's
    unnormalized rows, their sums and their running maxima, in log2 units) after it. queries is (q,
    offs_m): q (BLOCK_M, BLOCK_D) holds the queries offs_m; kv is (K's view, V's view), read in head
    kv_h; MASKED, a block that may cross the mask's edges or seqlen_k; SOFTCAP (None: off) softcaps the
    scores first; first_keys (None: off), the queries' first keys under document masking (masks.py)."""
    q, offs_m = queries
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
    qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N) raw scores
    if SOFTCAP is not None:  # before the mask: tanh(-inf) would unmask a hidden score
        qk = _softcapped_scores(qk, qk_scale, SOFTCAP=SOFTCAP)[0]
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
    elif MASKED:
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
        qk = tl.where(visible, qk, float("-inf"))
    # The row max of the raw scores, scaled per row (qk_scale > 0 keeps it the max): the scale then
    # rides in the exponent's FFMA, qk * qk_scale - m, not in an FMUL per score (TUNING.md).
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    m_safe = m_new
    if MASKED:  # a row that has seen no visible key yet keeps m = -inf: subtract 0 there, not -inf (NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
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
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_kernel(
    Q,  # (batch, seqlen_q, heads, head_dim)
    K,  # (batch, seqlen_k, kv_heads, head_dim)
    V,  # (batch, seqlen_k, kv_heads, head_dim)
    OUT,  # (batch, seqlen_q, heads, head_dim); Q, K, V, OUT are TMA descriptors with TMA (padded)
    LSE,  # (batch, heads, seqlen_q) float32, natural log
    cu_seqlens,  # (CU_SEQLENS_Q, CU_SEQLENS_K), with VARLEN: (batch + 1,) int32 sequence starts in Q; K
    softmax_scale,
    seqlens,  # (seqlen_q, seqlen_k); with VARLEN the longest sequences'
    mask,  # (MASK, window, INLINE_PTX): MASK "full", "causal" or "local"; window (left, right), with
    # "local": query i sees keys i + seqlen_k - seqlen_q - left ... + right; INLINE_PTX, an NVIDIA
    # target: the causal mask as PTX (see _causal_scores)
    layout,  # (sizes, strides): sizes (batch, heads, group_size), group_size query heads sharing a kv
    # head; strides (q, k, v, o, lse), the (batch, seqlen, heads) strides of Q, K, V, OUT, as _strides
    # gives them, and (batch, heads) of LSE; packed, (1, head stride): a sequence by its first row
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    VARLEN: tl.constexpr,
    score_mods,  # (SOFTCAP, SINKS, FIRST_KEYS), each None (off) or: SOFTCAP c > 0, the scaled scores
    # are c tanh(scores / c); SINKS (heads,) float32, each head's sink logit, in every row's softmax
    # denominator; FIRST_KEYS, with MASK "causal", (batch, seqlen) int32: query i's first key
    # (document masking)
):
    # grid = (cdiv(seqlen_q, BLOCK_M) * batch * heads,): a program per tile, BLOCK_M queries of one
    # (batch, head). Tiles go head-major, so the programs running together share their head's k and v
    # in L2; causal ones go longest query block first, so the last tiles to run are the short ones.
    # A tuple's constexpr element stays a constexpr only by an annotated assignment: unpacked with the
    # others, Triton would make it a tensor.
    MASK: tl.constexpr = mask[0]
    window = mask[1]
    INLINE_PTX: tl.constexpr = mask[2]
    sizes, strides = layout
    SOFTCAP: tl.constexpr = score_mods[0]
    SINKS = score_mods[1]
    FIRST_KEYS = score_mods[2]
    CAUSAL: tl.constexpr = MASK == "causal"
    LOCAL: tl.constexpr = MASK == "local"
    m_blocks = tl.cdiv(seqlens[0], BLOCK_M)
    qk_scale = softmax_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    tile = tl.program_id(0)
    _, heads, group_size = sizes
    q_strides, k_strides, v_strides, o_strides, lse_strides = strides
    batch_head = tile // m_blocks
    m_block = tile % m_blocks
    if CAUSAL:
        m_block = m_blocks - 1 - m_block
    start_m = m_block * BLOCK_M
    b = batch_head // heads
    h = batch_head % heads
    kv_h = h // group_size
    q_seq, seqlen_q = _sequence(cu_seqlens[0], b=b, seqlen=seqlens[0], VARLEN=VARLEN)
    k_seq, seqlen_k = _sequence(cu_seqlens[1], b=b, seqlen=seqlens[1], VARLEN=VARLEN)
    q_view = (Q, q_seq, q_strides, seqlen_q)
    o_view = (OUT, q_seq, o_strides, seqlen_q)
    k_view = (K, k_seq, k_strides, seqlen_k)
    v_view = (V, k_seq, v_strides, seqlen_k)
    if VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
        if TMA:  # views of this sequence's rows alone (_sequence_view): no tile reaches the next
            q_view = _sequence_view(q_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
            o_view = _sequence_view(o_view, heads=heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D)
            kv_heads = heads // group_size
            k_view = _sequence_view(
                k_view, heads=kv_heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_N, BLOCK_C=BLOCK_D
            )
            v_view = _sequence_view(
                v_view, heads=kv_heads, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_N, BLOCK_C=BLOCK_D
            )
    seqlens = (seqlen_q, seqlen_k)
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
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SINKS is not None:  # the sink: a key every row sees, of score sink and value 0, seen first
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + h) * 1.4426950408889634
        l_i += 1.0
    first_keys = None
    tile_first_keys = None
    if FIRST_KEYS is not None:  # document masking: each query's first key, and the tile's edges
        first_keys, tile_first_keys = _document_first_keys(
            FIRST_KEYS, b=b, start_m=start_m, offs_m=offs_m, seqlen_q=seqlen_q, BLOCK_M=BLOCK_M
        )
    # Masked key blocks on both sides of the unmasked ones: a window's, or the documents' (masks.py).
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
    # The unmasked key blocks, then the masked ones: masked is a constexpr, so each is a compiled loop of
    # its own, and the block's mask code is compiled into the second alone.
    for masked in tl.static_range(2):
        lo, hi, step, blocks = _key_loop(keys, masked=masked, BLOCK_N=BLOCK_N, LOCAL=TWO_SIDED)
        for n in range(lo, hi, step):
            start_n = _masked_key_block(n, blocks=blocks, BLOCK_N=BLOCK_N) if masked and TWO_SIDED else n
            acc, l_i, m_i = _attn_fwd_block(
                acc=acc,
                l_i=l_i,
                m_i=m_i,
                queries=(q, offs_m),
                start_n=start_n,
                kv=(k_view, v_view),
                kv_h=kv_h,
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
    # A query that sees no key: l = 0, so the output is 0 and lse = log 0 = -inf.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    _store_tile(
        o_view, out, head=h, row=start_m, col=0, HEAD_DIM=HEAD_DIM, BLOCK_S=BLOCK_M, BLOCK_C=BLOCK_D, TMA=TMA
    )
    if VARLEN:
        lse_row = q_seq.to(tl.int64) * lse_strides[0] + h.to(tl.int64) * lse_strides[1]
    else:  # the same offset, in fewer registers: the strided sum spilled at head dim 128 on triton 3.9
        lse_row = batch_head.to(tl.int64) * seqlen_q
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < seqlen_q)
