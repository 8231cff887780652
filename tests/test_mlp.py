"""The fused MLP kernels (horse.kernels.mlp) against the float64 truth: every output and gradient, for every
activation, with and without bias, on sizes that are not multiples of the tiles.

The baseline of the accuracy rule is PyTorch at the same precision: the float32 reference with
each intermediate tensor rounded to the input dtype where eager PyTorch stores it (after every
linear, activation and gate product, and their gradients likewise). The truth is the same graph
in float64 with no rounding.

bfloat16 through the GEMM kernels runs on a GPU only: the interpreter's bf16 ``tl.dot`` multiplies
bit patterns. The elementwise backward has no dot, and is tested in bfloat16 here too.
"""

import copy
import functools
import itertools
import zlib

import pytest
import torch
import triton
from helpers import (
    assert_close,
    device_has_tma,
    record_gemms,
    record_launches,
    record_tma_choices,
    run_family_tables,
)
from torch import nn

from horse import kernels
from horse.kernels import mlp, reference, runtime
from horse.layers import FusedMLP

ACTIVATIONS = mlp.ACTIVATIONS
# (M, K, N): every size 1, 33, 100 and 257 appears as M, as K and as N; none is a tile multiple.
SHAPES = [(1, 33, 100), (33, 257, 1), (100, 1, 257), (257, 100, 33)]
# (M, K, H, D) for the two-GEMM MLPs.
MLP_SHAPES = [(33, 100, 257, 1), (257, 33, 100, 40), (1, 257, 33, 100)]


def _seed(*case) -> int:
    """Fresh data for every case, the same on every run (str hashes change from run to run)."""
    return zlib.crc32(repr(case).encode())


def _id(value) -> str:
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return "bias" if value else "nobias"


@pytest.fixture(autouse=True)
def exact_cublas():
    # The float32 baseline must be float32, not TF32 (off by default in PyTorch; made sure of here).
    # And the weight and input gradients, which ours leaves to cuBLAS in 16 bits, must not reduce
    # split-K partial sums in 16 bits (on by default): the test judges our kernels, not that.
    matmul = torch.backends.cuda.matmul
    flags = ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
    previous = {flag: getattr(matmul, flag) for flag in flags}
    for flag in flags:
        setattr(matmul, flag, False)
    yield
    for flag, value in previous.items():
        setattr(matmul, flag, value)


class _Round(torch.autograd.Function):
    """Rounds to dtype in the forward and the gradient to dtype in the backward, as eager PyTorch
    stores both at that precision."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


def reference_graph(kind: str, t: dict, activation: str, round_to: torch.dtype | None) -> torch.Tensor:
    """The unfused computation, each op's output rounded to round_to (None: no rounding)."""

    def r(z):
        return z if round_to is None else _Round.apply(z, round_to)

    def lin(x, w, b=None):
        return r(torch.nn.functional.linear(x, w, b))

    def act(z):
        return z if activation == "none" else r(reference.apply_activation(z, activation))

    if kind == "linear_act":
        return act(lin(t["x"], t["weight"], t.get("bias")))
    if kind == "fused_mlp":
        return lin(act(lin(t["x"], t["w_in"], t.get("b_in"))), t["w_out"], t.get("b_out"))
    # x feeds two linears: eager PyTorch rounds each one's dx, then sums them (r on x rounds them).
    h = r(act(lin(r(t["x"]), t["w_gate"])) * lin(r(t["x"]), t["w_up"]))
    return h if kind == "gated_linear" else lin(h, t["w_down"])


def call_ours(kind: str, t: dict, activation: str) -> torch.Tensor:
    if kind == "linear_act":
        return kernels.linear_act(t["x"], t["weight"], t.get("bias"), activation=activation)
    if kind == "gated_linear":
        return kernels.gated_linear(t["x"], t["w_gate"], t["w_up"], activation=activation)
    if kind == "fused_mlp":
        return kernels.fused_mlp(
            t["x"], t["w_in"], t.get("b_in"), t["w_out"], t.get("b_out"), activation=activation
        )
    return kernels.fused_gated_mlp(t["x"], t["w_gate"], t["w_up"], t["w_down"], activation=activation)


def make_tensors(kind: str, sizes: tuple, dtype, device, bias: bool = True, seed: int = 0) -> dict:
    """Inputs and weights for kind, and the gradient "dy" of the output: uniform with unit variance
    (weights 1/fan_in), so pre-activations are O(1). Bounded, not normal: with K = 1 a product of
    normals through relu2 and a gate has tails so heavy that one rounding decides the largest
    gradient, and the 2x rule then judges a coin toss."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def uniform(*shape, scale=1.0):
        unit = (torch.rand(*shape, generator=gen) * 2 - 1) * 3**0.5  # U(-√3, √3): variance 1
        return (unit * scale).to(device=device, dtype=dtype)

    if kind in ("linear_act", "gated_linear"):
        M, K, N = sizes
        out = N
    else:
        M, K, N, out = sizes
    t = {"x": uniform(M, K)}
    if kind == "linear_act":
        t["weight"] = uniform(N, K, scale=max(K, 1) ** -0.5)
        if bias:
            t["bias"] = uniform(N, scale=0.5)
    elif kind == "fused_mlp":
        t["w_in"] = uniform(N, K, scale=max(K, 1) ** -0.5)
        t["w_out"] = uniform(out, N, scale=max(N, 1) ** -0.5)
        if bias:
            t["b_in"], t["b_out"] = uniform(N, scale=0.5), uniform(out, scale=0.5)
    else:
        t["w_gate"], t["w_up"] = (
            uniform(N, K, scale=max(K, 1) ** -0.5),
            uniform(N, K, scale=max(K, 1) ** -0.5),
        )
        if kind == "fused_gated_mlp":
            t["w_down"] = uniform(out, N, scale=max(N, 1) ** -0.5)
    t["dy"] = uniform(M, out)
    return t


def run(fn, tensors: dict, dtype=None) -> dict:
    """y = fn(leaves) and the gradient of every leaf for dy, by name ("y", "dx", "dweight", ...)."""
    leaves = {name: (v.detach().to(dtype) if dtype else v.detach().clone()).requires_grad_()
              for name, v in tensors.items() if name != "dy"}  # fmt: skip
    y = fn(leaves)
    dy = tensors["dy"].to(y.dtype)
    grads = torch.autograd.grad(y, list(leaves.values()), dy)
    return {"y": y.detach()} | {f"d{name}": g for name, g in zip(leaves, grads, strict=True)}


def check(kind: str, tensors: dict, activation: str) -> None:
    dtype = tensors["x"].dtype
    ours = run(lambda t: call_ours(kind, t, activation), tensors)
    truth = run(lambda t: reference_graph(kind, t, activation, None), tensors, torch.float64)
    baseline = run(lambda t: reference_graph(kind, t, activation, dtype), tensors, torch.float32)
    assert ours.keys() == truth.keys()
    for name in truth:
        assert_close(name, ours[name], truth[name], baseline[name].to(dtype))


@pytest.mark.parametrize("shape,bias", list(zip(SHAPES, [True, False] * 2, strict=True)), ids=_id)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_act(activation, shape, bias, device):
    seed = _seed(activation, bias, shape)
    check("linear_act", make_tensors("linear_act", shape, torch.float16, device, bias, seed), activation)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_linear(activation, shape, device):
    seed = _seed(activation, shape)
    check("gated_linear", make_tensors("gated_linear", shape, torch.float16, device, seed=seed), activation)


@pytest.mark.parametrize("shape", MLP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_mlp(activation, shape, device):
    bias = MLP_SHAPES.index(shape) != 1  # with and without both biases
    seed = _seed(activation, shape)
    check("fused_mlp", make_tensors("fused_mlp", shape, torch.float16, device, bias, seed), activation)


@pytest.mark.parametrize("shape", MLP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu2"])
def test_fused_gated_mlp(activation, shape, device):
    seed = _seed(activation, shape)
    tensors = make_tensors("fused_gated_mlp", shape, torch.float16, device, seed=seed)
    check("fused_gated_mlp", tensors, activation)


@pytest.mark.parametrize("family", list(runtime.ARCHS))
def test_every_gpu_familys_gemm_tiles_match_reference(family, device, monkeypatch):
    # The interpreter runs small tiles of its own; here every GEMM entry of a GPU family's table at
    # its real tile shape (pointer loads before sm_90). With LARGE_OUTPUTS lowered, M = 40 is the
    # small class, 100 x 72 outputs the medium one and 257 x 136 the large one.
    if device != "cpu":
        pytest.skip("a GPU launches its own family's entries (the other tests)")
    chosen = run_family_tables(monkeypatch, family, mlp.configs, "INTERPRETER_GEMM_BLOCKS", "gemm_config")
    monkeypatch.setattr(mlp.configs, "LARGE_OUTPUTS", 2**15)
    sizes = ((40, 72), (100, 72), (257, 136))
    for kind, (M, H) in itertools.product(("fused_mlp", "fused_gated_mlp"), sizes):
        tensors = make_tensors(kind, (M, 40, H, 24), torch.float16, device, seed=_seed(family, kind, M))
        check(kind, tensors, "gelu_tanh")
    tables = mlp.configs.GEMM_CONFIGS[family]
    assert chosen == {cfg for classes in tables.values() for cfg in classes.values()}


# K, H and D multiples of 8 (rows of 16-byte multiples in float16, as TMA needs), none a tile
# multiple; M is 1, 33, 100 and 257.
TMA_SHAPES = {
    "linear_act": (257, 40, 72),
    "gated_linear": (33, 264, 24),
    "fused_mlp": (1, 24, 136, 40),
    "fused_gated_mlp": (100, 40, 72, 24),
}
# The GEMM launches of each: the up projection, and in the MLPs the backward's dh = dy W_out.
GEMM_TABLES = {
    "linear_act": ["fwd"],
    "gated_linear": ["gated_fwd"],
    "fused_mlp": ["fwd", "dh_bwd"],
    "fused_gated_mlp": ["gated_fwd", "gated_dh_bwd"],
}


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("kind", list(TMA_SHAPES))
def test_tma_and_pointer_loads_both_match_reference(kind, use_tma, device, monkeypatch):
    monkeypatch.setattr(mlp.launch, "USE_TMA", use_tma)
    choices = record_tma_choices(monkeypatch, mlp.launch)
    sizes = TMA_SHAPES[kind]
    check(kind, make_tensors(kind, sizes, torch.float16, device, seed=_seed(kind, "tma")), "gelu")
    M, N = sizes[0], sizes[-2 if kind.startswith("fused") else -1]
    allowed = [mlp.configs.gemm_config(table, M, N, torch.device(device)).tma for table in GEMM_TABLES[kind]]
    assert choices == [use_tma and a and device_has_tma(device) for a in allowed]


def test_unaligned_operands_take_the_pointer_path(device, monkeypatch):
    choices = record_tma_choices(monkeypatch, mlp.launch)
    # K = 33 and H = 100: rows of x, w_in (66 bytes) and w_out (200) are not multiples of 16.
    check("fused_mlp", make_tensors("fused_mlp", (100, 33, 100, 40), torch.float16, device, seed=9), "gelu")
    assert choices == [False, False]
    # x a view starting 2 bytes into its buffer: its forward reads x by pointers, the backward's dy
    # and w_down are aligned and go by TMA; the results are those of an aligned copy of x.
    t = make_tensors("fused_gated_mlp", (33, 40, 72, 24), torch.float16, device, seed=9)
    buffer = torch.zeros(33, 48, dtype=torch.float16, device=device)
    buffer[:, 1:41] = t["x"]

    def outputs_and_grads(x):
        leaves = [v.detach().requires_grad_() for v in (x, t["w_gate"], t["w_up"], t["w_down"])]
        y = kernels.fused_gated_mlp(*leaves, activation="silu")
        return [y, *torch.autograd.grad(y, leaves, t["dy"])]

    has_tma = device_has_tma(device)
    choices.clear()
    unaligned = outputs_and_grads(buffer[:, 1:41])
    assert choices == [False, has_tma]
    choices.clear()
    aligned = outputs_and_grads(t["x"])
    assert choices == [has_tma, has_tma]
    for a, b in zip(unaligned, aligned, strict=True):
        torch.testing.assert_close(a, b)


class _GivenLinear(torch.autograd.Function):
    """A linear x Wᵀ + b whose forward value is given (a saved pre-activation) and whose backward is a
    linear's: the backward of linear_act and gated_linear from their saved pre-activations."""

    @staticmethod
    def forward(ctx, value, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return value.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return None, grad @ w, grad.t() @ x, grad.sum(0) if ctx.has_bias else None


@pytest.mark.parametrize("kind", ["linear_act", "gated_linear"])
@pytest.mark.parametrize("activation", ACTIVATIONS[1:])
def test_elementwise_backward_in_bfloat16(activation, kind, device):
    # The elementwise kernel has no tl.dot, so it runs in the interpreter in bfloat16 too; the
    # forward (a GEMM) is replaced by pre-activations computed here.
    t = make_tensors(kind, (257, 100, 33), torch.bfloat16, device, seed=7)
    gated = kind == "gated_linear"
    weights = ("w_gate", "w_up") if gated else ("weight",)
    bias = t["bias"].float() if "bias" in t else None
    pres = {w: torch.nn.functional.linear(t["x"].float(), t[w].float(), bias).bfloat16() for w in weights}
    dy, x = t["dy"], t["x"]
    if gated:
        dx, dw_gate_up = mlp.launch.gated_linear_bwd(
            dy, x, t["w_gate"], t["w_up"], *pres.values(), activation, [True] * 3
        )
        grads = (dx, *dw_gate_up.tensor_split(2))  # one GEMM's (2N, K): [dW_gate; dW_up]
    else:
        grads = mlp.launch.linear_act_bwd(dy, x, t["weight"], pres["weight"], True, activation, [True] * 2)
    ours = dict(zip(["dx"] + [f"d{w}" for w in weights] + ([] if gated else ["dbias"]), grads, strict=True))

    def graph(leaves, round_to):
        def r(z):
            return z if round_to is None else _Round.apply(z, round_to)

        pre = [r(_GivenLinear.apply(pres[w], leaves["x"], leaves[w], leaves.get("bias"))) for w in weights]
        y = r(reference.apply_activation(pre[0], activation))
        return r(y * pre[1]) if gated else y

    truth = run(lambda leaves: graph(leaves, None), t, torch.float64)
    baseline = run(lambda leaves: graph(leaves, torch.bfloat16), t, torch.float32)
    for name in ours:
        assert_close(name, ours[name], truth[name], baseline[name].to(torch.bfloat16))


def test_leading_dims_strides_and_expanded_gradients_are_read_in_place(device):
    # x (2, 3, K) a slice of a wider tensor (row stride 64, not K), weights stored transposed
    # (strides (1, out_features)), and the gradient of .sum() expanded with stride 0: the kernels
    # read them all through their strides, and agree with contiguous copies.
    t = make_tensors("fused_mlp", (6, 40, 72, 24), torch.float16, device, seed=3)
    x = torch.randn(2, 3, 64, dtype=torch.float16, device=device)[..., 8:48]
    w_in, w_out = (t[w].t().contiguous().t() for w in ("w_in", "w_out"))
    assert not x.is_contiguous() and w_in.stride() == (1, 72)

    def outputs_and_grads(*tensors):
        leaves = [v.detach().requires_grad_() for v in tensors]  # detach keeps the strides
        y = kernels.fused_mlp(leaves[0], leaves[1], t["b_in"], leaves[2], t["b_out"], activation="gelu_tanh")
        y.sum().backward()
        plain = [kernels.linear_act(tensors[0], tensors[1], t["b_in"], activation="silu")]
        gated = [
            kernels.gated_linear(tensors[0], tensors[1], t["w_in"], activation="relu2")
        ]  # w_up: other strides
        return [y, *(v.grad for v in leaves), *plain, *gated]

    strided = outputs_and_grads(x, w_in, w_out)
    contiguous = outputs_and_grads(x.contiguous(), t["w_in"], t["w_out"])
    assert strided[0].shape == (2, 3, 24)
    for a, b in zip(strided, contiguous, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["fused_mlp", "fused_gated_mlp"])
def test_backward_is_deterministic(kind, device):
    tensors = make_tensors(kind, (257, 33, 100, 40), torch.float16, device, seed=5)
    first, again = (
        run(lambda t: call_ours(kind, t, "gelu"), tensors),
        run(lambda t: call_ours(kind, t, "gelu"), tensors),
    )
    for name in first:
        assert torch.equal(first[name], again[name]), f"{name} changed between identical runs"


@pytest.mark.parametrize("kind", ["linear_act", "gated_linear", "fused_mlp", "fused_gated_mlp"])
def test_without_grad_nothing_is_saved_and_the_output_is_the_same(kind, device, monkeypatch):
    store_pre = []  # the flag each forward launch got
    launch = mlp.launch._fwd_gemm
    monkeypatch.setattr(mlp.launch, "_fwd_gemm", lambda *args: store_pre.append(args[-1]) or launch(*args))
    sizes = (33, 40, 50) if kind.endswith("linear") or kind == "linear_act" else (33, 40, 50, 24)
    inputs = {k: v for k, v in make_tensors(kind, sizes, torch.float16, device).items() if k != "dy"}
    with torch.no_grad():
        y_inference = call_ours(kind, inputs, "gelu")
    y_training = call_ours(kind, {k: v.clone().requires_grad_() for k, v in inputs.items()}, "gelu")
    assert store_pre == [False, True]
    torch.testing.assert_close(y_training.detach(), y_inference, rtol=0, atol=0)


@pytest.mark.parametrize("sizes", [(0, 16, 32, 8), (5, 0, 32, 8), (5, 16, 0, 8)], ids=["M=0", "K=0", "H=0"])
def test_empty_dimensions(sizes, device):
    t = make_tensors("fused_mlp", sizes, torch.float16, device)
    ours = run(lambda leaves: call_ours("fused_mlp", leaves, "gelu_tanh"), t)
    truth = run(lambda leaves: reference_graph("fused_mlp", leaves, "gelu_tanh", None), t, torch.float32)
    for name in truth:
        torch.testing.assert_close(ours[name], truth[name].half(), rtol=1e-3, atol=1e-3)


def test_cpu_without_interpreter_uses_the_reference_and_takes_float32(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    t = make_tensors("fused_mlp", (5, 16, 32, 8), torch.float32, "cpu")
    y = kernels.fused_mlp(t["x"], t["w_in"], t["b_in"], t["w_out"], t["b_out"], activation="relu2")
    assert torch.equal(
        y, reference.fused_mlp(t["x"], t["w_in"], t["b_in"], t["w_out"], t["b_out"], activation="relu2")
    )
    half = kernels.linear_act(t["x"].half(), t["w_in"].half(), None, activation="silu")
    assert half.dtype == torch.float16


# Each with an activation (required, keyword-only), so that a case fails only on what it names.
LINEAR, GATED, MLP, GATED_MLP = (
    functools.partial(fn, activation="gelu_tanh")
    for fn in (kernels.linear_act, kernels.gated_linear, kernels.fused_mlp, kernels.fused_gated_mlp)
)
BAD_INPUTS = [
    (lambda t: LINEAR(t["x"], t["w_in"][:, :8]), ValueError,
     "weight has in_features 8 but input's last dimension is 16"),
    (lambda t: LINEAR(t["x"], t["w_in"], t["b_out"]), ValueError, r"bias must have shape \[32\]"),
    (lambda t: LINEAR(t["x"], t["w_in"], activation="gelu_erf"), ValueError, "unknown activation 'gelu_erf'"),
    (lambda t: LINEAR(t["x"], t["w_in"].double()), TypeError, "weight must be float16 or bfloat16"),
    (lambda t: LINEAR(t["x"], t["w_in"].bfloat16()), TypeError,
     "weight is torch.bfloat16 but input is torch.float16"),
    (lambda t: LINEAR(t["x"], t["w_in"].to("meta")), ValueError, "weight is on meta but input is on cpu"),
    (lambda t: LINEAR(t["x"], t["w_in"][0]), ValueError, "weight must have 2 dimension"),
    (lambda t: LINEAR(t["x"].float(), t["w_in"].float()), TypeError, "or bfloat16 on the Triton path"),
    (lambda t: LINEAR(t["x"].numpy(), t["w_in"]), TypeError, "input must be a torch.Tensor"),
    (lambda t: LINEAR(t["x"][0, 0], t["w_in"]), ValueError, "input must have at least one dimension"),
    (lambda t: GATED(t["x"], t["w_in"], t["w_in"][:16]), ValueError, r"w_up must have shape \[32, 16\]"),
    (lambda t: MLP(t["x"], t["w_in"], None, t["w_out"][:, :5], None), ValueError,
     r"w_out must have shape \[8, 32\] \(in_features = w_in's out_features"),
    (lambda t: MLP(t["x"], t["w_in"], None, t["w_out"], t["b_in"]), ValueError, r"b_out must have shape \[8"),
    (lambda t: GATED_MLP(t["x"], t["w_in"], t["w_in"], t["w_in"]), ValueError, r"w_down must have shape"),
    (lambda t: GATED_MLP(t["x"], t["w_in"], t["w_in"], t["w_out"], activation="swish"), ValueError,
     "unknown activ"),
]  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_input_is_named(call, error, message):
    t = make_tensors("fused_mlp", (4, 16, 32, 8), torch.float16, "cpu")
    with pytest.raises(error, match=message):
        call(t)


class LlamaMLP(nn.Module):
    """The LLaMA MLP as Hugging Face writes it: the reference for FusedMLP(gated=True)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _gpt2_reference(d_model: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d_model))


def _load_sequential(fused: FusedMLP, sequential: nn.Sequential) -> None:
    names = {"0": "c_fc", "2": "c_proj"}
    fused.load_state_dict({f"{names[k[0]]}{k[1:]}": v for k, v in sequential.state_dict().items()})


def _module_pair(gated: bool, d_model: int, device) -> tuple[nn.Module, FusedMLP]:
    """The torch MLP (nanoGPT's or LLaMA's) and a FusedMLP holding the same random weights."""
    torch.manual_seed(0)
    ref = (LlamaMLP if gated else _gpt2_reference)(d_model, 100).to(device)
    fused = FusedMLP(d_model, 100, gated=gated, bias=not gated).to(device)
    if gated:
        fused.load_state_dict(ref.state_dict())
    else:
        _load_sequential(fused, ref)
    return ref, fused


@pytest.mark.parametrize("gated", [False, True], ids=["gpt2", "llama"])
def test_fused_mlp_module_matches_the_torch_layers(gated, device):
    d_model = 48
    ref, fused = _module_pair(gated, d_model, device)
    fused.half()
    x = torch.randn(2, 33, d_model, device=device)
    dy = torch.randn(2, 33, d_model, device=device)

    def run_module(module, dtype):
        module = copy.deepcopy(module).to(dtype)
        leaf = x.to(dtype).requires_grad_()
        y = module(leaf)
        y.backward(dy.to(dtype))
        return [y.detach(), leaf.grad] + [p.grad for p in module.parameters()]

    ours, truth, baseline = (
        run_module(fused, torch.float16),
        run_module(ref, torch.float64),
        run_module(ref, torch.float16),
    )
    names = ["y", "dx"] + [f"d{name}" for name, _ in fused.named_parameters()]
    for name, actual, exact, eager in zip(names, ours, truth, baseline, strict=True):
        assert_close(name, actual, exact, eager)


@pytest.mark.parametrize("gated", [False, True], ids=["gpt2", "llama"])
def test_fused_mlp_state_dicts_load_both_ways(gated):
    ref = LlamaMLP(16, 40) if gated else nn.Module()
    if not gated:  # nanoGPT's MLP: c_fc, an activation, c_proj
        ref.c_fc, ref.c_proj = nn.Linear(16, 40), nn.Linear(40, 16)
    fused = FusedMLP(16, 40, gated=gated, bias=not gated)
    fused.load_state_dict(ref.state_dict())
    assert fused.state_dict().keys() == ref.state_dict().keys()
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(1.0)
    ref.load_state_dict(fused.state_dict())
    for a, b in zip(ref.state_dict().values(), fused.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert "activation='silu'" in repr(fused) if gated else "activation='gelu_tanh'" in repr(fused)


def test_fused_mlp_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        FusedMLP(8, 16, activation="tanh")
    with pytest.raises(ValueError, match="no biases"):
        FusedMLP(8, 16, gated=True)


@pytest.mark.interpreter
def test_custom_ops_pass_opcheck():
    t = make_tensors("fused_mlp", (8, 16, 32, 8), torch.float16, "cpu")
    x, w_in, b_in, w_out, b_out = (
        t[k].clone().requires_grad_() for k in ("x", "w_in", "b_in", "w_out", "b_out")
    )
    ops = torch.ops.horse
    torch.library.opcheck(ops.linear_act_fwd.default, (x, w_in, b_in, "gelu_tanh", True))
    torch.library.opcheck(ops.linear_act_fwd.default, (x, w_in, None, "none", True))
    torch.library.opcheck(ops.gated_linear_fwd.default, (x, w_in, w_in.detach().clone(), "silu", True))
    torch.library.opcheck(ops.fused_mlp_fwd.default, (x, w_in, b_in, w_out, b_out, "relu", True))
    torch.library.opcheck(ops.fused_mlp_fwd.default, (x, w_in, None, w_out, None, "none", True))
    no_grad = [t.detach() for t in (x, w_in, w_out)]
    torch.library.opcheck(
        ops.fused_mlp_fwd.default, (no_grad[0], no_grad[1], None, no_grad[2], None, "silu", False)
    )
    y, _ = ops.fused_mlp_fwd(x, w_in, b_in, w_out, b_out, "relu", False)  # saves nothing
    with pytest.raises(RuntimeError, match="save_pre=False"):
        y.sum().backward()
    torch.library.opcheck(ops.gated_mlp_fwd.default, (x, w_in, w_in.detach().clone(), w_out, "gelu", True))


class TwoMLPs(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt2 = FusedMLP(32, 48)
        self.llama = FusedMLP(32, 40, gated=True, bias=False)

    def forward(self, x):
        return self.llama(self.gpt2(x))


@pytest.mark.interpreter
def test_torch_compile_fullgraph_runs_through_the_ops():
    torch.manual_seed(0)
    model = TwoMLPs().half()
    x = torch.randn(2, 5, 32, dtype=torch.float16, requires_grad=True)
    eager = model(x)
    eager.float().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)(x)  # fullgraph: a graph break raises
    compiled.float().sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for got, want in zip([x.grad] + [p.grad for p in model.parameters()], grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["linear_act", "gated_linear", "fused_mlp", "fused_gated_mlp"])
@pytest.mark.parametrize(
    "shape",
    [(33, 100, 257, 40), (1000, 768, 3072, 768), (4099, 1024, 4096, 1000), (8192, 2048, 5504, 2048)],
    ids=["ragged", "medium", "large", "gated-large"],
)
def test_gpu_every_shape_class_and_dtype(shape, kind, dtype):
    # bfloat16 GEMMs run here only (the interpreter's bf16 tl.dot is wrong); the shapes reach the
    # small, medium and large entries of the config table, with ragged edges.
    sizes = shape[:3] if kind in ("linear_act", "gated_linear") else shape
    for activation in ("gelu_tanh", "relu2") if kind == "fused_mlp" else ("silu",):
        check(kind, make_tensors(kind, sizes, dtype, "cuda", seed=11), activation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["linear_act", "gated_linear", "fused_mlp", "fused_gated_mlp"])
def test_gpu_pointer_loads(kind, dtype, monkeypatch):
    # Aligned shapes take TMA in the other GPU tests; here every GEMM takes the pointer path.
    monkeypatch.setattr(mlp.launch, "USE_TMA", False)
    sizes = (1000, 768, 3072, 768)[: 3 if kind in ("linear_act", "gated_linear") else 4]
    check(kind, make_tensors(kind, sizes, dtype, "cuda"), "silu" if "gated" in kind else "gelu_tanh")


@pytest.mark.gpu
def test_gpu_small_rows_and_every_activation():
    for activation in ACTIVATIONS:
        check("linear_act", make_tensors("linear_act", (17, 512, 1024), torch.bfloat16, "cuda"), activation)


@pytest.mark.parametrize("gated", [False, True], ids=["gpt2", "llama"])
def test_fused_mlp_under_autocast_matches_nn_linear_and_trains_fp32_weights(gated, device):
    """Float32 master weights under torch.autocast(float16): the kernels see float16, as nn.Linear
    does, and the float32 weights get float32 gradients equal to the eager module's."""
    d_model = 48
    ref, fused = _module_pair(gated, d_model, device)
    x = torch.randn(2, 33, d_model, device=device)
    results = []
    for module in (ref, fused):
        with torch.autocast(device, torch.float16):
            y = module(x)
        y.float().square().sum().backward()
        results.append((y, [p.grad for p in module.parameters()]))
    (y_ref, grads_ref), (y, grads) = results
    assert y.dtype == y_ref.dtype == torch.float16
    torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=1e-2)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, g_ref, rtol=2e-2, atol=2e-2 * g_ref.abs().max().item())


def past_2_31_elements(t: torch.Tensor) -> torch.Tensor:
    """t (M, N) stored column-major in a buffer whose columns lie 2**30 elements apart: from the third
    on they start past 2**31, where an index * stride in 32 bits wraps. The buffer takes 4 GiB of
    address space per 2 columns; only the columns' pages are ever touched."""
    M, N = t.shape
    column_stride = 2**30
    buffer = torch.empty((N - 1) * column_stride + M, dtype=t.dtype, device=t.device)
    return buffer.as_strided((M, N), (1, column_stride)).copy_(t)


def test_columns_past_2_31_elements_are_addressed_in_64_bits(device):
    # A transposed x (the forward GEMM's k * x_strides[1]) and a transposed gradient (the elementwise
    # backward's n * dh_strides[1]), each with a column past 2**31 elements.
    tensors = make_tensors("linear_act", (5, 3, 3), torch.float16, device, seed=7)
    x = past_2_31_elements(tensors["x"]).requires_grad_()
    weight, bias = (tensors[name].clone().requires_grad_() for name in ("weight", "bias"))
    y = kernels.linear_act(x, weight, bias, activation="gelu")
    grads = torch.autograd.grad(y, (x, weight, bias), past_2_31_elements(tensors["dy"]))
    ours = {"y": y.detach(), "dx": grads[0], "dweight": grads[1], "dbias": grads[2]}
    truth = run(lambda t: reference_graph("linear_act", t, "gelu", None), tensors, torch.float64)
    baseline = run(lambda t: reference_graph("linear_act", t, "gelu", torch.float16), tensors, torch.float32)
    for name in truth:
        assert_close(name, ours[name], truth[name], baseline[name].to(torch.float16))


@pytest.mark.parametrize("kind", ["linear_act", "gated_linear"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_float16_pre_activations_past_65504_are_clamped_in_forward_and_backward(kind, activation, device):
    # x Wᵀ = ±90,000 in two columns: past float16's largest finite value. Stored as ±inf, silu's
    # derivative at -inf was inf x 0 = NaN under a finite output; clamped to ±65,504 (straight
    # through) the output and the gradients are those of the clamped pre-activation, all finite.
    x = torch.tensor([[0.75, 0.75], [0.5, -0.25]], dtype=torch.float16, device=device, requires_grad=True)
    big = torch.tensor([[6e4, 6e4], [-6e4, -6e4], [0.5, 0.25]], dtype=torch.float16, device=device)
    weights = [big.clone().requires_grad_()]
    if kind == "gated_linear":  # a large gate, a moderate up projection: act(gate) * up stays finite
        weights.append(torch.full_like(big, 0.001).requires_grad_())
        y = kernels.gated_linear(x, *weights, activation=activation)
    else:
        y = kernels.linear_act(x, *weights, activation=activation)
    dy = torch.ones_like(y)
    ours = (y, *torch.autograd.grad(y, (x, *weights), dy))

    leaves = [t.detach().double().requires_grad_() for t in (x, *weights)]
    pre = [leaves[0] @ w.t() for w in leaves[1:]]
    straight_through = [p.detach().clamp(-65504, 65504).requires_grad_() for p in pre]
    h = reference.apply_activation(straight_through[0], activation)
    h = h * straight_through[1] if kind == "gated_linear" else h
    dpre = torch.autograd.grad(h, straight_through, dy.double())
    grads = torch.autograd.grad(pre, leaves, dpre)
    for name, value, truth in zip(("y", "dx", "dw", "dw_up"), ours, (h, *grads), strict=False):
        assert torch.isfinite(value).all(), f"{name}: {value}"
        torch.testing.assert_close(value.double(), truth, rtol=2e-3, atol=1e-2, msg=name)


# (kind, the leaves that need a gradient, the Triton kernels and cuBLAS GEMMs its backward launches)
FROZEN_CASES = [
    ("linear_act", {"x"}, ["_act_bwd_kernel"], ["matmul"]),  # frozen weight (LoRA): dx only
    ("linear_act", {"weight", "bias"}, ["_act_bwd_kernel"], ["matmul"]),  # input needs none: dW only
    ("fused_mlp", {"x"}, ["_dh_act_bwd_kernel"], ["matmul"]),
    ("fused_mlp", {"w_out"}, [], ["matmul"]),  # only the last layer trains: no dh GEMM
    ("fused_gated_mlp", {"w_up"}, ["_dh_act_bwd_kernel"], ["matmul"]),
    ("gated_linear", {"x"}, ["_act_bwd_kernel"], ["matmul", "addmm"]),
    # dW_gate and dW_up as ONE GEMM over [dgate | dup] (2N rows), whether or not dx is wanted
    ("gated_linear", {"w_gate", "w_up"}, ["_act_bwd_kernel"], ["matmul"]),
    (
        "fused_gated_mlp",
        {"x", "w_gate", "w_up", "w_down"},
        ["_dh_act_bwd_kernel"],
        ["matmul", "addmm", "matmul", "matmul"],
    ),  # dx (two), dW_gate|up, dW_down
    ("fused_gated_mlp", {"w_gate", "w_down"}, ["_dh_act_bwd_kernel"], ["matmul", "matmul"]),
]


# ids spell the trained set sorted: a set's own order changes with the hash seed, and xdist
# workers must collect the same names
@pytest.mark.parametrize(
    ("kind", "trained", "kernels_run", "gemms_run"),
    FROZEN_CASES,
    ids=lambda v: "+".join(sorted(v)) if isinstance(v, set) else str(v),
)
def test_frozen_tensors_get_no_gradient_gemm_and_inputs_only_weights_need_are_not_saved(
    kind, trained, kernels_run, gemms_run, device, monkeypatch
):
    sizes = (33, 16, 40) if kind in ("linear_act", "gated_linear") else (33, 16, 40, 8)
    t = make_tensors(kind, sizes, torch.float16, device)
    full = run(lambda leaves: call_ours(kind, leaves, "silu"), t)
    leaves = {name: v.clone().requires_grad_(name in trained) for name, v in t.items() if name != "dy"}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        y = call_ours(kind, leaves, "silu")
    launches, gemms = record_launches(monkeypatch), record_gemms(monkeypatch)
    y.backward(t["dy"])
    assert [name for name, _ in launches] == kernels_run
    assert gemms == gemms_run
    for name, leaf in leaves.items():
        assert (leaf.grad is not None) == (name in trained), name
        if name in trained:  # the same gradient as with every leaf trained, bit for bit
            assert torch.equal(leaf.grad, full[f"d{name}"]), name
    x_saved = any(s is not None and s.data_ptr() == leaves["x"].data_ptr() for s in saved)
    assert x_saved == bool(trained & {"weight", "w_in", "w_gate", "w_up"})


# tanh.approx.f32's largest relative error (PTX ISA): the forward epilogues' gelu_tanh on NVIDIA GPUs.
TANH_APPROX_ERROR = 2**-10.987


def _gelu_tanh_with_tanh_error(z: torch.Tensor, relative_error: float):
    """(gelu_tanh, its derivative) in float64 with tanh(u) off by relative_error: the worst case of
    the forward epilogue's tanh.approx, modelled (the interpreter cannot run PTX)."""
    tanh = torch.tanh(0.7978845608028654 * (z + 0.044715 * z**3)) * (1 + relative_error)
    s = 0.5 * (1 + tanh)
    return z * s, s + z * s * (1 - s) * 1.5957691216057308 * (1 + 0.134145 * z * z)


def test_gelu_tanh_by_tanh_approx_stays_within_float16_tolerance_in_the_forward_only():
    # Pre-activations over [-6, 6]. Worst-case tanh.approx error moves gelu_tanh by 2.46e-4 |z| at
    # most (measured here: 1.48e-3 at z = -6), within the suite's float16 rule; the derivative, whose
    # s (1 - s) z^3 terms multiply it (1.35e-2 at z = -6, 8.3e-3 at z = -5), is not: the backward
    # keeps the exp2 form (horse.kernels.mlp.forward._act_fwd).
    z = torch.linspace(-6, 6, 120001, dtype=torch.float64)
    truth, truth_grad = _gelu_tanh_with_tanh_error(z, 0.0)
    for sign in (1, -1):
        y, grad = _gelu_tanh_with_tanh_error(z, sign * TANH_APPROX_ERROR)
        assert (y - truth).abs().max().item() == pytest.approx(1.478e-3, rel=1e-2)
        assert ((y - truth).abs() <= 2.4636e-4 * z.abs() + 1e-12).all()
        assert_close("y", y.half(), truth, truth.half())
        with pytest.raises(AssertionError, match="outside 2 x PyTorch's error"):
            assert_close("dpre", grad.half(), truth_grad, truth_grad.half())


def _run_without_interpreter(script: str):
    """The JSON that script prints last, run in a fresh Python without TRITON_INTERPRET (ahead-of-time
    compiles for a GPU target need Triton's compiler, not its interpreter)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
    run_ = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert run_.returncode == 0, run_.stdout + run_.stderr
    return json.loads(run_.stdout.splitlines()[-1])


GELU_TANH_SASS = """
import collections, json, re, sys
from bench import sass_loops
from bench.compile_report.mlp import mlp_gemm_config
from horse.kernels import mlp

counts = {}
for table in ("fwd", "gated_fwd", "dh_bwd"):
    cfg = mlp.configs.GEMM_CONFIGS["sm90"][table]["small"]
    for inline_ptx in (True, False) if table != "dh_bwd" else (None,):
        kc = mlp_gemm_config(table, "small", cfg, mlp.SUPPORTED_DTYPES[0], "gelu_tanh", True)
        if inline_ptx is not None:
            kc.constexprs["EPILOGUE"] = kc.constexprs["EPILOGUE"]._replace(inline_ptx=inline_ptx)
        mufu = collections.Counter(re.findall(r"MUFU\\.(\\w+)", sass_loops.sass_of(kc)))
        elements = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
        counts[f"{table} {inline_ptx}"] = [dict(mufu), elements]
print(json.dumps(counts))
"""


def test_gelu_tanh_epilogue_takes_one_mufu_an_element_in_sm90_sass():
    """The sm_90 SASS of the small forward GEMMs with gelu_tanh (AOT compiles, no GPU): with
    inline_ptx one MUFU.TANH an element of the tile and no EX2; the exp2 form (the interpreter's
    path, and the backward's) an EX2 and an RCP an element. Two RCP outside the epilogue either way."""
    counts = _run_without_interpreter(GELU_TANH_SASS)
    for table in ("fwd", "gated_fwd"):
        (mufu, elements), (portable, _) = counts[f"{table} True"], counts[f"{table} False"]
        assert mufu == {"TANH": elements, "RCP": 2}, (table, mufu)
        assert portable == {"EX2": elements, "RCP": elements + 2}, (table, portable)
    mufu, elements = counts["dh_bwd None"]
    assert mufu == {"EX2": elements, "RCP": elements + 2}, mufu


DH_PREFETCH_SASS = """
import json, torch
from bench import sass_loops
from bench.compile_report.mlp import mlp_gemm_config
from horse.kernels import mlp

placement = {}
for table in ("dh_bwd", "gated_dh_bwd"):
    cfg = mlp.configs.GEMM_CONFIGS["sm90"][table]["small"]
    for tma in (False, True):
        sass = sass_loops.sass_of(mlp_gemm_config(table, "small", cfg, torch.float16, "gelu", tma))
        (loop,) = sass_loops.main_loops(sass)
        prefetches = [offset for offset, text in sass_loops.parse(sass) if "CCTL.E.PF2" in text]
        placement[f"{table} {tma}"] = [loop.start <= offset <= loop.end for offset in prefetches]
print(json.dumps(placement))
"""


def test_dh_gemm_asks_l2_for_its_saved_tiles_inside_its_k_loop_in_sm90_sass():
    """The sm_90 SASS of the small dh GEMMs (AOT, no GPU), pointer and TMA loads: the L2 prefetch of
    the saved pre-activation (and, gated, of up) is issued inside the K loop (during its last
    PREFETCH_STEPS steps, horse.kernels.mlp.gemm._matmul_tile), one a thread per saved tensor, none
    elsewhere."""
    run_ = _run_without_interpreter(DH_PREFETCH_SASS)
    for variant, inside in run_.items():
        assert inside == [True] * (2 if variant.startswith("gated") else 1), (variant, inside)


@pytest.mark.gpu
def test_gpu_gelu_tanh_over_wide_pre_activations():
    # tanh.approx on the GPU against the float64 truth: pre-activations up to ±8 (x = the identity
    # on 16 columns, scaled), forward and backward, float16.
    x = torch.linspace(-8, 8, 16 * 1024, device="cuda").reshape(1024, 16).half()
    t = {"x": x, "weight": torch.eye(16, device="cuda").half(), "dy": torch.ones_like(x)}
    check("linear_act", t, "gelu_tanh")


@pytest.mark.parametrize("kind", ["linear_act", "gated_linear"])
@pytest.mark.parametrize("M", [1, 7, 64])
def test_decode_rows_split_k_and_match_reference(M, kind, device, monkeypatch):
    # M <= 64 with one column tile: too few programs for the interpreter's stand-in SM count (4), so
    # the forward splits its K loop (K = 257: 9 uneven steps of 32) and a second kernel adds the
    # partials and runs the epilogue; output and gradients against the float64 truth.
    sms = runtime.num_sms(torch.device(device))
    launches = record_launches(monkeypatch)
    check(kind, make_tensors(kind, (M, 257, 33), torch.float16, device, seed=M), "gelu_tanh")
    tiles = triton.cdiv(M, mlp.configs.gemm_config("fwd", M, 33, torch.device(device)).block_m)
    splits = triton.cdiv(sms, tiles)
    assert launches[:2] == [("_fwd_kernel", (tiles, splits)), ("_split_k_epilogue_kernel", (1, tiles))]
    assert tiles * splits >= sms
    x = make_tensors(kind, (M, 257, 33), torch.float16, device, seed=M)
    first, again = (run(lambda t: call_ours(kind, t, "gelu_tanh"), x) for _ in range(2))
    assert all(torch.equal(first[name], again[name]) for name in first)  # a fixed summation order


def test_split_k_fills_an_h200_at_decode_sizes_only():
    # The launcher's rule on the sm90 table with an H200's 132 SMs (no GPU needed): GPT-2 124M's up
    # projection at M = 1 is 48 tiles of 64 x 64, split 3 ways (K = 768, 12 steps) -> 144 programs;
    # LLaMA 7B's gated one (172 tiles), 65 rows and a one-step K stay unsplit.
    sm90 = mlp.configs.GEMM_CONFIGS["sm90"]
    cfg, gated = sm90["fwd"]["small"], sm90["gated_fwd"]["small"]
    h200 = torch.device("cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "num_sms", lambda device: 132)
        assert mlp.configs.split_k(cfg, 1, 3072, 768, h200) == 3 and 48 * 3 >= 132
        assert mlp.configs.split_k(cfg, 64, 1024, 4096, h200) == 9  # 16 tiles, 64 K steps
        assert mlp.configs.split_k(cfg, 64, 1024, 64, h200) == 1  # one K step: nothing to split
        assert mlp.configs.split_k(gated, 1, 11008, 4096, h200) == 1
        assert mlp.configs.split_k(cfg, 65, 3072, 768, h200) == 1


# (M, K, N) past the small class: K a multiple of 8 (TMA operands), none a tile multiple; every one more
# output tiles than the interpreter's stand-in SM count (4), so each program walks several tiles. N
# = 65 has rows of 130 bytes, no TMA store: the tiled kernel runs.
PERSISTENT_SHAPES = [(1, 40, 264), (100, 264, 72), (257, 24, 136), (100, 40, 65)]


@pytest.mark.parametrize("sizes", PERSISTENT_SHAPES, ids=_id)
@pytest.mark.parametrize("kind", ["linear_act", "gated_linear"])
def test_persistent_forward_walks_several_tiles_per_program(kind, sizes, device, monkeypatch):
    monkeypatch.setattr(mlp.configs, "SMALL_ROWS", 0)  # M = 1 takes the medium (persistent) entry too
    launches = record_launches(monkeypatch)
    check(kind, make_tensors(kind, sizes, torch.float16, device, seed=_seed(kind, sizes)), "gelu_tanh")
    M, _, N = sizes
    table = "fwd" if kind == "linear_act" else "gated_fwd"
    cfg = mlp.configs.gemm_config(table, M, N, torch.device(device))
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    sms = runtime.num_sms(torch.device(device))
    if cfg.persistent and N % 8 == 0:
        assert launches[0] == ("_fwd_persistent_kernel", (min(tiles, sms),))
    else:
        assert launches[0] == ("_fwd_kernel", (tiles,))
    if device == "cpu":  # the interpreter's small tiles take the sm90 entries' persistence
        assert cfg.persistent and tiles > sms


@pytest.mark.parametrize("d_model,hidden", [(768, 3072), (1024, 4096)], ids=["124M", "350M"])
def test_gpt2_up_projections_run_the_persistent_kernel_one_program_an_h200_sm(d_model, hidden, monkeypatch):
    # The bench's GPT-2 cases (bench.mlp, 8192 tokens) on sm90's table with an H200's 132 SMs: the
    # launcher is walked, no kernel runs (too large for the interpreter).
    run_family_tables(monkeypatch, "sm90", mlp.configs, "INTERPRETER_GEMM_BLOCKS", "gemm_config")
    monkeypatch.setattr(runtime, "num_sms", lambda device: 132)
    launches = record_launches(monkeypatch, execute=False)
    x, w = torch.empty(8192, d_model, dtype=torch.float16), torch.empty(hidden, d_model, dtype=torch.float16)
    kernels.linear_act(x, w, torch.empty(hidden, dtype=torch.float16), activation="gelu_tanh")
    kernels.gated_linear(x, w, w, activation="silu")
    assert launches == [("_fwd_persistent_kernel", (132,))] * 2


# (M, K, H, D): the small class (M = 1, split-K: 2 column tiles of 64 for the interpreter's 4 stand-in
# SMs, K = 264 in 5 steps), the medium one and, with LARGE_OUTPUTS lowered, the large one.
LAUNCH_SHAPES = [(1, 264, 72, 24), (100, 40, 72, 24), (257, 40, 136, 24)]


@pytest.mark.parametrize("family", list(runtime.ARCHS))
def test_every_launch_takes_constexprs_the_compile_report_builds(family, device, monkeypatch):
    # The report's rows stand for the launches only if each launch's constexprs (the Epilogue group
    # among them) and warps are one of its configs': every launch of the four functions, forward and
    # backward, on family's table at its real tiles, as a GPU of the family makes them (inline PTX on
    # NVIDIA), in float16 with gelu (the report builds every kernel with it). The launchers are
    # walked; no kernel runs. Stages where the launch sets them (the elementwise kernels take
    # Triton's default).
    from bench.compile_report.mlp import mlp_configs

    if device != "cpu":
        pytest.skip("the walk needs no GPU")
    run_family_tables(monkeypatch, family, mlp.configs, "INTERPRETER_GEMM_BLOCKS", "gemm_config")
    monkeypatch.setattr(mlp.configs, "LARGE_OUTPUTS", 2**15)
    monkeypatch.setattr(mlp.launch, "inline_ptx", lambda t: not runtime.ARCHS[family].hip_target)
    launches = []
    monkeypatch.setattr(runtime, "launch", lambda kernel, grid, *args, **kw: launches.append((kernel, kw)))
    for kind, sizes in itertools.product(
        ["linear_act", "gated_linear", "fused_mlp", "fused_gated_mlp"], LAUNCH_SHAPES
    ):
        if kind in ("linear_act", "gated_linear"):
            sizes = sizes[:3]
        run(lambda t, kind=kind: call_ours(kind, t, "gelu"), make_tensors(kind, sizes, torch.float16, device))
    options = {"num_warps", "num_stages", *runtime.COMPILE_OPTIONS}
    built = mlp_configs(runtime.ARCHS[family])

    def built_for(kernel, kwargs) -> bool:
        constexprs = {k: v for k, v in kwargs.items() if k not in options}
        return any(
            cfg.fn is kernel
            and {k: v for k, v in cfg.constexprs.items() if "[" not in k} == constexprs
            and cfg.num_warps == kwargs["num_warps"]
            and cfg.num_stages == kwargs.get("num_stages", cfg.num_stages)
            for cfg in built
        )

    tables = mlp.configs.GEMM_CONFIGS[family].values()
    persistent = (
        {"_fwd_persistent_kernel"} if any(c.persistent for t in tables for c in t.values()) else set()
    )
    names = {kernel.__name__ for kernel, _ in launches}
    assert (
        names
        == {"_fwd_kernel", "_split_k_epilogue_kernel", "_dh_act_bwd_kernel", "_act_bwd_kernel"} | persistent
    )
    for kernel, kwargs in launches:
        assert built_for(kernel, kwargs), (kernel.__name__, kwargs)
