"""The custom ops (torch.ops.horse.*: op, fake and autograd in one registration each) and the public
functions, which validate their arguments and run the ops, or off the Triton path the float32
reference.
"""

import math

import torch

from horse.kernels import reference, runtime
from horse.kernels.mlp.configs import SUPPORTED_DTYPES
from horse.kernels.mlp.launch import (
    _gated_input_grads,
    _input_grads,
    _out_grads,
    _split_gate_up,
    _stores_pre,
    fused_mlp_bwd,
    fused_mlp_fwd,
    gated_linear_bwd,
    gated_linear_fwd,
    gated_mlp_bwd,
    gated_mlp_fwd,
    linear_act_bwd,
    linear_act_fwd,
)

ACTIVATIONS = ("none", "relu", "relu2", "gelu", "gelu_tanh", "silu")
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
