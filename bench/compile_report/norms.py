"""The norm kernels' configs (horse.kernels.layernorm): every RowConfig its rule can return."""

import itertools

from bench.compile_report.config import TRITON_TYPES, KernelConfig, plan_config, row_sizes
from horse.kernels import layernorm, runtime

# The norm kernels by direction: the longest row a program holds in registers, and the flags that keep
# the most values live (a residual; in the backward every gradient).
NORM_KERNELS = {
    "fwd": (layernorm.FWD_MAX_ROW_IN_REGISTERS, {"HAS_RESIDUAL": True}),
    "bwd": (layernorm.BWD_MAX_ROW_IN_REGISTERS, {"HAS_DRESIDUAL": True, "HAS_DX": True, "HAS_DW": True}),
}
NUM_SMS = 132  # the backward's grid only: its compiled code takes no SM count


def norm_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every RowConfig that layernorm.row_config can return on arch, in the plans of LayerNorm (residual,
    weight, bias) and RMSNorm (residual, weight), the variants with the most live values, in every
    dtype."""
    configs = []
    for dtype, (norm, rms), (direction, (limit, most_live)) in itertools.product(
        TRITON_TYPES, (("layer_norm", False), ("rms_norm", True)), NORM_KERNELS.items()
    ):
        flags = {"IS_RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms} | most_live
        for n in row_sizes(limit):
            if direction == "fwd":
                plan = layernorm.fwd_plan(1, n, dtype, arch, flags)
                in_registers = plan.constexprs["ROW_IN_REGISTERS"]
            else:
                plan, _ = layernorm.bwd_plan(1, n, dtype, arch, NUM_SMS, flags)
                in_registers = plan.constexprs["ROW_IN_TILE"]
            # The backward's row split into column blocks, each sweeping the others: its own name.
            split = "" if in_registers or direction == "fwd" else "_split_row"
            shape_class = f"N<={n}" if in_registers else f"N>{limit}"
            name = f"{norm}_{direction}{split}"
            configs.append(plan_config(plan, shape_class, dtype, arch.name, name=name))
    return configs
