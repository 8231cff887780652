"""The norm kernels' configs (horse.kernels.layernorm): every RowConfig its rule can return."""

import itertools

from bench.compile_report.config import TRITON_TYPES, KernelConfig, kernel_config, row_sizes
from horse.kernels import layernorm, runtime

# The norm kernels by direction: the constexpr that holds a row in registers, the longest row it holds,
# and the flags that keep the most values live (a residual; in the backward every gradient) with the
# kernel's other constexprs.
NORM_KERNELS = {
    "fwd": ("ROW_IN_REGISTERS", layernorm.FWD_MAX_ROW_IN_REGISTERS, {"HAS_RESIDUAL": True}),
    "bwd": (
        "ROW_IN_TILE",
        layernorm.BWD_MAX_ROW_IN_REGISTERS,
        {"HAS_DRESIDUAL": True, "HAS_DX": True, "HAS_DW": True, "SWEEP_BLOCK_N": layernorm.BWD_SWEEP_BLOCK_N},
    ),
}


# The norm kernels' tuple arguments by direction, each element typed as the argument of its name would be
# (bench.compile_report.compiler._signature): the launchers pass (mean, rstd), (M, N[, rows_per_program])
# and the row strides as tuples.
NORM_TUPLES = {
    "fwd": {
        "row_stats": ("MEAN", "RSTD"),
        "sizes": ("M", "N"),
        "strides": ("stride_x_row", "stride_res_row"),
    },
    "bwd": {
        "row_stats": ("MEAN", "RSTD"),
        "sizes": ("M", "N", "rows_per_program"),
        "strides": ("stride_dy_row", "stride_dres_row", "stride_x_row"),
    },
}


def norm_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every RowConfig that layernorm.row_config can return on arch, for LayerNorm (residual, weight,
    bias) and RMSNorm (residual, weight), the variants with the most live values, in every dtype."""
    configs = []
    for dtype, (norm, rms), (direction, (in_registers, limit, flags)) in itertools.product(
        TRITON_TYPES, (("layer_norm", False), ("rms_norm", True)), NORM_KERNELS.items()
    ):
        for n in row_sizes(limit):
            cfg = layernorm.row_config(n, direction == "bwd", dtype, arch)
            constexprs = {
                "IS_RMS": rms,
                "HAS_WEIGHT": True,
                "HAS_BIAS": not rms,
                **flags,
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n,
                in_registers: cfg.row_in_registers,
            }
            # The backward's row split into column blocks, each sweeping the others: its own name.
            split = "" if cfg.row_in_registers or direction == "fwd" else "_split_row"
            shape_class = f"N<={n}" if cfg.row_in_registers else f"N>{limit}"
            kernel = f"layernorm._norm_{direction}_kernel"
            configs.append(
                kernel_config(
                    kernel,
                    shape_class,
                    dtype,
                    constexprs,
                    cfg.num_warps,
                    arch.name,
                    name=f"{norm}_{direction}{split}",
                    tuples=NORM_TUPLES[direction],
                )
            )
    return configs
