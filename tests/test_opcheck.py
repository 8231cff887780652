"""torch.library.opcheck of every horse:: custom op: the fake kernel's outputs (shapes, dtypes,
strides) against the real kernel's, the schema, the autograd registration and the op under
torch.compile's tracing. Forward and backward ops, float16 and bfloat16, with and without bias."""

import pytest
import torch

pytestmark = pytest.mark.interpreter  # the real kernels, on the CPU

OPS = torch.ops.horse
DTYPES = [torch.float16, torch.bfloat16]
M, K, N, D = 9, 16, 24, 8  # rows, in features, hidden, out features


def _randn(*shape, dtype, requires_grad=True):
    gen = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(*shape, generator=gen) * 0.5).to(dtype).requires_grad_(requires_grad)


def _plain(args):
    """args with every tensor detached: the backward ops' inputs, which need no gradient."""
    return [a.detach() if isinstance(a, torch.Tensor) else a for a in args]


def norm_cases(dtype, bias):
    x, residual, weight = _randn(M, N, dtype=dtype), _randn(M, N, dtype=dtype), _randn(N, dtype=dtype)
    b = _randn(N, dtype=dtype) if bias else None
    # LayerNorm with a residual; RMSNorm without a weight (its backward has no weight gradient).
    cases = []
    for args in ((x, weight, b, residual, 1e-5, False), (x, None, b, None, 1e-5, True)):
        cases.append((OPS.norm_fwd, args))
        x_, weight_, _, residual_, _, rms = _plain(args)
        y, residual_out, mean, rstd = OPS.norm_fwd(*_plain(args))
        h, dres = (residual_out, torch.ones_like(y)) if residual_ is not None else (x_, None)
        bwd = (torch.ones_like(y), dres, h, weight_, mean, rstd, bias, rms)
        for needs in ([True] * 3, [False, True, True], [True, False, False]):  # frozen x; frozen w, b
            cases.append((OPS.norm_bwd, (*bwd, needs)))
    return cases


def attention_cases(dtype, bias):
    if bias:  # attention has no bias
        return []
    q, k, v = (_randn(2, 12, heads, 32, dtype=dtype) for heads in (4, 2, 2))
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    padded = (q, k, v, None, 0.0, True, 0.125, -1, -1, None, None, 0, 0)
    packed = (
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        None,
        0.0,
        False,
        0.125,
        3,
        2,
        cu,
        cu,
        19,
        19,
    )
    cases = []
    for args in (padded, packed):
        cases.append((OPS.flash_attn_fwd, args))
        plain = _plain(args)
        out, lse = OPS.flash_attn_fwd(*plain)
        bwd = (torch.ones_like(out), torch.ones_like(lse), *plain[:3], out, lse, *plain[3:])
        for needs in ([True, True, False], [False, True, False], [True, False, False]):  # frozen q; k, v
            cases.append((OPS.flash_attn_bwd, (*bwd, needs)))
    return cases


def mlp_cases(dtype, bias):
    x, w_in, w_up, w_out = (_randn(*shape, dtype=dtype) for shape in ((M, K), (N, K), (N, K), (D, N)))
    b_in, b_out = (_randn(N, dtype=dtype), _randn(D, dtype=dtype)) if bias else (None, None)
    names = ("x", "w_in", "w_up", "w_out", "b_in", "b_out")
    p = dict(zip(names, _plain((x, w_in, w_up, w_out, b_in, b_out)), strict=True))
    cases = []
    for activation in ("gelu_tanh", "none"):
        cases.append((OPS.linear_act_fwd, (x, w_in, b_in, activation, True)))
        y, pre = OPS.linear_act_fwd(p["x"], p["w_in"], p["b_in"], activation, True)
        dy = torch.ones_like(y)
        cases.append((OPS.linear_act_bwd, (dy, p["x"], p["w_in"], pre, bias, activation, [True, True])))
        cases.append((OPS.linear_act_bwd, (dy, None, p["w_in"], pre, bias, activation, [True, False])))
        cases.append((OPS.linear_act_bwd, (dy, p["x"], p["w_in"], pre, False, activation, [False, True])))
        cases.append((OPS.fused_mlp_fwd, (x, w_in, b_in, w_out, b_out, activation, True)))
        y, pre = OPS.fused_mlp_fwd(p["x"], p["w_in"], p["b_in"], p["w_out"], p["b_out"], activation, True)
        bwd = (torch.ones_like(y), p["x"], p["w_in"], p["w_out"], pre, bias, bias, activation)
        cases.append((OPS.fused_mlp_bwd, (*bwd, [True] * 3)))
        frozen_in = (torch.ones_like(y), None, p["w_in"], p["w_out"], pre, False, bias, activation)
        cases.append((OPS.fused_mlp_bwd, (*frozen_in, [True, False, False])))  # LoRA-style: only dx
        cases.append((OPS.fused_mlp_bwd, (*frozen_in, [False, False, True])))  # only W_out trains
    if bias:  # the gated forms have no biases
        return cases
    cases.append((OPS.gated_linear_fwd, (x, w_in, w_up, "silu", True)))
    y, gate, up = OPS.gated_linear_fwd(p["x"], p["w_in"], p["w_up"], "silu", True)
    bwd = (torch.ones_like(y), p["x"], p["w_in"], p["w_up"], gate, up, "silu")
    cases.append((OPS.gated_linear_bwd, (*bwd, [True] * 3)))
    cases.append((OPS.gated_linear_bwd, (*bwd, [False, True, False])))
    cases.append((OPS.gated_mlp_fwd, (x, w_in, w_up, w_out, "silu", True)))
    y, gate, up = OPS.gated_mlp_fwd(p["x"], p["w_in"], p["w_up"], p["w_out"], "silu", True)
    bwd = (torch.ones_like(y), p["x"], p["w_in"], p["w_up"], p["w_out"], gate, up, "silu")
    cases.append((OPS.gated_mlp_bwd, (*bwd, [True] * 4)))
    cases.append((OPS.gated_mlp_bwd, (bwd[0], None, *bwd[2:], [True, False, False, False])))
    cases.append((OPS.gated_mlp_bwd, (bwd[0], None, *bwd[2:], [False, False, False, True])))
    return cases


def loss_cases(dtype, bias):
    x, weight = _randn(M, K, dtype=dtype), _randn(37, K, dtype=dtype)  # 37 classes: not a block multiple
    b = _randn(37, dtype=dtype) if bias else None
    target = torch.tensor([3, -100, 0, 36, 5, -100, 9, 1, 2])  # two rows ignored
    logits, plain = (x @ weight.T).detach(), _plain((x, weight, b))  # no autograd: the ops take none
    return [
        (OPS.linear_cross_entropy_chunks, (*plain, target, torch.ones(()), -100, 0.1, 1e-3, True)),
        (OPS.linear_cross_entropy_chunks, (*plain, target, None, -100, 0.0, 0.0, True)),
        (OPS.linear_cross_entropy_chunks, (*plain, target, torch.rand(M), -100, 0.1, 1e-3, False)),
        (OPS.cross_entropy_rows, (logits, target, torch.ones(()), -100, 0.1, 1e-3, True)),
        (OPS.cross_entropy_rows, (logits, target, torch.rand(M), -100, 0.0, 0.0, False)),
        # with a softcap, the last argument
        (OPS.linear_cross_entropy_chunks, (*plain, target, torch.rand(M), -100, 0.0, 0.0, True, 30.0)),
        (OPS.cross_entropy_rows, (logits, target, torch.ones(()), -100, 0.1, 1e-3, False, 5.0)),
    ]


def moe_cases(dtype, bias):
    # 9 tokens, top 2 of 4 experts (every pair routed: a dropped pair's saved rows are never written);
    # transformers' layout, and gpt-oss's (transposed views, interleaved, clamped) with float32 weights.
    ids = torch.tensor([[0, 2], [2, 1], [3, 0], [1, 2], [2, 3], [0, 1], [3, 2], [1, 0], [2, 0]])
    x, weights = _randn(M, K, dtype=dtype), torch.rand(M, 2, generator=torch.Generator().manual_seed(0))
    gate_up, down = _randn(4, 2 * N, K, dtype=dtype), _randn(4, K, N, dtype=dtype)
    gate_up_t = _randn(4, K, 2 * N, dtype=dtype).transpose(1, 2)
    biases = (_randn(4, 2 * N, dtype=dtype), _randn(4, K, dtype=dtype)) if bias else (None, None)
    forwards = [
        (x, ids, weights.to(dtype).requires_grad_(), gate_up, down, *biases, "silu", None, False, True),
        (x, ids, weights.requires_grad_(), gate_up_t, down, *biases, "silu", 7.0, True, True),
        _plain(
            (x, ids, weights.to(dtype), gate_up, down, *biases, "gelu_tanh", None, False, False)
        ),  # no grad
    ]
    cases = []
    for args in forwards:
        cases.append((OPS.moe_mlp_fwd, args))
        if not args[-1]:
            continue
        plain = _plain(args)
        y, gate, up, sorted_pairs, pair_rows, offsets = OPS.moe_mlp_fwd(*plain)
        saved = (*plain[:5], plain[6], gate, up, sorted_pairs, pair_rows, offsets, *plain[7:10])
        for needs in ([True] * 4 + [bias] * 2, [True] + [False] * 5, [False, False, True, True, bias, bias]):
            cases.append((OPS.moe_mlp_bwd, (torch.ones_like(y), *saved, needs)))
    return cases


CASE_MAKERS = (norm_cases, attention_cases, mlp_cases, loss_cases, moe_cases)


def test_every_registered_op_is_checked():
    # A new op without a case here fails this test.
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("horse::")}
    checked = {op._qualified_op_name for make in CASE_MAKERS for dtype in DTYPES for bias in (False, True)
               for op, _ in make(dtype, bias)}  # fmt: skip
    assert checked == registered


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make", CASE_MAKERS, ids=lambda make: make.__name__)
def test_opcheck(make, dtype, bias):
    for op, args in make(dtype, bias):
        torch.library.opcheck(op.default, args)
