"""The MLP kernels' configs (horse.kernels.mlp): every GEMM table entry in every variant it can be
launched in, the split-K epilogue and the elementwise backward.
"""

import dataclasses
import itertools

import torch

from bench.compile_report.config import KernelConfig, plan_config
from horse.kernels import runtime

# The unit strides the MLP kernels are compiled with, as constexprs (Triton specialises a stride of 1 on
# a GPU): x, dy and the weights row-major (the backward reads W_out transposed, unit stride along N).
# The persistent forward reads only descriptors.
UNIT_STRIDES = {
    "_fwd_kernel": {"x_strides[1]": 1, "w_strides[1]": 1},
    "_fwd_persistent_kernel": {},
    "_dh_act_bwd_kernel": {"dy_strides[1]": 1, "w_strides[0]": 1},
    "_split_k_epilogue_kernel": {},
    "_act_bwd_kernel": {"dh_strides[1]": 1},
}
NUM_SMS = 132  # the persistent forward's grid only: its compiled code takes no SM count


def _inline_ptx(arch: str) -> bool:
    """Epilogue.inline_ptx as the launchers set it (runtime.inline_ptx) on a GPU of family arch."""
    return not runtime.ARCHS[arch].hip_target


def mlp_plan_config(
    plan, table: str, shape_class: str, dtype: torch.dtype, arch: str, **fields
) -> KernelConfig:
    """The KernelConfig of an MLP launcher's plan, named mlp_<table>, compiled with its unit strides."""
    strides = UNIT_STRIDES[plan.kernel.fn.__name__]
    plan = dataclasses.replace(plan, constexprs=plan.constexprs | strides)
    return plan_config(plan, shape_class, dtype, arch, name=f"mlp_{table}", **fields)


def mlp_gemm_config(
    table: str,
    shape_class: str,
    cfg,
    dtype: torch.dtype,
    activation: str,
    tma: bool,
    arch: str = "sm90",
    split_k: bool = False,
    persistent: bool = False,
):
    """The KernelConfig of MLP GEMM ``table`` ("fwd" or "dh_bwd", or gated_<it>) run with the
    horse.kernels.mlp.configs.GemmConfig ``cfg`` and activation, pointer or TMA loads, for GPU family
    arch, with the epilogue that keeps the most values live (Epilogue.store: the stored
    pre-activation, the recomputed h): the launcher's plan (horse.kernels.mlp.launch); split_k: a
    forward's split-K variant (partial sums stored, no epilogue); persistent: a forward's persistent
    kernel (TMA)."""
    from horse.kernels.mlp import launch
    from horse.kernels.mlp.configs import Epilogue

    gated = table.startswith("gated_")
    epilogue = Epilogue(
        activation,
        gated,
        has_bias=not gated,
        store=True,
        split=cfg.epilogue_split,
        inline_ptx=_inline_ptx(arch),
    )
    if table.removeprefix("gated_") == "fwd":
        plan = launch.fwd_plan(cfg, 1, 1, epilogue, tma, 2 if split_k else 1, persistent, NUM_SMS)
    else:
        plan = launch.dh_plan(cfg, 1, 1, epilogue, tma)
    kind = " persistent" if persistent else " tma" if tma else ""
    shape = f"{shape_class}/{activation}{kind}{' split-k' if split_k else ''}"
    return mlp_plan_config(plan, table, shape, dtype, arch, matmul=True)


def mlp_entry_configs(table: str, shape_class: str, cfg, arch: runtime.Arch) -> list[KernelConfig]:
    """Every KernelConfig that entry cfg of horse.kernels.mlp.configs.GEMM_CONFIGS[arch][table] at
    shape_class compiles to on arch: in both dtypes, for the two activations with the heaviest
    epilogues (gelu's erf and gelu_tanh), with pointer loads (always selectable: USE_TMA off,
    unaligned inputs) and, on sm_90+ where cfg.tma, TMA loads; a forward's small entry (decode-sized
    M) also in its split-K variant (horse.kernels.mlp.configs.split_k), and a forward entry with
    cfg.persistent also as the persistent kernel (TMA loads and stores)."""
    from horse.kernels.mlp import configs

    tma_modes = (False, True) if cfg.tma and arch.tma else (False,)
    split_modes = (False, True) if table in ("fwd", "gated_fwd") and shape_class == "small" else (False,)
    variants = [(split_modes, tma_modes, False)]  # (split-K modes, TMA modes, persistent)
    # Its tiled TMA and pointer kernels stay selectable (horse.kernels.mlp.launch._persistent).
    if cfg.persistent and arch.tma:
        variants.append(((False,), (True,), True))
    return [
        mlp_gemm_config(table, shape_class, cfg, dtype, activation, tma, arch.name, split, persistent)
        for splits, tmas, persistent in variants
        for split, dtype, activation, tma in itertools.product(
            splits, configs.SUPPORTED_DTYPES, ("gelu", "gelu_tanh"), tmas
        )
    ]


def mlp_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every GEMM table entry of horse.kernels.mlp.configs for arch (:func:`mlp_entry_configs`), and the
    elementwise backward, plain and gated, in both dtypes."""
    from horse.kernels.mlp import configs, launch

    kernel_configs = []
    for table, entries in configs.GEMM_CONFIGS[arch.name].items():
        for shape_class, cfg in entries.items():
            kernel_configs += mlp_entry_configs(table, shape_class, cfg, arch)
    # The split-K epilogue in the small tiles, and the elementwise backward, plain and gated.
    activations = ("gelu", "gelu_tanh")
    for gated, dtype, activation in itertools.product((False, True), configs.SUPPORTED_DTYPES, activations):
        table = "gated_fwd" if gated else "fwd"
        cfg = configs.GEMM_CONFIGS[arch.name][table]["small"]
        epilogue = configs.Epilogue(
            activation, gated, has_bias=not gated, store=True, inline_ptx=_inline_ptx(arch.name)
        )
        plan = launch.split_k_epilogue_plan(cfg, 1, 1, epilogue)
        name = f"{'gated_' * gated}split_k_epilogue"
        kernel_configs.append(mlp_plan_config(plan, name, f"small/{activation}", dtype, arch.name))
    for dtype, gated in itertools.product(configs.SUPPORTED_DTYPES, (False, True)):
        epilogue = configs.Epilogue("gelu", gated, has_bias=not gated, store=False)
        plan, _ = launch.act_bwd_plan(1, 1, epilogue, NUM_SMS)
        name = f"{'gated_' * gated}act_bwd"
        kernel_configs.append(mlp_plan_config(plan, name, "any/gelu", dtype, arch.name))
    return kernel_configs
