"""The forward kernels: y = act(x Wᵀ + b), or gated act(x W_gateᵀ) ⊙ (x W_upᵀ), with act, the bias and
the stored pre-activation in the GEMM's epilogue. The tiled kernel (pointer or TMA loads, optionally
split-K), the split-K epilogue that adds its partials, and sm_90+'s persistent kernel.

Every kernel takes what its epilogue computes as one constexpr group, EPILOGUE
(:class:`horse.kernels.mlp.configs.Epilogue`: activation, gated, has_bias, store (pre and up, for
the backward), split (column subtiles), inline_ptx).
"""

import triton
import triton.language as tl

from horse.kernels.mlp.gemm import _grouped_tile, _k_range, _matmul_tile, _store_partial, _subtile


@triton.jit
def _act_fwd(z, EPILOGUE: tl.constexpr):
    """act(z), act being EPILOGUE.activation, for a float32 tile in the forward GEMMs' epilogues.

    gelu_tanh is 0.5 z (1 + tanh(u)) = z sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3). inline_ptx
    (an NVIDIA GPU, sm_75+; not the interpreter, which cannot run PTX) takes tanh.approx.f32: one
    MUFU.TANH an element where tl.sigmoid's exp2 and reciprocal are two (MUFU.EX2 + MUFU.RCP;
    TUNING.md). Its relative error, 2^-10.987 at most (PTX ISA), moves gelu_tanh by 2.4e-4 |z| at
    most (tests/test_mlp.py models the worst case), below the float16 output's tolerance. The
    backward keeps the exp2 form: act' = s + z s (1 - s) c (1 + 3 · 0.044715 z^2) multiplies an
    error in s by up to 34 at z = -5 (0.8 % of act' there, worst case), past float16 tolerance.
    """
    if EPILOGUE.activation == "relu":
        z = tl.maximum(z, 0.0)
    elif EPILOGUE.activation == "relu2":
        z = tl.maximum(z, 0.0)
        z = z * z
    elif EPILOGUE.activation == "gelu":
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif EPILOGUE.activation == "gelu_tanh":
        if EPILOGUE.inline_ptx:
            u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            tanh = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True, pack=1
            )
            z = 0.5 * z * (1.0 + tanh)
        else:
            z = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif EPILOGUE.activation == "silu":
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def _finite_in(z, OUT_DTYPE: tl.constexpr, EPILOGUE: tl.constexpr):
    """z clamped to float16's finite range (±65,504) when it is stored in float16 and feeds an
    activation: a pre-activation stored as ±inf would give act' = inf x 0 = NaN in the backward
    (silu at -inf) while the forward stayed finite. The forward computes act of the same clamped
    value, so forward and backward agree (a straight-through clamp). Without an activation the
    value is the output, left as a matmul gives it."""
    if OUT_DTYPE == tl.float16 and EPILOGUE.activation != "none":
        z = tl.clamp(z, -65504.0, 65504.0)
    return z


@triton.jit
def _pre_activation(acc, B, offs_n, N, OUT_DTYPE: tl.constexpr, EPILOGUE: tl.constexpr):
    """acc + b for a forward tile at columns offs_n, clamped as :func:`_finite_in` says (float32)."""
    if EPILOGUE.has_bias:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return _finite_in(acc, OUT_DTYPE=OUT_DTYPE, EPILOGUE=EPILOGUE)


@triton.jit
def _fwd_epilogue(acc, acc_up, B, Y, PRE, UP, offs_m, offs_n, M, N, EPILOGUE: tl.constexpr):
    """Store y = act(acc + b), or gated act(acc) * acc_up (and pre = acc + b, gated and up = acc_up)
    for the tile at rows offs_m, columns offs_n."""
    pre = _pre_activation(acc, B, offs_n=offs_n, N=N, OUT_DTYPE=Y.dtype.element_ty, EPILOGUE=EPILOGUE)
    if EPILOGUE.gated:
        up = _finite_in(acc_up, OUT_DTYPE=Y.dtype.element_ty, EPILOGUE=EPILOGUE)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if EPILOGUE.store:
        tl.store(PRE + out, pre.to(PRE.dtype.element_ty), mask=mask)
        if EPILOGUE.gated:
            tl.store(UP + out, up.to(UP.dtype.element_ty), mask=mask)
    y = _act_fwd(pre, EPILOGUE=EPILOGUE)
    if EPILOGUE.gated:
        y = y * up
    tl.store(Y + out, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_kernel(
    X,  # (M, K), strides x_strides; with TMA a descriptor, (BLOCK_M, BLOCK_K) blocks
    W,  # (N, K) W, or gated W_gate, strides w_strides; with TMA a descriptor, (BLOCK_N, BLOCK_K) blocks
    WU,  # (N, K) W_up, the same strides as W (w_strides); with TMA a descriptor like W's; read when gated
    B,  # (N,); read when EPILOGUE.has_bias
    Y,  # (M, N) contiguous: act(x Wᵀ + b), or gated act(x W_gateᵀ) * (x W_upᵀ)
    PRE,  # (M, N) contiguous: x Wᵀ + b (gated: the gate x W_gateᵀ); written when EPILOGUE.store
    UP,  # (M, N) contiguous: x W_upᵀ; written when gated and EPILOGUE.store
    PARTIAL,  # (splits, M, N) float32, gated (2 splits, M, N): with SPLIT_K, each split's sum over its
    # K steps (gated: slabs 2s and 2s + 1 hold split s's gate and up)
    M,
    N,
    K,
    x_strides,
    w_strides,
    EPILOGUE: tl.constexpr,  # Epilogue; gated: two accumulators over one pass of x, gate and up
    SPLIT_K: tl.constexpr,  # store partial sums; _split_k_epilogue_kernel adds them and runs the epilogue
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
):
    # grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits): splits > 1 only with SPLIT_K
    pid_m, pid_n = _grouped_tile(
        tl.program_id(0), M=M, N=N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M
    )
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_range = _k_range(K, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K)
    acc, acc_up = _matmul_tile(
        X,
        W,
        WU,
        tile=(pid_m, pid_n),
        shape=(M, N, K),
        x_strides=x_strides,
        w_strides=w_strides,
        k_range=k_range,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        TMA=TMA,
        W_KN=False,
        GATED=EPILOGUE.gated,
    )
    if SPLIT_K:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        if EPILOGUE.gated:
            _store_partial(acc, PARTIAL, slab=2 * split, offs_m=offs_m, offs_n=offs_n, M=M, N=N)
            _store_partial(acc_up, PARTIAL, slab=2 * split + 1, offs_m=offs_m, offs_n=offs_n, M=M, N=N)
        else:
            _store_partial(acc, PARTIAL, slab=split, offs_m=offs_m, offs_n=offs_n, M=M, N=N)
    else:
        SPLIT: tl.constexpr = EPILOGUE.split
        SUB_N: tl.constexpr = BLOCK_N // SPLIT
        for i in tl.static_range(SPLIT):
            sub = _subtile(acc, INDEX=i, SPLIT=SPLIT)
            sub_up = _subtile(acc_up, INDEX=i, SPLIT=SPLIT)
            offs_sub = pid_n * BLOCK_N + i * SUB_N + tl.arange(0, SUB_N)
            _fwd_epilogue(
                sub, sub_up, B, Y, PRE, UP, offs_m=offs_m, offs_n=offs_sub, M=M, N=N, EPILOGUE=EPILOGUE
            )


@triton.jit
def _split_k_epilogue_kernel(
    PARTIAL,  # (splits, M, N) float32, or gated (2 splits, M, N): the GEMM kernels' split-K partials
    B,  # (N,); read when EPILOGUE.has_bias
    Y,  # (M, N) contiguous: act(pre), or gated act(gate) * up
    PRE,  # (M, N) contiguous: the pre-activation (the gate when gated); written when EPILOGUE.store
    UP,  # (M, N) contiguous: the up projection; written when gated and EPILOGUE.store
    M,
    N,
    splits,
    EPILOGUE: tl.constexpr,  # Epilogue: the forward GEMM's, unsplit (split 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
        if EPILOGUE.gated:
            acc += tl.load(PARTIAL + 2 * split * slab + tile, mask=mask, other=0.0)
            acc_up += tl.load(PARTIAL + (2 * split + 1) * slab + tile, mask=mask, other=0.0)
        else:
            acc += tl.load(PARTIAL + split * slab + tile, mask=mask, other=0.0)
    _fwd_epilogue(acc, acc_up, B, Y, PRE, UP, offs_m=offs_m, offs_n=offs_n, M=M, N=N, EPILOGUE=EPILOGUE)


@triton.jit
def _fwd_persistent_kernel(
    X,  # descriptor of x (M, K), (BLOCK_M, BLOCK_K) blocks
    W,  # descriptor of W (N, K), or gated of W_gate, (BLOCK_N, BLOCK_K) blocks
    WU,  # descriptor of W_up (N, K), like W's; read when gated
    B,  # (N,); read when EPILOGUE.has_bias
    Y,  # descriptor of y (M, N) contiguous, (BLOCK_M, BLOCK_N // EPILOGUE.split) blocks: act(x Wᵀ + b),
    # or gated act(x W_gateᵀ) * (x W_upᵀ)
    PRE,  # descriptor like Y's of pre (M, N), x Wᵀ + b (gated: the gate x W_gateᵀ); when EPILOGUE.store
    UP,  # descriptor like Y's of x W_upᵀ (M, N); written when gated and EPILOGUE.store
    M,
    N,
    K,
    EPILOGUE: tl.constexpr,  # Epilogue; gated: two accumulators over one pass of x, gate and up
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grid = (min(tiles, SMs),): program p walks output tiles p, p + grid, ... in grouped order. The
    # tile and K loops are flattened into one pipelined loop, so the next tile's first TMA loads are
    # in flight during this tile's epilogue, whose subtiles leave by TMA stores (async: the next
    # subtile's math runs while one is written).
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    SPLIT: tl.constexpr = EPILOGUE.split
    SUB_N: tl.constexpr = BLOCK_N // SPLIT
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _grouped_tile(tile, M=M, N=N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M)
        start_m = pid_m * BLOCK_M
        start_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_steps):  # out-of-bounds elements load as zeros: no masks
            x = X.load([start_m, k * BLOCK_K])
            acc = tl.dot(x, tl.trans(W.load([start_n, k * BLOCK_K])), acc)
            if EPILOGUE.gated:
                acc_up = tl.dot(x, tl.trans(WU.load([start_n, k * BLOCK_K])), acc_up)
        for i in tl.static_range(SPLIT):
            sub = _subtile(acc, INDEX=i, SPLIT=SPLIT)
            offs_sub = start_n + i * SUB_N + tl.arange(0, SUB_N)
            pre = _pre_activation(sub, B, offs_n=offs_sub, N=N, OUT_DTYPE=Y.dtype, EPILOGUE=EPILOGUE)
            if EPILOGUE.gated:
                sub_up = _subtile(acc_up, INDEX=i, SPLIT=SPLIT)
                up = _finite_in(sub_up, OUT_DTYPE=Y.dtype, EPILOGUE=EPILOGUE)
            if EPILOGUE.store:  # the stores drop rows and columns past the edges
                PRE.store([start_m, start_n + i * SUB_N], pre.to(Y.dtype))
                if EPILOGUE.gated:
                    UP.store([start_m, start_n + i * SUB_N], up.to(Y.dtype))
            y = _act_fwd(pre, EPILOGUE=EPILOGUE)
            if EPILOGUE.gated:
                y = y * up
            Y.store([start_m, start_n + i * SUB_N], y.to(Y.dtype))
