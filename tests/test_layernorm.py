"""LayerNorm / RMSNorm kernels against the float64 truth, forward and backward (horse.kernels.layernorm)."""

from dataclasses import dataclass

import pytest
import torch
import triton
from helpers import all_pairs, assert_close, record_launches

from horse import kernels
from horse.kernels import layernorm, reference, runtime
from horse.layers import FusedRMSNorm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Rows 1..4099; hidden sizes from 1 past the register-resident limits (16384 forward, 8192
# backward) to the maximum, where the chunked kernels take over.
SHAPES = [(1, 1), (4099, 1), (3, 7), (130, 64), (4099, 64), (257, 1000), (5, 4096), (3, 8192),
          (2, 20000), (2, 65536)]  # fmt: skip


@dataclass
class Case:
    rms: bool
    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    dy: torch.Tensor
    dresidual: torch.Tensor | None  # gradient arriving at h = x + residual from the next branch
    eps: float
    weight_offset: float = 0.0  # RMSNorm's scale is weight_offset + weight (Gemma's: 1)

    @property
    def n(self) -> int:
        return self.x.shape[-1]


def make_case(
    rms,
    shape,
    dtype,
    device,
    residual=False,
    weight=True,
    bias=True,
    param_dtype=None,
    seed=0,
    weight_offset=0.0,
):
    # Drawn on the device: the GPU tests' largest shapes take a billion samples.
    gen = torch.Generator(device=device).manual_seed(seed)
    param_dtype = param_dtype or dtype

    def randn(*size, dt=dtype, scale=1.0, shift=0.0):
        return (torch.randn(*size, generator=gen, device=device) * scale + shift).to(dtype=dt)

    n = shape[-1]
    return Case(
        rms=rms,
        x=randn(*shape, scale=2.0, shift=0.5),  # a nonzero mean, so centring matters
        residual=randn(*shape) if residual else None,
        weight=randn(n, dt=param_dtype, scale=0.5, shift=1.0) if weight else None,
        bias=randn(n, dt=param_dtype) if bias and not rms else None,
        dy=randn(*shape),
        dresidual=randn(*shape) if residual else None,
        eps=1e-5 if not rms else 1e-6,
        weight_offset=weight_offset,
    )


def run_kernel(case: Case) -> dict:
    """Forward and backward through the public API; every output and gradient, by name."""
    leaves = {name: t.clone().requires_grad_() for name, t in
              (("x", case.x), ("residual", case.residual), ("weight", case.weight), ("bias", case.bias))
              if t is not None}  # fmt: skip
    x, w, b = leaves["x"], leaves.get("weight"), leaves.get("bias")
    out = {}
    if case.residual is not None:
        if case.rms:
            y, h = kernels.add_rms_norm(
                x, leaves["residual"], case.n, w, case.eps, weight_offset=case.weight_offset
            )
        else:
            y, h = kernels.add_layer_norm(x, leaves["residual"], case.n, w, b, case.eps)
        torch.autograd.backward([y, h], [case.dy, case.dresidual])
        out["h"] = h.detach()
        assert torch.equal(leaves["residual"].grad, x.grad), "the residual's gradient must equal dx"
    else:
        if case.rms:
            y = kernels.rms_norm(x, case.n, w, case.eps, weight_offset=case.weight_offset)
        else:
            y = kernels.layer_norm(x, case.n, w, b, case.eps)
        y.backward(case.dy)
    out["y"] = y.detach()
    out.update({f"d{name}": t.grad for name, t in leaves.items() if name != "residual"})
    return out


def run_reference(case: Case, h: torch.Tensor, compute_dtype: torch.dtype, round_outputs: bool) -> dict:
    """The plain-PyTorch reference on h (the kernel's own h, so y is judged given h), computed
    in compute_dtype; rounded to the kernel's output dtypes when round_outputs (the baseline)."""
    hc = h.detach().to(compute_dtype).requires_grad_()
    params = {name: t.detach().to(compute_dtype).requires_grad_() for name, t in
              (("weight", case.weight), ("bias", case.bias)) if t is not None}  # fmt: skip
    w, b = params.get("weight"), params.get("bias")
    if case.rms:
        y = reference.rms_norm(hc, case.n, w, case.eps, weight_offset=case.weight_offset)
    else:
        y = reference.layer_norm(hc, case.n, w, b, case.eps)
    grads = torch.autograd.grad(y, [hc, *params.values()], case.dy.to(compute_dtype))
    dx = grads[0] if case.dresidual is None else grads[0] + case.dresidual.to(compute_dtype)
    out = {"y": y, "dx": dx} | {f"d{name}": g for name, g in zip(params, grads[1:], strict=True)}
    if round_outputs:
        param = case.weight if case.weight is not None else case.bias
        out = {k: v.to(case.x.dtype if k in ("y", "dx") else param.dtype) for k, v in out.items()}
    return out


def check_case(case: Case) -> None:
    ours = run_kernel(case)
    h = case.x
    if case.residual is not None:
        truth_h = case.x.double() + case.residual.double()
        assert_close("h", ours["h"], truth_h, reference.residual_add(case.x, case.residual))
        h = ours["h"]
    truth = run_reference(case, h, torch.float64, round_outputs=False)
    baseline = run_reference(case, h, torch.float32, round_outputs=True)
    assert ours.keys() - {"h"} == truth.keys()
    for name in truth:
        assert_close(name, ours[name], truth[name], baseline[name])


# Every value of each axis and every pair of values (30 cases), not all 120 combinations.
CASES = all_pairs([False, True], DTYPES, [False, True], SHAPES)
CASE_IDS = [f"{'rms' if rms else 'layer'}_norm-{dtype}-{'residual' if residual else 'plain'}-{n}x{m}"
            for rms, dtype, residual, (n, m) in CASES]  # fmt: skip


@pytest.mark.parametrize(("rms", "dtype", "residual", "shape"), CASES, ids=CASE_IDS)
def test_matches_reference(rms, dtype, residual, shape, device):
    check_case(make_case(rms, shape, dtype, device, residual=residual))


@pytest.mark.parametrize("shape", [(33, 1000), (2, 20000)], ids=["tile", "chunked"])
@pytest.mark.parametrize(
    "weight,bias", [(True, False), (False, True), (False, False)], ids=["w", "b", "none"]
)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_optional_weight_and_bias(rms, weight, bias, shape, device):
    if rms and bias:
        pytest.skip("RMSNorm has no bias")
    check_case(make_case(rms, shape, torch.float16, device, residual=True, weight=weight, bias=bias))


@pytest.mark.parametrize("shape", [(33, 1000), (2, 20000)], ids=["tile", "chunked"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(
    "dtype,param_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
    ids=["float32", "float16", "float32-bfloat16_weight"],
)
def test_weight_offset_matches_reference(dtype, param_dtype, residual, shape, device):
    # Gemma's RMSNorm, (x̂ · (1 + weight)) with 1 + weight in float32: a bfloat16 weight's 1 + w rounded in
    # bfloat16 would miss the float32 truth by ~2**-9 of the scale.
    case = make_case(True, shape, dtype, device, residual, param_dtype=param_dtype, weight_offset=1.0)
    check_case(case)
    assert run_kernel(case)["dweight"].dtype == param_dtype


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_parameters_in_another_dtype(param_dtype, device):
    # fp16 activations with fp32 (or bf16) norm weights, as mixed-precision models keep them.
    case = make_case(False, (65, 512), torch.float16, device, residual=True, param_dtype=param_dtype)
    check_case(case)
    assert run_kernel(case)["dweight"].dtype == param_dtype


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_leading_dims_and_multidim_normalized_shape(rms, device):
    x = torch.randn(3, 5, 4, 8, device=device)
    w = torch.randn(4, 8, device=device)
    x_ = x.clone().requires_grad_()
    w_ = w.clone().requires_grad_()
    if rms:
        y = kernels.rms_norm(x_, (4, 8), w_)
        y_ref = torch.nn.functional.rms_norm(x, (4, 8), w)
    else:
        y = kernels.layer_norm(x_, [4, 8], w_)
        y_ref = torch.nn.functional.layer_norm(x, [4, 8], w)
    assert y.shape == x.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y.sum().backward()  # the gradient arrives expanded, with stride 0
    x_ref = x.clone().requires_grad_()
    w_ref = w.clone().requires_grad_()
    fn = torch.nn.functional.rms_norm if rms else torch.nn.functional.layer_norm
    fn(x_ref, (4, 8), w_ref).sum().backward()
    torch.testing.assert_close(x_.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [100, 20000], ids=["tile", "chunked"])
def test_strided_inputs_are_read_right(n, device):
    base = torch.randn(6, n + 24, dtype=torch.float16, device=device)
    x = base[:, 8 : 8 + n]  # rows further apart than n: handled through the row stride
    assert not x.is_contiguous()
    w = torch.randn(n, dtype=torch.float16, device=device)
    torch.testing.assert_close(kernels.layer_norm(x, n, w), kernels.layer_norm(x.contiguous(), n, w))
    x3 = torch.randn(5, 4, n, dtype=torch.float16, device=device).transpose(0, 1)  # not flattenable
    r3 = torch.randn(4, 5, n, dtype=torch.float16, device=device)
    y, h = kernels.add_rms_norm(x3, r3, n, w)
    y_ref, h_ref = kernels.add_rms_norm(x3.contiguous(), r3, n, w)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)


# Rows past the backward's 8,192 held in registers: split into column blocks of 4,096, each program
# sweeping the others for the row sums. One block and a ragged one (8193), a ragged last block
# among four (16411), whole blocks (16384); one row and several.
WIDE_SHAPES = [(1, 8193), (3, 8193), (1, 16384), (2, 16411)]


@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_split_rows_match_reference(rms, residual, shape, device):
    check_case(make_case(rms, shape, torch.float16, device, residual=residual, seed=shape[1]))


def test_split_rows_launch_a_program_per_column_block(monkeypatch):
    # On an H200's 132 SMs: a slab's column blocks side by side in launch order (axis 0), one program
    # an SM in all, so the partial sums take a row per slab (26 here, where each of the 5 blocks
    # once launched 4 per SM: 528 rows of partial sums).
    M, N = 1000, 16411
    monkeypatch.setattr(runtime, "num_sms", lambda device: 132)
    launches = record_launches(monkeypatch, execute=False)
    x, dy = torch.zeros(M, N, dtype=torch.float16), torch.zeros(M, N, dtype=torch.float16)
    w, stats = torch.ones(N, dtype=torch.float16), torch.ones(M)
    _, dweight, _ = layernorm.norm_bwd(dy, None, x, w, stats, stats, True, False, [True, True, True])
    assert launches == [("_norm_bwd_kernel", (5, 26))] and dweight.shape == (N,)
    assert triton.cdiv(N, layernorm.BWD_SPLIT_ROW.block_n) == 5


# 259 rows: slabs of several 2-row tiles, a ragged last one; at this size (not at 131) dweight's bits
# do change when the slabs do (num_sms 3 for 4), so a run-to-run change of order would show.
@pytest.mark.parametrize("shape", [(259, 1000), (5, 20000)], ids=["tile", "chunked"])
def test_backward_is_deterministic(shape, device):
    case = make_case(False, shape, torch.float16, device, residual=True)
    first, again = run_kernel(case), run_kernel(case)
    for name in first:
        assert torch.equal(first[name], again[name]), f"{name} changed between identical runs"


def test_zero_rows(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    y = kernels.layer_norm(x, 64, w)
    y.sum().backward()
    assert y.shape == (0, 64) and torch.equal(w.grad, torch.zeros(64, device=device))


def test_cpu_without_interpreter_uses_the_reference(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    x = torch.randn(4, 16, dtype=torch.float16)
    r = torch.randn(4, 16, dtype=torch.float16)
    w = torch.randn(16)
    y, h = kernels.add_layer_norm(x, r, 16, w)
    y_ref, h_ref = reference.add_layer_norm(x, r, 16, w)
    assert y.dtype == torch.float16 and torch.equal(y, y_ref.half()) and torch.equal(h, h_ref)


BAD_INPUTS = [
    (lambda x, w: kernels.layer_norm(x.double(), 16, w), TypeError, "input must be float16"),
    (lambda x, w: kernels.layer_norm(x.int(), 16), TypeError, "input must be float16"),
    (lambda x, w: kernels.layer_norm(x, 16, w[:8]), ValueError, r"weight must have shape \[16\]"),
    (lambda x, w: kernels.layer_norm(x, 16, w, torch.zeros(3)), ValueError, r"bias must have shape \[16\]"),
    (lambda x, w: kernels.rms_norm(x, 16, w.to("meta")), ValueError, "weight is on meta"),
    (lambda x, w: kernels.rms_norm(x, 12, w), ValueError, "normalized_shape .* trailing dimensions"),
    (
        lambda x, w: kernels.layer_norm(torch.zeros(2, 65537), 65537),
        ValueError,
        r"normalized_shape \[65537\] holds 65537 elements; the kernels take 1 to 65536",
    ),
    (
        lambda x, w: kernels.layer_norm(torch.zeros(2, 0), 0),
        ValueError,
        r"normalized_shape \[0\] holds 0 elements; the kernels take 1 to 65536",
    ),
    (lambda x, w: kernels.layer_norm(x.t(), 4, None), ValueError, "input must have a contiguous last"),
    (lambda x, w: kernels.add_layer_norm(x, x.half(), 16, w), ValueError, "residual must match"),
    (lambda x, w: kernels.add_rms_norm(x, x[:2], 16, w), ValueError, "residual must match"),
    (
        lambda x, w: kernels.rms_norm(x, 16, None, weight_offset=1.0),
        ValueError,
        "weight_offset 1.0 needs a weight",
    ),
    (lambda x, w: kernels.layer_norm(x.numpy(), 16), TypeError, "input must be a torch.Tensor"),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_input_is_named(call, error, message):
    x = torch.randn(4, 16)
    w = torch.randn(16)
    with pytest.raises(error, match=message):
        call(x, w)


@pytest.mark.parametrize("shape", [(33, 1000), (5, 20000)], ids=["tile", "chunked"])
@pytest.mark.parametrize(
    "trained",
    [{"x"}, {"residual"}, {"weight", "bias"}, {"bias"}, {"x", "weight"}],
    ids=lambda t: "+".join(sorted(t)),
)
def test_frozen_tensors_get_no_gradient_work(trained, shape, device, monkeypatch):
    # Frozen parameters (fine-tuning) or inputs that need no gradient: the backward computes and
    # stores nothing that only their gradient would use, and the others' gradients are unchanged.
    M, N = shape
    gen = torch.Generator().manual_seed(M + N)
    t = {name: torch.randn(*size, generator=gen).to(device) for name, size in
         (("x", (M, N)), ("residual", (M, N)), ("weight", (N,)), ("bias", (N,)), ("dy", (M, N)))}  # fmt: skip

    def norm(leaves):
        y, h = kernels.add_layer_norm(leaves["x"], leaves["residual"], (N,), leaves["weight"], leaves["bias"])
        return y

    full = {name: v.clone().requires_grad_() for name, v in t.items() if name != "dy"}
    norm(full).backward(t["dy"])
    leaves = {name: v.clone().requires_grad_(name in trained) for name, v in t.items() if name != "dy"}
    y = norm(leaves)
    allocations = []
    empty = runtime.empty
    monkeypatch.setattr(
        runtime, "empty", lambda shape, *a: allocations.append(tuple(shape)) or empty(shape, *a)
    )
    launches = record_launches(monkeypatch)
    y.backward(t["dy"])
    needs_dx = bool(trained & {"x", "residual"})
    assert [name for name, _ in launches] == ["_norm_bwd_kernel"]
    assert ((M, N) in allocations) == needs_dx  # dx
    partial_rows = [a for a in allocations if len(a) == 2 and a[1] == N and a != (M, N)]
    assert len(partial_rows) == len(trained & {"weight", "bias"})  # dweight's and dbias's partial sums
    for name, leaf in leaves.items():
        assert (leaf.grad is not None) == (name in trained), name
        if name in trained:  # the same gradient as with every leaf trained, bit for bit
            assert torch.equal(leaf.grad, full[name].grad), name


@pytest.mark.interpreter
def test_custom_ops_pass_opcheck():
    x = torch.randn(8, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    r = torch.randn(8, 40, requires_grad=True)
    for args in [(x, w, b, r, 1e-5, False), (x, w, None, None, 1e-6, True), (x, None, None, r, 1e-6, True)]:
        torch.library.opcheck(torch.ops.horse.norm_fwd.default, args)


class PreNormBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        from horse.layers import FusedLayerNorm, FusedRMSNorm

        self.proj = torch.nn.Linear(d, d)
        self.norm1 = FusedLayerNorm(d)
        self.norm2 = FusedRMSNorm(d)

    def forward(self, x):
        y = self.proj(self.norm1(x))
        y, h = self.norm2.forward_residual(y, x)
        return y * h


@pytest.mark.interpreter
def test_torch_compile_fullgraph_runs_through_the_ops():
    torch.manual_seed(0)
    model = PreNormBlock(48)
    x = torch.randn(2, 5, 48, requires_grad=True)
    eager = model(x)
    eager.sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)(x)  # fullgraph: a graph break raises
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip([x.grad] + [p.grad for p in model.parameters()], grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
# (1024, 65536): the chunked path at its largest hidden size; the float64 truth of each case takes
# ~8 GiB there, with the GPU tests running in 12 processes on one GPU.
@pytest.mark.parametrize("shape", [(16384, 4096), (1024, 65536), (3, 12288)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_gpu_large_shapes(rms, dtype, shape):
    check_case(make_case(rms, shape, dtype, "cuda", residual=True))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_launches_on_the_inputs_device():
    case = make_case(False, (257, 1000), torch.float16, "cuda:1", residual=True)
    with torch.cuda.device(0):
        check_case(case)


def test_fused_rms_norm_with_weight_offset_is_gemmas_norm(device):
    norm = FusedRMSNorm(48, eps=1e-6, weight_offset=1.0, device=device)
    assert torch.equal(norm.weight, torch.zeros(48, device=device)), "the scale 1 + weight starts at 1"
    assert repr(norm) == "FusedRMSNorm((48,), eps=1e-06, elementwise_affine=True, weight_offset=1.0)"
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator(device=device).manual_seed(0))
    x = torch.randn(5, 48, device=device, dtype=torch.float16)
    r = torch.randn_like(x)
    y, h = norm.forward_residual(x, r)
    assert torch.equal(h, reference.residual_add(x, r))
    truth = reference.rms_norm(h.double(), 48, norm.weight.double(), 1e-6, weight_offset=1.0)
    baseline = reference.rms_norm(h, 48, norm.weight, 1e-6, weight_offset=1.0).to(x.dtype)
    assert_close("forward_residual", y, truth, baseline)
    assert_close("forward", norm(h), truth, baseline)
    with pytest.raises(ValueError, match="weight_offset 1.0 needs elementwise_affine=True"):
        FusedRMSNorm(48, elementwise_affine=False, weight_offset=1.0)
