"""The loss kernels' configs (horse.kernels.cross_entropy): every RowConfig its rule can return."""

import importlib
import itertools

from bench.compile_report.config import TRITON_TYPES, KernelConfig, plan_config, row_sizes
from horse.kernels import runtime

SOFTCAP = 30.0  # Gemma 2's final-logit softcap: every kernel built with it, its most live values


def loss_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every RowConfig that horse.kernels.cross_entropy.row_config can return on arch (one per block size),
    for its three kernels' plans (the fused one, the vocabulary shard's statistics and gradient passes)
    with the flags that keep the most values live (label smoothing, the gradient, a softcap), in every
    dtype."""
    loss = importlib.import_module("horse.kernels.cross_entropy")  # the module: also the name of a function
    limit = loss.MAX_BLOCK_V
    configs = []
    for dtype, n in itertools.product(TRITON_TYPES, row_sizes(limit)):
        shape_class = f"V<={n}" if n <= limit else f"V>{limit}"
        plans = (
            loss.cross_entropy_plan(1, n, arch, smoothing=True, write_grad=True, softcap=SOFTCAP),
            loss.stats_plan(1, n, arch, smoothing=True, softcap=SOFTCAP),
            loss.grad_plan(1, n, arch, softcap=SOFTCAP),
        )
        configs += [plan_config(plan, shape_class, dtype, arch.name) for plan in plans]
    return configs
