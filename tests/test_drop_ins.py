"""Every drop-in against the function it replaces, over that function's input domain (1-D input, zero
sizes, N-D, strides, mixed dtypes, every optional argument): each case either matches it, forward and
the gradients of every floating-point input, within the dtype's tolerance (helpers.assert_close, the
replaced function in float64 the truth and at the inputs' own precision the baseline), or raises an
error that names the argument. Never a different answer. A case that ours refuses is first given to
the replaced function, which must take it: the case is in its domain.

    horse.kernels                                  replaces
    cross_entropy                                  F.cross_entropy
    linear_act(..., activation="none")             F.linear
    layer_norm, add_layer_norm                     F.layer_norm (of input + residual)
    rms_norm, add_rms_norm                         F.rms_norm (of input + residual)
    flash_attention                                flash-attn's flash_attn_func, here by
                                                   F.scaled_dot_product_attention on transposes

Small shapes: without a GPU the kernels run in Triton's interpreter, whose bfloat16 tl.dot is wrong,
so the bfloat16 cases of the matmul families run on a GPU only.
"""

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from helpers import assert_close
from torch.nn.attention import SDPBackend, sdpa_kernel

from horse import kernels

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
_generator = torch.Generator().manual_seed(0)


def _randn(*shape, dtype=F32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=_generator) * scale).to(dtype)


def _classes(*shape, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, shape, generator=_generator)


@dataclass
class Case:
    id: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    refuses: str | None = None  # the argument ours refuses: its error must name it; None: ours matches
    view: Callable | None = None  # applied to the positional arguments first: strided views of them
    gpu_only: bool = False  # bfloat16 GEMMs: the interpreter's bfloat16 tl.dot is wrong


def _params(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.gpu] if c.gpu_only else []) for c in cases]


def _inputs(case: Case, device: str, dtype: torch.dtype | None, requires_grad=True):
    """The case's arguments on device, floating-point tensors as fresh leaves (copies, in dtype when
    given, that require a gradient unless told not to), then viewed; and the leaves."""
    leaves = []

    def leaf(value):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return value.to(device) if isinstance(value, torch.Tensor) else value
        fresh = value.to(device=device, dtype=dtype or value.dtype, copy=True)
        leaves.append(fresh.requires_grad_(requires_grad))
        return leaves[-1]

    args = tuple(leaf(a) for a in case.args)
    kwargs = {name: leaf(value) for name, value in case.kwargs.items()}
    return (case.view(*args) if case.view else args), kwargs, leaves


def _run(fn, case: Case, device: str, dtype: torch.dtype | None = None):
    """fn's outputs (a tuple) and the gradients of its floating-point inputs for a fixed random
    upstream gradient (the same values at every precision)."""
    args, kwargs, leaves = _inputs(case, device, dtype)
    outputs = fn(*args, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    upstream_generator = torch.Generator().manual_seed(1)
    upstream = [(torch.rand(o.shape, generator=upstream_generator, dtype=F64) + 0.5).to(o) for o in outputs]
    grads = torch.autograd.grad(outputs, leaves, upstream, allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)]
    return [o.detach() for o in outputs], grads


def _assert_close(name: str, actual, truth, baseline) -> None:
    """helpers.assert_close, where the truth's NaNs (F.cross_entropy's mean over no rows) must be
    NaN in ours too."""
    nan = truth.isnan()
    ours_nan, truth_nan = (t.isnan().flatten().nonzero().flatten().tolist() for t in (actual, truth))
    assert ours_nan == truth_nan, f"{name}: NaN at (flat) {ours_nan} in ours, {truth_nan} in the truth"
    assert_close(name, actual.masked_fill(nan, 0), truth.masked_fill(nan, 0), baseline.masked_fill(nan, 0))


def walk(case: Case, ours, theirs, device: str, check_domain=True, result_dtype=None) -> None:
    """Assert that ours matches theirs on the case, or refuses it with an error naming the argument.

    check_domain: theirs is the replaced function itself, so a refused case must run there.
    result_dtype: ours' documented result dtype where it is not theirs (cross_entropy: float32)."""
    if case.refuses:  # no gradients: F.cross_entropy's class weights must not require one
        if check_domain:
            args, kwargs, _ = _inputs(case, device, None, requires_grad=False)
            theirs(*args, **kwargs)
        args, kwargs, _ = _inputs(case, device, None, requires_grad=False)
        with pytest.raises((TypeError, ValueError)) as error:
            ours(*args, **kwargs)
        assert re.search(rf"\b{case.refuses}\b", str(error.value)), (
            f"does not name {case.refuses}: {error.value}"
        )
        return
    truth, truth_grads = _run(theirs, case, device, F64)
    baseline, baseline_grads = _run(theirs, case, device)
    actual, grads = _run(ours, case, device)
    assert len(actual) == len(truth), f"{len(actual)} outputs, the replaced function has {len(truth)}"
    for i, (a, t, b) in enumerate(zip(actual, truth, baseline, strict=True)):
        assert a.dtype == (result_dtype or b.dtype), (
            f"output {i}: {a.dtype}, the replaced function's {b.dtype}"
        )
        _assert_close(f"output {i}", a, t, b.to(a.dtype))
    for i, (g, t, b) in enumerate(zip(grads, truth_grads, baseline_grads, strict=True)):
        _assert_close(f"gradient of floating-point input {i}", g, t, b)


# ----------------------------------------------------------------------------------------------
# cross_entropy, against F.cross_entropy
# ----------------------------------------------------------------------------------------------


def _rows(n: int, classes: int, dtype=F32) -> tuple:
    """Logits (n, classes) and their targets."""
    return _randn(n, classes, dtype=dtype), _classes(n, classes=classes)


def _with_ignored(target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    target = target.clone()
    target[::3] = ignore_index
    return target


CROSS_ENTROPY = [
    Case("(N, C)", _rows(6, 11)),
    Case("(N, C) float16, sum", _rows(6, 11, dtype=F16), {"reduction": "sum"}),
    Case("(N, C) bfloat16, none", _rows(6, 11, dtype=BF16), {"reduction": "none"}),
    Case("(C,) and a 0-D target", (_randn(11), torch.tensor(4))),
    Case("(C,) and a 0-D target, none", (_randn(11), torch.tensor(0)), {"reduction": "none"}),
    Case("(C,) and an ignored target: a mean of NaN", (_randn(11), torch.tensor(-100))),
    Case("(C,) and an ignored target, sum", (_randn(11), torch.tensor(-100)), {"reduction": "sum"}),
    Case("no rows: a mean of NaN", _rows(0, 11)),
    Case("no rows, sum", _rows(0, 11), {"reduction": "sum"}),
    Case("no rows, none", _rows(0, 11), {"reduction": "none"}),
    Case("every row ignored: a mean of NaN", (_randn(4, 11), torch.full((4,), -100))),
    Case("some rows ignored", (_randn(7, 11), _with_ignored(_classes(7, classes=11)))),
    Case("ignore_index a class", _rows(7, 5), {"ignore_index": 2}),
    Case(
        "label_smoothing, ignored rows",
        (_randn(7, 11), _with_ignored(_classes(7, classes=11))),
        {"label_smoothing": 0.1},
    ),
    Case("label_smoothing, none", _rows(7, 11), {"label_smoothing": 0.3, "reduction": "none"}),
    Case("one class", (_randn(5, 1), torch.zeros(5, dtype=torch.long))),
    Case("transposed logits", (_randn(11, 6), _classes(6, classes=11)), view=lambda z, t: (z.T, t)),
    Case(
        "nn.CrossEntropyLoss's call",
        _rows(6, 11),
        {"weight": None, "ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0},
    ),
    Case("weight None, positional", (*_rows(6, 11), None)),
    Case("size_average and reduce None", _rows(6, 11), {"size_average": None, "reduce": None}),
    # The issue's example: (N, C, d1) whose target fits as (N, d1) and as ours' old (N, C) alike.
    Case("(N, C, d1)", (_randn(2, 3, 3), _classes(2, 3, classes=3)), refuses="logits"),
    Case("(N, C, d1), C not last", (_randn(2, 5, 3), _classes(2, 3, classes=5)), refuses="logits"),
    Case("(N, C, d1, d2)", (_randn(2, 4, 3, 2), _classes(2, 3, 2, classes=4)), refuses="logits"),
    Case("class probabilities (N, C)", (_randn(4, 5), _randn(4, 5).softmax(-1)), refuses="target"),
    Case("class probabilities (C,)", (_randn(5), _randn(5).softmax(-1)), refuses="target"),
    Case("uint8 targets", (_randn(4, 5), _classes(4, classes=5).to(torch.uint8)), refuses="target"),
    Case("(C,) and a (1,) target", (_randn(5), torch.tensor([2])), refuses="target"),
    Case("class weights", _rows(4, 5), {"weight": _randn(5).abs()}, refuses="weight"),
    Case("class weights, positional", (*_rows(4, 5), _randn(5).abs()), refuses="weight"),
    Case("size_average", _rows(4, 5), {"size_average": False}, refuses="size_average"),
    Case("reduce", _rows(4, 5), {"reduce": False}, refuses="reduce"),
    Case("float64", _rows(4, 5, dtype=F64), refuses="logits"),
]


@pytest.mark.parametrize("case", _params(CROSS_ENTROPY))
@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
def test_cross_entropy_is_f_cross_entropy_or_refuses(case, device):
    walk(case, kernels.cross_entropy, F.cross_entropy, device, result_dtype=F32)


# ----------------------------------------------------------------------------------------------
# linear_act with activation="none", against F.linear
# ----------------------------------------------------------------------------------------------


def _linear(x_shape, w_shape, bias_shape=None, dtype=F16) -> tuple:
    k = max(w_shape[-1], 1)
    tensors = [_randn(*x_shape, dtype=dtype), _randn(*w_shape, dtype=dtype, scale=k**-0.5)]
    return (*tensors, _randn(*bias_shape, dtype=dtype)) if bias_shape is not None else tuple(tensors)


LINEAR = [
    Case("2-D", _linear((5, 12), (7, 12))),
    Case("2-D with a bias", _linear((5, 12), (7, 12), (7,))),
    Case("bias by keyword", _linear((5, 12), (7, 12)), {"bias": _randn(7, dtype=F16)}),
    Case("bias=None by keyword", _linear((5, 12), (7, 12)), {"bias": None}),
    Case("1-D input", _linear((12,), (7, 12), (7,))),
    Case("3-D input", _linear((2, 3, 12), (7, 12), (7,))),
    Case("no rows", _linear((0, 12), (7, 12), (7,))),
    Case("K = 0", _linear((5, 0), (7, 0), (7,))),
    Case("N = 0", _linear((5, 12), (0, 12), (0,))),
    Case("transposed input", _linear((12, 5), (7, 12), (7,)), view=lambda x, w, b: (x.T, w, b)),
    Case("transposed weight", _linear((5, 12), (12, 7)), view=lambda x, w: (x, w.T)),
    Case("bfloat16", _linear((5, 12), (7, 12), (7,), dtype=BF16), gpu_only=True),
    Case("1-D weight", _linear((5, 12), (12,)), refuses="weight"),
    Case("0-D bias", _linear((5, 12), (7, 12), ()), refuses="bias"),
    Case("a one-element bias, broadcast", _linear((5, 12), (7, 12), (1,)), refuses="bias"),
    Case("float32", _linear((5, 12), (7, 12), (7,), dtype=F32), refuses="input"),
]


@pytest.mark.parametrize("case", _params(LINEAR))
def test_linear_act_without_activation_is_f_linear_or_refuses(case, device):
    walk(case, functools.partial(kernels.linear_act, activation="none"), F.linear, device)


def test_linear_act_given_f_linears_arguments_alone_raises_naming_activation():
    x, weight, bias = _linear((5, 12), (7, 12), (7,))
    with pytest.raises(TypeError, match="activation"):
        kernels.linear_act(x, weight, bias)


@pytest.mark.parametrize(
    "fn", [kernels.linear_act, kernels.gated_linear, kernels.fused_mlp, kernels.fused_gated_mlp]
)
def test_no_mlp_function_picks_an_activation(fn):
    activation = inspect.signature(fn).parameters["activation"]
    assert activation.kind == inspect.Parameter.KEYWORD_ONLY
    assert activation.default is inspect.Parameter.empty, f"{fn.__name__} defaults to {activation.default!r}"


# ----------------------------------------------------------------------------------------------
# layer_norm and rms_norm against F.layer_norm and F.rms_norm; add_* against the sum, then the norm
# ----------------------------------------------------------------------------------------------


def _norm_args(shape, normalized_shape, dtype=F32, weight=True, bias=True, param_dtype=None) -> tuple:
    params = [
        _randn(*normalized_shape, dtype=param_dtype or dtype) + 1 for present in (weight, bias) if present
    ]
    return (_randn(*shape, dtype=dtype), normalized_shape, *params)


LAYER_NORM = [
    Case("2-D, weight and bias", _norm_args((5, 24), (24,))),
    Case("1-D input", _norm_args((24,), (24,))),
    Case("over the last two dims", _norm_args((2, 3, 8), (3, 8))),
    Case("normalized_shape a torch.Size", _norm_args((4, 24), torch.Size([24]))),
    Case("weight only", _norm_args((4, 24), (24,), bias=False)),
    Case("bias only", _norm_args((4, 24), (24,), weight=False, bias=False), {"bias": _randn(24)}),
    Case("eps", (*_norm_args((4, 24), (24,)), 0.1)),
    Case("no rows", _norm_args((0, 24), (24,))),
    Case("one element a row", _norm_args((5, 1), (1,))),
    Case("float16", _norm_args((5, 24), (24,), dtype=F16)),
    Case("bfloat16", _norm_args((5, 24), (24,), dtype=BF16)),
    Case("float16 input, float32 weight and bias", _norm_args((5, 24), (24,), dtype=F16, param_dtype=F32)),
    Case("rows with a stride", _norm_args((5, 40), (24,)), view=lambda x, *rest: (x[:, :24], *rest)),
    Case("normalized_shape of no elements", (_randn(3, 0), (0,)), refuses="normalized_shape"),
    Case("float64", _norm_args((5, 24), (24,), dtype=F64), refuses="input"),
    Case("a strided last dim", (_randn(24, 5), (24,)), view=lambda x, shape: (x.T, shape), refuses="input"),
]

RMS_NORM = [
    Case("2-D with a weight", _norm_args((5, 24), (24,), bias=False)),
    Case("1-D input", _norm_args((24,), (24,), bias=False)),
    Case("over the last two dims", _norm_args((2, 3, 8), (3, 8), bias=False)),
    Case("no weight", _norm_args((4, 24), (24,), weight=False, bias=False)),
    Case("eps", (*_norm_args((4, 24), (24,), bias=False), 1e-3)),
    Case("eps by keyword", _norm_args((4, 24), (24,), bias=False), {"eps": 0.5}),
    Case("no rows", _norm_args((0, 24), (24,), bias=False)),
    # eps=None is float32's eps for every input dtype: at float16's own eps these rows would differ
    Case("float16, small rows, eps None", ((_randn(5, 24) * 1e-3).half(), (24,), _randn(24, dtype=F16))),
    Case("bfloat16", _norm_args((5, 24), (24,), dtype=BF16, bias=False)),
    Case("float16 input, float32 weight", _norm_args((5, 24), (24,), dtype=F16, bias=False, param_dtype=F32)),
    Case("normalized_shape of no elements", (_randn(3, 0), (0,)), refuses="normalized_shape"),
    Case("float64", _norm_args((5, 24), (24,), dtype=F64, bias=False), refuses="input"),
]


def _residual_cases(cases: list[Case]) -> list[Case]:
    """The norm's cases with a residual of input's shape and dtype after input, and the two that
    the unfused sum takes and ours refuses: a residual that broadcasts, and one of another dtype."""
    with_residual = [
        Case(c.id, (c.args[0], _randn(*c.args[0].shape, dtype=c.args[0].dtype), *c.args[1:]), c.kwargs)
        for c in cases
        if not c.refuses and not c.view
    ]
    x = _randn(5, 24, dtype=F16)
    return with_residual + [
        Case("a residual that broadcasts", (x, _randn(24, dtype=F16), (24,)), refuses="residual"),
        Case("a float32 residual to float16 input", (x, _randn(5, 24), (24,)), refuses="residual"),
    ]


def _add_then(norm):
    def unfused(input, residual, *args, **kwargs):
        h = input + residual
        return norm(h, *args, **kwargs), h

    return unfused


@pytest.mark.parametrize("case", _params(LAYER_NORM))
def test_layer_norm_is_f_layer_norm_or_refuses(case, device):
    walk(case, kernels.layer_norm, F.layer_norm, device)


# F.rms_norm itself warns, once a process, that a float32 weight on float16 input leaves its fused path:
# the truth's warning, in the cases that walk exactly that input (both, as either may run first).
F_RMS_NORM_WARNS = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")


@F_RMS_NORM_WARNS
@pytest.mark.parametrize("case", _params(RMS_NORM))
def test_rms_norm_is_f_rms_norm_or_refuses(case, device):
    walk(case, kernels.rms_norm, F.rms_norm, device)


@pytest.mark.parametrize("case", _params(_residual_cases(LAYER_NORM)))
def test_add_layer_norm_is_the_sum_then_f_layer_norm_or_refuses(case, device):
    walk(case, kernels.add_layer_norm, _add_then(F.layer_norm), device)


@F_RMS_NORM_WARNS
@pytest.mark.parametrize("case", _params(_residual_cases(RMS_NORM)))
def test_add_rms_norm_is_the_sum_then_f_rms_norm_or_refuses(case, device):
    walk(case, kernels.add_rms_norm, _add_then(F.rms_norm), device)


# ----------------------------------------------------------------------------------------------
# flash_attention, against flash-attn's flash_attn_func (SDPA on transposes)
# ----------------------------------------------------------------------------------------------


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """flash-attn's flash_attn_func, for the arguments our flash_attention shares with it, by
    F.scaled_dot_product_attention: (batch, seqlen, heads, head_dim) in and out, k and v heads a
    divisor of q's, causal and the window aligned to the bottom-right corner (query i stands at key
    position i + seqlen_k - seqlen_q), a query that sees no key gets zeros (as SDPA gives them); softcap
    > 0: the scaled scores become softcap · tanh(scores / softcap) before the mask, by hand (SDPA has no
    softcap)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    left, right = window_size[0], 0 if causal else window_size[1]
    key_minus_query = (
        torch.arange(seqlen_k)[None, :] - torch.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q)
    )
    sees = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        sees &= key_minus_query >= -left
    if right >= 0:
        sees &= key_minus_query <= right
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seqlen, head_dim)
    if softcap > 0:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        scores = softcap * torch.tanh((q.float() @ k.float().transpose(-1, -2)) * scale / softcap)
        p = scores.masked_fill(~sees.to(q.device), float("-inf")).softmax(-1).nan_to_num(0.0)
        return (p @ v.float()).to(q.dtype).transpose(1, 2)
    # The math backend: the plain computation, whose zeros for a query that sees no key were checked
    # on the CPU (flash-attn gives zeros there too).
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=sees.to(q.device), scale=softmax_scale, enable_gqa=True
        )
    return out.transpose(1, 2)


def _qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=F16) -> tuple:
    return (
        _randn(batch, seqlen_q, heads, head_dim, dtype=dtype),
        _randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype),
        _randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype),
    )


def _heads_first(q, k, v):
    return tuple(t.transpose(1, 2) for t in (q, k, v))


ATTENTION = [
    Case("plain", _qkv(1, 5, 5, 2, 2, 16)),
    Case("causal", _qkv(1, 5, 5, 2, 2, 16), {"causal": True}),
    Case("causal, fewer queries than keys", _qkv(1, 3, 6, 2, 2, 16), {"causal": True}),
    Case("causal, more queries than keys", _qkv(1, 6, 3, 2, 2, 16), {"causal": True}),
    Case("one query against a cache", _qkv(1, 1, 7, 2, 2, 16), {"causal": True}),
    Case("grouped-query heads", _qkv(2, 4, 4, 4, 2, 16)),
    Case("one kv head", _qkv(1, 4, 4, 3, 1, 16)),
    Case("head_dim 24", _qkv(1, 4, 4, 1, 1, 24)),
    Case("softmax_scale", _qkv(1, 4, 4, 1, 1, 16), {"softmax_scale": 0.3}),
    Case("window_size", _qkv(1, 6, 6, 1, 1, 16), {"window_size": (2, 1)}),
    Case("window_size and causal", _qkv(1, 6, 6, 1, 1, 16), {"window_size": (2, 1), "causal": True}),
    Case(
        "(batch, heads, seqlen) tensors, transposed",
        tuple(_randn(1, 2, 5, 16, dtype=F16) for _ in "qkv"),
        view=_heads_first,
    ),
    Case("bfloat16", _qkv(1, 5, 5, 2, 2, 16, dtype=BF16), gpu_only=True),
    Case("float32", _qkv(1, 4, 4, 1, 1, 16, dtype=F32), refuses="q"),
    Case("dropout_p", _qkv(1, 4, 4, 1, 1, 16), {"dropout_p": 0.1}, refuses="dropout_p"),
    Case("softcap", _qkv(1, 5, 5, 2, 1, 16), {"softcap": 2.0, "causal": True}),
    Case("alibi_slopes", _qkv(1, 4, 4, 1, 1, 16), {"alibi_slopes": torch.ones(1)}, refuses="alibi_slopes"),
    Case("deterministic", _qkv(1, 4, 4, 1, 1, 16), {"deterministic": True}, refuses="deterministic"),
    Case(
        "return_attn_probs", _qkv(1, 4, 4, 1, 1, 16), {"return_attn_probs": True}, refuses="return_attn_probs"
    ),
]


@pytest.mark.parametrize("case", _params(ATTENTION))
def test_flash_attention_is_flash_attn_func_or_refuses(case, device):
    # The stand-in takes only the arguments the two share: flash-attn itself is not installed.
    walk(case, kernels.flash_attention, flash_attn_func, device, check_domain=False)
