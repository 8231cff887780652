"""The mixture-of-experts MLP in the bench suite: ``horse.kernels.moe_mlp`` against transformers' own experts.

    python -m bench --only moe

Layers: Qwen3-MoE's (128 experts, top 8, hidden 2048, expert inter 768) and Mixtral's (8 experts, top 2,
hidden 4096, inter 14336), 8,192 tokens, bfloat16 (the dtype MoE checkpoints ship in), the packed
weights as transformers 5.25 holds them (gate_up_proj (experts, 2·inter, hidden), down_proj (experts,
hidden, inter)). The routing is a random router's top-k (softmax over random logits, the top-k weights
renormalized), fixed per copy of the inputs. Implementations, each a call on the same tensors:

* ours: ``moe_mlp`` (counting sort, grouped GEMMs, the combine; forward and backward).
* ours-pointer: ours with TMA off (``horse.kernels.moe.launch.USE_TMA = False``: the down and dx
  GEMMs on pointer loads), what TMA brings on sm_90.
* loop: transformers' eager experts forward (the family's ``<Family>Experts`` class), a Python loop
  over the experts that received tokens, a gather, two GEMMs and an ``index_add_`` each.
* grouped_mm: transformers' "grouped_mm" experts implementation, its default: the pairs sorted by
  expert and both projections as ``torch._grouped_mm`` (its own fallback where torch's kernel does not
  run: before sm_90, or float16). transformers' "batched_mm" gathers a weight matrix per routed pair
  (65,536 of 3 MiB each for the Qwen3-MoE layer) and does not fit: not timed.

Forward, backward (``torch.autograd.grad`` w.r.t. x, the routing weights and both weights) and both.
FLOPs count the routed pairs' GEMMs only (:func:`moe_flops`): 2·pairs·hidden·2·inter for gate_up and
2·pairs·inter·hidden for down, pairs = tokens·top_k; a backward twice the forward. Peak memory per case
is the suite's own (``peak_memory_bytes``). Without a GPU: :func:`interpreter_checks` on small, ragged
layers in float16 (the interpreter's bfloat16 dot is wrong).
"""

import functools
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from bench import correctness, suite, timing

DTYPE = torch.bfloat16
INTERPRETER_DTYPE = torch.float16
TOKENS = 8192
# Largest normalized error (bench.correctness.normalized_error) allowed against the float32 reference.
TOLERANCE = 2e-2


@dataclass(frozen=True)
class Layer:
    """One MoE layer's routed experts: hidden → 2·inter (gate, up) → hidden, top_k of experts a token."""

    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    modeling: str  # the transformers family whose Experts class is the loop baseline


LAYERS = (
    Layer("qwen3-moe", experts=128, top_k=8, hidden=2048, inter=768, modeling="qwen3_moe"),
    Layer("mixtral", experts=8, top_k=2, hidden=4096, inter=14336, modeling="mixtral"),
)
# Small and ragged layers for the interpreter: (layer, tokens); the second routes 17 tokens over 5 experts.
# Rows of a multiple of 16 bytes in float16: torch._grouped_mm (the grouped_mm baseline) takes no other.
INTERPRETER_CASES = (
    (Layer("tiny", experts=8, top_k=2, hidden=40, inter=24, modeling="qwen3_moe"), 33),
    (Layer("tiny-top1", experts=5, top_k=1, hidden=56, inter=40, modeling="mixtral"), 17),
)


def moe_flops(layer: Layer, tokens: int, direction: str) -> int:
    """The routed pairs' GEMMs: 2·pairs·hidden·2·inter (gate_up) + 2·pairs·inter·hidden (down) forward; the
    backward two GEMMs (input and weight gradients) per forward GEMM; forward+backward three times."""
    pairs = tokens * layer.top_k
    forward = 2 * pairs * layer.hidden * 2 * layer.inter + 2 * pairs * layer.inter * layer.hidden
    return forward * {"forward": 1, "backward": 2, "forward+backward": 3}[direction]


# ----------------------------------------------------------------------------------------------
# Inputs and implementations, each called as fn(tensors)
# ----------------------------------------------------------------------------------------------


def make_inputs(layer: Layer, tokens: int, device, dtype=DTYPE, requires_grad: bool = False) -> dict:
    """x ~ N(0, 1) (tokens, hidden); the routing of a random router (expert_ids int64, expert_weights its
    renormalized top-k softmax, (tokens, top_k)); weights ~ N(0, 1/fan_in)."""

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_(requires_grad)

    router_probs = torch.randn(tokens, layer.experts, device=device).softmax(dim=-1)
    top_weights, expert_ids = router_probs.topk(layer.top_k, dim=-1)
    top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    e, h, i = layer.experts, layer.hidden, layer.inter
    return {
        "x": randn(tokens, h),
        "expert_ids": expert_ids,
        "expert_weights": top_weights.to(dtype).requires_grad_(requires_grad),
        "gate_up_proj": randn(e, 2 * i, h, scale=h**-0.5),
        "down_proj": randn(e, h, i, scale=i**-0.5),
    }


def _moe(ops, layer: Layer, t: dict) -> torch.Tensor:
    """The routed experts by ops: the kernels package or horse.kernels.reference (the same signature)."""
    weights = (t["expert_weights"], t["gate_up_proj"], t["down_proj"])
    return ops.moe_mlp(t["x"], t["expert_ids"], *weights, activation="silu")


def _on(ops: str, fn):
    """fn(layer, t) on the module ops, imported at call time: the CPU path sets TRITON_INTERPRET first."""
    return lambda layer, t: fn(importlib.import_module(ops), layer, t)


ours_moe, reference_moe = _on("horse.kernels", _moe), _on("horse.kernels.reference", _moe)


class _Experts:
    """transformers' packed-experts module as its experts functions read it, on a case's tensors (a
    module's parameters cannot be swapped per call); SwiGLU, no biases, gate rows first, not transposed."""

    has_gate, has_bias, is_transposed, has_post_expert_norm, _is_expert_parallel = (
        True,
        False,
        False,
        False,
        False,
    )

    def __init__(self, experts: int, t: dict):
        self.num_experts = experts
        self.gate_up_proj, self.down_proj = t["gate_up_proj"], t["down_proj"]
        self.act_fn = F.silu

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        from transformers.integrations import moe

        return moe._default_apply_gate(self, gate_up_out)


def transformers_experts(implementation: str, layer: Layer, t: dict) -> torch.Tensor:
    """The routed experts by transformers: "loop" (the family's Experts class's own forward) or an
    experts implementation registered in its ExpertsInterface ("grouped_mm")."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    modeling = importlib.import_module(f"transformers.models.{layer.modeling}.modeling_{layer.modeling}")
    experts_class = next(c for name, c in vars(modeling).items() if name.endswith("Experts"))
    loop = experts_class.forward.__wrapped__  # under use_experts_implementation's dispatch
    forward = loop if implementation == "loop" else ALL_EXPERTS_FUNCTIONS[implementation]
    return forward(_Experts(layer.experts, t), t["x"], t["expert_ids"], t["expert_weights"])


# ----------------------------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------------------------


def check(layer: Layer, tokens: int, device, dtype=DTYPE) -> tuple[dict, bool]:
    """Output and every gradient of ours for a random dy against the float32 reference
    (:func:`bench.correctness.check`); the expert ids, not differentiable, held fixed."""
    torch.manual_seed(0)
    tensors = make_inputs(layer, tokens, device, dtype, requires_grad=True)
    expert_ids = tensors.pop("expert_ids")

    def bind(fn):
        return lambda *ts: fn(layer, dict(zip(tensors, ts, strict=True)) | {"expert_ids": expert_ids})

    names = ["y", *(f"d{name}" for name in tensors)]
    return correctness.check(bind(ours_moe), bind(reference_moe), list(tensors.values()), names, TOLERANCE)


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def layer_cases(
    layer: Layer, tokens: int, quick: bool = False, device="cuda", dtype=DTYPE
) -> list[suite.Case]:
    """The cases of one layer: ours, ours-pointer, the loop and grouped_mm, in every direction (quick:
    forward+backward, where the gates are)."""
    params = {
        "tokens": tokens,
        "experts": layer.experts,
        "top_k": layer.top_k,
        "hidden": layer.hidden,
        "inter": layer.inter,
    }
    implementations = {
        "ours": ours_moe,
        "ours-pointer": ours_moe,
        "loop": functools.partial(transformers_experts, "loop"),
        "grouped_mm": functools.partial(transformers_experts, "grouped_mm"),
    }
    # What one call reads: x (and dy, as large), the weights.
    read = (2 * tokens * layer.hidden + 3 * layer.experts * layer.inter * layer.hidden) * dtype.itemsize

    def setup(name, fn, direction):
        make_copy = functools.partial(make_inputs, layer, tokens, device, dtype)
        tma_off = "horse.kernels.moe.launch" if name == "ours-pointer" else None
        return timing.setup(
            lambda: functools.partial(fn, layer), make_copy, direction, read, device, tma_off=tma_off
        )

    directions = ["forward+backward"] if quick else suite.DIRECTIONS
    return suite.family_cases(
        "moe_mlp",
        params,
        implementations,
        directions,
        work=functools.partial(moe_flops, layer, tokens),
        unit="flop",
        setup=setup,
        check=functools.partial(check, layer, tokens, device, dtype),
    )


def cases(quick: bool) -> list[suite.Case]:
    return [case for layer in LAYERS for case in layer_cases(layer, TOKENS, quick)]


def interpreter_checks() -> list[tuple[str, dict, bool]]:
    """The correctness check on small, ragged layers, on the CPU (in Triton's interpreter when it is on)."""
    results = []
    for layer, tokens in INTERPRETER_CASES:
        label = f"moe_mlp tokens={tokens} experts={layer.experts} top_k={layer.top_k} hidden={layer.hidden} "
        results.append((label + f"inter={layer.inter}", *check(layer, tokens, "cpu", INTERPRETER_DTYPE)))
    return results
