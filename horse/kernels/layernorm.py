"""LayerNorm and RMSNorm over the last dimension, with an optional fused residual add.

    h = x + residual                       (optional; h is also returned, for the next residual branch)
    LayerNorm:  y = (h - mean(h)) * rstd * weight + bias,   rstd = 1 / sqrt(var(h) + eps)
    RMSNorm:    y = h * rstd * weight,                      rstd = 1 / sqrt(mean(h^2) + eps)

Inputs are (M, N) row-major views (leading dims flattened, unit column stride, any row stride) in
float16, bfloat16 or float32; weight and bias are (N,) in any of those dtypes. Statistics and
accumulation are float32; y and h come out in x's dtype, and y is computed from h rounded to that
dtype, exactly as an unfused model computes ``norm(x + residual)``. N ranges over 1..65,536.

Forward: rows of up to 16,384 elements stay in registers (one read, one write); longer rows are
read twice in chunks, their mean and variance merged chunk by chunk (Chan's parallel update).

Backward: dx in one pass over dy and h; dweight and dbias as per-program float32 partial sums
over a contiguous slab of rows, then one final sum over programs. The programs and their slabs
depend only on the shape and the device, never on timing, so gradients are bit-identical run to
run (no atomics). Rows longer than 8,192 elements are split into column blocks of 4,096, one
program each, launched side by side; each adds the rest of its row to the row sums dx needs by
reading the other blocks as their own programs read them (from L2), so dy and h leave DRAM once.

The kernels' arguments come in groups, as the launchers pack them: ``row_stats`` (mean, rstd),
``sizes`` (M, N; the backward's also rows_per_program) and ``strides`` (the tensors' row strides);
the device helpers take the tensors they read as one tuple and are called by keyword.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from horse.kernels import reference, runtime

MAX_HIDDEN = 65536
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_normalized_input(
    inputs,
    rows,
    row_mask,
    start,
    N,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
):
    """Columns start to start + BLOCK_N of rows: the (BLOCK_M, BLOCK_N) tile of h = x [+ residual] in
    float32, h rounded to x's dtype; with the columns, their mask and the tile's. inputs is the
    forward kernel's (X, stride_x_row, RESIDUAL, stride_res_row, RESIDUAL_OUT)."""
    X, stride_x_row, RESIDUAL, stride_res_row, RESIDUAL_OUT = inputs
    cols = start + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(RESIDUAL + rows[:, None] * stride_res_row + cols[None, :], mask=mask, other=0.0)
        h = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        if STORE_RESIDUAL:
            tl.store(RESIDUAL_OUT + rows[:, None] * N + cols[None, :], h, mask=mask)
        x = h
    return x.to(tl.float32), cols, col_mask, mask


@triton.jit
def _affine(y, W, B, cols, col_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _norm_fwd_kernel(
    X,  # (M, N), row stride stride_x_row
    RESIDUAL,  # (M, N), row stride stride_res_row; read when HAS_RESIDUAL
    W,  # (N,)
    B,  # (N,)
    Y,  # (M, N) contiguous
    RESIDUAL_OUT,  # (M, N) contiguous; h = x + residual, written when HAS_RESIDUAL
    row_stats,  # (MEAN, RSTD): (M,) float32 each; MEAN written unless IS_RMS
    sizes,  # (M, N)
    strides,  # (stride_x_row, stride_res_row): the row strides of X and RESIDUAL
    eps,
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_IN_REGISTERS: tl.constexpr,
):
    # grid = (cdiv(M, BLOCK_M),)
    MEAN, RSTD = row_stats
    M, N = sizes
    stride_x_row, stride_res_row = strides
    inputs = (X, stride_x_row, RESIDUAL, stride_res_row, RESIDUAL_OUT)  # what _load_normalized_input reads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # row * stride passes 2**31 on large tensors
    if ROW_IN_REGISTERS:
        x, cols, col_mask, mask = _load_normalized_input(
            inputs,
            rows=rows,
            row_mask=row_mask,
            start=0,
            N=N,
            BLOCK_N=BLOCK_N,
            HAS_RESIDUAL=HAS_RESIDUAL,
            STORE_RESIDUAL=True,
        )
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            tl.store(MEAN + rows, mean, mask=row_mask)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = _affine(
            xc * rstd[:, None],
            W=W,
            B=B,
            cols=cols,
            col_mask=col_mask,
            HAS_WEIGHT=HAS_WEIGHT,
            HAS_BIAS=HAS_BIAS,
        )
        tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Pass 1: statistics, merging each chunk's (count, mean, M2) into the running ones.
        count = tl.zeros([BLOCK_M], dtype=tl.float32)
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            x, cols, col_mask, mask = _load_normalized_input(
                inputs,
                rows=rows,
                row_mask=row_mask,
                start=start,
                N=N,
                BLOCK_N=BLOCK_N,
                HAS_RESIDUAL=HAS_RESIDUAL,
                STORE_RESIDUAL=True,
            )
            if IS_RMS:
                m2 += tl.sum(x * x, axis=1)
            else:
                chunk_count = tl.sum(col_mask.to(tl.float32), axis=0)
                chunk_mean = tl.sum(x, axis=1) / chunk_count
                d = tl.where(mask, x - chunk_mean[:, None], 0.0)
                delta = chunk_mean - mean
                total = count + chunk_count
                mean += delta * (chunk_count / total)
                m2 += tl.sum(d * d, axis=1) + delta * delta * (count * chunk_count / total)
                count = total
        rstd = tl.rsqrt(m2 / N + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        if not IS_RMS:
            tl.store(MEAN + rows, mean, mask=row_mask)
        # Pass 2: normalise. h is recomputed from x and residual rather than read back from
        # RESIDUAL_OUT: another thread of this program may have written it, with no barrier.
        for start in range(0, N, BLOCK_N):
            x, cols, col_mask, mask = _load_normalized_input(
                inputs,
                rows=rows,
                row_mask=row_mask,
                start=start,
                N=N,
                BLOCK_N=BLOCK_N,
                HAS_RESIDUAL=HAS_RESIDUAL,
                STORE_RESIDUAL=False,
            )
            xc = x if IS_RMS else x - mean[:, None]
            y = _affine(
                xc * rstd[:, None],
                W=W,
                B=B,
                cols=cols,
                col_mask=col_mask,
                HAS_WEIGHT=HAS_WEIGHT,
                HAS_BIAS=HAS_BIAS,
            )
            tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(inputs, rows, cols, row_mask, col_mask, IS_RMS: tl.constexpr):
    """dy and h of a (BLOCK_M, BLOCK_N) tile as stored, and the rows' mean and rstd. inputs is the
    backward kernel's (DY, stride_dy_row, X, stride_x_row, (MEAN, RSTD))."""
    DY, stride_dy_row, X, stride_x_row, row_stats = inputs
    MEAN, RSTD = row_stats
    mask = row_mask[:, None] & col_mask[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0)
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mean = rstd if IS_RMS else tl.load(MEAN + rows, mask=row_mask, other=0.0)  # RMSNorm's: unused
    return dy, x, mean, rstd


@triton.jit
def _bwd_tile(dy, x, w, mean, rstd, mask, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """dy, x_hat = (h - mean) * rstd and w * dy in float32, from a tile's dy and h as loaded."""
    dy = dy.to(tl.float32)
    x = x.to(tl.float32)
    x_hat = x * rstd[:, None] if IS_RMS else tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    wdy = dy * w[None, :] if HAS_WEIGHT else dy
    return dy, x_hat, wdy


@triton.jit
def _load_weight(W, cols, col_mask, HAS_WEIGHT: tl.constexpr):
    """The (BLOCK_N,) weight in float32; ones without a weight (then never read: HAS_WEIGHT)."""
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.full(cols.shape, 1.0, tl.float32)
    return w


@triton.jit
def _norm_bwd_kernel(
    DY,  # (M, N), row stride stride_dy_row
    DRESIDUAL_OUT,  # (M, N), row stride stride_dres_row: gradient of h; read when HAS_DRESIDUAL
    X,  # (M, N), row stride stride_x_row: the normalised input h
    W,  # (N,)
    row_stats,  # (MEAN, RSTD): (M,) float32 each, as the forward wrote them (MEAN unread if IS_RMS)
    DX,  # (M, N) contiguous
    DW_PARTIAL,  # (cdiv(M, rows_per_program), N) float32: this program's sum over its rows
    DB_PARTIAL,  # (cdiv(M, rows_per_program), N) float32
    sizes,  # (M, N, rows_per_program): rows_per_program, the rows of a program's slab
    strides,  # (stride_dy_row, stride_dres_row, stride_x_row): the row strides of DY, DRESIDUAL_OUT, X
    IS_RMS: tl.constexpr,
    HAS_DRESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # dbias wanted (the backward needs no bias otherwise)
    HAS_DX: tl.constexpr,  # dx wanted: the input or the residual trains
    HAS_DW: tl.constexpr,  # dweight wanted: a weight that trains (a frozen one only scales dx)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_IN_TILE: tl.constexpr,  # BLOCK_N >= N; else the row spans several column blocks
    SWEEP_BLOCK_N: tl.constexpr,  # chunk of the sweep over the other column blocks; divides BLOCK_N
):
    # grid = (cdiv(N, BLOCK_N), cdiv(M, rows_per_program)). A slab's column blocks are neighbours in
    # launch order: they run side by side and walk the same rows in step, so the sweep's reads of a
    # row's other blocks come from L2, where their owners' reads have just put them.
    M, N, rows_per_program = sizes
    stride_dy_row, stride_dres_row, stride_x_row = strides
    inputs = (DY, stride_dy_row, X, stride_x_row, row_stats)  # what _load_rows reads
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    col_start = pid_n * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = _load_weight(W, cols=cols, col_mask=col_mask, HAS_WEIGHT=HAS_WEIGHT)  # once per program, not per row
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid_m * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    # Columns outside this program's block: the sweep walks them in chunks, skipping the block.
    other_cols = N - tl.minimum(BLOCK_N, N - col_start)
    if not ROW_IN_TILE:
        # The row loop pipelined by hand (Triton's pipeliner leaves loads that feed no tl.dot alone):
        # the next tile is loaded while this one is worked on. TUNING.md has the figures.
        first_rows = row_start + tl.arange(0, BLOCK_M)
        next_tile = _load_rows(
            inputs,
            rows=first_rows.to(tl.int64),
            cols=cols,
            row_mask=first_rows < row_end,
            col_mask=col_mask,
            IS_RMS=IS_RMS,
        )
    for block_start in range(row_start, row_end, BLOCK_M):
        rows = block_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        if ROW_IN_TILE:
            dy, x, mean, rstd = _load_rows(
                inputs, rows=rows, cols=cols, row_mask=row_mask, col_mask=col_mask, IS_RMS=IS_RMS
            )
        else:
            dy, x, mean, rstd = next_tile
            next_tile = _load_rows(
                inputs,
                rows=rows + BLOCK_M,
                cols=cols,
                row_mask=rows + BLOCK_M < row_end,
                col_mask=col_mask,
                IS_RMS=IS_RMS,
            )
        dy, x_hat, wdy = _bwd_tile(
            dy, x=x, w=w, mean=mean, rstd=rstd, mask=mask, IS_RMS=IS_RMS, HAS_WEIGHT=HAS_WEIGHT
        )
        if HAS_DX:
            sum_xhat_wdy = tl.sum(x_hat * wdy, axis=1)
            sum_wdy = tl.sum(wdy, axis=1)
            if not ROW_IN_TILE:
                for start in range(0, other_cols, SWEEP_BLOCK_N):
                    sweep_cols = tl.where(start < col_start, start, start + BLOCK_N) + tl.arange(
                        0, SWEEP_BLOCK_N
                    )
                    sweep_mask = sweep_cols < N
                    w_other = _load_weight(W, cols=sweep_cols, col_mask=sweep_mask, HAS_WEIGHT=HAS_WEIGHT)
                    dy_other, x_other, _, _ = _load_rows(
                        inputs,
                        rows=rows,
                        cols=sweep_cols,
                        row_mask=row_mask,
                        col_mask=sweep_mask,
                        IS_RMS=IS_RMS,
                    )
                    other_mask = row_mask[:, None] & sweep_mask[None, :]
                    _, x_hat_other, wdy_other = _bwd_tile(
                        dy_other,
                        x=x_other,
                        w=w_other,
                        mean=mean,
                        rstd=rstd,
                        mask=other_mask,
                        IS_RMS=IS_RMS,
                        HAS_WEIGHT=HAS_WEIGHT,
                    )
                    sum_xhat_wdy += tl.sum(x_hat_other * wdy_other, axis=1)
                    sum_wdy += tl.sum(wdy_other, axis=1)
            c1 = sum_xhat_wdy / N
            c2 = sum_wdy / N
            if IS_RMS:
                dx = (wdy - x_hat * c1[:, None]) * rstd[:, None]
            else:
                dx = (wdy - x_hat * c1[:, None] - c2[:, None]) * rstd[:, None]
            if HAS_DRESIDUAL:
                dres_ptrs = DRESIDUAL_OUT + rows[:, None] * stride_dres_row + cols[None, :]
                dx += tl.load(dres_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
    partial = pid_m.to(tl.int64) * N + cols
    if HAS_DW:
        tl.store(DW_PARTIAL + partial, dw_acc, mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial, db_acc, mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of a row-wise kernel: a (block_m, block_n) tile and its warps."""

    block_m: int
    block_n: int
    num_warps: int
    row_in_registers: bool


# The rule's limits, each the largest that compiles with no spills on every GPU family; what was
# tried and its figures: TUNING.md beside this file.
# Longest rows held whole in registers; the backward holds five float32 values per element.
FWD_MAX_ROW_IN_REGISTERS = 16384
BWD_MAX_ROW_IN_REGISTERS = 8192
# Short rows are packed several to a program, up to a tile of this many elements.
FWD_TILE_ELEMENTS = 4096
BWD_TILE_ELEMENTS = 2048
CHUNKED_FWD = RowConfig(block_m=1, block_n=4096, num_warps=8, row_in_registers=False)
# Longer backward rows are split into column blocks, one program each; a program adds the rest of
# its row to dx's row sums by a sweep over the other blocks in chunks of BWD_SWEEP_BLOCK_N, reading
# them from L2 as their own programs, launched beside it, read them: dy and h leave DRAM once.
BWD_SPLIT_ROW = RowConfig(block_m=1, block_n=4096, num_warps=16, row_in_registers=False)
BWD_SWEEP_BLOCK_N = 2048


def row_config(n: int, backward: bool, dtype: torch.dtype, arch: runtime.Arch) -> RowConfig:
    """The one block-size rule of the row-wise kernels on GPU family arch: about 8 float32 values a
    thread (16 in the backward on NVIDIA GPUs before sm_90), at most 1024 threads a program."""
    block_n = triton.next_power_of_2(n)
    if block_n > (BWD_MAX_ROW_IN_REGISTERS if backward else FWD_MAX_ROW_IN_REGISTERS):
        return BWD_SPLIT_ROW if backward else CHUNKED_FWD
    block_m = max(1, min(64, (BWD_TILE_ELEMENTS if backward else FWD_TILE_ELEMENTS) // block_n))
    # 16-bit backward rows stop at 16 warps: at 32 the 8192-element row spilled.
    max_warps = min(16 if backward and dtype.itemsize == 2 else 32, runtime.MAX_THREADS // arch.warp_size)
    # The backward before Hopper takes 16 values a thread (at 8, ptxas held rows to 64 registers and
    # spilled); AMD's gfx942 has twice the registers a lane: 8 is clean there.
    values_per_thread = 16 if backward and not arch.hip_target and arch.capability < 90 else 8
    num_warps = min(max_warps, max(1, block_m * block_n // (arch.warp_size * values_per_thread)))
    return RowConfig(block_m, block_n, num_warps, row_in_registers=True)


# The kernels' tuple arguments by their elements' names (runtime.Plan.tuples): the row statistics, the
# sizes and the row strides.
FWD_TUPLES = {
    "row_stats": ("MEAN", "RSTD"),
    "sizes": ("M", "N"),
    "strides": ("stride_x_row", "stride_res_row"),
}
BWD_TUPLES = {
    "row_stats": ("MEAN", "RSTD"),
    "sizes": ("M", "N", "rows_per_program"),
    "strides": ("stride_dy_row", "stride_dres_row", "stride_x_row"),
}


def fwd_plan(M: int, N: int, dtype: torch.dtype, arch: runtime.Arch, flags: dict) -> runtime.Plan:
    """The forward's plan for x (M, N) of dtype on GPU family arch, with flags its IS_RMS and HAS_*
    constexprs: a program per tile of row_config's rows."""
    cfg = row_config(N, backward=False, dtype=dtype, arch=arch)
    blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ROW_IN_REGISTERS=cfg.row_in_registers)
    grid = (triton.cdiv(M, cfg.block_m),)
    constexprs = flags | blocks
    return runtime.Plan(_norm_fwd_kernel, grid, constexprs, cfg.num_warps, num_stages=1, tuples=FWD_TUPLES)


def bwd_plan(
    M: int, N: int, dtype: torch.dtype, arch: runtime.Arch, num_sms: int, flags: dict
) -> tuple[runtime.Plan, int]:
    """(plan, rows_per_program) of the backward for (M, N) of dtype on a GPU of family arch with num_sms
    SMs, with flags its IS_RMS and HAS_* constexprs: a program per column block of a slab of rows
    (:func:`backward_rows_per_program`)."""
    cfg = row_config(N, backward=True, dtype=dtype, arch=arch)
    rows_per_program = backward_rows_per_program(M, N, cfg, num_sms) if M else 1
    blocks = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        ROW_IN_TILE=cfg.row_in_registers,
        SWEEP_BLOCK_N=BWD_SWEEP_BLOCK_N,
    )
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, rows_per_program))
    constexprs = flags | blocks
    plan = runtime.Plan(_norm_bwd_kernel, grid, constexprs, cfg.num_warps, num_stages=1, tuples=BWD_TUPLES)
    return plan, rows_per_program


def _dummy_if_none(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # A pointer argument that its HAS_* flag keeps the kernel from reading.
    return like if t is None else t


def _unit_column_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    # Gradients can arrive expanded (stride 0) or transposed; the kernels take any row stride.
    return t if t is None or t.stride(1) == 1 else t.contiguous()


def _fwd_outputs(x: torch.Tensor, residual: torch.Tensor | None, rms: bool) -> tuple[torch.Tensor, ...]:
    """:func:`norm_fwd`'s outputs, new (and so its op's fake): y (M, N) like x; residual_out (M, N),
    or an empty tensor without a residual; mean (M,) float32, empty for RMSNorm; rstd (M,) float32."""
    M, N = x.shape
    y = runtime.empty((M, N), x.dtype, x.device)
    residual_out = runtime.empty((M, N) if residual is not None else (0,), x.dtype, x.device)
    mean = runtime.empty((0,) if rms else (M,), torch.float32, x.device)
    return y, residual_out, mean, runtime.empty((M,), torch.float32, x.device)


def norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of LayerNorm (``rms=False``) or RMSNorm on validated (M, N) inputs.

    Returns ``(y, residual_out, mean, rstd)``: y (M, N) in x's dtype; residual_out = x + residual
    (M, N), or an empty tensor without a residual; mean (M,) float32, empty for RMSNorm; rstd (M,).
    """
    M, N = x.shape
    y, residual_out, mean, rstd = _fwd_outputs(x, residual, rms)
    if M == 0:
        return y, residual_out, mean, rstd
    residual_in = _dummy_if_none(residual, x)
    flags = dict(
        IS_RMS=rms,
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
    )
    plan = fwd_plan(M, N, x.dtype, runtime.arch(x.device), flags)
    values = dict(
        MEAN=mean, RSTD=rstd, M=M, N=N, stride_x_row=x.stride(0), stride_res_row=residual_in.stride(0)
    )
    with runtime.device_guard(x):
        runtime.launch(
            plan.kernel,
            plan.grid,
            X=x,
            RESIDUAL=residual_in,
            W=_dummy_if_none(weight, x),
            B=_dummy_if_none(bias, x),
            Y=y,
            RESIDUAL_OUT=residual_out,
            eps=eps,
            **plan.pack(values),
            **plan.options(),
            **runtime.COMPILE_OPTIONS,
        )
    return y, residual_out, mean, rstd


def backward_rows_per_program(M: int, N: int, cfg: RowConfig, num_sms: int) -> int:
    """Rows in each program's slab: enough programs, counting a row's column blocks, to fill the
    GPU, and a whole number of tiles. The partial sums take a row of N per slab."""
    # A split row's 16-warp program holds over 100 registers a thread: one fits an SM, so one wave of
    # them, all resident at once, every slab's blocks in step.
    programs_per_sm = max(1, 32 // cfg.num_warps) if cfg.row_in_registers else 1
    programs = num_sms * programs_per_sm
    slabs = max(1, programs // triton.cdiv(N, cfg.block_n))
    return triton.cdiv(triton.cdiv(M, slabs), cfg.block_m) * cfg.block_m


def norm_bwd(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
    rms: bool,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`norm_fwd`; ``x`` is the normalised input (``residual_out`` if any).

    Returns ``(dx, dweight, dbias)``: dx (M, N) in x's dtype, also the gradient of the residual;
    dweight and dbias (N,) in weight's dtype. needs (dx, dweight, dbias) says which are wanted: one
    not wanted, or without its parameter, is an empty tensor, neither computed nor stored.
    """
    needs_dx, needs_dw, needs_db = needs[0], needs[1] and weight is not None, needs[2] and has_bias
    M, N = x.shape
    dy, dresidual_out = _unit_column_stride(dy), _unit_column_stride(dresidual_out)
    dx = runtime.empty((M, N) if needs_dx else (0,), x.dtype, x.device)
    flags = dict(
        IS_RMS=rms,
        HAS_DRESIDUAL=dresidual_out is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=needs_db,
        HAS_DX=needs_dx,
        HAS_DW=needs_dw,
    )
    plan, rows_per_program = bwd_plan(M, N, x.dtype, runtime.arch(x.device), runtime.num_sms(x.device), flags)
    programs = plan.grid[1]  # each sums its slab's rows into a row of partial dweight and dbias
    dw_partial = runtime.empty((programs, N) if needs_dw else (0,), torch.float32, x.device)
    db_partial = runtime.empty((programs, N) if needs_db else (0,), torch.float32, x.device)
    if M > 0:
        dres = _dummy_if_none(dresidual_out, dy)
        values = dict(
            MEAN=mean,
            RSTD=rstd,
            M=M,
            N=N,
            rows_per_program=rows_per_program,
            stride_dy_row=dy.stride(0),
            stride_dres_row=dres.stride(0),
            stride_x_row=x.stride(0),
        )
        with runtime.device_guard(x):
            runtime.launch(
                plan.kernel,
                plan.grid,
                DY=dy,
                DRESIDUAL_OUT=dres,
                X=x,
                W=_dummy_if_none(weight, x),
                DX=dx,
                DW_PARTIAL=dw_partial,
                DB_PARTIAL=db_partial,
                **plan.pack(values),
                **plan.options(),
                **runtime.COMPILE_OPTIONS,
            )
    param_dtype = weight.dtype if weight is not None else x.dtype
    # Stage two of the reduction: a fixed-order sum over the programs' partial rows. Without the
    # parameter, an empty tensor of its dtype all the same (the fake kernel's).
    dweight = dw_partial.sum(0) if needs_dw else dw_partial
    dbias = db_partial.sum(0) if needs_db else db_partial
    return dx, dweight.to(param_dtype), dbias.to(param_dtype)


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd
# ----------------------------------------------------------------------------------------------


def _norm_fwd_fake(x, weight, bias, residual, eps, rms):
    return _fwd_outputs(x, residual, rms)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _eps, rms = inputs
    _y, residual_out, mean, rstd = output
    ctx.save_for_backward(residual_out if residual is not None else x, weight, mean, rstd)
    ctx.has_bias, ctx.has_residual, ctx.rms = bias is not None, residual is not None, rms


def _backward(ctx, dy, dresidual_out, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dres = dresidual_out if ctx.has_residual else None
    needs_x, needs_weight, needs_bias, needs_residual = ctx.needs_input_grad[:4]
    needs = [needs_x or needs_residual, needs_weight, needs_bias]  # x and the residual share dx
    dx, dweight, dbias = _norm_bwd_op(dy, dres, x, weight, mean, rstd, ctx.has_bias, ctx.rms, needs)
    grads = zip((dx, dweight, dbias, dx), (needs_x, needs_weight, needs_bias, needs_residual), strict=True)
    return *(g if need else None for g, need in grads), None, None


_norm_fwd_op = runtime.custom_op("norm_fwd", _norm_fwd_fake, _backward, _setup_context)(norm_fwd)


def _norm_bwd_fake(dy, dresidual_out, x, weight, mean, rstd, has_bias, rms, needs):
    N = x.shape[1]
    param_dtype = weight.dtype if weight is not None else x.dtype
    return (
        x.new_empty(x.shape if needs[0] else (0,)),
        x.new_empty((N,) if needs[1] and weight is not None else (0,), dtype=param_dtype),
        x.new_empty((N,) if needs[2] and has_bias else (0,), dtype=param_dtype),
    )


_norm_bwd_op = runtime.custom_op("norm_bwd", _norm_bwd_fake)(norm_bwd)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _check_tensor(fn: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    runtime.check_tensor(fn, name, t, ref.device, SUPPORTED_DTYPES, "float16, bfloat16 or float32")


def _normalized_size(fn: str, x: torch.Tensor, normalized_shape) -> tuple[tuple[int, ...], int]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) == 0 or len(shape) > x.dim() or tuple(x.shape[-len(shape) :]) != shape:
        raise ValueError(
            f"{fn}: normalized_shape {list(shape)} must match the trailing dimensions of input, "
            f"whose shape is {list(x.shape)}"
        )
    n = math.prod(shape)
    if not 1 <= n <= MAX_HIDDEN:
        raise ValueError(
            f"{fn}: normalized_shape {list(shape)} holds {n} elements; the kernels take 1 to {MAX_HIDDEN}"
        )
    return shape, n


def _check_last_dim(fn: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{fn}: {name} must have a contiguous last dimension (stride 1), got stride "
            f"{t.stride(-1)}; call .contiguous() on it first"
        )


def _norm(fn, x, residual, normalized_shape, weight, bias, eps, rms, weight_offset=0.0):
    """Validate, flatten to (M, N), dispatch; returns (y, residual_out or None)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: input must be a torch.Tensor, got {type(x).__name__}")
    _check_tensor(fn, "input", x, x)
    shape, n = _normalized_size(fn, x, normalized_shape)
    _check_last_dim(fn, "input", x)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            _check_tensor(fn, name, p, x)
            if tuple(p.shape) != shape:
                raise ValueError(f"{fn}: {name} must have shape {list(shape)}, got {list(p.shape)}")
    if residual is not None:
        _check_tensor(fn, "residual", residual, x)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"{fn}: residual must match input's shape {list(x.shape)} and dtype {x.dtype}, "
                f"got {list(residual.shape)} and {residual.dtype}"
            )
        _check_last_dim(fn, "residual", residual)
    if weight_offset != 0.0 and weight is None:
        raise ValueError(f"{fn}: weight_offset {weight_offset} needs a weight, got weight=None")
    if rms and eps is None:
        eps = torch.finfo(torch.float32).eps  # as torch.nn.functional.rms_norm
    if not runtime.runs_triton(x):
        h = x if residual is None else reference.residual_add(x, residual)
        if rms:
            y = reference.rms_norm(h, shape, weight, eps, weight_offset)
        else:
            y = reference.layer_norm(h, shape, weight, bias, eps)
        return y.to(x.dtype), None if residual is None else h
    if weight_offset != 0.0:
        # The kernels multiply by the weight in float32 before the cast to input's dtype: a float32
        # weight + offset is Gemma's float32 (1 + weight) exactly, and autograd carries its gradient back.
        weight = weight.float() + weight_offset
    w = weight.reshape(n) if weight is not None else None
    b = bias.reshape(n) if bias is not None else None
    r = residual.reshape(-1, n) if residual is not None else None
    y, residual_out, _, _ = _norm_fwd_op(x.reshape(-1, n), w, b, r, float(eps), rms)
    return y.view(x.shape), residual_out.view(x.shape) if residual is not None else None


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` with Triton kernels.

    input (..., *normalized_shape) in float16/bfloat16/float32 with a contiguous last dimension;
    weight and bias of shape normalized_shape (product at most 65,536) or None. Returns a tensor
    of input's shape and dtype.
    """
    return _norm("layer_norm", input, None, normalized_shape, weight, bias, eps, rms=False)[0]


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` with Triton kernels; ``eps=None`` means float32's eps.

    weight_offset: the scale is ``weight_offset + weight``, added and multiplied in float32 before the
    cast to input's dtype; Gemma's RMSNorm, ``(x̂ · (1 + weight.float())).to(x.dtype)``, is
    ``weight_offset=1.0``. It needs a weight, whose gradient comes back in the weight's dtype.
    """
    return _norm("rms_norm", input, None, normalized_shape, weight, None, eps, True, weight_offset)[0]


def add_layer_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``h = input + residual; y = layer_norm(h)``, returning ``(y, h)``.

    residual has input's shape and dtype; h is rounded to that dtype before it is normalised, as
    in the unfused computation. Feed h to the next residual branch.
    """
    return _norm("add_layer_norm", input, residual, normalized_shape, weight, bias, eps, rms=False)


def add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``h = input + residual; y = rms_norm(h, weight_offset=weight_offset)``, returning ``(y, h)``."""
    return _norm("add_rms_norm", input, residual, normalized_shape, weight, None, eps, True, weight_offset)
