"""Decoding against a KV cache: a few new queries (a GQA group's heads packed into one tile) against
the cache's keys, split among programs, and a second pass that reduces the splits' partial outputs.
"""

import triton
import triton.language as tl

from horse.kernels.attention.forward import _attn_fwd_block


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
    window,  # (left, right), with LOCAL, as in _attn_fwd_kernel
    sizes,  # (kv_heads, group_size)
    strides,  # (q, k, v), as in _attn_fwd_kernel
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,  # "full", "causal" or "local"
    INLINE_PTX: tl.constexpr,
    SOFTCAP: tl.constexpr,  # as in _attn_fwd_kernel (the sinks join in the reduce)
):
    # grid = (batch * kv_heads, splits, cdiv(group_size * seqlen_q, BLOCK_M)): keys
    # [split * keys_per_split, + keys_per_split) of one sequence against BLOCK_M rows of its query
    # heads sharing kv head kv_h, row r being query r % seqlen_q of head kv_h * group_size + r //
    # seqlen_q: a GQA group's heads fill the tile that one decoded token would leave 1/16 full.
    CAUSAL: tl.constexpr = MASK == "causal"
    LOCAL: tl.constexpr = MASK == "local"
    window_left, _ = window
    kv_heads, group_size = sizes
    q_strides, k_strides, v_strides = strides
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
    k_view = (K, b, k_strides, seqlen_k)
    v_view = (V, b, v_strides, seqlen_k)
    # The forward's block with the rows' positions as query indices (and seqlen_q = seqlen_k: the
    # diagonal offset is 0); every block masked: the pass is bound by reading the cache.
    for start_n in range(start, end, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_block(
            acc=acc,
            l_i=l_i,
            m_i=m_i,
            queries=(q, positions),
            start_n=start_n,
            kv=(k_view, v_view),
            kv_h=kv_h,
            seqlens=(seqlen_k, seqlen_k),
            window=window,
            qk_scale=qk_scale,
            HEAD_DIM=HEAD_DIM,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
            MASKED=True,
            CAUSAL=CAUSAL,
            LOCAL=LOCAL,
            TMA=False,
            INLINE_PTX=INLINE_PTX,
            SOFTCAP=SOFTCAP,
        )
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
    SINKS,  # None, or (heads,) float32 as in _attn_fwd_kernel: a split of its own, of output 0
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
    if SINKS is not None:
        sink = tl.load(SINKS + (row // seqlen_q) % heads)
        m_max = tl.maximum(m_max, sink)
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
    denominator = tl.sum(total, axis=0)
    if SINKS is not None:
        denominator += tl.math.exp(sink - m_max)
    out = acc / tl.maximum(denominator, 1e-30)
    i = row % seqlen_q
    bh = (row // seqlen_q).to(tl.int64)
    base = OUT + (bh // heads) * o_strides[0] + i.to(tl.int64) * o_strides[1] + (bh % heads) * o_strides[2]
    tl.store(base + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
