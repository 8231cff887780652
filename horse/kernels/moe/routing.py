"""The routing kernels: the stable counting sort of the routed (token, k) pairs by expert, and the
combine that sums each token's top_k rows back in token order.
"""

import triton
import triton.language as tl


@triton.jit
def _count_sort_kernel(
    EXPERT_IDS,  # (pairs,) int: pair p = token * top_k + k routed to expert EXPERT_IDS[p]
    OFFSETS,  # (experts + 1,) int32: expert e's rows are OFFSETS[e] .. OFFSETS[e + 1] of the sorted order
    SORTED_PAIRS,  # (pairs,) int32: the pair at each sorted row (rows past OFFSETS[experts] unwritten)
    PAIR_ROWS,  # (pairs,) int32: each pair's sorted row; -1 for an id outside [0, experts) (dropped)
    pairs,
    experts,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,  # experts rounded up to a power of two
):
    # grid = (1,): one program reads the ids twice, block by block in pair order, so the sort is
    # stable and the same on every run. Pass one counts each expert's pairs; pass two gives each pair
    # its expert's next free row (a block's pairs of one expert take rows in pair order: the exclusive
    # prefix sum of the block's one-hot matrix).
    offs_e = tl.arange(0, BLOCK_EXPERTS)
    counts = tl.zeros((BLOCK_EXPERTS,), dtype=tl.int32)
    for start in range(0, pairs, BLOCK_PAIRS):
        offs_p = start + tl.arange(0, BLOCK_PAIRS)
        ids = tl.load(EXPERT_IDS + offs_p, mask=offs_p < pairs, other=-1)
        one_hot = (ids[:, None] == offs_e[None, :]).to(tl.int32)
        counts += tl.sum(one_hot, axis=0)
    ends = tl.cumsum(counts, axis=0)
    tl.store(OFFSETS + 1 + offs_e, ends, mask=offs_e < experts)
    tl.store(OFFSETS + offs_e, tl.zeros_like(offs_e), mask=offs_e == 0)
    next_row = ends - counts
    for start in range(0, pairs, BLOCK_PAIRS):
        offs_p = start + tl.arange(0, BLOCK_PAIRS)
        ids = tl.load(EXPERT_IDS + offs_p, mask=offs_p < pairs, other=-1)
        one_hot = (ids[:, None] == offs_e[None, :]).to(tl.int32)
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # this block's earlier pairs of the same expert
        row = tl.sum(one_hot * (next_row[None, :] + earlier), axis=1)
        routed = (ids >= 0) & (ids < experts)
        tl.store(SORTED_PAIRS + row, offs_p, mask=routed & (offs_p < pairs))
        tl.store(PAIR_ROWS + offs_p, tl.where(routed, row, -1), mask=offs_p < pairs)
        next_row += tl.sum(one_hot, axis=0)


@triton.jit
def _combine_kernel(
    ROWS,  # (pairs, N) contiguous, in sorted order: each routed pair's output row
    PAIR_ROWS,  # (tokens * top_k,) int32: each pair's sorted row, -1 for a dropped pair
    OUT,  # (tokens, N) contiguous: Σ_k ROWS[PAIR_ROWS[token * top_k + k]]
    N,
    top_k,
    BLOCK_N: tl.constexpr,
):
    # grid = (tokens, cdiv(N, BLOCK_N)): each token's top_k rows summed in float32 in k order, the
    # same sum on every run (no atomics).
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, top_k):
        row = tl.load(PAIR_ROWS + token * top_k + k).to(tl.int64)
        acc += tl.load(ROWS + row * N + offs_n, mask=(offs_n < N) & (row >= 0), other=0.0).to(tl.float32)
    tl.store(OUT + token * N + offs_n, acc.to(OUT.dtype.element_ty), mask=offs_n < N)
