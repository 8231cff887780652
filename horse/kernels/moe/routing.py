"""The routing kernels: the stable counting sort of the routed (token, k) pairs by expert (a count
pass and a place pass over blocks of pairs, the blocks' rows between them by a prefix sum on the
device), and the combine that sums each token's top_k rows back in token order.
"""

import triton
import triton.language as tl


@triton.jit
def _one_hot_block(EXPERT_IDS, pairs, BLOCK_PAIRS: tl.constexpr, BLOCK_EXPERTS: tl.constexpr):
    """(pair indices, ids, one-hot (BLOCK_PAIRS, BLOCK_EXPERTS) int32) of this program's block of pairs;
    a pair past the end or with an id outside [0, BLOCK_EXPERTS) has a row of zeros."""
    offs_p = tl.program_id(0) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    ids = tl.load(EXPERT_IDS + offs_p, mask=offs_p < pairs, other=-1)
    one_hot = (ids[:, None] == tl.arange(0, BLOCK_EXPERTS)[None, :]).to(tl.int32)
    return offs_p, ids, one_hot


@triton.jit
def _count_kernel(
    EXPERT_IDS,  # (pairs,) int: pair p = token * top_k + k routed to expert EXPERT_IDS[p]
    COUNTS,  # (blocks, experts) int32: how many of each block's pairs each expert takes
    pairs,
    experts,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,  # experts rounded up to a power of two
):
    # grid = (cdiv(pairs, BLOCK_PAIRS),): pass one of the counting sort
    _, _, one_hot = _one_hot_block(EXPERT_IDS, pairs, BLOCK_PAIRS=BLOCK_PAIRS, BLOCK_EXPERTS=BLOCK_EXPERTS)
    offs_e = tl.arange(0, BLOCK_EXPERTS)
    tl.store(COUNTS + tl.program_id(0) * experts + offs_e, tl.sum(one_hot, axis=0), mask=offs_e < experts)


@triton.jit
def _place_kernel(
    EXPERT_IDS,  # (pairs,) int
    BLOCK_ROWS,  # (blocks, experts) int32: the first sorted row of each block's pairs of each expert
    SORTED_PAIRS,  # (pairs,) int32: the pair at each sorted row (rows past the routed pairs unwritten)
    PAIR_ROWS,  # (pairs,) int32: each pair's sorted row; -1 for an id outside [0, experts) (dropped)
    pairs,
    experts,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,
):
    # grid = (cdiv(pairs, BLOCK_PAIRS),): pass two. A block's pairs of one expert take its rows in pair
    # order (the exclusive prefix sum of the block's one-hot matrix), after the earlier blocks' pairs
    # of that expert: a stable sort, the same on every run whatever order the programs run in.
    offs_p, ids, one_hot = _one_hot_block(
        EXPERT_IDS, pairs, BLOCK_PAIRS=BLOCK_PAIRS, BLOCK_EXPERTS=BLOCK_EXPERTS
    )
    offs_e = tl.arange(0, BLOCK_EXPERTS)
    first = tl.load(BLOCK_ROWS + tl.program_id(0) * experts + offs_e, mask=offs_e < experts, other=0)
    earlier = tl.cumsum(one_hot, axis=0) - one_hot  # this block's earlier pairs of the same expert
    row = tl.sum(one_hot * (first[None, :] + earlier), axis=1)
    routed = (ids >= 0) & (ids < experts)
    tl.store(SORTED_PAIRS + row, offs_p, mask=routed & (offs_p < pairs))
    tl.store(PAIR_ROWS + offs_p, tl.where(routed, row, -1), mask=offs_p < pairs)


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
