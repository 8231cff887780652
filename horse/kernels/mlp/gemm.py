"""The tiled GEMM's device helpers, shared by the forward and the backward kernels: the grouped tile
order, the K loop (TMA descriptors or pointers, one or two accumulators, split-K ranges), the split-K
partial store, the L2 prefetch of the dh GEMM's saved tiles and the epilogue's column subtiles.
"""

import triton
import triton.language as tl

# The dh GEMM asks L2 for its epilogue's saved tiles this many K steps before its loop ends: about
# twice a DRAM load's latency (an estimate; TUNING.md).
PREFETCH_STEPS = tl.constexpr(2)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile pid: column-major within groups of GROUP_M row tiles, so the
    tiles running together share a few weight tiles (L2 reuse) instead of sweeping all of W."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _operand_offsets(offs_m, offs_n, offs_k, M, N, x_strides, w_strides):
    """Offsets of the first (BLOCK_M, BLOCK_K) tile of x and (BLOCK_K, BLOCK_N) tile of Wᵀ.

    Rows and columns past the edges wrap around (offs % M), so loads need no row or column mask;
    the stores drop those rows and columns. Offsets are int64: index * stride passes 2**31 (a row of a
    large x, a column of a transposed one).
    """
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = offs_k.to(tl.int64)
    x_offs = rows[:, None] * x_strides[0] + offs_k[None, :] * x_strides[1]
    w_offs = offs_k[:, None] * w_strides[1] + cols[None, :] * w_strides[0]
    return x_offs, w_offs


@triton.jit
def _k_steps(x_strides, w_strides, BLOCK_K: tl.constexpr):
    """How far the x and Wᵀ pointers move per K step, in 64 bits: BLOCK_K times a column stride of
    a transposed operand passes 2**31."""
    return tl.cast(x_strides[1], tl.int64) * BLOCK_K, tl.cast(w_strides[1], tl.int64) * BLOCK_K


@triton.jit
def _k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """(first, last + 1) of the K steps this program sums: all of them, or with SPLIT_K the share
    of split tl.program_id(1) of tl.num_programs(1), as even as integers allow (none empty: the
    launcher makes no more splits than K steps)."""
    steps = tl.cdiv(K, BLOCK_K)
    k_first = 0
    k_last = steps
    if SPLIT_K:
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        k_first = split * steps // splits
        k_last = (split + 1) * steps // splits
    return k_first, k_last


@triton.jit
def _store_partial(acc, PARTIAL, slab, offs_m, offs_n, M, N):
    """acc, a float32 (BLOCK_M, BLOCK_N) tile at rows offs_m, columns offs_n, into slab `slab` of the
    split-K partial sums PARTIAL (slabs, M, N)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = (slab * M).to(tl.int64) * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(PARTIAL + out, acc, mask=mask)


@triton.jit
def _matmul_tile(
    X,
    W,
    WU,
    tile,
    shape,
    x_strides,
    w_strides,
    k_range,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
    W_KN: tl.constexpr,
    GATED: tl.constexpr,
    SAVED=None,
    PREFETCH: tl.constexpr = 0,
):
    """The (BLOCK_M, BLOCK_N) float32 tiles tile = (pid_m, pid_n) of x Wᵀ and, GATED, of x WUᵀ (WU
    like W, W_KN false; one pass over x, two accumulators; otherwise WU is not read and the second
    is zeros), summed over K steps k_range = (first, last + 1) of BLOCK_K each (:func:`_k_range`).
    shape is (M, N, K): x is (M, K), W (N, K).

    With TMA, X is a descriptor of x (M, K) and W one of W (N, K), or with W_KN of Wᵀ (K, N) as
    stored (a descriptor needs a unit stride in its last dimension); their loads read elements past
    the edges as zeros. Otherwise X and W are pointers, walked through their strides.

    PREFETCH (the dh GEMM's epilogue input, NVIDIA only): 1 asks L2 for the (M, N) tile of SAVED =
    (PRE, UP)'s PRE during the last PREFETCH_STEPS K steps, 2 for UP's too (:func:`_prefetch_saved`).
    """
    pid_m, pid_n = tile
    M, N, K = shape
    k_first, k_last = k_range
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start_m = pid_m * BLOCK_M
    start_n = pid_n * BLOCK_N
    k_prefetch = tl.maximum(k_last - PREFETCH_STEPS, k_first)
    if not TMA:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        x_offs, w_offs = _operand_offsets(
            offs_m, offs_n, offs_k, M=M, N=N, x_strides=x_strides, w_strides=w_strides
        )
        x_step, w_step = _k_steps(x_strides, w_strides, BLOCK_K=BLOCK_K)
        x_ptrs = X + x_offs + k_first * x_step
        w_ptrs = W + w_offs + k_first * w_step
        wu_ptrs = WU + w_offs + k_first * w_step
    for k in range(k_first, k_last):
        if PREFETCH and k == k_prefetch:
            _prefetch_saved(
                SAVED,
                start=(start_m, start_n),
                shape=(M, N),
                GATED=PREFETCH == 2,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
            )
        if TMA:
            x = X.load([start_m, k * BLOCK_K])
            if W_KN:
                w = W.load([k * BLOCK_K, start_n])
            else:
                w = tl.trans(W.load([start_n, k * BLOCK_K]))
            acc = tl.dot(x, w, acc)
            if GATED:
                acc_up = tl.dot(x, tl.trans(WU.load([start_n, k * BLOCK_K])), acc_up)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            if GATED:
                wu = tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(x, w, acc)
            if GATED:
                acc_up = tl.dot(x, wu, acc_up)
                wu_ptrs += w_step
            x_ptrs += x_step
            w_ptrs += w_step
    return acc, acc_up


@triton.jit
def _prefetch_saved(SAVED, start, shape, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Ask L2 for the saved pre (and up) tile (BLOCK_M, BLOCK_N) at start = (row, column) of the (M,
    N) = shape contiguous SAVED = (PRE, UP) (16-bit): one prefetch a 128-byte line, its row and
    column kept inside the tensor, so that the epilogue's loads of the tile hit L2."""
    PRE, UP = SAVED
    start_m, start_n = start
    M, N = shape
    LINE: tl.constexpr = 64  # 16-bit elements a 128-byte line
    LINES: tl.constexpr = BLOCK_N // LINE if BLOCK_N > LINE else 1
    rows = tl.minimum(start_m + tl.arange(0, BLOCK_M), M - 1)
    cols = tl.minimum(start_n + tl.arange(0, LINES) * LINE, N - 1)
    lines = rows.to(tl.int64)[:, None] * N + cols[None, :]
    for T in tl.static_range(2 if GATED else 1):  # pre, and gated up
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
            "=r,l",
            [(UP if T else PRE) + lines],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _halves(acc):
    """The left and right (rows, columns // 2) column halves of a tile."""
    rows: tl.constexpr = acc.shape[0]
    columns: tl.constexpr = acc.shape[1]
    return tl.split(tl.permute(tl.reshape(acc, (rows, 2, columns // 2)), (0, 2, 1)))


@triton.jit
def _subtile(acc, INDEX: tl.constexpr, SPLIT: tl.constexpr):
    """Column subtile INDEX of SPLIT (1, 2 or 4) equal ones of a tile.

    The reshape, permute and split move no data in the MMA accumulator's register layout.
    """
    if SPLIT == 1:
        sub = acc
    else:
        left, right = _halves(acc)
        half = left if INDEX < SPLIT // 2 else right
        if SPLIT == 2:
            sub = half
        else:
            left, right = _halves(half)
            sub = left if INDEX % 2 == 0 else right
    return sub
