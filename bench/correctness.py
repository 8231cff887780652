"""The bench suite's correctness check: ours against the reference, outputs and gradients.

Every family checks ours this way, once per shape before timing it (``suite.Case.check``) and on
small shapes in Triton's interpreter (``interpreter_checks``): ours runs with every output buffer
NaN-poisoned (an element a kernel never writes fails), the reference on float32 (or float64) copies
of the same inputs with TF32 off, both differentiated for the same random cotangent, and each output
and gradient compared by :func:`normalized_error`.
"""

from collections.abc import Callable, Sequence

import torch


def normalized_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1.0) -> float:
    """Largest ``|actual - expected|`` over ``max(floor, largest |expected|)`` (the difference alone
    where that is 0). floor 1: absolute on outputs of O(1) (y, dx), relative on sums over rows
    (dweight, dbias); floor 0: relative to the tensor's scale (attention outputs and gradients shrink
    as sequences grow). NaN in actual gives NaN, which fails every tolerance."""
    difference = (actual.float() - expected.float()).abs().max().item()
    scale = max(floor, expected.float().abs().max().item())
    return difference / scale if scale > 0 else difference


def check(
    ours: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    names: Sequence[str],
    tolerance: float,
    *,
    floor: float = 1.0,
    crop: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach,
    exact_dtype: torch.dtype = torch.float32,
) -> tuple[dict, bool]:
    """``ours(*inputs)`` and, where the inputs require grad, its gradients for a random cotangent
    (none for a scalar output) against ``reference`` on ``exact_dtype`` copies of ``crop(input)``
    (crop: the block the reference can afford, every element by default). Returns {name: error}
    (names: the output's, then each gradient's) and whether every output and gradient of ours is
    finite, the uncropped part included, and each error within tolerance."""
    from horse.kernels import runtime  # here, not at import: the CPU path sets TRITON_INTERPRET first

    grad = any(t.requires_grad for t in inputs)
    with runtime.poison_outputs():
        out = ours(*inputs)
        dout = torch.randn_like(out) if out.ndim else None
        actual = (out, *(torch.autograd.grad(out, inputs, dout) if grad else ()))
    exact = [crop(t).to(exact_dtype).requires_grad_(grad) for t in inputs]
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        out_exact = reference(*exact)
        dout_exact = None if dout is None else crop(dout).to(exact_dtype)
        expected = (out_exact, *(torch.autograd.grad(out_exact, exact, dout_exact) if grad else ()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    errors = {n: normalized_error(crop(a), e, floor) for n, a, e in zip(names, actual, expected, strict=True)}
    finite = all(bool(torch.isfinite(a).all()) for a in actual)
    return errors, finite and all(error <= tolerance for error in errors.values())
