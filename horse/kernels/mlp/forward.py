"""The forward kernels: y = act(x Wᵀ + b), or gated act(x W_gateᵀ) ⊙ (x W_upᵀ), with act, the bias and
the stored pre-activation in the GEMM's epilogue. The tiled kernel (pointer or TMA loads, optionally
split-K), the split-K epilogue that adds its partials, and sm_90+'s persistent kernel.
"""

import triton
import triton.language as tl

from horse.kernels.mlp.gemm import _grouped_tile, _k_range, _matmul_tile, _store_partial, _subtile


@triton.jit
def _act_fwd(z, ACTIVATION: tl.constexpr, INLINE_PTX: tl.constexpr):
    """act(z) for a float32 tile in the forward GEMMs' epilogues.

    gelu_tanh is 0.5 z (1 + tanh(u)) = z sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3). INLINE_PTX
    (an NVIDIA GPU, sm_75+; not the interpreter, which cannot run PTX) takes tanh.approx.f32: one
    MUFU.TANH an element where tl.sigmoid's exp2 and reciprocal are two (MUFU.EX2 + MUFU.RCP; see
    GEMM_CONFIGS). Its relative error, 2^-10.987 at most (PTX ISA), moves gelu_tanh by 2.4e-4 |z|
    at most (tests/test_mlp.py models the worst case), below the float16 output's tolerance. The
    backward keeps the exp2 form: act' = s + z s (1 - s) c (1 + 3 · 0.044715 z^2) multiplies an
    error in s by up to 34 at z = -5 (0.8 % of act' there, worst case), past float16 tolerance.
    """
    if ACTIVATION == "relu":
        z = tl.maximum(z, 0.0)
    elif ACTIVATION == "relu2":
        z = tl.maximum(z, 0.0)
        z = z * z
    elif ACTIVATION == "gelu":
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        if INLINE_PTX:
            u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            tanh = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True, pack=1
            )
            z = 0.5 * z * (1.0 + tanh)
        else:
            z = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif ACTIVATION == "silu":
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def _finite_in(z, OUT_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr):
    """z clamped to float16's finite range (±65,504) when it is stored in float16 and feeds an
    activation: a pre-activation stored as ±inf would give act' = inf x 0 = NaN in the backward
    (silu at -inf) while the forward stayed finite. The forward computes act of the same clamped
    value, so forward and backward agree (a straight-through clamp). Without an activation the
    value is the output, left as a matmul gives it."""
    if OUT_DTYPE == tl.float16 and ACTIVATION != "none":
        z = tl.clamp(z, -65504.0, 65504.0)
    return z


@triton.jit
def _pre_activation(acc, B, offs_n, N, OUT_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    """acc + b for a forward tile at columns offs_n, clamped as :func:`_finite_in` says (float32)."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return _finite_in(acc, OUT_DTYPE, ACTIVATION)


@triton.jit
def _fwd_epilogue(
    acc,
    acc_up,
    B,
    Y,
    PRE,
    UP,
    offs_m,
    offs_n,
    M,
    N,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,
    INLINE_PTX: tl.constexpr,
):
    """Store y = act(acc + b), or GATED act(acc) * acc_up (and pre = acc + b, GATED and up = acc_up)
    for the tile at rows offs_m, columns offs_n."""
    pre = _pre_activation(acc, B, offs_n, N, Y.dtype.element_ty, ACTIVATION, HAS_BIAS)
    if GATED:
        up = _finite_in(acc_up, Y.dtype.element_ty, ACTIVATION)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if STORE_PRE:
        tl.store(PRE + out, pre.to(PRE.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(UP + out, up.to(UP.dtype.element_ty), mask=mask)
    y = _act_fwd(pre, ACTIVATION, INLINE_PTX)
    if GATED:
        y = y * up
    tl.store(Y + out, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_kernel(
    X,  # (M, K), strides x_strides; with TMA a descriptor, (BLOCK_M, BLOCK_K) blocks
    W,  # (N, K) W, or GATED W_gate, strides w_strides; with TMA a descriptor, (BLOCK_N, BLOCK_K) blocks
    WU,  # (N, K) W_up, the same strides as W (w_strides); with TMA a descriptor like W's; read when GATED
    B,  # (N,); read when HAS_BIAS
    Y,  # (M, N) contiguous: act(x Wᵀ + b), or GATED act(x W_gateᵀ) * (x W_upᵀ)
    PRE,  # (M, N) contiguous: x Wᵀ + b (GATED: the gate x W_gateᵀ); written when STORE_PRE
    UP,  # (M, N) contiguous: x W_upᵀ; written when GATED and STORE_PRE
    PARTIAL,  # (splits, M, N) float32, GATED (2 splits, M, N): with SPLIT_K, each split's sum over its
    # K steps (GATED: slabs 2s and 2s + 1 hold split s's gate and up)
    M,
    N,
    K,
    x_strides,
    w_strides,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,  # two accumulators over one pass of x: gate and up
    HAS_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,
    SPLIT_K: tl.constexpr,  # store partial sums; _split_k_epilogue_kernel adds them and runs the epilogue
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    TMA: tl.constexpr,
    INLINE_PTX: tl.constexpr,  # an NVIDIA GPU, not the interpreter: gelu_tanh by tanh.approx (_act_fwd)
):
    # grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits): splits > 1 only with SPLIT_K
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_first, k_last = _k_range(K, BLOCK_K, SPLIT_K)
    acc, acc_up = _matmul_tile(
        X, W, WU, pid_m, pid_n, M, N, K, x_strides, w_strides, k_first, k_last, BLOCK_M, BLOCK_N, BLOCK_K,
        TMA, False, GATED,
    )  # fmt: skip
    if SPLIT_K:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATED:
            _store_partial(acc, PARTIAL, 2 * tl.program_id(1), offs_m, offs_n, M, N)
            _store_partial(acc_up, PARTIAL, 2 * tl.program_id(1) + 1, offs_m, offs_n, M, N)
        else:
            _store_partial(acc, PARTIAL, tl.program_id(1), offs_m, offs_n, M, N)
    else:
        SUB_N: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
        for i in tl.static_range(EPILOGUE_SPLIT):
            sub = _subtile(acc, i, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N)
            sub_up = _subtile(acc_up, i, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N)
            offs_sub = pid_n * BLOCK_N + i * SUB_N + tl.arange(0, SUB_N)
            _fwd_epilogue(
                sub, sub_up, B, Y, PRE, UP, offs_m, offs_sub, M, N, ACTIVATION, GATED, HAS_BIAS, STORE_PRE,
                INLINE_PTX,
            )  # fmt: skip


@triton.jit
def _split_k_epilogue_kernel(
    PARTIAL,  # (splits, M, N) float32, or gated (2 splits, M, N): the GEMM kernels' split-K partials
    B,  # (N,); read when HAS_BIAS
    Y,  # (M, N) contiguous: act(pre), or gated act(gate) * up
    PRE,  # (M, N) contiguous: the pre-activation (the gate when GATED); written when STORE_PRE
    UP,  # (M, N) contiguous: the up projection; written when GATED and STORE_PRE
    M,
    N,
    splits,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INLINE_PTX: tl.constexpr,  # as in _fwd_kernel
):
    # grid = (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): the partials summed in split order, the same sum
    # run to run (no atomics), then the forward GEMMs' own epilogue.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    slab = tl.cast(M, tl.int64) * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for split in range(0, splits):
        if GATED:
            acc += tl.load(PARTIAL + 2 * split * slab + tile, mask=mask, other=0.0)
            acc_up += tl.load(PARTIAL + (2 * split + 1) * slab + tile, mask=mask, other=0.0)
        else:
            acc += tl.load(PARTIAL + split * slab + tile, mask=mask, other=0.0)
    _fwd_epilogue(
        acc, acc_up, B, Y, PRE, UP, offs_m, offs_n, M, N, ACTIVATION, GATED, HAS_BIAS, STORE_PRE, INLINE_PTX
    )


@triton.jit
def _fwd_persistent_kernel(
    X,  # descriptor of x (M, K), (BLOCK_M, BLOCK_K) blocks
    W,  # descriptor of W (N, K), or GATED of W_gate, (BLOCK_N, BLOCK_K) blocks
    WU,  # descriptor of W_up (N, K), like W's; read when GATED
    B,  # (N,); read when HAS_BIAS
    Y,  # descriptor of y (M, N) contiguous, (BLOCK_M, BLOCK_N // EPILOGUE_SPLIT) blocks: act(x Wᵀ + b),
    # or GATED act(x W_gateᵀ) * (x W_upᵀ)
    PRE,  # descriptor like Y's of pre (M, N), x Wᵀ + b (GATED: the gate x W_gateᵀ); when STORE_PRE
    UP,  # descriptor like Y's of x W_upᵀ (M, N); written when GATED and STORE_PRE
    M,
    N,
    K,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,  # two accumulators over one pass of x: gate and up
    HAS_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    INLINE_PTX: tl.constexpr,  # as in _fwd_kernel
):
    # grid = (min(tiles, SMs),): program p walks output tiles p, p + grid, ... in grouped order. The
    # tile and K loops are flattened into one pipelined loop, so the next tile's first TMA loads are
    # in flight during this tile's epilogue, whose subtiles leave by TMA stores (async: the next
    # subtile's math runs while one is written).
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    SUB_N: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        start_m = pid_m * BLOCK_M
        start_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_steps):  # out-of-bounds elements load as zeros: no masks
            x = X.load([start_m, k * BLOCK_K])
            acc = tl.dot(x, tl.trans(W.load([start_n, k * BLOCK_K])), acc)
            if GATED:
                acc_up = tl.dot(x, tl.trans(WU.load([start_n, k * BLOCK_K])), acc_up)
        for i in tl.static_range(EPILOGUE_SPLIT):
            sub = _subtile(acc, i, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N)
            offs_sub = start_n + i * SUB_N + tl.arange(0, SUB_N)
            pre = _pre_activation(sub, B, offs_sub, N, Y.dtype, ACTIVATION, HAS_BIAS)
            if GATED:
                up = _finite_in(_subtile(acc_up, i, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N), Y.dtype, ACTIVATION)
            if STORE_PRE:  # the stores drop rows and columns past the edges
                PRE.store([start_m, start_n + i * SUB_N], pre.to(Y.dtype))
                if GATED:
                    UP.store([start_m, start_n + i * SUB_N], up.to(Y.dtype))
            y = _act_fwd(pre, ACTIVATION, INLINE_PTX)
            if GATED:
                y = y * up
            Y.store([start_m, start_n + i * SUB_N], y.to(Y.dtype))
