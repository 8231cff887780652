"""Cross-entropy with its gradient in the same pass, and the LM head fused with it.

    lse_i  = log Σ_v exp(z_iv)                                  (online max and sum over blocks of v)
    loss_i = (1 - ε)(lse_i - z_i,t) + ε(lse_i - mean_v z_iv) + λ lse_i²    (ε label smoothing, λ z-loss)
    ∂loss_i/∂z_iv = softmax(z_i)_v (1 + 2λ lse_i) - (1 - ε)[v = t] - ε / V

With a softcap c (Gemma 2's final-logit softcapping), z = c tanh(y / c) of the logits y, inside every
kernel (no capped copy of the logits), and ∂loss_i/∂y_iv = ∂loss_i/∂z_iv (1 - (z_iv / c)²).

``cross_entropy``: one Triton program per row sweeps the row twice inside one launch: the first sweep
keeps the running max and sum of exponentials (and the sum of logits for label smoothing), the second
writes the gradient, already multiplied by d(reduced loss)/d(loss_i) (1/n_valid for "mean", 1 for
"sum" and "none"), so the backward is a scale by the incoming gradient and never reads the logits
again. No float32 copy of the logits exists; arithmetic is float32 on float16/bfloat16/float32 rows.
The public ``cross_entropy`` writes the gradient into a buffer the op owns (the caller's logits are
left alone); ``linear_cross_entropy`` writes it in place of its own chunk of logits.

``linear_cross_entropy``: x (N, H) @ weightᵀ (V, H) [+ bias] and the loss, without the (N, V) logits.
Rows go in chunks (:func:`chunk_rows`: a budget of logits bytes, smaller when the GPU has little
free memory); per chunk a GEMM writes the logits, the kernel above turns them into the loss and, in
place, their gradient, and two GEMMs turn that into dx (complete for the chunk's rows) and dW
(added to a float32 accumulator, as db); everything in a fixed order, so gradients repeat bit for
bit. The GEMMs run in x's dtype (the weight and bias are cast to it; their gradients come back in
their own dtypes), so a float32 master weight under autocast gets a float32 gradient directly.
With reduction "none" the gradient depends on the incoming per-row gradient, so the forward
computes the loss only and the backward runs the chunks again.

A vocabulary shard (:class:`VocabShard`, tensor parallelism): the weight holds columns [start, start +
V_local) of a vocabulary of V; per chunk the row statistics are reduced over the ranks (one all-reduce
of the max, one of the sum of exponentials, the target's logit and the sum of logits) between a
statistics kernel and a gradient kernel; no rank ever holds another's logits.

One autograd (``_CrossEntropy``) serves both losses and every caller: the public functions, and
:func:`head_loss`, the model's loss and its tensor-parallel head's (with a shard, or of logits split by
vocabulary). Its forward computes the loss and the inputs' gradients, its backward scales them. On the
whole vocabulary it calls the custom ops ``horse::cross_entropy_rows`` and
``horse::linear_cross_entropy_chunks``, which torch.compile takes whole; a shard's collectives are
Python callables that cannot pass an op's schema, so with a shard it calls the same functions
directly. The chunk steps run on the Triton kernels or, on the model's reference backend and on a CPU
outside Triton's interpreter, on their plain-PyTorch twins (``*_torch``).

Targets are int64 in [0, V) or ``ignore_index`` (such rows add nothing and get zero gradients; the
"mean" of a batch with no other row is NaN from ``cross_entropy``, as from F.cross_entropy, and 0 from
``linear_cross_entropy``, the trainer's loss). V ranges over 1..1,048,576 (MAX_VOCAB), any size.
``cross_entropy`` takes logits (N, C) or (C,) only: F.cross_entropy reads N-D logits' classes from dim 1.

The kernels' arguments come in groups, as the launchers pack them: ``coefficients`` (label_smoothing,
z_loss: ε and λ), the fused kernel's ``strides`` (its tensors' row strides) and the statistics kernel's
``sizes`` (M, N); kernels are launched and device helpers called by keyword.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from horse.kernels import runtime

# The kernels sweep a row in blocks with int32 column offsets (row offsets are int64), so a row could
# hold up to 2**31 - 1 columns; the bound is the size the tests run (Gemma 3's 262,208 is above the
# previous 2**18).
MAX_VOCAB = 2**20
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------------------------
# Kernels (a row of logits has N vocabulary columns; M rows)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _softcap(z, SOFTCAP: tl.constexpr):
    """SOFTCAP · tanh(z / SOFTCAP) in float32, or z itself when SOFTCAP is None. Triton's core language
    has no tanh: tanh(u) = 2 sigmoid(2u) - 1, on every backend and in the interpreter."""
    if SOFTCAP is not None:
        z = SOFTCAP * (2.0 * tl.sigmoid(z * (2.0 / SOFTCAP)) - 1.0)
    return z


@triton.jit
def _row_stats(ROW, N, HAS_SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """(max, Σ exp(z - max), Σ z) of one row's (softcapped) logits z, float32, in one sweep over blocks
    of BLOCK_V."""
    m = tl.full((), float("-inf"), tl.float32)
    d = tl.zeros((), tl.float32)
    sum_z = tl.zeros((), tl.float32)
    for start in range(0, N, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < N
        z = tl.load(ROW + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if SOFTCAP is not None:  # the cap would turn the padding's -inf into -SOFTCAP
            z = tl.where(mask, _softcap(z, SOFTCAP=SOFTCAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # A row (or its start) of -inf logits: exp(-inf - -inf) would be NaN; shift by 0 instead.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            sum_z += tl.sum(tl.where(mask, z, 0.0), axis=0)
    return m, d, sum_z


@triton.jit
def _write_grad(
    ROW, DROW, N, target_col, lse, scale, coefficients, vocab, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr
):
    """DROW = scale · (softmax(z) (1 + 2 λ lse) - (1 - ε) onehot(target_col) - ε / vocab), in DROW's dtype,
    with coefficients (ε, λ) = (label_smoothing, z_loss); with a SOFTCAP c, z = c tanh(ROW / c) and the
    chain rule's 1 - (z / c)² multiplies that. Each element is read before it is written, so DROW may
    be ROW (in place)."""
    label_smoothing, z_loss = coefficients
    p_scale = 1.0 + 2.0 * z_loss * lse
    for start in range(0, N, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < N
        z = _softcap(tl.load(ROW + cols, mask=mask, other=0.0).to(tl.float32), SOFTCAP=SOFTCAP)
        g = tl.exp(z - lse) * p_scale - label_smoothing / vocab
        g = tl.where(cols == target_col, g - (1.0 - label_smoothing), g)
        if SOFTCAP is not None:
            capped = z * (1.0 / SOFTCAP)
            g *= 1.0 - capped * capped
        tl.store(DROW + cols, (g * scale).to(DROW.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_kernel(
    LOGITS,  # (M, N), row stride stride_logits, unit column stride
    DLOGITS,  # (M, N), row stride stride_dlogits: the gradient, when WRITE_GRAD; may be LOGITS
    TARGET,  # (M,) int64
    DLOSS,  # (M,) float32 with stride dloss_stride (0: one value for every row): d(reduced)/d(loss_i)
    LOSS,  # (M,) float32: loss_i, 0 on ignored rows
    LSE,  # (M,) float32
    N,
    strides,  # (stride_logits, stride_dlogits, dloss_stride): the row strides of LOGITS, DLOGITS, DLOSS
    ignore_index,
    coefficients,  # (label_smoothing, z_loss): ε and λ
    HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    SOFTCAP: tl.constexpr,  # None, or c: the logits are c tanh(z / c)
    BLOCK_V: tl.constexpr,
):
    # grid = (M,)
    stride_logits, stride_dlogits, dloss_stride = strides
    label_smoothing, z_loss = coefficients
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 on large logits
    logits_row = LOGITS + row * stride_logits
    target = tl.load(TARGET + row)
    ignored = target == ignore_index
    m, d, sum_z = _row_stats(logits_row, N=N, HAS_SMOOTHING=HAS_SMOOTHING, SOFTCAP=SOFTCAP, BLOCK_V=BLOCK_V)
    lse = tl.where(m == float("-inf"), 0.0, m) + tl.log(d)
    target_logit = tl.load(logits_row + target, mask=~ignored, other=0.0).to(tl.float32)
    target_logit = _softcap(target_logit, SOFTCAP=SOFTCAP)
    loss = lse * (1.0 + z_loss * lse) - (1.0 - label_smoothing) * target_logit
    if HAS_SMOOTHING:
        loss -= label_smoothing * sum_z / N
    tl.store(LOSS + row, tl.where(ignored, 0.0, loss))
    tl.store(LSE + row, lse)
    if WRITE_GRAD:
        scale = tl.where(ignored, 0.0, tl.load(DLOSS + row * dloss_stride))
        col = tl.where(ignored, -1, target)
        _write_grad(
            logits_row,
            DROW=DLOGITS + row * stride_dlogits,
            N=N,
            target_col=col,
            lse=tl.where(ignored, 0.0, lse),
            scale=scale,
            coefficients=coefficients,
            vocab=N,
            SOFTCAP=SOFTCAP,
            BLOCK_V=BLOCK_V,
        )


@triton.jit
def _cross_entropy_stats_kernel(
    LOGITS,  # (M, N), row stride stride_logits: this rank's vocabulary columns
    TARGET,  # (M,) int64: column of the target in this shard (outside [0, N): another rank's)
    STATS,  # (4, M) float32: max, Σ exp(z - max), the target's logit (0 if not here), Σ z
    sizes,  # (M, N)
    stride_logits,
    HAS_SMOOTHING: tl.constexpr,
    SOFTCAP: tl.constexpr,  # None, or c: the logits are c tanh(z / c)
    BLOCK_V: tl.constexpr,
):
    # grid = (M,)
    M, N = sizes
    row = tl.program_id(0).to(tl.int64)
    logits_row = LOGITS + row * stride_logits
    target = tl.load(TARGET + row)
    m, d, sum_z = _row_stats(logits_row, N=N, HAS_SMOOTHING=HAS_SMOOTHING, SOFTCAP=SOFTCAP, BLOCK_V=BLOCK_V)
    here = (target >= 0) & (target < N)
    tl.store(STATS + row, m)
    tl.store(STATS + M + row, d)
    target_logit = tl.load(logits_row + target, mask=here, other=0.0).to(tl.float32)
    tl.store(STATS + 2 * M + row, _softcap(target_logit, SOFTCAP=SOFTCAP))
    tl.store(STATS + 3 * M + row, sum_z)


@triton.jit
def _cross_entropy_grad_kernel(
    LOGITS,  # (M, N), row stride stride_logits: overwritten by the gradient
    TARGET,  # (M,) int64: column of the target in this shard
    LSE,  # (M,) float32: over the whole vocabulary
    SCALE,  # (M,) float32: d(reduced loss)/d(loss_i), 0 on ignored rows
    N,
    stride_logits,
    vocab,  # the whole vocabulary's size (N: this shard's columns)
    coefficients,  # (label_smoothing, z_loss): ε and λ
    SOFTCAP: tl.constexpr,  # None, or c: the logits are c tanh(z / c)
    BLOCK_V: tl.constexpr,
):
    # grid = (M,)
    row = tl.program_id(0).to(tl.int64)
    logits_row = LOGITS + row * stride_logits
    _write_grad(
        logits_row,
        DROW=logits_row,
        N=N,
        target_col=tl.load(TARGET + row),
        lse=tl.load(LSE + row),
        scale=tl.load(SCALE + row),
        coefficients=coefficients,
        vocab=vocab,
        SOFTCAP=SOFTCAP,
        BLOCK_V=BLOCK_V,
    )


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowConfig:
    block_v: int
    num_warps: int


# Logits a program holds per step of its sweep. At 4096 a float32 block is 8 values a thread over 16
# warps: larger blocks buy nothing for a memory-bound sweep and cost registers.
MAX_BLOCK_V = 4096


def row_config(n_cols: int, arch: runtime.Arch) -> RowConfig:
    """The block rule of the cross-entropy kernels on GPU family arch: the row (up to MAX_BLOCK_V) a
    step, 8 values a thread."""
    block_v = min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)
    return RowConfig(block_v, max(1, min(16, block_v // (8 * arch.warp_size))))


# The kernels' tuple arguments by their elements' names (runtime.Plan.tuples): the loss's coefficients
# (ε and λ), the fused kernel's row strides and the statistics kernel's sizes.
COEFFICIENTS = ("label_smoothing", "z_loss")
FUSED_TUPLES = {"strides": ("stride_logits", "stride_dlogits", "dloss_stride"), "coefficients": COEFFICIENTS}
STATS_TUPLES = {"sizes": ("M", "N")}
GRAD_TUPLES = {"coefficients": COEFFICIENTS}


def _row_plan(kernel, rows: int, vocab: int, arch: runtime.Arch, tuples: dict, **constexprs) -> runtime.Plan:
    """A plan of a loss kernel: a program per row of vocab logits, in row_config's blocks."""
    cfg = row_config(vocab, arch)
    constexprs |= {"BLOCK_V": cfg.block_v}
    return runtime.Plan(kernel, (rows,), constexprs, cfg.num_warps, num_stages=1, tuples=tuples)


def cross_entropy_plan(
    rows: int, vocab: int, arch: runtime.Arch, smoothing: bool, write_grad: bool, softcap: float | None
) -> runtime.Plan:
    """The fused kernel's plan for logits (rows, vocab) on GPU family arch: with label smoothing or
    not, writing the gradient or not, softcapped by softcap unless None."""
    return _row_plan(
        _cross_entropy_kernel,
        rows,
        vocab,
        arch,
        FUSED_TUPLES,
        HAS_SMOOTHING=smoothing,
        WRITE_GRAD=write_grad,
        SOFTCAP=softcap,
    )


def stats_plan(
    rows: int, vocab: int, arch: runtime.Arch, smoothing: bool, softcap: float | None
) -> runtime.Plan:
    """The statistics kernel's plan for a vocabulary shard's logits (rows, vocab)."""
    return _row_plan(
        _cross_entropy_stats_kernel, rows, vocab, arch, STATS_TUPLES, HAS_SMOOTHING=smoothing, SOFTCAP=softcap
    )


def grad_plan(rows: int, vocab: int, arch: runtime.Arch, softcap: float | None) -> runtime.Plan:
    """The gradient kernel's plan for a vocabulary shard's logits (rows, vocab)."""
    return _row_plan(_cross_entropy_grad_kernel, rows, vocab, arch, GRAD_TUPLES, SOFTCAP=softcap)


def _coefficients(label_smoothing: float, z_loss: float) -> dict:
    """The values of the kernels' coefficients, floats (an int 0 would compile another kernel)."""
    return dict(label_smoothing=float(label_smoothing), z_loss=float(z_loss))


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    dloss: torch.Tensor | None,
    dlogits: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and log-sum-exp (M,) float32 of logits (M, V) (unit column stride), softcapped by softcap
    unless None, against target (M,).

    With dloss (a float32 scalar, or (M,)) the kernel also writes dloss_i · ∂loss_i/∂logits into
    dlogits (M, V), which may be logits itself; ignored rows get zeros.
    """
    M, V = logits.shape
    loss = runtime.empty((M,), torch.float32, logits.device)
    lse = runtime.empty((M,), torch.float32, logits.device)
    if M == 0:
        return loss, lse
    write_grad = dloss is not None
    plan = cross_entropy_plan(M, V, runtime.arch(logits.device), label_smoothing > 0, write_grad, softcap)
    out = dlogits if write_grad else logits
    dloss = dloss if write_grad else loss
    values = _coefficients(label_smoothing, z_loss) | dict(
        stride_logits=logits.stride(0),
        stride_dlogits=out.stride(0),
        dloss_stride=dloss.stride(0) if dloss.dim() else 0,  # 0: one value for every row
    )
    with runtime.device_guard(logits):
        runtime.launch(
            plan.kernel,
            plan.grid,
            LOGITS=logits,
            DLOGITS=out,
            TARGET=target,
            DLOSS=dloss,
            LOSS=loss,
            LSE=lse,
            N=V,
            ignore_index=ignore_index,
            **plan.pack(values),
            **plan.options(),
            **runtime.COMPILE_OPTIONS,
        )
    return loss, lse


def cross_entropy_stats(
    logits: torch.Tensor, target: torch.Tensor, smoothing: bool, softcap: float | None
) -> torch.Tensor:
    """(4, M) float32 of logits (M, V_local) as :func:`cross_entropy_stats_torch` returns them."""
    M, V = logits.shape
    stats = runtime.empty((4, M), torch.float32, logits.device)
    if M == 0:
        return stats
    plan = stats_plan(M, V, runtime.arch(logits.device), smoothing, softcap)
    with runtime.device_guard(logits):
        runtime.launch(
            plan.kernel,
            plan.grid,
            LOGITS=logits,
            TARGET=target,
            STATS=stats,
            stride_logits=logits.stride(0),
            **plan.pack(dict(M=M, N=V)),
            **plan.options(),
            **runtime.COMPILE_OPTIONS,
        )
    return stats


def cross_entropy_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    vocab: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
) -> None:
    """Overwrite logits (M, V_local) by scale_i · ∂loss_i/∂logits (:func:`cross_entropy_grad_torch_`)."""
    M, V = logits.shape
    if M == 0:
        return
    plan = grad_plan(M, V, runtime.arch(logits.device), softcap)
    with runtime.device_guard(logits):
        runtime.launch(
            plan.kernel,
            plan.grid,
            LOGITS=logits,
            TARGET=target,
            LSE=lse,
            SCALE=scale,
            N=V,
            stride_logits=logits.stride(0),
            vocab=vocab,
            **plan.pack(_coefficients(label_smoothing, z_loss)),
            **plan.options(),
            **runtime.COMPILE_OPTIONS,
        )


# ----------------------------------------------------------------------------------------------
# The chunk steps on plain PyTorch: the statistics and gradient kernels' twins (the model's reference
# backend, and the CPU outside Triton's interpreter), on chunks of logits (C, V_local) in float32
# ----------------------------------------------------------------------------------------------


def finite_or_zero(row_max: torch.Tensor) -> torch.Tensor:
    """The row max to shift by before exp: 0 for a row of -inf logits (else exp(-inf - -inf) = NaN)."""
    return torch.where(row_max == float("-inf"), 0.0, row_max)


def softcap_(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """z ← softcap · tanh(z / softcap) in place (float32), or z as it is when softcap is None."""
    return z if softcap is None else z.div_(softcap).tanh_().mul_(softcap)


def cross_entropy_stats_torch(
    logits: torch.Tensor, target: torch.Tensor, smoothing: bool, softcap: float | None
) -> torch.Tensor:
    """:func:`cross_entropy_stats` on plain PyTorch: (4, C), each row's max, Σ exp(z - max), the logit at
    column target (0 where target is outside [0, V_local): another shard's, or ignored) and, with
    smoothing, Σ z (else 0), of the logits z softcapped by softcap unless None."""
    z = softcap_(logits.to(torch.float32, copy=True), softcap)  # the chunk's one float32 copy; then in place
    row_max = z.amax(dim=-1)
    here = (target >= 0) & (target < z.shape[1])
    target_logit = z.gather(1, target.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    sum_z = z.sum(dim=-1) if smoothing else torch.zeros_like(row_max)
    sum_exp = z.sub_(finite_or_zero(row_max)[:, None]).exp_().sum(dim=-1)
    return torch.stack([row_max, sum_exp, torch.where(here, target_logit, 0.0), sum_z])


def cross_entropy_grad_torch_(
    logits, target, lse, scale, vocab: int, label_smoothing: float, z_loss: float, softcap: float | None
):
    """:func:`cross_entropy_grad_` on plain PyTorch: overwrite logits (C, V_local) by scale_i · (softmax(z)
    (1 + 2 λ lse) - (1 - ε) onehot(target) - ε / vocab), lse over the whole vocabulary, target the
    column here (outside [0, V_local): none); with a softcap c, z = c tanh(logits / c) and that times
    1 - tanh²(logits / c) (a second float32 copy of the chunk)."""
    g = softcap_(logits.to(torch.float32, copy=True), softcap)  # one float32 copy, then in place
    g.sub_(lse[:, None]).exp_().mul_((1 + 2 * z_loss * lse)[:, None]).sub_(label_smoothing / vocab)
    here = ((target >= 0) & (target < g.shape[1])).to(g.dtype)[:, None]
    g.scatter_add_(1, target.clamp(0, g.shape[1] - 1)[:, None], -(1 - label_smoothing) * here)
    if softcap is not None:
        g.mul_(logits.to(torch.float32).div_(softcap).tanh_().square_().neg_().add_(1))
    logits.copy_(g.mul_(scale[:, None]))


# ----------------------------------------------------------------------------------------------
# The loss of a chunk, of logits, and of the LM head in chunks
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns [start, start + V_local) of a vocabulary of ``vocab`` split over ranks, and
    the two collectives that combine the ranks' row statistics (in place, over the tp group)."""

    start: int
    vocab: int
    all_reduce_max: Callable[[torch.Tensor], None]
    all_reduce_sum: Callable[[torch.Tensor], None]


# Bytes of one chunk's logits. 64 MiB is 0.7 % of the unfused loss's peak at gpt2-124m, 16 x 1024 tokens
# (10 GB: tests/test_cross_entropy.py's memory test), and gives the GEMMs 667 rows of a 50,304-word
# vocabulary in 16-bit. The plain-PyTorch twins hold a float32 copy of the chunk besides: half the rows.
CHUNK_BYTES = 64 * 2**20
# dW's float32 sum takes each chunk's 16-bit product in slices of the vocabulary of at most these bytes
# (a whole (V, H) product would be 77 MB more at gpt2-124m).
DW_SLICE_BYTES = 16 * 2**20


def chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device, use_triton: bool) -> int:
    """Rows per chunk: as many as CHUNK_BYTES of logits hold (half without Triton), at most 1/8 of the
    GPU's free memory."""
    budget = CHUNK_BYTES if use_triton else CHUNK_BYTES // 2
    if device.type == "cuda":
        budget = min(budget, torch.cuda.mem_get_info(device)[0] // 8)
    return max(1, min(n_rows, budget // (vocab * dtype.itemsize)))


def cross_entropy_loss_from_stats(stats, ignored, vocab: int, label_smoothing: float, z_loss: float):
    """(loss, lse) per row from the whole vocabulary's statistics (4, C) (:func:`cross_entropy_stats`,
    reduced over the shards); ignored rows lose 0."""
    row_max, sum_exp, target_logit, sum_z = stats
    lse = finite_or_zero(row_max) + torch.log(sum_exp)
    loss = lse * (1 + z_loss * lse) - (1 - label_smoothing) * target_logit
    if label_smoothing > 0:
        loss = loss - label_smoothing * sum_z / vocab
    return torch.where(ignored, 0.0, loss), lse


def _chunk_loss_(logits, target, dloss, options: tuple, use_triton: bool, shard: VocabShard | None):
    """Loss (C,) of a chunk of logits (C, V_local) with its targets (C,); with dloss the gradient
    replaces the logits. options: (ignore_index, label_smoothing, z_loss, softcap)."""
    ignore_index, label_smoothing, z_loss, softcap = options
    if use_triton and shard is None:
        return cross_entropy_fwd(logits, target, dloss, logits, *options)[0]
    start, vocab = (0, logits.shape[1]) if shard is None else (shard.start, shard.vocab)
    ignored = target == ignore_index
    local = torch.where(ignored, -1, target - start)  # the target's column here; outside: elsewhere
    smoothing = label_smoothing > 0
    if use_triton:
        stats = cross_entropy_stats(logits, local, smoothing, softcap)
    else:
        stats = cross_entropy_stats_torch(logits, local, smoothing, softcap)
    if shard is not None:
        row_max = stats[0].clone()
        shard.all_reduce_max(row_max)
        stats[1] *= torch.exp(stats[0] - finite_or_zero(row_max))
        stats[0] = row_max
        sums = stats[1:].contiguous()  # one all-reduce for the three sums
        shard.all_reduce_sum(sums)
        stats[1:] = sums
    loss, lse = cross_entropy_loss_from_stats(stats, ignored, vocab, label_smoothing, z_loss)
    if dloss is not None:
        scale = torch.where(ignored, 0.0, dloss.float().expand(target.shape)).contiguous()
        lse = torch.where(ignored, 0.0, lse)
        grad_ = cross_entropy_grad_ if use_triton else cross_entropy_grad_torch_
        grad_(logits, local, lse, scale, vocab, label_smoothing, z_loss, softcap)
    return loss


def cross_entropy_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    dloss: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    use_triton: bool,
    shard: VocabShard | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of logits (M, V_local), softcapped by softcap unless None, against target (M,) as one
    chunk: (loss (M,) float32, dlogits).

    With dloss (a float32 scalar or (M,): d(reduced loss)/d(loss_i)), dlogits is dloss_i · ∂loss_i/∂logits
    in a new tensor of logits' shape and dtype (logits are left alone); without, it is empty.
    """
    grad = dloss is not None
    options = (ignore_index, label_smoothing, z_loss, softcap)
    if use_triton and shard is None:  # one launch reads the logits and writes their gradient
        dlogits = runtime.empty(logits.shape if grad else (0,), logits.dtype, logits.device)
        loss, _ = cross_entropy_fwd(logits, target, dloss, dlogits if grad else None, *options)
        return loss, dlogits
    dlogits = logits.clone() if grad else logits.new_empty((0,))
    return _chunk_loss_(dlogits if grad else logits, target, dloss, options, use_triton, shard), dlogits


def linear_cross_entropy_chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    dloss: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    use_triton: bool,
    shard: VocabShard | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk loop: x (N, H), weight (V_local, H), bias (V_local,) or None, target (N,); the logits
    softcapped by softcap unless None.

    Returns (loss (N,) float32, dx, dweight, dbias). With dloss (a float32 scalar or (N,): the
    gradient of the caller's reduced loss with respect to each row's loss), dx is (N, H) in x's dtype
    and dweight, dbias come in weight's and bias's dtypes, summed in float32; without, they are empty.
    The per-chunk math runs the Triton kernels (use_triton) or their plain-PyTorch twins.
    """
    N, _ = x.shape
    V = weight.shape[0]
    w = weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    loss = runtime.empty((N,), torch.float32, x.device)
    grad = dloss is not None
    dx = runtime.empty(x.shape if grad else (0,), x.dtype, x.device)
    dw = torch.zeros(weight.shape if grad else (0,), dtype=torch.float32, device=x.device)
    db = torch.zeros((V,) if grad and bias is not None else (0,), dtype=torch.float32, device=x.device)
    if dloss is not None:
        dloss = dloss.float().expand(N)
    rows = chunk_rows(N, V, x.dtype, x.device, use_triton)
    dw_slice = max(1, DW_SLICE_BYTES // (x.shape[1] * x.element_size()))  # vocabulary rows
    buffer = torch.empty((min(rows, N), V), dtype=x.dtype, device=x.device)
    for start in range(0, N, rows):
        end = min(start + rows, N)
        xc = x[start:end]  # (C, H)
        logits = buffer[: end - start]  # (C, V): the chunk's logits, then their gradient
        if b is None:
            torch.mm(xc, w.T, out=logits)
        else:
            torch.addmm(b, xc, w.T, out=logits)
        dloss_c = None if dloss is None else dloss[start:end]
        options = (ignore_index, label_smoothing, z_loss, softcap)
        loss[start:end] = _chunk_loss_(logits, target[start:end], dloss_c, options, use_triton, shard)
        if grad:
            torch.mm(logits, w, out=dx[start:end])
            if dw.dtype == logits.dtype:
                dw.addmm_(logits.T, xc)
            else:  # 16-bit products (float32 inside the GEMM) added to the float32 sum
                for v in range(0, V, dw_slice):
                    dw[v : v + dw_slice] += logits[:, v : v + dw_slice].T @ xc
            if bias is not None:
                db += logits.sum(0, dtype=torch.float32)
    return loss, dx, dw.to(weight.dtype), db.to(x.dtype if bias is None else bias.dtype)


def row_weight(target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """d(reduced loss)/d(loss_i), a float32 scalar tensor: 1/n_valid for "mean", else 1. With no valid
    row it is 1: every row's own gradient is 0 then."""
    if reduction != "mean":
        return torch.ones((), dtype=torch.float32, device=target.device)
    return 1.0 / (target != ignore_index).sum().clamp(min=1).to(torch.float32)


def reduce_loss(
    loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, empty_mean_is_nan: bool
) -> torch.Tensor:
    """The reduced loss of per-row losses (float32). "mean" is over the rows not ignored; with none
    left it is NaN where empty_mean_is_nan (F.cross_entropy's 0/0), else 0."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    count = (target != ignore_index).sum().to(torch.float32)
    return loss.sum() / (count if empty_mean_is_nan else count.clamp(min=1))


# ----------------------------------------------------------------------------------------------
# Custom ops and the autograd
# ----------------------------------------------------------------------------------------------

# The options both ops take after their tensors, in torch's schema language.
_OPTIONS = "SymInt ignore_index, float label_smoothing, float z_loss, bool use_triton, float? softcap=None"


def _rows_fake(logits, target, dloss, ignore_index, label_smoothing, z_loss, use_triton, softcap=None):
    dlogits = logits.new_empty(logits.shape if dloss is not None else (0,))
    return logits.new_empty(target.shape, dtype=torch.float32), dlogits


@runtime.custom_op(
    "cross_entropy_rows",
    _rows_fake,
    schema=f"(Tensor logits, Tensor target, Tensor? dloss, {_OPTIONS}) -> (Tensor, Tensor)",
)
def _cross_entropy_rows_op(
    logits, target, dloss, ignore_index, label_smoothing, z_loss, use_triton, softcap=None
):
    options = (ignore_index, label_smoothing, z_loss)
    return cross_entropy_rows(logits, target, dloss, *options, use_triton, softcap=softcap)


def _chunks_fake(
    x, weight, bias, target, dloss, ignore_index, label_smoothing, z_loss, use_triton, softcap=None
):
    grad = dloss is not None
    return (
        x.new_empty(target.shape, dtype=torch.float32),
        x.new_empty(x.shape if grad else (0,)),
        weight.new_empty(weight.shape if grad else (0,)),
        x.new_empty((0,)) if bias is None else bias.new_empty(bias.shape if grad else (0,)),
    )


@runtime.custom_op(
    "linear_cross_entropy_chunks",
    _chunks_fake,
    schema=f"(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? dloss, {_OPTIONS}) -> "
    "(Tensor, Tensor, Tensor, Tensor)",
)
def _linear_cross_entropy_chunks_op(
    x, weight, bias, target, dloss, ignore_index, label_smoothing, z_loss, use_triton, softcap=None
):
    options = (ignore_index, label_smoothing, z_loss)
    return linear_cross_entropy_chunks(x, weight, bias, target, dloss, *options, use_triton, softcap=softcap)


def _loss_and_grads(
    x, weight, bias, target, dloss, shard, use_triton, ignore_index, label_smoothing, z_loss, softcap
):
    """(loss (N,), dx, dweight, dbias) of the logits x (weight None; dweight, dbias None then) or of the
    head x Wᵀ + b. On the whole vocabulary through the custom ops, which torch.compile takes whole; a
    shard's collectives cannot pass an op's schema, so a shard runs the same functions as Python."""
    options = (ignore_index, label_smoothing, z_loss)
    if weight is None:
        if shard is None:
            loss, dlogits = _cross_entropy_rows_op(x, target, dloss, *options, use_triton, softcap)
        else:
            loss, dlogits = cross_entropy_rows(x, target, dloss, *options, use_triton, shard, softcap)
        return loss, dlogits, None, None
    if shard is None:
        return _linear_cross_entropy_chunks_op(x, weight, bias, target, dloss, *options, use_triton, softcap)
    return linear_cross_entropy_chunks(x, weight, bias, target, dloss, *options, use_triton, shard, softcap)


class _CrossEntropy(torch.autograd.Function):
    """The loss's one autograd: of logits x (weight None) or of the LM head x Wᵀ + b, on the whole
    vocabulary (shard None) or on a shard of it (at tp > 1; ``head_loss``).

    The forward computes the inputs' gradients with the loss, for a gradient of 1 of the reduced loss
    (of each row's loss for "none"), and the backward scales them by the real one. The head's "none"
    instead runs the chunks again in the backward with each row's own gradient: dW sums over rows.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, target, shard, use_triton, wants_grad, options):
        # x (N, V_local) logits, or (N, H) with weight (V_local, H), bias (V_local,) or None; target (N,)
        ignore_index, reduction, label_smoothing, z_loss, softcap = options
        ctx.steps = (shard, use_triton, ignore_index, label_smoothing, z_loss, softcap)
        ctx.per_row = reduction == "none"
        ctx.recompute = weight is not None and ctx.per_row
        ctx.has_bias = bias is not None
        in_forward = wants_grad and not ctx.recompute
        dloss = row_weight(target, ignore_index, reduction) if in_forward else None
        loss, *grads = _loss_and_grads(x, weight, bias, target, dloss, *ctx.steps)
        ctx.save_for_backward(*((x, weight, bias, target) if ctx.recompute else grads))
        # a mean over no rows: F.cross_entropy's NaN for logits (cross_entropy is its drop-in); 0 for the
        # head, the trainer's loss, which stops on a NaN
        return reduce_loss(loss, target, ignore_index, reduction, empty_mean_is_nan=weight is None)

    @staticmethod
    def backward(ctx, dloss):
        if ctx.recompute:
            x, weight, bias, target = ctx.saved_tensors
            _, *grads = _loss_and_grads(x, weight, bias, target, dloss.contiguous(), *ctx.steps)
        else:  # computed in the forward for a reduced loss of gradient 1 (per row: the logits' rows)
            scale = dloss[:, None] if ctx.per_row else dloss
            grads = [None if g is None else (g * scale).to(g.dtype) for g in ctx.saved_tensors]
        dx, dweight, dbias = grads
        return dx, dweight, dbias if ctx.has_bias else None, None, None, None, None, None


def _cross_entropy(x, weight, bias, target, shard, use_triton, options: tuple) -> torch.Tensor:
    """The loss by its autograd. options: (ignore_index, reduction, label_smoothing, z_loss, softcap). The
    forward computes gradients only where autograd records (its ctx.needs_input_grad says True under
    torch.no_grad too)."""
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return _CrossEntropy.apply(x, weight, bias, target, shard, use_triton, wants_grad, options)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def check_options(fn: str, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float) -> None:
    if not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{fn}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"{fn}: z_loss must be at least 0, got {z_loss}")


def check_softcap(fn: str, softcap: float | None) -> float | None:
    """softcap as the kernels take it: None, or a positive finite float (an int becomes one: the
    kernels compile one program per value)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{fn}: softcap must be a positive float or None, got {type(softcap).__name__}")
    if not 0.0 < softcap < float("inf"):
        raise ValueError(f"{fn}: softcap must be a positive float or None, got {softcap}")
    return float(softcap)


def check_target(fn: str, target: torch.Tensor, rows: tuple[int, ...], vocab: int, ignore_index: int, device):
    """target: an int64 tensor of shape rows on device, every value in [0, vocab) or ignore_index.

    The values are checked on the host for CPU tensors; on a GPU and under torch.compile by an
    asynchronous device assert (no synchronisation), whose failure names the argument too."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{fn}: target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point:
        raise TypeError(
            f"{fn}: target must hold class indices, int64 (torch.long); got {target.dtype}: class "
            "probabilities (F.cross_entropy's floating-point targets) are not supported"
        )
    if target.dtype != torch.int64:
        raise TypeError(f"{fn}: target must be int64 (torch.long), got {target.dtype}")
    if tuple(target.shape) != rows:
        raise ValueError(f"{fn}: target must have shape {list(rows)}, got {list(target.shape)}")
    if target.device != device:
        raise ValueError(f"{fn}: target is on {target.device} but the input is on {device}")
    if target.device.type == "meta":
        return
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    message = f"{fn}: target values must be in [0, {vocab}) or ignore_index ({ignore_index})"
    if torch.compiler.is_compiling() or target.device.type != "cpu":
        torch._assert_async(~bad.any(), message)
    elif bad.any():
        value = target[bad][0].item()
        raise ValueError(f"{message}; got {value} at {tuple(bad.nonzero()[0].tolist())}")


def _check_float(fn: str, name: str, t: torch.Tensor, device) -> None:
    runtime.check_tensor(fn, name, t, device, SUPPORTED_DTYPES, "float16, bfloat16 or float32")


def _check_vocab(fn: str, name: str, vocab: int) -> None:
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"{fn}: {name} must have between 1 and {MAX_VOCAB} classes, got {vocab}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    # (M, n) with a unit column stride: the kernels take any row stride
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _refuse_unsupported(fn: str, weight, size_average, reduce) -> None:
    """F.cross_entropy's arguments that cross_entropy lacks: each accepted only at its default, None."""
    supported = "supported: ignore_index, reduction, label_smoothing, z_loss, softcap"
    if weight is not None:
        raise ValueError(f"{fn}: weight (F.cross_entropy's per-class weights) is not supported; {supported}")
    for name, value in (("size_average", size_average), ("reduce", reduce)):
        if value is not None:
            raise ValueError(
                f"{fn}: {name} (F.cross_entropy's deprecated form of reduction) is not supported; pass "
                f"reduction='mean', 'sum' or 'none' instead ({supported})"
            )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    size_average: None = None,
    reduce: None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of logits (N, C) against target (N,) int64, or of logits (C,) against a
    0-D target, plus ``z_loss · logsumexp²`` per row (PaLM's z-loss), in float32. With softcap (a
    positive float; Gemma 2's final-logit softcapping is 30.0) the logits are first ``softcap ·
    tanh(logits / softcap)``, inside the kernel (the gradient is that of the whole composition).

    Logits of more dimensions raise: F.cross_entropy reads their classes from dim 1 ((N, C, d1, ...)),
    where a language model's (B, T, V) logits have them last; flatten the rows first,
    ``cross_entropy(logits.flatten(0, -2), target.flatten())`` (with reduction "none", ``.view(B, T)``
    the result). reduction "mean" (over rows whose target is not ignore_index; NaN when there are
    none, as F.cross_entropy's), "sum", or "none" (one value a row, 0 at ignored rows). Targets are
    class indices; F.cross_entropy's class probabilities, ``weight``, ``size_average`` and ``reduce``
    raise unless None. Returns float32 (F.cross_entropy returns the logits' dtype). The gradient of
    the logits is written in the forward into a buffer of logits' shape and dtype owned by the op
    (never into logits); only with autograd recording and logits requiring a gradient.
    """
    fn = "cross_entropy"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{fn}: logits must be a torch.Tensor, got {type(logits).__name__}")
    _check_float(fn, "logits", logits, logits.device)
    if logits.dim() not in (1, 2):
        raise ValueError(
            f"{fn}: logits must be (N, C) or (C,), got shape {list(logits.shape)}. F.cross_entropy reads "
            "the classes of N-D input from dim 1, (N, C, d1, ...), where this function would read the last "
            "dim: flatten the rows first, cross_entropy(logits.flatten(0, -2), target.flatten()), and with "
            "reduction='none' reshape the result to target's shape"
        )
    _refuse_unsupported(fn, weight, size_average, reduce)
    check_options(fn, ignore_index, reduction, label_smoothing, z_loss)
    softcap = check_softcap(fn, softcap)
    _check_vocab(fn, "logits", logits.shape[-1])
    check_target(fn, target, tuple(logits.shape[:-1]), logits.shape[-1], ignore_index, logits.device)
    options = (ignore_index, reduction, float(label_smoothing), float(z_loss), softcap)
    use_triton = runtime.runs_triton(logits)
    loss = _cross_entropy(_rows(logits), None, None, target.reshape(-1), None, use_triton, options)
    return loss.view(target.shape) if reduction == "none" else loss


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``cross_entropy(x @ weight.T + bias, target, ...)`` without the logits: x (..., H), weight (V, H)
    as nn.Linear's, bias (V,) or None, target (...) int64 (the classes are the last dim: no ambiguity
    here); options as :func:`cross_entropy`, except that a mean over no rows (every target ignored)
    is 0 with zero gradients, not NaN: the trainer's loss, which stops on a NaN.

    The matmuls run in x's dtype (autocast's, when on); weight and bias may be float32 masters and
    get float32 gradients. Returns float32: a scalar, or (...) for reduction "none".
    """
    fn = "linear_cross_entropy"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    _check_float(fn, "x", x, x.device)
    _check_float(fn, "weight", weight, x.device)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{fn}: weight must be (V, H) with H = x's last dimension; got x {list(x.shape)}, weight "
            f"{list(weight.shape)}"
        )
    vocab = weight.shape[0]
    _check_vocab(fn, "weight", vocab)
    if bias is not None:
        _check_float(fn, "bias", bias, x.device)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"{fn}: bias must have shape [{vocab}], got {list(bias.shape)}")
    check_options(fn, ignore_index, reduction, label_smoothing, z_loss)
    softcap = check_softcap(fn, softcap)
    check_target(fn, target, tuple(x.shape[:-1]), vocab, ignore_index, x.device)
    (x,) = runtime.autocast(x)  # the weight stays as given: the op casts it, its gradient keeps its dtype
    options = (ignore_index, reduction, float(label_smoothing), float(z_loss), softcap)
    use_triton = runtime.runs_triton(x)
    loss = _cross_entropy(_rows(x), _rows(weight), bias, target.reshape(-1), None, use_triton, options)
    return loss.view(target.shape) if reduction == "none" else loss


def head_loss(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    target: torch.Tensor,
    *,
    use_triton: bool,
    shard: VocabShard | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    fn: str = "head_loss",
) -> torch.Tensor:
    """Mean cross entropy (float32 scalar) of the LM head ``x @ weightᵀ`` against target, for the model
    and its tensor-parallel form: x (N, H), weight (V_local, H), target (N,) in [0, V) or ignore_index;
    with weight None, x is the head's logits (N, V_local) (the unfused loss; a mean over no rows is
    NaN then, as F.cross_entropy's, else 0). With a shard the columns are [shard.start, shard.start +
    V_local) of a vocabulary of shard.vocab, and the shard's collectives combine the ranks' statistics
    of each chunk. softcap: as :func:`cross_entropy`'s. The Triton kernels run where use_triton and x is
    where they run, else their plain-PyTorch twins. fn names the caller in errors."""
    check_options(fn, ignore_index, "mean", label_smoothing, z_loss)
    softcap = check_softcap(fn, softcap)
    columns = x.shape[1] if weight is None else weight.shape[0]  # this rank's, or the whole vocabulary
    vocab = columns if shard is None else shard.vocab
    check_target(fn, target, tuple(x.shape[:1]), vocab, ignore_index, x.device)
    if weight is not None:
        (x,) = runtime.autocast(x)  # the weight stays as given, as in linear_cross_entropy
    use_triton = use_triton and runtime.runs_triton(x)
    options = (ignore_index, "mean", float(label_smoothing), float(z_loss), softcap)
    return _cross_entropy(x, weight, None, target, shard, use_triton, options)
