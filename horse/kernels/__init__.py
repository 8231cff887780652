"""Little Horse kernels: hand-written Triton kernels behind a functional, autograd-aware API.

Every function runs the Triton kernels on CUDA tensors, and on CPU tensors either in Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported) or as the float32 reference
(see ``horse.kernels.runtime``). Each is a registered PyTorch custom op, so ``torch.compile`` traces
through it without graph breaks.
"""

from horse.kernels.attention import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from horse.kernels.cross_entropy import cross_entropy, linear_cross_entropy
from horse.kernels.layernorm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from horse.kernels.mlp import fused_gated_mlp, fused_mlp, gated_linear, linear_act
from horse.kernels.moe import moe_mlp

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "cross_entropy",
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "fused_gated_mlp",
    "fused_mlp",
    "gated_linear",
    "layer_norm",
    "linear_cross_entropy",
    "linear_act",
    "moe_mlp",
    "rms_norm",
]
