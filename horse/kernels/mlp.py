"""The transformer MLP: GEMMs with the bias and activation fused into their epilogues, forward and backward.

    linear_act:      y = act(x Wᵀ + b)
    gated_linear:    y = act(x W_gateᵀ) ⊙ (x W_upᵀ)                  (SwiGLU with silu, GeGLU with gelu)
    fused_mlp:       y = act(x W_inᵀ + b_in) W_outᵀ + b_out           (GPT-2: c_fc → GELU → c_proj)
    fused_gated_mlp: y = (act(x W_gateᵀ) ⊙ (x W_upᵀ)) W_downᵀ        (LLaMA: gate_proj, up_proj, down_proj)

act is one of ``none``, ``relu``, ``relu2`` (relu squared), ``gelu`` (erf), ``gelu_tanh`` and ``silu``,
always named by the caller (``activation=``, keyword-only, no default: no function picks one silently).
x is (..., K) with its leading dims flattened to M rows; weights are nn.Linear's (out_features,
in_features). Any M, N, K (ragged edges are masked; zero sizes allowed) and any strides: the kernels
take every stride, so transposed or expanded operands are read in place (only gate and up weights
with different strides from each other are copied). float16 or bfloat16
(every tensor of a call in one dtype), float32 accumulation, outputs in the input dtype.
float32 inputs raise on the Triton path: tl.dot would run them as TF32 behind the caller's back.
On CPU tensors without the interpreter, every function runs the float32 reference of
``horse.kernels.reference`` instead (float32 allowed there), cast to the input's dtype.

Forward: one tiled GEMM per projection with act in the epilogue. Tiles go in grouped order
(GROUP_M row tiles share each weight column tile while it is in L2). The gated kernel makes one
pass over x with two accumulators, so x W_gateᵀ and x W_upᵀ reach memory only when the backward
needs them. Decode-sized M (at most 64 rows) with fewer output tiles than SMs splits the K loop
over programs (:func:`split_k`: at least one program an SM) and a second kernel adds the float32
partials in a fixed order and runs the same epilogue (repeatable: no atomics). gelu_tanh in these
epilogues is tanh.approx on NVIDIA GPUs (one MUFU an element; see ``_act_fwd``). The
down projection is a bare ``torch.matmul`` (cuBLAS, bias in its epilogue): it has nothing to fuse.

Backward: dpre = dh ⊙ act'(pre); dx = dpre W; dW = dpreᵀ x; db = Σ_rows dpre. In the MLPs the
GEMM that produces dh = dy W_out (K = out_features) is ours, with dpre computed in its epilogue
(for the gated form the product rule: dgate = dh ⊙ up ⊙ act'(gate), dup = dh ⊙ act(gate)) and db
summed there as per-row-tile float32 partials (no atomics: bit-identical run to run). In
linear_act / gated_linear, dh arrives from outside, so an elementwise kernel computes dpre and the
db partials. dx and dW are ``torch.matmul``: a plain GEMM with nothing to fuse, where cuBLAS is
the fastest there is. Gated, dgate and dup are the halves of one (M, 2N) buffer, so dW_gate and
dW_up are ONE GEMM of 2N rows, [dgate | dup]ᵀ x, when both train (the custom ops return it
stacked; the autograd binding splits it).

Saved, not recomputed: the forward's epilogue writes the pre-activation (gate and up for the gated
form) in the input dtype, and the backward reads it. Cost: M·N elements kept per layer (2·M·N
gated) and one extra M·N write in the forward; no extra FLOPs. Recomputing it instead would save
that memory but cost the forward GEMM again, 2·M·N·K FLOPs (+1/6 of a GPT-2 MLP's forward+backward
GEMM FLOPs, +2/9 gated).
The MLPs keep only the pre-activation, not the hidden activation h = act(pre) that dW_out needs:
the backward's epilogue recomputes h from pre (about ten FLOPs per element, on CUDA cores) and
writes it, one M·N write. So an MLP keeps M·H elements for its backward (2·M·H gated), where eager
PyTorch keeps pre and h (2·M·H; gated 4·M·H: gate, act(gate), up and h). ``bench.mlp`` measures
both costs: the forward with and without saving, and the bytes each implementation keeps.
No grad needed (``torch.no_grad()`` or no input requiring one): nothing is saved or written.

float16 overflow: a pre-activation (gate, up) past ±65,504 that feeds an activation is clamped to
it, and both the output and the backward's act' are computed from the clamped value (a
straight-through clamp), so they agree: stored as ±inf it gave a finite output (silu(-inf) = 0) and
NaN gradients (act'(-inf) = inf x 0). With activation ``none`` the output is left as a matmul gives it.

Operand tiles move by TMA on Hopper and newer (sm_90+): x and weight tiles (dy and W_out in the backward's)
come through tensor descriptors, whose loads read out-of-bounds elements as zeros (no masks in the K loop);
W_out is read as stored, in (K, N) tiles (a descriptor needs its unit stride last). Operands whose start or
row stride is not a multiple of 16 bytes, transposed weights, other GPUs and ``USE_TMA = False`` take pointer
loads (one kernel serves both: the ``TMA`` constexpr). sm_90's large and medium forwards run persistent
(``GemmConfig.persistent``): one program an SM walks the tiles in grouped order and the epilogue subtiles
leave by TMA stores while the next tile's loads are in flight; other epilogues store by pointers. The GEMM
tiles come from a table with an entry per GPU family (``horse.kernels.runtime.ARCHS``), clean in the
compile report.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from horse.kernels import reference, runtime
from horse.kernels.runtime import inline_ptx

ACTIVATIONS = ("none", "relu", "relu2", "gelu", "gelu_tanh", "silu")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Operand tiles by TMA where tma_usable allows; False sends every GEMM down the pointer path (the
# bench's "ours-pointer" row measures the difference).
USE_TMA = True
# The dh GEMM asks L2 for its epilogue's saved tiles this many K steps before its loop ends: at ~7.5
# dense fp16 TFLOP/s an SM (an H200's), a 128x256x64 step takes ~0.6 us; two, about twice a DRAM
# load's latency (an estimate: no GPU has timed it).
PREFETCH_STEPS = tl.constexpr(2)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


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
def _act_fwd_and_grad(z, ACTIVATION: tl.constexpr):
    """(act(z), act'(z)) for a float32 tile."""
    if ACTIVATION == "relu":
        y = tl.maximum(z, 0.0)
        dy = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == "relu2":
        r = tl.maximum(z, 0.0)
        y = r * r
        dy = 2.0 * r
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        y = z * cdf
        dy = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACTIVATION == "gelu_tanh":
        s = tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
        y = z * s
        dy = s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z)
    elif ACTIVATION == "silu":
        s = tl.sigmoid(z)
        y = z * s
        dy = s * (1.0 + z * (1.0 - s))
    else:
        y = z
        dy = tl.full(z.shape, 1.0, tl.float32)
    return y, dy


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
    pid_m,
    pid_n,
    M,
    N,
    K,
    x_strides,
    w_strides,
    k_first,
    k_last,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
    W_KN: tl.constexpr,
    GATED: tl.constexpr,
    PRE=None,
    UP=None,
    PREFETCH: tl.constexpr = 0,
):
    """The (BLOCK_M, BLOCK_N) float32 tiles (pid_m, pid_n) of x Wᵀ and, GATED, of x WUᵀ (WU like W,
    W_KN false; one pass over x, two accumulators; otherwise WU is not read and the second is zeros),
    summed over K steps k_first to k_last - 1 (of BLOCK_K each; :func:`_k_range`).

    With TMA, X is a descriptor of x (M, K) and W one of W (N, K), or with W_KN of Wᵀ (K, N) as
    stored (a descriptor needs a unit stride in its last dimension); their loads read elements past
    the edges as zeros. Otherwise X and W are pointers, walked through their strides.

    PREFETCH (the dh GEMM's epilogue input, NVIDIA only): 1 asks L2 for PRE's (M, N) tile (pid_m,
    pid_n) during the last PREFETCH_STEPS K steps, 2 for UP's too (:func:`_prefetch_saved`).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start_m = pid_m * BLOCK_M
    start_n = pid_n * BLOCK_N
    k_prefetch = tl.maximum(k_last - PREFETCH_STEPS, k_first)
    if TMA:
        for k in range(k_first, k_last):
            if PREFETCH and k == k_prefetch:
                _prefetch_saved(PRE, UP, start_m, start_n, M, N, PREFETCH == 2, BLOCK_M, BLOCK_N)
            x = X.load([start_m, k * BLOCK_K])
            if W_KN:
                w = W.load([k * BLOCK_K, start_n])
            else:
                w = tl.trans(W.load([start_n, k * BLOCK_K]))
            acc = tl.dot(x, w, acc)
            if GATED:
                acc_up = tl.dot(x, tl.trans(WU.load([start_n, k * BLOCK_K])), acc_up)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        x_offs, w_offs = _operand_offsets(offs_m, offs_n, offs_k, M, N, x_strides, w_strides)
        x_step, w_step = _k_steps(x_strides, w_strides, BLOCK_K)
        x_ptrs = X + x_offs + k_first * x_step
        w_ptrs = W + w_offs + k_first * w_step
        wu_ptrs = WU + w_offs + k_first * w_step
        for k in range(k_first, k_last):
            if PREFETCH and k == k_prefetch:
                _prefetch_saved(PRE, UP, start_m, start_n, M, N, PREFETCH == 2, BLOCK_M, BLOCK_N)
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
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The left and right (BLOCK_M, BLOCK_N // 2) column halves of a tile."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _subtile(acc, INDEX: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column subtile INDEX of SPLIT (1, 2 or 4) equal ones of a (BLOCK_M, BLOCK_N) tile.

    The reshape, permute and split move no data in the MMA accumulator's register layout.
    """
    if SPLIT == 1:
        sub = acc
    else:
        left, right = _halves(acc, BLOCK_M, BLOCK_N)
        half = left if INDEX < SPLIT // 2 else right
        if SPLIT == 2:
            sub = half
        else:
            left, right = _halves(half, BLOCK_M, BLOCK_N // 2)
            sub = left if INDEX % 2 == 0 else right
    return sub


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
def _act_bwd_tile(
    dh,
    pre,
    up,
    DPRE,
    DUP,
    H,
    offs_m,
    offs_n,
    M,
    N,
    stride_dpre,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    STORE_H: tl.constexpr,
):
    """Given dh, the float32 gradient of the hidden activation h on one tile, and the saved pre (and,
    gated, up) tiles as :func:`_load_saved` loads them, store dpre (and, gated, dup) and, when
    STORE_H, h itself; return dpre in float32 with rows past M zeroed (for db). DPRE and DUP have
    rows stride_dpre apart (2N gated: the halves of one [dgate | dup] buffer, so the weight
    gradients are one GEMM); H is (M, N) contiguous.

    Plain: h = act(pre), dpre = dh act'(pre). Gated, with pre the gate and up the up projection:
    h = act(gate) up, dgate = dh up act'(gate), dup = dh act(gate).
    """
    row_mask = offs_m < M
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    grad_tile = offs_m.to(tl.int64)[:, None] * stride_dpre + offs_n[None, :]
    act, act_grad = _act_fwd_and_grad(pre.to(tl.float32), ACTIVATION)
    if GATED:
        up = up.to(tl.float32)
        tl.store(DUP + grad_tile, (dh * act).to(DUP.dtype.element_ty), mask=mask)
        dpre = dh * up * act_grad
        h = act * up
    else:
        dpre = dh * act_grad
        h = act
    tl.store(DPRE + grad_tile, dpre.to(DPRE.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(H + tile, h.to(H.dtype.element_ty), mask=mask)
    return tl.where(row_mask[:, None], dpre, 0.0)


@triton.jit
def _prefetch_saved(
    PRE, UP, start_m, start_n, M, N, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Ask L2 for the saved pre (and up) tile (BLOCK_M, BLOCK_N) at (start_m, start_n) of the (M, N)
    contiguous PRE and UP (16-bit): one prefetch a 128-byte line, its row and column kept inside the
    tensor, so that the epilogue's loads of the tile hit L2."""
    LINE: tl.constexpr = 64  # 16-bit elements a 128-byte line
    LINES: tl.constexpr = BLOCK_N // LINE if BLOCK_N > LINE else 1
    rows = tl.minimum(start_m + tl.arange(0, BLOCK_M), M - 1)
    cols = tl.minimum(start_n + tl.arange(0, LINES) * LINE, N - 1)
    lines = rows.to(tl.int64)[:, None] * N + cols[None, :]
    for T in tl.static_range(2 if GATED else 1):  # pre, and gated up
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [(UP if T else PRE) + lines], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _dh_act_bwd_kernel(
    DY,  # (M, K): the gradient of the MLP's output, strides dy_strides; with TMA a descriptor,
    # blocks (BLOCK_M, BLOCK_K)
    W,  # (N, K): W_outᵀ read through its strides w_strides, so dh = dy W_out; with TMA
    # a descriptor of W_out (K, N) as stored, blocks (BLOCK_K, BLOCK_N)
    PRE,  # (M, N) contiguous: the saved pre-activation (the gate when GATED)
    UP,  # (M, N) contiguous: the saved up projection; read when GATED
    DPRE,  # (M, N), row stride stride_dpre: gradient of PRE
    DUP,  # (M, N), row stride stride_dpre: gradient of UP; written when GATED
    H,  # (M, N) contiguous: the hidden activation, recomputed from PRE; written when STORE_H
    DB_PARTIAL,  # (cdiv(M, BLOCK_M), N) float32: column sums of dpre per row tile; when HAS_BIAS
    M,
    N,
    K,
    dy_strides,
    w_strides,
    stride_dpre,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    STORE_H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    TMA: tl.constexpr,
    INLINE_PTX: tl.constexpr,  # an NVIDIA GPU, not the interpreter: the L2 prefetch (_prefetch_saved)
):
    # grid = (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),): dh = dy W_out never reaches memory.
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    SUB_N: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
    # The saved pre (and up) is loaded after the K loop, and asked of L2 during its last K steps.
    # Loaded into registers there (issue 25), the first subtile's LDGs did precede the last wgmma wait
    # in the sm_90 SASS, but Triton then computed that subtile's act twice, in the load's layout for
    # h's store and in the MMA's for dpre (dh small: MUFU.EX2 32 -> 48 a thread; large: 4672 -> 5392
    # instructions). sm_90 fp16 gelu, prefetch before the loop -> in it: a K step 123 -> 132
    # instructions (large, pointers), 86 -> 95 (TMA), the prefetch's branch taken on one step alone;
    # registers -15..+3, no spill (medium, small likewise).
    dh, _ = _matmul_tile(
        DY, W, W, pid_m, pid_n, M, N, K, dy_strides, w_strides, 0, tl.cdiv(K, BLOCK_K), BLOCK_M, BLOCK_N,
        BLOCK_K, TMA, True, False, PRE, UP, (1 + GATED) if INLINE_PTX else 0,
    )  # fmt: skip
    for i in tl.static_range(EPILOGUE_SPLIT):
        sub = _subtile(dh, i, EPILOGUE_SPLIT, BLOCK_M, BLOCK_N)
        offs_sub = pid_n * BLOCK_N + i * SUB_N + tl.arange(0, SUB_N)
        pre, up = _load_saved(PRE, UP, offs_m, offs_sub, M, N, GATED)
        dpre = _act_bwd_tile(
            sub, pre, up, DPRE, DUP, H, offs_m, offs_sub, M, N, stride_dpre, ACTIVATION, GATED, STORE_H
        )
        if HAS_BIAS:
            db_ptrs = DB_PARTIAL + pid_m.to(tl.int64) * N + offs_sub
            tl.store(db_ptrs, tl.sum(dpre, axis=0), mask=offs_sub < N)


@triton.jit
def _act_bwd_kernel(
    DH,  # (M, N): gradient of the hidden activation, strides dh_strides
    PRE,  # (M, N) contiguous: the saved pre-activation (the gate when GATED)
    UP,  # (M, N) contiguous: the saved up projection; read when GATED
    DPRE,  # (M, N), row stride stride_dpre
    DUP,  # (M, N), row stride stride_dpre; written when GATED
    DB_PARTIAL,  # (cdiv(M, rows_per_program), N) float32: column sums of dpre per slab; when HAS_BIAS
    M,
    N,
    rows_per_program,
    dh_strides,
    stride_dpre,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
        pre, up = _load_saved(PRE, UP, offs_m, offs_n, row_end, N, GATED)
        dpre = _act_bwd_tile(
            dh, pre, up, DPRE, DUP, DPRE, offs_m, offs_n, row_end, N, stride_dpre, ACTIVATION, GATED, False
        )
        if HAS_BIAS:
            db_acc += tl.sum(dpre, axis=0)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid_m.to(tl.int64) * N + offs_n, db_acc, mask=offs_n < N)


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


@triton.jit
def _pre_activation(acc, B, offs_n, N, OUT_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    """acc + b for a forward tile at columns offs_n, clamped as :func:`_finite_in` says (float32)."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return _finite_in(acc, OUT_DTYPE, ACTIVATION)


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


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of a GEMM kernel: a (block_m, block_n) output tile, its K step, group and pipeline."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    epilogue_split: int = 1  # the epilogue runs on 1, 2 or 4 column subtiles, one after another
    tma: bool = True  # x, weight and dy tiles by TMA (tensor descriptors) where the GPU and strides allow
    # A forward's persistent kernel (one program an SM walking the tiles, epilogue stored by TMA) where
    # its operands and outputs take TMA (:func:`_persistent`); the tiled kernel otherwise.
    persistent: bool = False


# Per GPU family (runtime.arch), kernel and shape class (see shape_class). float16 and bfloat16 share
# every entry: the same element size, tensor-core instruction shapes and shared-memory footprint;
# the compile report builds each entry in both dtypes for its family's target, with pointer loads
# and on sm_90+ where tma is set with TMA loads, and every one lowers to tensor-core instructions
# with no spills, for every activation (python -m bench.compile_report --filter mlp: its output is
# the record of how each builds). The sm_90 entries, here, are chosen for speed. The other families'
# (horse/kernels/configs/mlp.json) are the first candidates, from sm_90's tile and the deepest pipeline
# down, that compile clean there on triton 3.6 and 3.9 (python -m bench.tune mlp --compile-only
# --arch FAMILY --start-from sm90); none is measured yet (python -m bench.tune mlp on such a GPU
# refines them).
#
# sm_90: TMA took fewer registers in the forwards (170 against 223 in the large gelu_tanh one, 174
# against 242 in the medium gated one), about as many in the backwards, and 24-64 bytes more
# shared memory (its barriers); which is faster is for the bench to measure ("ours" against
# "ours-pointer"). 8 warps are two warpgroups, each owning a 64-row half of the tile. The gated
# forward holds two accumulators, so its tiles are half as wide. The epilogue split keeps the
# activation's temporaries within the registers the accumulator leaves: unsplit, a 128 x 256
# forward with gelu spilled 224 bytes and the backward 2136, a 128 x 128 gated backward 1000.
# gelu_tanh by tanh.approx in the forward epilogues (issue 25; sm_90 SASS, fp16, TMA, before ->
# after): MUFU an element of the tile 2 (EX2 + RCP) -> 1 (TANH) in fwd and gated_fwd, every class;
# kernel instructions fwd large 3312 -> 2288, medium 1888 -> 1368, small 1144 -> 888, gated_fwd
# 2088 -> 1568, 2120 -> 1608, 1336 -> 1080; main loop per K step unchanged (87, 83, 81; 122, 123,
# 120); registers (pointer / TMA) fwd large 220/169 -> 190/167, medium 136/104 -> 142/104, small
# 72/58 -> 72/58, gated large 190/160 -> 184/160, medium 242/168 -> 204/172, small 128/96 ->
# 122/96; no spills before or after.
# Split-K at decode sizes (issue 25; the small entries of fwd and gated_fwd, sm_90, fp16, TMA):
# programs for GPT-2 124M's up projection at M <= 64 48 -> 144 (3 splits, then a 48-program
# epilogue pass); the split variant's main loop 82 instructions a K step (81 unsplit; gated 120
# both), registers fwd 58 (as unsplit), gated 108 (96 unsplit), no spills; the epilogue kernel
# (SPLIT_K_EPILOGUE_WARPS) 48 registers (gated 58-64), no spills.
# The gated backward writes [dgate | dup] into one buffer (dW_gate and dW_up: 2 cuBLAS GEMMs ->
# 1 of 2N rows): gated_dh_bwd registers (pointer / TMA) large 128/132 -> 136/134, medium
# 128/126 -> 135/136, small 78/76 -> 88/87; dh_bwd within 3 of before; no spills.
# Persistent forwards (issue 25; sm_90 SASS, fp16, gelu_tanh, tiled TMA kernel -> persistent):
# programs on an H200's 132 SMs, GPT-2 at M = 8192 tokens: fwd large (128 x 256) 124M (N = 3072) 768
# tiles -> 132 programs of 5-6 tiles, 350M (N = 4096) 1024 -> 132 of 7-8; gated large (128 x 128)
# at the same shapes 1536 / 2048 -> 132 of 11-12 / 15-16; one program resident an SM before and
# after. TMA stores (UTMASTG) in the epilogue 0 -> one per output subtile (fwd large 8: y and pre
# in 4 quarters; medium 4; gated large 12, medium 6), each copy twice in the SASS (the flattened
# loop's pipelined and remainder versions); plain STG 32/16/24/24 -> 0. wgmma shapes unchanged
# (4x 64x256x16, 4x 64x128x16, 8x 64x128x16 a K step). The flattened loop (tile and K loops as one,
# the epilogue under a branch) takes per K step fwd large 87 -> 166 instructions, medium 83 -> 168,
# gated large 122 -> 216, medium 123 -> 217 (the next tile's coordinates and predicates ride
# along; unflattened the K loop was 89, 85, 127, 130, with the next tile's loads only after the
# epilogue). Registers 167 -> 186, 104 -> 119, 160 -> 176, 172 -> 166; shared memory (KiB) 144 ->
# 160, 128 -> 144, 192 -> 200, 160 -> 168 (the epilogue's staging buffer); no spills. The medium
# fwd entry's epilogue is split in two for its subtiled stores: tiled kernel registers (pointer /
# TMA) 142/104 -> 116/101. Which kernel is faster is for bench.mlp on an H200 to say.
# dh backward (issue 25): loading the first subtile's saved pre (and up) before the K loop put its
# LDG.E.128 ahead of the HGMMA loop and the last wgmma wait in the sm_90 SASS (after it before),
# but Triton's layout pass then computed that subtile's act twice (see _dh_act_bwd_kernel), and the
# large entries spilled 56-120 bytes on sm_90 (gelu, TMA and pointer), 8-104 on sm_80 and sm_86,
# 248 on gfx942. Not kept: the load stays after the loop.
GEMM_CONFIGS = {
    "sm90": {
        "fwd": {
            "large": GemmConfig(128, 256, 64, 8, 8, 3, epilogue_split=4, persistent=True),
            "medium": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=2, persistent=True),
            "small": GemmConfig(64, 64, 64, 8, 4, 4),
        },
        "gated_fwd": {
            "large": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=4, persistent=True),
            "medium": GemmConfig(64, 128, 64, 8, 4, 4, epilogue_split=2, persistent=True),
            "small": GemmConfig(64, 64, 64, 8, 4, 4),
        },
        "dh_bwd": {
            "large": GemmConfig(128, 256, 64, 8, 8, 3, epilogue_split=4),
            "medium": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=2),
            "small": GemmConfig(64, 64, 64, 8, 4, 4, epilogue_split=2),
        },
        "gated_dh_bwd": {
            "large": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=4),
            "medium": GemmConfig(64, 128, 64, 8, 4, 4, epilogue_split=4),
            "small": GemmConfig(64, 64, 64, 8, 4, 4, epilogue_split=2),
        },
    },
    **runtime.load_configs("mlp", GemmConfig)["GEMM_CONFIGS"],
}
# Small, unequal tiles in the interpreter: quick there, several tiles cross every edge, and the
# epilogue runs split, so the CPU tests run the subtile code too.
INTERPRETER_GEMM_BLOCKS = {"block_m": 32, "block_n": 64, "block_k": 32, "group_m": 2, "num_warps": 4,
                           "num_stages": 1, "epilogue_split": 4}  # fmt: skip
# From this many outputs on, the large class's 128 x 256 tiles fill about two waves of an H200's
# 132 SMs (256 tiles); below, smaller tiles keep more SMs busy.
LARGE_OUTPUTS = 2**23
SMALL_ROWS = 64
# The split-K epilogue (elementwise, in the small GEMM entry's tiles) on 8 warps: on 4, sm100's
# fwd tile spilled 8 bytes with gelu_tanh in bfloat16.
SPLIT_K_EPILOGUE_WARPS = 8


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of the elementwise backward: (block_m, block_n) tiles, and its warps."""

    block_m: int
    block_n: int
    num_warps: int


# 4 warps (32 values a thread) spilled 8 bytes with gelu in bfloat16 on triton 3.9.
ACT_BWD_CONFIG = RowConfig(16, 256, 8)


def shape_class(M: int, N: int) -> str:
    """The GEMM table's key for an (M, N) output: ``small`` (M <= 64: decoding, tiny batches),
    ``large`` (at least LARGE_OUTPUTS elements) or ``medium``."""
    if M <= SMALL_ROWS:
        return "small"
    return "large" if M * N >= LARGE_OUTPUTS else "medium"


def gemm_config(kernel: str, M: int, N: int, device: torch.device) -> GemmConfig:
    """The GEMM_CONFIGS entry of kernel for an (M, N) output on device's GPU family."""
    cfg = GEMM_CONFIGS[runtime.arch(device).name][kernel][shape_class(M, N)]
    return dataclasses.replace(cfg, **INTERPRETER_GEMM_BLOCKS) if runtime.INTERPRET else cfg


def _grid(cfg: GemmConfig, M: int, N: int, splits: int = 1) -> tuple[int, ...]:
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    return (tiles,) if splits == 1 else (tiles, splits)


def split_k(cfg: GemmConfig, M: int, N: int, K: int, device: torch.device) -> int:
    """How many programs share each output tile's K loop in a forward GEMM (1: no split).

    Decode-sized M (at most SMALL_ROWS rows) gives too few output tiles to occupy the GPU: GPT-2
    124M's up projection at M <= 64 is 48 tiles of 64 x 64 for 132 SMs. Its K loop is then split
    until at least one program runs per SM (runtime.num_sms: the device's count; a fixed stand-in
    in the interpreter), with at least one K step a split; the partial sums (float32, M x N a split)
    are added in split order by _split_k_epilogue_kernel, which runs the epilogue: repeatable, no
    atomics. GPT-2 124M at M = 1: 48 programs -> 144 (3 splits of 4 K steps each).
    """
    tiles = _grid(cfg, M, N)[0]
    sms = runtime.num_sms(device)
    if M > SMALL_ROWS or tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, tiles), triton.cdiv(K, cfg.block_k)))


def _launch_options(cfg: GemmConfig, tma: bool | None) -> dict:
    """The constexprs and options of a GEMM launch; tma None for the persistent kernels (TMA only)."""
    blocks = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}
    options = {"EPILOGUE_SPLIT": cfg.epilogue_split, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return blocks | options | ({} if tma is None else {"TMA": tma}) | runtime.COMPILE_OPTIONS


def _persistent(cfg: GemmConfig, tma: bool, splits: int, y: torch.Tensor) -> bool:
    """Whether a forward runs its persistent kernel: the entry says so, the operands take TMA, the K
    loop is not split, and the outputs (y's shape, all contiguous) take TMA stores: rows of a
    multiple of 16 bytes."""
    return cfg.persistent and tma and splits == 1 and runtime.tma_compatible(y)


def _output_tiles(cfg: GemmConfig, *outputs: torch.Tensor) -> list:
    """Descriptors of (M, N) outputs for the persistent kernels' epilogue subtiles; an empty output
    (pre not saved) gets the first one's, which the kernel does not write."""
    block = (cfg.block_m, cfg.block_n // cfg.epilogue_split)
    tiles = [runtime.tma_operand(t, block, True) if t.numel() else None for t in outputs]
    return [t if t is not None else tiles[0] for t in tiles]


def tma_usable(cfg: GemmConfig, *operands: torch.Tensor) -> bool:
    """Whether a GEMM with cfg loads its operand tiles by TMA: ``USE_TMA`` and the table entry allow
    it and :func:`runtime.tma_compatible` holds for every operand as stored (K not a multiple of 8 in
    half precision, unaligned views and transposed weights take the pointer path)."""
    return USE_TMA and cfg.tma and runtime.tma_compatible(*operands)


def _stores_pre(activation: str, save_pre: bool) -> bool:
    # act' of "none" is 1: its backward needs no pre-activation.
    return save_pre and activation != "none"


def _fwd_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_up: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str,
    store_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """act(x Wᵀ + b), or with w_up (weight is then W_gate, no bias) act(x W_gateᵀ) ⊙ x W_upᵀ in one
    pass over x with two accumulators. Returns (y, pre, up), each (M, N) in x's dtype: pre = x Wᵀ + b
    (the gate), up = x W_upᵀ (pre again without w_up), both empty unless store_pre."""
    M, K = x.shape
    N = weight.shape[0]
    gated = w_up is not None
    if gated and w_up.stride() != weight.stride():  # the pointer path walks both with one set of strides
        weight, w_up = weight.contiguous(), w_up.contiguous()
    y = runtime.empty((M, N), x.dtype, x.device)
    pre = runtime.empty((M, N) if store_pre else (0,), x.dtype, x.device)
    up = runtime.empty((M, N) if store_pre else (0,), x.dtype, x.device) if gated else pre
    if M == 0 or N == 0:
        return y, pre, up
    cfg = gemm_config("gated_fwd" if gated else "fwd", M, N, x.device)
    tma = tma_usable(cfg, x, weight, *([w_up] if gated else []))
    x_tiles = runtime.tma_operand(x, (cfg.block_m, cfg.block_k), tma)
    w_tiles = runtime.tma_operand(weight, (cfg.block_n, cfg.block_k), tma)
    wu_tiles = runtime.tma_operand(w_up, (cfg.block_n, cfg.block_k), tma) if gated else w_tiles
    b = bias if bias is not None else x if gated else weight  # a dummy pointer without a bias
    flags = {"ACTIVATION": activation, "GATED": gated, "HAS_BIAS": bias is not None, "STORE_PRE": store_pre}
    splits = split_k(cfg, M, N, K, x.device)
    partial = runtime.empty(((1 + gated) * splits, M, N) if splits > 1 else (0,), torch.float32, x.device)
    with runtime.device_guard(x):
        if _persistent(cfg, tma, splits, y):
            # One program an SM (runtime.num_sms: the interpreter's stand-in is 4), or one a tile if fewer.
            programs = min(_grid(cfg, M, N)[0], runtime.num_sms(x.device))
            runtime.launch(
                _fwd_persistent_kernel, (programs,),
                x_tiles, w_tiles, wu_tiles, b, *_output_tiles(cfg, y, pre, up), M, N, K,
                **flags, INLINE_PTX=inline_ptx(x), **_launch_options(cfg, None),
            )  # fmt: skip
        else:
            runtime.launch(
                _fwd_kernel, _grid(cfg, M, N, splits),
                x_tiles, w_tiles, wu_tiles, b, y, pre, up, partial, M, N, K, x.stride(), weight.stride(),
                **flags, SPLIT_K=splits > 1, INLINE_PTX=inline_ptx(x), **_launch_options(cfg, tma),
            )  # fmt: skip
        if splits > 1:  # the epilogue, after the float32 partials' sum in split order, in the GEMM's tiles
            runtime.launch(
                _split_k_epilogue_kernel, (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m)),
                partial, bias if bias is not None else y, y, pre, up, M, N, splits, **flags,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INLINE_PTX=inline_ptx(y),
                num_warps=SPLIT_K_EPILOGUE_WARPS, **runtime.COMPILE_OPTIONS,
            )  # fmt: skip
    return y, pre, up


def _db(partial: torch.Tensor, has_bias: bool, dtype: torch.dtype) -> torch.Tensor:
    # Stage two of the bias gradient: a fixed-order sum over the row tiles' float32 partials. Without
    # a bias, an empty tensor of the parameters' dtype all the same (the fake kernel's).
    return (partial.sum(0) if has_bias else partial).to(dtype)


def _pre_grads(M: int, N: int, gated: bool, like: torch.Tensor):
    """(dpre, dpre's rows, dup's rows, their row stride): where the backward kernels write the
    gradient of the pre-activation. Gated, dpre is one (M, 2N) buffer [dgate | dup] whose halves
    the kernels write, so that dW_gate and dW_up are one GEMM (:func:`_gated_input_grads`);
    otherwise (M, N), and dup's rows an empty tensor."""
    dpre = runtime.empty((M, 2 * N if gated else N), like.dtype, like.device)
    if not gated:
        return dpre, dpre, runtime.empty((0,), like.dtype, like.device), N
    return dpre, dpre[:, :N], dpre[:, N:], 2 * N


def _dh_act_bwd(
    dy: torch.Tensor,
    w_out: torch.Tensor,
    pre: torch.Tensor,
    up: torch.Tensor | None,
    activation: str,
    has_bias: bool,
    need_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dh = dy W_out in a GEMM whose epilogue applies act' (and the gate's product rule).

    Returns (dpre, h, db): dpre (M, N), or gated (up given) (M, 2N), [dgate | dup]; h, the hidden
    activation recomputed from pre (M, N), or pre itself for ``none`` (empty unless need_h: only
    the gradient of W_out uses it); db (N,) or empty.
    """
    M, N = pre.shape
    K = dy.shape[1]
    gated = up is not None
    store_h = need_h and (gated or activation != "none")
    dpre, dpre_rows, dup_rows, stride_dpre = _pre_grads(M, N, gated, pre)
    h = runtime.empty((M, N), pre.dtype, pre.device) if store_h else pre if need_h else pre[:0]
    cfg = gemm_config("gated_dh_bwd" if gated else "dh_bwd", M, N, pre.device)
    db_partial = runtime.empty(
        (triton.cdiv(M, cfg.block_m), N) if has_bias else (0,), torch.float32, pre.device
    )
    if M > 0 and N > 0:
        w = w_out.t()  # (N, K) view of the (K, N) weight: dh = dy (w_outᵀ)ᵀ, read in place
        # TMA reads w_out as stored, (block_k, block_n) tiles: a descriptor needs its unit stride last.
        tma = tma_usable(cfg, dy, w_out)
        dy_tiles = runtime.tma_operand(dy, (cfg.block_m, cfg.block_k), tma)
        w_tiles = runtime.tma_operand(w_out, (cfg.block_k, cfg.block_n), tma) if tma else w
        with runtime.device_guard(pre):
            runtime.launch(
                _dh_act_bwd_kernel, _grid(cfg, M, N),
                dy_tiles, w_tiles, pre, up if gated else pre, dpre_rows, dup_rows, h, db_partial, M, N, K,
                dy.stride(), w.stride(), stride_dpre,
                ACTIVATION=activation, GATED=gated, STORE_H=store_h, HAS_BIAS=has_bias,
                INLINE_PTX=inline_ptx(pre), **_launch_options(cfg, tma),
            )  # fmt: skip
    return dpre, h, _db(db_partial, has_bias, pre.dtype)


def _act_bwd(
    dh: torch.Tensor, pre: torch.Tensor, up: torch.Tensor | None, activation: str, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise backward of act (or of act(gate) ⊙ up): (dpre, db or empty), dpre as
    :func:`_pre_grads` lays it out."""
    M, N = pre.shape
    gated = up is not None
    cfg = ACT_BWD_CONFIG
    # Enough slabs of rows to fill the GPU; each sums its own rows of db (float32, fixed order).
    column_blocks = triton.cdiv(N, cfg.block_n)
    slabs = max(1, 4 * runtime.num_sms(pre.device) // max(1, column_blocks))
    rows_per_program = triton.cdiv(triton.cdiv(max(M, 1), slabs), cfg.block_m) * cfg.block_m
    grid = (column_blocks, triton.cdiv(M, rows_per_program))
    dpre, dpre_rows, dup_rows, stride_dpre = _pre_grads(M, N, gated, pre)
    db_partial = runtime.empty((grid[1], N) if has_bias else (0,), torch.float32, pre.device)
    if M > 0 and N > 0:
        with runtime.device_guard(pre):
            runtime.launch(
                _act_bwd_kernel, grid,
                dh, pre, up if gated else pre, dpre_rows, dup_rows, db_partial, M, N, rows_per_program,
                dh.stride(), stride_dpre,
                ACTIVATION=activation, GATED=gated, HAS_BIAS=has_bias,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **runtime.COMPILE_OPTIONS,
            )  # fmt: skip
    return dpre, _db(db_partial, has_bias, pre.dtype)


def _input_grads(dpres, x: torch.Tensor | None, weights, needs: list[bool]) -> list[torch.Tensor]:
    """[dx = Σ dpre_i W_i, dW_i = dpre_iᵀ x ...] for the layers (dpre_i, W_i) that read x: plain GEMMs,
    cuBLAS's (nothing to fuse; torch.matmul reads any strides). needs[0] says whether dx is wanted,
    needs[1 + i] whether dW_i is: an input or a weight that needs no gradient (frozen weights,
    LoRA) gets an empty tensor and no GEMM, and x is saved (not None) only when some dW_i is wanted."""
    dx = dpres[0].new_empty((0,))  # a new empty tensor each: an op's outputs may not alias
    if needs[0]:
        for i, (dpre, weight) in enumerate(zip(dpres, weights, strict=True)):
            dx = torch.matmul(dpre, weight) if i == 0 else torch.addmm(dx, dpre, weight)
    pairs = zip(dpres, needs[1:], strict=True)
    return [dx, *(torch.matmul(dpre.t(), x) if need else dpre.new_empty((0,)) for dpre, need in pairs)]


def _gated_input_grads(dgate_up: torch.Tensor, x, w_gate, w_up, needs: list[bool]):
    """(dx, dW_gate|up) from dgate_up (M, 2N) = [dgate | dup]: dx = dgate W_gate + dup W_up, two
    cuBLAS GEMMs reading the halves in place; with both weights training, [dW_gate; dW_up] =
    [dgate | dup]ᵀ x in ONE GEMM of 2N rows, returned stacked (2N, K) (an op's outputs may not
    alias, so :func:`_split_gate_up` splits it outside the op); with one, that weight's (N, K); with
    neither, an empty tensor. One GEMM of 2N rows instead of two of N: half the launches and a
    single pass over x, the tiles of both halves in one grid."""
    N = w_gate.shape[0]
    dgate, dup = dgate_up[:, :N], dgate_up[:, N:]
    dx = _input_grads([dgate, dup], x, [w_gate, w_up], [needs[0], False, False])[0]
    rows = dgate_up if needs[1] and needs[2] else dgate if needs[1] else dup if needs[2] else None
    return dx, dgate_up.new_empty((0,)) if rows is None else torch.matmul(rows.t(), x)


def _split_gate_up(dw_gate_up: torch.Tensor, needs: list[bool]) -> tuple:
    """(dW_gate, dW_up) from :func:`_gated_input_grads`' result; None where needs says no gradient."""
    if needs[0] and needs[1]:
        return tuple(dw_gate_up.tensor_split(2))  # two empty halves when N = 0
    return (dw_gate_up, None) if needs[0] else (None, dw_gate_up if needs[1] else None)


def linear_act_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of :func:`linear_act` on validated (M, K) input: (y, pre or an empty tensor)."""
    y, pre, _ = _fwd_gemm(x, weight, None, bias, activation, _stores_pre(activation, save_pre))
    return y, pre


def linear_act_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    pre: torch.Tensor,
    has_bias: bool,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`linear_act_fwd`: (dx, dweight, dbias), each an empty tensor where not
    wanted (needs: dx, dweight; has_bias: dbias); x may then be None (see :func:`_input_grads`)."""
    if activation == "none":
        dpre = dy
        db = dy.sum(0, dtype=torch.float32).to(dy.dtype) if has_bias else dy.new_empty((0,))
    else:
        dpre, db = _act_bwd(dy, pre, None, activation, has_bias)
    return *_input_grads([dpre], x, [weight], needs), db


def gated_linear_fwd(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of :func:`gated_linear` on validated (M, K) input: (y, gate, up), the last two empty
    unless save_pre."""
    return _fwd_gemm(x, w_gate, w_up, None, activation, save_pre)


def gated_linear_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of :func:`gated_linear_fwd`: (dx, dw_gate|up) as :func:`_gated_input_grads` returns
    them, empty where needs (dx, dw_gate, dw_up) says not wanted."""
    dgate_up, _ = _act_bwd(dy, gate, up, activation, has_bias=False)
    return _gated_input_grads(dgate_up, x, w_gate, w_up, needs)


def _down_proj(h: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor | None) -> torch.Tensor:
    # cuBLAS, with the bias in its epilogue: a plain GEMM has nothing for us to fuse.
    return torch.matmul(h, w_out.t()) if b_out is None else torch.addmm(b_out, h, w_out.t())


def _out_grads(dy: torch.Tensor, h: torch.Tensor, has_b_out: bool, need_dw: bool):
    """(dW_out = dyᵀ h or empty unless need_dw, db_out = Σ_rows dy or empty): cuBLAS, and one float32
    reduction over dy."""
    db_out = dy.sum(0, dtype=torch.float32).to(dy.dtype) if has_b_out else dy.new_empty((0,))
    return torch.matmul(dy.t(), h) if need_dw else dy.new_empty((0,)), db_out


def fused_mlp_fwd(
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    activation: str,
    save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of :func:`fused_mlp` on validated (M, K) input: (y, pre).

    pre is what the backward needs: the pre-activation (for ``none``, h itself), or an empty tensor
    unless save_pre.
    """
    store_pre = _stores_pre(activation, save_pre)
    h, pre, _ = _fwd_gemm(x, w_in, None, b_in, activation, store_pre)
    if save_pre and not store_pre:
        pre = h  # "none": h is the pre-activation
    return _down_proj(h, w_out, b_out), pre


def fused_mlp_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    pre: torch.Tensor,
    has_b_in: bool,
    has_b_out: bool,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`fused_mlp_fwd`: (dx, dw_in, db_in, dw_out, db_out); what needs (dx, dw_in,
    dw_out) or has_b_in / has_b_out leave out is an empty tensor, and costs no GEMM."""
    if needs[0] or needs[1] or has_b_in:
        dpre, h, db_in = _dh_act_bwd(dy, w_out, pre, None, activation, has_b_in, need_h=needs[2])
        dx, dw_in = _input_grads([dpre], x, [w_in], needs[:2])
    else:  # only W_out and b_out train: no dh GEMM, h recomputed elementwise where dW_out needs it
        dx, dw_in, db_in = (dy.new_empty((0,)) for _ in range(3))  # outputs may not alias
        h = reference.apply_activation(pre.float(), activation).to(pre.dtype) if needs[2] else dx
    return dx, dw_in, db_in, *_out_grads(dy, h, has_b_out, needs[2])


def gated_mlp_fwd(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
    save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of :func:`fused_gated_mlp` on validated (M, K) input: (y, gate, up)."""
    h, gate, up = _fwd_gemm(x, w_gate, w_up, None, activation, save_pre)
    return _down_proj(h, w_down, None), gate, up


def gated_mlp_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`gated_mlp_fwd`: (dx, dw_gate|up as :func:`_gated_input_grads` returns it,
    dw_down), empty where needs (dx, dw_gate, dw_up, dw_down) says not wanted (no GEMM for it)."""
    if any(needs[:3]):
        dgate_up, h, _ = _dh_act_bwd(dy, w_down, gate, up, activation, has_bias=False, need_h=needs[3])
        grads = _gated_input_grads(dgate_up, x, w_gate, w_up, needs[:3])
    else:  # only W_down trains: no dh GEMM, h recomputed elementwise
        grads = [dy.new_empty((0,)) for _ in range(2)]  # outputs may not alias
        h = (reference.apply_activation(gate.float(), activation) * up.float()).to(gate.dtype)
        h = h if needs[3] else grads[0]
    return *grads, _out_grads(dy, h, has_b_out=False, need_dw=needs[3])[0]


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd
# ----------------------------------------------------------------------------------------------


def _fake_pre(x: torch.Tensor, n: int, saved: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], n) if saved else (0,))


def _fake_dgate_up(dy: torch.Tensor, w_gate: torch.Tensor) -> torch.Tensor:
    # The backward fakes run the cuBLAS GEMMs of :func:`_input_grads` and :func:`_gated_input_grads`
    # on fake tensors, as the ops do: the fakes' shapes and strides are the ops'. This stands for the
    # Triton kernels' [dgate | dup] (M, 2N).
    return dy.new_empty((dy.shape[0], 2 * w_gate.shape[0]))


def _require_saved(ctx, op: str) -> None:
    if not ctx.save_pre:
        raise RuntimeError(
            f"horse::{op}: backward through a forward run with save_pre=False, which saves nothing; "
            "the public functions set save_pre whenever an input requires grad"
        )


def _wanted(ctx, *grads):
    """grads, None where needs_input_grad says the input takes none (the op returned an empty tensor)."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=True))


def _linear_act_fwd_fake(x, weight, bias, activation, save_pre):
    N = weight.shape[0]
    return x.new_empty((x.shape[0], N)), _fake_pre(x, N, _stores_pre(activation, save_pre))


def _linear_act_setup_context(ctx, inputs, output):
    x, weight, bias, activation, save_pre = inputs
    # x only for the weight's gradient: with a frozen weight (LoRA, fine-tuning) it is not kept.
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight, output[1])
    ctx.has_bias = bias is not None and ctx.needs_input_grad[2]
    ctx.activation, ctx.save_pre = activation, save_pre or activation == "none"


def _linear_act_backward(ctx, dy, _dpre):
    _require_saved(ctx, "linear_act_fwd")
    x, weight, pre = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:2])
    dx, dweight, dbias = _linear_act_bwd_op(dy, x, weight, pre, ctx.has_bias, ctx.activation, needs)
    return _wanted(ctx, dx, dweight, dbias, None, None)


_linear_act_fwd_op = runtime.custom_op(
    "linear_act_fwd", _linear_act_fwd_fake, _linear_act_backward, _linear_act_setup_context
)(linear_act_fwd)


def _linear_act_bwd_fake(dy, x, weight, pre, has_bias, activation, needs):
    # dy stands for dpre (M, N), as it is for "none".
    return (*_input_grads([dy], x, [weight], needs), dy.new_empty((weight.shape[0],) if has_bias else (0,)))


_linear_act_bwd_op = runtime.custom_op("linear_act_bwd", _linear_act_bwd_fake)(linear_act_bwd)


def _gated_linear_fwd_fake(x, w_gate, w_up, activation, save_pre):
    N = w_gate.shape[0]
    return x.new_empty((x.shape[0], N)), _fake_pre(x, N, save_pre), _fake_pre(x, N, save_pre)


def _gated_linear_setup_context(ctx, inputs, output):
    x, w_gate, w_up, activation, save_pre = inputs
    _y, gate, up = output
    needs = ctx.needs_input_grad
    ctx.save_for_backward(x if needs[1] or needs[2] else None, w_gate, w_up, gate, up)
    ctx.activation, ctx.save_pre = activation, save_pre


def _gated_linear_backward(ctx, dy, _dgate, _dup):
    _require_saved(ctx, "gated_linear_fwd")
    x, w_gate, w_up, gate, up = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])
    dx, dw_gate_up = _gated_linear_bwd_op(dy, x, w_gate, w_up, gate, up, ctx.activation, needs)
    return _wanted(ctx, dx, *_split_gate_up(dw_gate_up, needs[1:]), None, None)


_gated_linear_fwd_op = runtime.custom_op(
    "gated_linear_fwd", _gated_linear_fwd_fake, _gated_linear_backward, _gated_linear_setup_context
)(gated_linear_fwd)


def _gated_linear_bwd_fake(dy, x, w_gate, w_up, gate, up, activation, needs):
    return _gated_input_grads(_fake_dgate_up(dy, w_gate), x, w_gate, w_up, needs)


_gated_linear_bwd_op = runtime.custom_op("gated_linear_bwd", _gated_linear_bwd_fake)(gated_linear_bwd)


def _fused_mlp_fwd_fake(x, w_in, b_in, w_out, b_out, activation, save_pre):
    return x.new_empty((x.shape[0], w_out.shape[0])), _fake_pre(x, w_in.shape[0], save_pre)


def _fused_mlp_setup_context(ctx, inputs, output):
    x, w_in, b_in, w_out, b_out, activation, save_pre = inputs
    needs = ctx.needs_input_grad
    ctx.save_for_backward(x if needs[1] else None, w_in, w_out, output[1])
    ctx.has_b_in, ctx.has_b_out = b_in is not None and needs[2], b_out is not None and needs[4]
    ctx.activation, ctx.save_pre = activation, save_pre


def _fused_mlp_backward(ctx, dy, _dpre):
    _require_saved(ctx, "fused_mlp_fwd")
    x, w_in, w_out, pre = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (0, 1, 3)]
    grads = _fused_mlp_bwd_op(dy, x, w_in, w_out, pre, ctx.has_b_in, ctx.has_b_out, ctx.activation, needs)
    return _wanted(ctx, *grads, None, None)


_fused_mlp_fwd_op = runtime.custom_op(
    "fused_mlp_fwd", _fused_mlp_fwd_fake, _fused_mlp_backward, _fused_mlp_setup_context
)(fused_mlp_fwd)


def _fused_mlp_bwd_fake(dy, x, w_in, w_out, pre, has_b_in, has_b_out, activation, needs):
    dx, dw_in = _input_grads([pre], x, [w_in], needs[:2])  # pre stands for dpre and h, (M, H)
    db_in = dy.new_empty((w_in.shape[0],) if has_b_in else (0,))
    return dx, dw_in, db_in, *_out_grads(dy, pre, has_b_out, needs[2])


_fused_mlp_bwd_op = runtime.custom_op("fused_mlp_bwd", _fused_mlp_bwd_fake)(fused_mlp_bwd)


def _gated_mlp_fwd_fake(x, w_gate, w_up, w_down, activation, save_pre):
    N = w_gate.shape[0]
    return x.new_empty((x.shape[0], w_down.shape[0])), _fake_pre(x, N, save_pre), _fake_pre(x, N, save_pre)


def _gated_mlp_setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, activation, save_pre = inputs
    _y, gate, up = output
    needs = ctx.needs_input_grad
    ctx.save_for_backward(x if needs[1] or needs[2] else None, w_gate, w_up, w_down, gate, up)
    ctx.activation, ctx.save_pre = activation, save_pre


def _gated_mlp_backward(ctx, dy, _dgate, _dup):
    _require_saved(ctx, "gated_mlp_fwd")
    x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    dx, dw_gate_up, dw_down = _gated_mlp_bwd_op(dy, x, w_gate, w_up, w_down, gate, up, ctx.activation, needs)
    return _wanted(ctx, dx, *_split_gate_up(dw_gate_up, needs[1:3]), dw_down, None, None)


_gated_mlp_fwd_op = runtime.custom_op(
    "gated_mlp_fwd", _gated_mlp_fwd_fake, _gated_mlp_backward, _gated_mlp_setup_context
)(gated_mlp_fwd)


def _gated_mlp_bwd_fake(dy, x, w_gate, w_up, w_down, gate, up, activation, needs):
    grads = _gated_input_grads(_fake_dgate_up(dy, w_gate), x, w_gate, w_up, needs[:3])
    return *grads, _out_grads(dy, gate, has_b_out=False, need_dw=needs[3])[0]  # gate stands for h


_gated_mlp_bwd_op = runtime.custom_op("gated_mlp_bwd", _gated_mlp_bwd_fake)(gated_mlp_bwd)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _check_tensor(fn: str, name: str, t, x: torch.Tensor, dim: int) -> None:
    runtime.check_tensor(fn, name, t, x.device, REFERENCE_DTYPES, "float16 or bfloat16 (float32 off the GPU)")
    if t.dtype != x.dtype:
        raise TypeError(f"{fn}: {name} is {t.dtype} but input is {x.dtype}; all tensors must share a dtype")
    if t.dim() != dim:
        raise ValueError(f"{fn}: {name} must have {dim} dimension(s), got shape {list(t.shape)}")


def _check_shape(fn: str, name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: {name} must have shape {list(shape)} ({what}), got {list(t.shape)}")


# Each bias by name, and the weight whose out_features it adds to.
_BIASES = {"bias": "weight", "b_in": "w_in", "b_out": "w_out"}


def _validate(fn: str, x, activation, params: dict) -> bool:
    """Check every argument, naming the bad one; returns whether the Triton kernels run.

    params: the weights, (out_features, in_features) tensors, and the biases (_BIASES), by name. The
    first weight consumes x; w_up has w_gate's shape; the down projection (w_out, w_down) consumes
    the first weight's outputs.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{fn}: input must have at least one dimension (..., in_features), got a scalar")
    _check_tensor(fn, "input", x, x, x.dim())
    if activation not in ACTIVATIONS:
        raise ValueError(f"{fn}: unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    weights = {name: w for name, w in params.items() if name not in _BIASES}
    for name, w in weights.items():
        _check_tensor(fn, name, w, x, 2)
    (first, w), *rest = weights.items()
    if w.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{fn}: {first} has in_features {w.shape[1]} but input's last dimension is {x.shape[-1]} "
            f"(input {list(x.shape)}, {first} {list(w.shape)}; weights are (out_features, in_features) "
            "as in nn.Linear)"
        )
    for name, t in rest:
        if name == "w_up":
            _check_shape(fn, name, t, tuple(w.shape), f"{first}'s shape")
        else:
            _check_shape(fn, name, t, (t.shape[0], w.shape[0]), f"in_features = {first}'s out_features")
    for name, bias in params.items():
        if name in _BIASES and bias is not None:
            weight_name = _BIASES[name]
            _check_tensor(fn, name, bias, x, 1)
            _check_shape(fn, name, bias, (weights[weight_name].shape[0],), f"{weight_name}'s out_features")
    triton_path = runtime.runs_triton(x)
    if triton_path and x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{fn}: input must be float16 or bfloat16 on the Triton path, got {x.dtype} (tl.dot would "
            "compute float32 as TF32); cast the input and weights first"
        )
    return triton_path


def _apply(fn: str, op, reference_fn, x, activation: str, params: dict) -> torch.Tensor:
    """The public functions' one body: autocast, validate, then op on x as (M, K) (off the Triton
    path reference_fn), y back in x's leading dims. params: the op's tensors after x, by name."""
    x, *tensors = runtime.autocast(x, *params.values())
    if not _validate(fn, x, activation, dict(zip(params, tensors, strict=True))):
        return reference_fn(x, *tensors, activation=activation).to(x.dtype)
    x_2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # -1 cannot be inferred when K = 0
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors))
    y = op(x_2d, *tensors, activation, save)[0]
    return y.view(*x.shape[:-1], y.shape[-1])


def linear_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` in one GEMM, differentiable in x, weight and bias.

    x (..., K); weight (N, K) as nn.Linear's; bias (N,) or None; float16 or bfloat16, all one dtype
    and device. activation, required: none, relu, relu2, gelu (erf), gelu_tanh or silu; the positional
    arguments are F.linear's, and ``linear_act(x, weight, bias, activation="none")`` is F.linear (no
    default: F.linear's arguments alone raise rather than get an activation). Returns (..., N) in
    x's dtype. With grad enabled the pre-activation (M, N) is saved for the backward.
    """
    params = {"weight": weight, "bias": bias}
    return _apply("linear_act", _linear_act_fwd_op, reference.linear_act, x, activation, params)


def gated_linear(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, *, activation: str
) -> torch.Tensor:
    """``act(x @ w_gate.T) * (x @ w_up.T)`` in one kernel (SwiGLU with silu, GeGLU with gelu).

    x (..., K); w_gate and w_up (N, K); no biases. Returns (..., N) in x's dtype. One pass over x
    with two accumulators; with grad enabled both projections (M, N) are saved for the backward.
    """
    params = {"w_gate": w_gate, "w_up": w_up}
    return _apply("gated_linear", _gated_linear_fwd_op, reference.gated_linear, x, activation, params)


def fused_mlp(
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    *,
    activation: str,
) -> torch.Tensor:
    """The GPT-2 MLP ``act(x @ w_in.T + b_in) @ w_out.T + b_out``, differentiable in every tensor.

    x (..., K); w_in (H, K); b_in (H,) or None; w_out (D, H); b_out (D,) or None; float16 or
    bfloat16. Returns (..., D) in x's dtype. The up projection and act are one Triton GEMM; the
    down projection is cuBLAS. With grad enabled only the pre-activation (M, H) is saved.
    """
    params = {"w_in": w_in, "b_in": b_in, "w_out": w_out, "b_out": b_out}
    return _apply("fused_mlp", _fused_mlp_fwd_op, reference.fused_mlp, x, activation, params)


def fused_gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: str,
) -> torch.Tensor:
    """The LLaMA MLP ``(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``, differentiable in every tensor.

    x (..., K); w_gate and w_up (H, K); w_down (D, H); no biases; float16 or bfloat16. Returns
    (..., D) in x's dtype. With grad enabled gate and up (M, H each) are saved, h is not.
    """
    params = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    return _apply("fused_gated_mlp", _gated_mlp_fwd_op, reference.fused_gated_mlp, x, activation, params)
