"""The forward pass: a program per BLOCK_M queries of one (batch, head), an online softmax over
the key blocks that the mask leaves visible, out and lse stored once.
"""

import triton
import triton.language as tl

from horse.kernels.attention.masks import _causal_scores, _key_loop, _key_range, _masked_key_block, _visible
from horse.kernels.attention.tiles import _load_tile, _sequence, _sequence_descriptor, _store_tile


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
