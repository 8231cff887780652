"""Plain-PyTorch references for every kernel in the package, computed in float32.

They are the truth the tests compare against and the eager baselines the benchmarks time. Each
takes the same arguments as its kernel and returns float32 (float64 for float64 inputs, which the
tests use for the truth); a residual sum comes back in the input's dtype, as the kernels return it.
"""

import torch


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    if weight is not None:
        y = y * _upcast(weight)
    if bias is not None:
        y = y + _upcast(bias)
    return y


def _flat_dims(normalized_shape) -> tuple[int, ...]:
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return tuple(range(-n, 0))


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """h = x + residual, summed in float32 and rounded to x's dtype."""
    return (x.float() + residual.float()).to(x.dtype)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims (biased variance)."""
    dims = _flat_dims(normalized_shape)
    x = _upcast(x)
    mean = x.mean(dim=dims, keepdim=True)
    var = (x - mean).square().mean(dim=dims, keepdim=True)
    return _affine((x - mean) * torch.rsqrt(var + eps), weight, bias)


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims; eps=None is float32's eps."""
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    dims = _flat_dims(normalized_shape)
    x = _upcast(x)
    return _affine(x * torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + eps), weight, None)


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """(layer_norm(h), h) with h = x + residual in x's dtype."""
    h = residual_add(x, residual)
    return layer_norm(h, normalized_shape, weight, bias, eps), h


def add_rms_norm(x, residual, normalized_shape, weight=None, eps: float | None = None):
    """(rms_norm(h), h) with h = x + residual in x's dtype."""
    h = residual_add(x, residual)
    return rms_norm(h, normalized_shape, weight, eps), h
