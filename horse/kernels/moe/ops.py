"""The custom ops (torch.ops.horse.moe_mlp_fwd / _bwd: op, fake and autograd in one registration
each) and the public function, which validates its arguments and runs the ops, or off the Triton path
the float32 reference.
"""

import torch

from horse.kernels import reference, runtime
from horse.kernels.moe import configs
from horse.kernels.moe.launch import grad_buffers, moe_bwd, moe_fwd

REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _moe_fwd_fake(
    x,
    expert_ids,
    expert_weights,
    gate_up_proj,
    down_proj,
    gate_up_bias,
    down_bias,
    activation,
    limit,
    interleaved,
    save,
):
    pairs, inter = expert_ids.numel(), gate_up_proj.shape[1] // 2
    saved = (pairs, inter) if save else (0,)
    index = expert_ids.new_empty((pairs,), dtype=torch.int32)
    offsets = expert_ids.new_empty((gate_up_proj.shape[0] + 1,), dtype=torch.int32)
    return x.new_empty(x.shape), x.new_empty(saved), x.new_empty(saved), index, index.clone(), offsets


def _moe_setup_context(ctx, inputs, output):
    x, expert_ids, expert_weights, gate_up_proj, down_proj, gate_up_bias, down_bias = inputs[:7]
    ctx.activation, ctx.limit, ctx.interleaved, ctx.save = inputs[7:]
    _y, gate, up, sorted_pairs, pair_rows, offsets = output
    ctx.save_for_backward(
        x,
        expert_ids,
        expert_weights,
        gate_up_proj,
        down_proj,
        down_bias,
        gate,
        up,
        sorted_pairs,
        pair_rows,
        offsets,
    )


def _moe_backward(ctx, dy, *_saved_grads):
    if not ctx.save:
        raise RuntimeError(
            "horse::moe_mlp_fwd: backward through a forward run with save=False, which saves nothing; "
            "moe_mlp sets save whenever an input requires grad"
        )
    needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4, 5, 6)]
    grads = _moe_bwd_op(dy, *ctx.saved_tensors, ctx.activation, ctx.limit, ctx.interleaved, needs)
    dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias = (
        g if n else None for g, n in zip(grads, needs, strict=True)
    )
    return dx, None, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias, None, None, None, None


_moe_fwd_op = runtime.custom_op("moe_mlp_fwd", _moe_fwd_fake, _moe_backward, _moe_setup_context)(moe_fwd)


def _moe_bwd_fake(
    dy,
    x,
    expert_ids,
    expert_weights,
    gate_up_proj,
    down_proj,
    down_bias,
    gate,
    up,
    sorted_pairs,
    pair_rows,
    offsets,
    activation,
    limit,
    interleaved,
    needs,
):
    return tuple(grad_buffers(x, expert_weights, gate_up_proj, down_proj, needs))


_moe_bwd_op = runtime.custom_op("moe_mlp_bwd", _moe_bwd_fake)(moe_bwd)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"moe_mlp: {name} must have shape {list(shape)} ({what}), got {list(t.shape)}")


def _validate(
    x, expert_ids, expert_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation, limit
):
    """Check every argument, naming the bad one; returns whether the Triton kernels run."""
    fn = "moe_mlp"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    runtime.check_tensor(fn, "x", x, x.device, REFERENCE_DTYPES, "float16 or bfloat16 (float32 off the GPU)")
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be (tokens, hidden), got shape {list(x.shape)}")
    tokens, hidden = x.shape
    runtime.check_tensor(fn, "expert_ids", expert_ids, x.device, INDEX_DTYPES, "int32 or int64")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != tokens or expert_ids.shape[1] == 0:
        raise ValueError(
            f"moe_mlp: expert_ids must be (tokens, top_k) = ({tokens}, top_k >= 1), "
            f"got {list(expert_ids.shape)}"
        )
    weight_dtypes = tuple(dict.fromkeys((x.dtype, torch.float32)))
    runtime.check_tensor(
        fn, "expert_weights", expert_weights, x.device, weight_dtypes, f"{x.dtype} or float32"
    )
    _check_shape("expert_weights", expert_weights, tuple(expert_ids.shape), "expert_ids' shape")
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        runtime.check_tensor(fn, name, w, x.device, (x.dtype,), f"x's dtype, {x.dtype}")
        if w.dim() != 3:
            raise ValueError(f"{fn}: {name} must have 3 dimensions (experts, ...), got shape {list(w.shape)}")
    experts, two_inter, gate_up_hidden = gate_up_proj.shape
    if gate_up_hidden != hidden or two_inter % 2 or not two_inter or not experts or not hidden:
        raise ValueError(
            f"{fn}: gate_up_proj must be (experts, 2 * inter, hidden) with hidden = x's {hidden} and "
            f"experts, inter, hidden >= 1, got {list(gate_up_proj.shape)} (gpt-oss's (experts, hidden, "
            "2 * inter): pass gate_up_proj.transpose(1, 2))"
        )
    inter = two_inter // 2
    _check_shape("down_proj", down_proj, (experts, hidden, inter), "(experts, hidden, inter)")
    for name, bias, shape in (
        ("gate_up_bias", gate_up_bias, (experts, two_inter)),
        ("down_bias", down_bias, (experts, hidden)),
    ):
        if bias is not None:
            runtime.check_tensor(fn, name, bias, x.device, (x.dtype,), f"x's dtype, {x.dtype}")
            _check_shape(
                name, bias, shape, "(experts, 2 * inter)" if name == "gate_up_bias" else "(experts, hidden)"
            )
    if activation not in configs.ACTIVATIONS:
        raise ValueError(
            f"{fn}: unknown activation {activation!r}; expected one of {', '.join(configs.ACTIVATIONS)}"
        )
    if limit is not None and (activation != "silu" or not limit > 0):
        raise ValueError(
            f"{fn}: limit (gpt-oss's clamped SwiGLU) needs activation 'silu' and a limit > 0, got "
            f"activation {activation!r}, limit {limit!r}"
        )
    triton_path = runtime.runs_triton(x)
    if triton_path and x.dtype not in configs.SUPPORTED_DTYPES:
        raise TypeError(
            f"{fn}: x must be float16 or bfloat16 on the Triton path, got {x.dtype} (tl.dot would compute "
            "float32 as TF32); cast x and the weights first"
        )
    if triton_path and experts > configs.MAX_EXPERTS:
        raise ValueError(f"{fn}: at most {configs.MAX_EXPERTS} experts on the Triton path, got {experts}")
    return triton_path


def moe_mlp(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    limit: float | None = None,
    gate_up_interleaved: bool = False,
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer, y[t] = Σ_k expert_weights[t, k] ·
    expert_{expert_ids[t, k]}(x[t]) with expert_e(x) = (act(x W_gate,eᵀ + b_gate,e) ⊙ (x W_up,eᵀ +
    b_up,e)) W_down,eᵀ + b_down,e. Dropless: every routed pair is computed; differentiable in x,
    expert_weights, both weights and both biases.

    x (tokens, hidden); expert_ids (tokens, top_k) int32 or int64 (an id outside [0, experts) routes
    its pair nowhere: transformers' convention for id = experts); expert_weights (tokens, top_k) in
    x's dtype or float32; gate_up_proj (experts, 2 · inter, hidden), gate rows first, then up, and
    down_proj (experts, hidden, inter), as transformers 5.25 packs them (Qwen3-MoE, Mixtral, OLMoE);
    any strides, so gpt-oss's (experts, hidden, 2 · inter) and (experts, inter, hidden) pass as
    ``.transpose(1, 2)`` views, read in place, with ``gate_up_interleaved=True`` (gate j is row 2j, up
    j row 2j + 1; gate_up_bias likewise). gate_up_bias (experts, 2 · inter), down_bias (experts, hidden)
    or None. activation, required: "silu" (SwiGLU) or "gelu_tanh" (GeGLU); with ``limit``, gpt-oss's
    clamped SwiGLU: g = min(gate, limit), u = clamp(up, ±limit), act = (u + 1) · g · sigmoid(1.702 g).
    Returns (tokens, hidden) in x's dtype.
    """
    x, gate_up_proj, down_proj, gate_up_bias, down_bias = runtime.autocast(
        x, gate_up_proj, down_proj, gate_up_bias, down_bias
    )
    tensors = (x, expert_ids, expert_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    if not _validate(*tensors, activation, limit):
        return reference.moe_mlp(
            *tensors[:5],
            activation=activation,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            limit=limit,
            gate_up_interleaved=gate_up_interleaved,
        ).to(x.dtype)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    limit = None if limit is None else float(limit)
    return _moe_fwd_op(*tensors, activation, limit, bool(gate_up_interleaved), save)[0]
