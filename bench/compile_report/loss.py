"""The loss kernels' configs (horse.kernels.cross_entropy): every RowConfig its rule can return."""

import importlib
import itertools

from bench.compile_report.config import TRITON_TYPES, KernelConfig, kernel_config, row_sizes
from horse.kernels import runtime

# The loss kernels (horse.kernels.cross_entropy._<name>_kernel) and the flags with the most live values (the
# fused one with smoothing and the gradient; every one with Gemma 2's final-logit softcap).
LOSS_KERNELS = {
    "cross_entropy": {"HAS_SMOOTHING": True, "WRITE_GRAD": True, "SOFTCAP": 30.0},
    "cross_entropy_stats": {"HAS_SMOOTHING": True, "SOFTCAP": 30.0},
    "cross_entropy_grad": {"SOFTCAP": 30.0},
}

# The loss kernels' tuple arguments, each element typed as the argument of its name would be
# (bench.compile_report.compiler._signature): the launchers pass (label_smoothing, z_loss), the fused
# kernel's row strides and the statistics kernel's (M, N) as tuples. Flattened, the arguments keep their
# order.
COEFFICIENTS = ("label_smoothing", "z_loss")
LOSS_TUPLES = {
    "cross_entropy": {
        "strides": ("stride_logits", "stride_dlogits", "dloss_stride"),
        "coefficients": COEFFICIENTS,
    },
    "cross_entropy_stats": {"sizes": ("M", "N")},
    "cross_entropy_grad": {"coefficients": COEFFICIENTS},
}


def loss_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every RowConfig that horse.kernels.cross_entropy.row_config can return on arch (one per block size),
    for its three kernels (LOSS_KERNELS: the fused one, the vocabulary shard's statistics and
    gradient passes), in every dtype."""
    loss = importlib.import_module("horse.kernels.cross_entropy")  # the module: also the name of a function
    limit = loss.MAX_BLOCK_V
    configs = []
    for dtype, n in itertools.product(TRITON_TYPES, row_sizes(limit)):
        cfg = loss.row_config(n, arch)
        shape_class = f"V<={n}" if n <= limit else f"V>{limit}"
        for name, flags in LOSS_KERNELS.items():
            constexprs = flags | {"BLOCK_V": cfg.block_v}
            kernel = f"cross_entropy._{name}_kernel"
            configs.append(
                kernel_config(
                    kernel, shape_class, dtype, constexprs, cfg.num_warps, arch.name, tuples=LOSS_TUPLES[name]
                )
            )
    return configs
