"""Drop-in fused layers: same constructors, parameter names and state dicts as their torch modules.

The norms subclass ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm``, so a state dict loads either way,
``isinstance`` checks still hold, and :func:`replace_norms` swaps a whole model in one line. Where
they run follows ``kernels.runtime``: Triton kernels on CUDA tensors, the float32 reference on CPU
tensors unless ``TRITON_INTERPRET=1`` was set before triton was imported.
"""

import torch
from torch import nn

import kernels


class FusedLayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` on the Triton LayerNorm kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def forward_residual(
        self, input: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = input + residual`` and ``self(h)`` in one kernel; returns ``(self(h), h)``."""
        return kernels.add_layer_norm(
            input, residual, self.normalized_shape, self.weight, self.bias, self.eps
        )


class FusedRMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` on the Triton RMSNorm kernel (``eps=None`` is float32's eps, as torch)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def forward_residual(
        self, input: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = input + residual`` and ``self(h)`` in one kernel; returns ``(self(h), h)``."""
        return kernels.add_rms_norm(input, residual, self.normalized_shape, self.weight, self.eps)


def _fused_copy(norm: nn.Module) -> nn.Module:
    # Built on the meta device, then handed the original Parameters: no copy, and an optimizer
    # that already holds them keeps working.
    if isinstance(norm, nn.LayerNorm):
        fused = FusedLayerNorm(
            norm.normalized_shape,
            norm.eps,
            norm.elementwise_affine,
            bias=norm.bias is not None,
            device="meta",
        )
    else:
        fused = FusedRMSNorm(norm.normalized_shape, norm.eps, norm.elementwise_affine, device="meta")
    for name, param in norm.named_parameters(recurse=False):
        setattr(fused, name, param)
    fused.train(norm.training)
    return fused


def replace_norms(model: nn.Module) -> nn.Module:
    """Replace every ``nn.LayerNorm`` and ``nn.RMSNorm`` in ``model`` (in place) by its fused twin.

    The fused modules share the original parameters, so state dicts, optimizers and weight tying
    carry over. Returns ``model``; a bare norm passed in is returned as its fused replacement.
    """
    if _replaceable(model):
        return _fused_copy(model)
    for name, child in model.named_children():
        if _replaceable(child):
            setattr(model, name, _fused_copy(child))
        else:
            replace_norms(child)
    return model


def _replaceable(module: nn.Module) -> bool:
    return type(module) in (nn.LayerNorm, nn.RMSNorm)
