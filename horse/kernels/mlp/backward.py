"""The backward kernels: dpre = dh ⊙ act'(pre) (gated, the product rule for dgate and dup) with the
bias gradient's per-row-tile partial sums. In the MLPs the GEMM dh = dy W_out runs it in its epilogue
(and recomputes h = act(pre) for dW_out); in linear_act and gated_linear, where dh arrives from
outside, an elementwise kernel does.

Both kernels take what their epilogue computes as one constexpr group, EPILOGUE
(:class:`horse.kernels.mlp.configs.Epilogue`: activation, gated, has_bias, store (h, which dW_out
reads; the dh GEMM only), split (column subtiles), inline_ptx (the dh GEMM's L2 prefetch)).
"""

import triton
import triton.language as tl

from horse.kernels.mlp.gemm import _grouped_tile, _matmul_tile, _subtile


@triton.jit
def _act_fwd_and_grad(z, EPILOGUE: tl.constexpr):
    """(act(z), act'(z)) for a float32 tile, act being EPILOGUE.activation."""
    if EPILOGUE.activation == "relu":
        y = tl.maximum(z, 0.0)
        dy = tl.where(z > 0.0, 1.0, 0.0)
    elif EPILOGUE.activation == "relu2":
        r = tl.maximum(z, 0.0)
        y = r * r
        dy = 2.0 * r
    elif EPILOGUE.activation == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        y = z * cdf
        dy = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif EPILOGUE.activation == "gelu_tanh":
        s = tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
        y = z * s
        dy = s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z)
    elif EPILOGUE.activation == "silu":
        s = tl.sigmoid(z)
        y = z * s
        dy = s * (1.0 + z * (1.0 - s))
    else:
        y = z
        dy = tl.full(z.shape, 1.0, tl.float32)
    return y, dy


@triton.jit
def _load_saved(PRE, UP, offs_m, offs_n, M, N, GATED: tl.constexpr):
    """The saved pre (the gate when GATED) and up tiles at rows offs_m, columns offs_n of the (M, N)
    contiguous PRE and UP, in their stored dtype (half the registers of float32); up is pre when not
    GATED (UP is not read)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    pre = tl.load(PRE + tile, mask=mask, other=0.0)
    up = pre
    if GATED:
        up = tl.load(UP + tile, mask=mask, other=0.0)
    return pre, up


@triton.jit
def _act_bwd_tile(dh, pre, up, DPRE, DUP, H, offs_m, offs_n, M, N, stride_dpre, EPILOGUE: tl.constexpr):
    """Given dh, the float32 gradient of the hidden activation h on one tile, and the saved pre (and,
    gated, up) tiles as :func:`_load_saved` loads them, store dpre (and, gated, dup) and, when
    EPILOGUE.store, h itself; return dpre in float32 with rows past M zeroed (for db). DPRE and DUP
    have rows stride_dpre apart (2N gated: the halves of one [dgate | dup] buffer, so the weight
    gradients are one GEMM); H is (M, N) contiguous.

    Plain: h = act(pre), dpre = dh act'(pre). Gated, with pre the gate and up the up projection:
    h = act(gate) up, dgate = dh up act'(gate), dup = dh act(gate).
    """
    row_mask = offs_m < M
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    grad_tile = offs_m.to(tl.int64)[:, None] * stride_dpre + offs_n[None, :]
    act, act_grad = _act_fwd_and_grad(pre.to(tl.float32), EPILOGUE=EPILOGUE)
    if EPILOGUE.gated:
        up = up.to(tl.float32)
        tl.store(DUP + grad_tile, (dh * act).to(DUP.dtype.element_ty), mask=mask)
        dpre = dh * up * act_grad
        h = act * up
    else:
        dpre = dh * act_grad
        h = act
    tl.store(DPRE + grad_tile, dpre.to(DPRE.dtype.element_ty), mask=mask)
    if EPILOGUE.store:
        tl.store(H + tile, h.to(H.dtype.element_ty), mask=mask)
    return tl.where(row_mask[:, None], dpre, 0.0)


@triton.jit
def _dh_act_bwd_kernel(
    DY,  # (M, K): the gradient of the MLP's output, strides dy_strides; with TMA a descriptor,
    # blocks (BLOCK_M, BLOCK_K)
    W,  # (N, K): W_outᵀ read through its strides w_strides, so dh = dy W_out; with TMA
    # a descriptor of W_out (K, N) as stored, blocks (BLOCK_K, BLOCK_N)
    PRE,  # (M, N) contiguous: the saved pre-activation (the gate when gated)
    UP,  # (M, N) contiguous: the saved up projection; read when gated
    DPRE,  # (M, N), row stride stride_dpre: gradient of PRE
    DUP,  # (M, N), row stride stride_dpre: gradient of UP; written when gated
    H,  # (M, N) contiguous: the hidden activation, recomputed from PRE; written when EPILOGUE.store
    DB_PARTIAL,  # (cdiv(M, BLOCK_M), N) float32: column sums of dpre per row tile; when EPILOGUE.has_bias
    M,
    N,
    K,
    dy_strides,
    w_strides,
    stride_dpre,
    EPILOGUE: tl.constexpr,  # Epilogue; store: h, which dW_out reads
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
):
    # grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),): dh = dy W_out never reaches memory.
    pid_m, pid_n = _grouped_tile(
        tl.program_id(0), M=M, N=N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M
    )
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    SPLIT: tl.constexpr = EPILOGUE.split
    SUB_N: tl.constexpr = BLOCK_N // SPLIT
    # The saved pre (and up) is loaded after the K loop (loaded before it, Triton computed act twice;
    # TUNING.md), and asked of L2 during its last K steps (NVIDIA: inline PTX).
    dh, _ = _matmul_tile(
        DY,
        W,
        W,
        tile=(pid_m, pid_n),
        shape=(M, N, K),
        x_strides=dy_strides,
        w_strides=w_strides,
        k_range=(0, tl.cdiv(K, BLOCK_K)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        TMA=TMA,
        W_KN=True,
        GATED=False,
        SAVED=(PRE, UP),
        PREFETCH=(1 + EPILOGUE.gated) if EPILOGUE.inline_ptx else 0,
    )
    for i in tl.static_range(SPLIT):
        sub = _subtile(dh, INDEX=i, SPLIT=SPLIT)
        offs_sub = pid_n * BLOCK_N + i * SUB_N + tl.arange(0, SUB_N)
        pre, up = _load_saved(PRE, UP, offs_m=offs_m, offs_n=offs_sub, M=M, N=N, GATED=EPILOGUE.gated)
        dpre = _act_bwd_tile(
            sub,
            pre,
            up,
            DPRE,
            DUP,
            H,
            offs_m=offs_m,
            offs_n=offs_sub,
            M=M,
            N=N,
            stride_dpre=stride_dpre,
            EPILOGUE=EPILOGUE,
        )
        if EPILOGUE.has_bias:
            db_ptrs = DB_PARTIAL + pid_m.to(tl.int64) * N + offs_sub
            tl.store(db_ptrs, tl.sum(dpre, axis=0), mask=offs_sub < N)


@triton.jit
def _act_bwd_kernel(
    DH,  # (M, N): gradient of the hidden activation, strides dh_strides
    PRE,  # (M, N) contiguous: the saved pre-activation (the gate when gated)
    UP,  # (M, N) contiguous: the saved up projection; read when gated
    DPRE,  # (M, N), row stride stride_dpre
    DUP,  # (M, N), row stride stride_dpre; written when gated
    DB_PARTIAL,  # (cdiv(M, rows_per_program), N) float32: column sums of dpre per slab; when has_bias
    M,
    N,
    rows_per_program,
    dh_strides,
    stride_dpre,
    EPILOGUE: tl.constexpr,  # Epilogue; store false: h is not written
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # grid = (cdiv(N, BLOCK_N), cdiv(M, rows_per_program)): each program one column block, a slab of
    # rows. Column blocks go on axis 0, which takes 2**31 - 1 programs (axis 1 only 65,535); the
    # launcher keeps the slabs to a few per SM.
    pid_m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid_m * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for block_start in range(row_start, row_end, BLOCK_M):
        offs_m = block_start + tl.arange(0, BLOCK_M)
        mask = (offs_m < row_end)[:, None] & (offs_n < N)[None, :]
        dh_offs = offs_m.to(tl.int64)[:, None] * dh_strides[0] + offs_n.to(tl.int64)[None, :] * dh_strides[1]
        dh = tl.load(DH + dh_offs, mask=mask, other=0.0).to(tl.float32)
        pre, up = _load_saved(PRE, UP, offs_m=offs_m, offs_n=offs_n, M=row_end, N=N, GATED=EPILOGUE.gated)
        dpre = _act_bwd_tile(
            dh,
            pre,
            up,
            DPRE,
            DUP,
            DPRE,  # H: not written (EPILOGUE.store is false)
            offs_m=offs_m,
            offs_n=offs_n,
            M=row_end,
            N=N,
            stride_dpre=stride_dpre,
            EPILOGUE=EPILOGUE,
        )
        if EPILOGUE.has_bias:
            db_acc += tl.sum(dpre, axis=0)
    if EPILOGUE.has_bias:
        tl.store(DB_PARTIAL + pid_m.to(tl.int64) * N + offs_n, db_acc, mask=offs_n < N)
