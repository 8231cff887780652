"""The fused MLP in the bench suite: ours against cuBLAS, torch eager and torch.compile.

    python -m bench --only mlp        (python -m bench.mlp: the same, then the saved-activation table)

Shapes: the MLPs of GPT-2 124M (d_model 768, hidden 3072), 350M (1024, 4096), 1.3B (2048, 8192),
all gelu_tanh with biases, and LLaMA 7B (4096, 11008, SwiGLU, no biases), at 8K, 16K and 32K tokens,
float16. Cases:

* ``linear_act`` (``gated_linear`` for 7B), forward: the up projection with its activation in the
  epilogue. ours: without grad (nothing saved); ours+save: with grad, so it also writes the
  pre-activation the backward reads (the time cost of saving it); ours-pointer: ours with TMA off
  (``horse.kernels.mlp.launch.USE_TMA = False``, pointer loads), what TMA brings; matmul: ``torch.matmul`` of
  the same GEMM alone (for 7B one GEMM against the concatenated gate and up weights); addmm-gelu
  (gelu_tanh models only): ``torch._addmm_activation(b, x, Wᵀ, use_gelu=True)``, cuBLASLt's GEMM
  with bias and tanh-approximate GELU in its epilogue, the same work as ours without saving;
  eager: ``F.linear`` then the activation, a separate kernel (matmul + activation); compile:
  ``torch.compile`` of eager. cuBLASLt has no SiLU or gated epilogue, so for the gated (SwiGLU)
  models the bare concatenated GEMM (matmul) stands in for a fused cuBLAS epilogue: a GEMM whose
  epilogue costs nothing, the bound such an epilogue would approach.
* decode: the same up projection forward at 1, 16 and 64 tokens (split-K in ours), against
  matmul, addmm-gelu and eager.
* ``mlp`` (``mlp_gated`` for 7B), forward, backward and forward+backward of the whole MLP:
  ``horse.kernels.fused_mlp`` / ``horse.kernels.fused_gated_mlp`` against ours-pointer (its GEMMs, the
  backward's included, with TMA off), eager and compile. Backward is ``torch.autograd.grad`` of y
  w.r.t. x and every parameter on a graph built once.

FLOPs count the GEMMs only, 2·M·N·K each (:func:`gemm_flops`): the up projection 2·T·D·H (twice
that gated), an MLP forward 4·T·D·H (6·T·D·H gated), a backward twice its forward and
forward+backward three times. The memory cost of saving the pre-activation is measured by
:func:`saved_activation_bytes` (every tensor autograd keeps for the backward, beyond the inputs
and parameters), which ``python -m bench.mlp`` prints for ours and eager.
"""

import functools
import importlib
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from bench import correctness, suite, timing

DTYPE = torch.float16
TOKENS = (8192, 16384, 32768)
# Decode-sized batches (M <= 64: horse.kernels.mlp.configs.split_k splits the K loop there), the up projection
# forward only, in the full run.
DECODE_TOKENS = (1, 16, 64)
DECODE_BASELINES = ("matmul", "addmm-gelu", "eager")
# Largest normalized error (bench.correctness.normalized_error) allowed against the float32 reference.
TOLERANCE = 2e-2


@dataclass(frozen=True)
class Model:
    """The MLP of one model: d_model → hidden → d_model."""

    name: str
    d_model: int
    hidden: int
    gated: bool  # LLaMA's SwiGLU (no biases) instead of GPT-2's gelu_tanh MLP (biases)

    @property
    def activation(self) -> str:
        return "silu" if self.gated else "gelu_tanh"

    @property
    def gemm_kernel(self) -> str:
        return "gated_linear" if self.gated else "linear_act"

    @property
    def mlp_kernel(self) -> str:
        return "mlp_gated" if self.gated else "mlp"


MODELS = (
    Model("124M", 768, 3072, gated=False),
    Model("350M", 1024, 4096, gated=False),
    Model("1.3B", 2048, 8192, gated=False),
    Model("7B", 4096, 11008, gated=True),
)
QUICK_CASES = ((MODELS[0], 16384), (MODELS[3], 16384))
# Small and ragged shapes for the interpreter: (model, tokens).
INTERPRETER_CASES = ((Model("tiny", 48, 80, False), 64), (Model("tiny", 40, 100, True), 33))


# ----------------------------------------------------------------------------------------------
# FLOPs, errors, saved memory
# ----------------------------------------------------------------------------------------------


def gemm_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m, k) x (k, n) GEMM: 2·m·n·k (a multiply and an add per term)."""
    return 2 * m * n * k


def up_projection_flops(model: Model, tokens: int) -> int:
    """The fused up projection: one GEMM tokens x d_model x hidden, two when gated."""
    return (2 if model.gated else 1) * gemm_flops(tokens, model.hidden, model.d_model)


def mlp_flops(model: Model, tokens: int, direction: str) -> int:
    """The MLP's GEMMs: up (one or two) and down in the forward; the backward has two GEMMs (dx, dW)
    per forward GEMM, twice the forward; forward+backward three times the forward."""
    forward = up_projection_flops(model, tokens) + gemm_flops(tokens, model.d_model, model.hidden)
    return forward * {"forward": 1, "backward": 2, "forward+backward": 3}[direction]


def saved_activation_bytes(fn: Callable[[dict], torch.Tensor], tensors: dict) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn(tensors)``, beyond the tensors
    themselves (inputs and parameters, alive anyway): each storage counted once."""
    inputs = {t.untyped_storage().data_ptr() for t in tensors.values()}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(tensors)
    return sum(saved.values())


# ----------------------------------------------------------------------------------------------
# Inputs and implementations, each called as fn(tensors)
# ----------------------------------------------------------------------------------------------


def make_inputs(model: Model, tokens: int, device, requires_grad: bool = False) -> dict:
    """x ~ N(0, 1) (tokens, d_model); weights ~ N(0, 1/fan_in) as nn.Linear's; biases ~ 0.1 N(0, 1)."""

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(DTYPE).requires_grad_(requires_grad)

    d, h = model.d_model, model.hidden
    tensors = {"x": randn(tokens, d)}
    if model.gated:
        tensors |= {"w_gate": randn(h, d, scale=d**-0.5), "w_up": randn(h, d, scale=d**-0.5)}
        tensors["w_down"] = randn(d, h, scale=h**-0.5)
    else:
        tensors |= {"w_in": randn(h, d, scale=d**-0.5), "b_in": randn(h, scale=0.1)}
        tensors |= {"w_out": randn(d, h, scale=h**-0.5), "b_out": randn(d, scale=0.1)}
    return tensors


def eager_up(model: Model, t: dict) -> torch.Tensor:
    if model.gated:
        return F.silu(F.linear(t["x"], t["w_gate"])) * F.linear(t["x"], t["w_up"])
    return F.gelu(F.linear(t["x"], t["w_in"], t["b_in"]), approximate="tanh")


def eager_mlp(model: Model, t: dict) -> torch.Tensor:
    if model.gated:
        return F.linear(eager_up(model, t), t["w_down"])
    return F.linear(eager_up(model, t), t["w_out"], t["b_out"])


def addmm_gelu(model: Model, t: dict) -> torch.Tensor:
    """cuBLASLt's fused epilogue: act(x W_inᵀ + b_in) in one library GEMM. use_gelu=True is the
    tanh-approximate GELU on CUDA (CUBLASLT_EPILOGUE_GELU_BIAS), so it stands in only where the
    model's activation is gelu_tanh. On the CPU torch computes the erf GELU instead (5e-4 from the
    tanh form at most, measured over [-4, 4] in float64): the same work, for the CPU tests."""
    if model.activation != "gelu_tanh":
        raise ValueError(f"addmm-gelu computes gelu_tanh, not {model.activation} ({model.name})")
    return torch._addmm_activation(t["b_in"], t["x"], t["w_in"].t(), use_gelu=True)


def _up(ops, model: Model, t: dict) -> torch.Tensor:
    """The up projection with its activation by ops: the kernels package or horse.kernels.reference."""
    if model.gated:
        return ops.gated_linear(t["x"], t["w_gate"], t["w_up"], activation=model.activation)
    return ops.linear_act(t["x"], t["w_in"], t["b_in"], activation=model.activation)


def _mlp(ops, model: Model, t: dict) -> torch.Tensor:
    """The whole MLP by ops: the kernels package or horse.kernels.reference (the same signatures)."""
    if model.gated:
        return ops.fused_gated_mlp(t["x"], t["w_gate"], t["w_up"], t["w_down"], activation=model.activation)
    return ops.fused_mlp(t["x"], t["w_in"], t["b_in"], t["w_out"], t["b_out"], activation=model.activation)


def _on(ops: str, fn):
    """fn(model, t) on the module ops, imported at call time, not at import: the CPU path sets
    TRITON_INTERPRET first."""
    return lambda model, t: fn(importlib.import_module(ops), model, t)


ours_up, ours_mlp = _on("horse.kernels", _up), _on("horse.kernels", _mlp)
reference_up, reference_mlp = _on("horse.kernels.reference", _up), _on("horse.kernels.reference", _mlp)


# ----------------------------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------------------------


def check(model: Model, tokens: int, device, whole_mlp: bool) -> tuple[dict, bool]:
    """Output and every gradient of ours (the MLP, or the up projection alone) for a random dy,
    against the float32 reference (:func:`bench.correctness.check`)."""
    torch.manual_seed(0)
    tensors = make_inputs(model, tokens, device, requires_grad=True)
    if not whole_mlp:
        up_inputs = ("x", "w_gate", "w_up") if model.gated else ("x", "w_in", "b_in")
        tensors = {name: tensors[name] for name in up_inputs}
    ours, reference = (ours_mlp, reference_mlp) if whole_mlp else (ours_up, reference_up)
    return correctness.check(
        lambda *ts: ours(model, dict(zip(tensors, ts, strict=True))),
        lambda *ts: reference(model, dict(zip(tensors, ts, strict=True))),
        list(tensors.values()),
        ["y", *(f"d{name}" for name in tensors)],
        TOLERANCE,
    )


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def _setup(
    make_fn,
    model: Model,
    tokens: int,
    direction: str,
    grad: bool = False,
    concat: bool = False,
    device="cuda",
    pointer_loads: bool = False,
):
    """A setup (:func:`bench.timing.setup`) of fn(tensors); with concat, the gated up projection's
    weights as one (the bare-GEMM baseline: one GEMM, N = 2·hidden); with pointer_loads, ours's GEMMs
    with TMA off for the whole call (ours-pointer)."""

    def make_copy(requires_grad: bool) -> dict:
        t = make_inputs(model, tokens, device, requires_grad)
        return {"x": t["x"], "w": torch.cat([t["w_gate"], t["w_up"]])} if concat else t

    # What one call reads: x, the weights (and dy, about as large as x).
    weights = (3 if model.gated else 2) * model.d_model * model.hidden
    read = (2 * tokens * model.d_model + weights) * DTYPE.itemsize
    tma_off = "horse.kernels.mlp.launch" if pointer_loads else None
    return timing.setup(make_fn, make_copy, direction, read, device, grad, tma_off)


def _bind(fn, model: Model):
    """A make_fn for the suite: builds the call fn(model, tensors) when the case is set up."""
    return lambda: functools.partial(fn, model)


def _matmul(tensors: dict) -> torch.Tensor:
    w = tensors["w"] if "w" in tensors else tensors["w_in"]
    return torch.matmul(tensors["x"], w.t())


def model_cases(model: Model, tokens: int, quick: bool = False, device="cuda") -> list[suite.Case]:
    """The cases of one model's MLP at one token count: the up projection forward, and the whole
    MLP in every direction, ours first. quick: ``torch.compile`` only where a gate holds ours to it
    (the whole MLP forward+backward), since each of its cases compiles afresh."""
    params = {"tokens": tokens, "d_model": model.d_model, "hidden": model.hidden}
    up = {
        "ours": (_bind(ours_up, model), {}),
        "ours+save": (_bind(ours_up, model), {"grad": True}),
        "ours-pointer": (_bind(ours_up, model), {"pointer_loads": True}),
        "matmul": (lambda: _matmul, {"concat": model.gated}),
        "eager": (_bind(eager_up, model), {}),
    }
    if model.activation == "gelu_tanh":  # gated models: matmul stands in (see the module docstring)
        up["addmm-gelu"] = (_bind(addmm_gelu, model), {})
    up["compile"] = (suite.compiled(functools.partial(eager_up, model)), {})
    whole = {
        "ours": (_bind(ours_mlp, model), {}),
        "ours-pointer": (_bind(ours_mlp, model), {"pointer_loads": True}),
        "eager": (_bind(eager_mlp, model), {}),
        "compile": (suite.compiled(functools.partial(eager_mlp, model)), {}),
    }

    def setup(name, impl, direction):
        make_fn, options = impl
        return _setup(make_fn, model, tokens, direction, device=device, **options)

    up_cases = suite.family_cases(
        model.gemm_kernel,
        params,
        up,
        ["forward"],
        work=lambda d: up_projection_flops(model, tokens),
        unit="flop",
        setup=setup,
        check=functools.partial(check, model, tokens, device, False),
    )
    mlp_cases = suite.family_cases(
        model.mlp_kernel,
        params,
        whole,
        suite.DIRECTIONS,
        work=functools.partial(mlp_flops, model, tokens),
        unit="flop",
        setup=setup,
        check=functools.partial(check, model, tokens, device, True),
    )
    cases = up_cases + mlp_cases
    if quick:  # compile only where a gate holds ours to it: the whole MLP forward+backward
        cases = [c for c in cases if c.implementation != "compile" or c.direction == "forward+backward"]
    return cases


def decode_cases(model: Model, tokens: int, device="cuda") -> list[suite.Case]:
    """The up projection forward at a decode-sized batch: ours (split-K) and the GEMM baselines."""
    up = [c for c in model_cases(model, tokens, quick=True, device=device) if c.kernel == model.gemm_kernel]
    return [c for c in up if c.implementation in ("ours", *DECODE_BASELINES)]


def cases(quick: bool) -> list[suite.Case]:
    shapes = QUICK_CASES if quick else tuple(itertools.product(MODELS, TOKENS))
    out = [case for model, tokens in shapes for case in model_cases(model, tokens, quick)]
    if not quick:
        for model, tokens in itertools.product(MODELS, DECODE_TOKENS):
            out += decode_cases(model, tokens)
    return out


def interpreter_checks() -> list[tuple[str, dict, bool]]:
    """The correctness check on small, ragged shapes, on the CPU (in Triton's interpreter when it is on)."""
    results = []
    for (model, tokens), whole_mlp in itertools.product(INTERPRETER_CASES, (False, True)):
        kernel = model.mlp_kernel if whole_mlp else model.gemm_kernel
        label = f"{kernel} tokens={tokens} d_model={model.d_model} hidden={model.hidden}"
        results.append((label, *check(model, tokens, "cpu", whole_mlp)))
    return results


def saved_activation_table(device, shapes) -> str:
    """Bytes each MLP keeps for its backward beyond inputs and parameters: ours and eager."""
    lines = ["saved for the backward (beyond inputs and parameters), MiB:"]
    for model, tokens in shapes:
        tensors = make_inputs(model, tokens, device, requires_grad=True)
        ours = saved_activation_bytes(lambda t, m=model: ours_mlp(m, t), tensors) / 2**20
        eager = saved_activation_bytes(lambda t, m=model: eager_mlp(m, t), tensors) / 2**20
        name = f"{model.mlp_kernel} {model.name} tokens={tokens}"
        lines.append(f"  {name:<28} ours {ours:10.3f}  eager {eager:10.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.__main__ import main

    code = main(["--only", "mlp", *sys.argv[1:]])
    gpu = torch.cuda.is_available()
    shapes = itertools.product(MODELS, TOKENS) if gpu else INTERPRETER_CASES
    print("\n" + saved_activation_table(torch.device("cuda" if gpu else "cpu"), shapes))
    sys.exit(code)
