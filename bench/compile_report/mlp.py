"""The MLP kernels' configs (horse.kernels.mlp): every GEMM table entry in every variant it can be
launched in, the split-K epilogue and the elementwise backward.
"""

import itertools

import torch

from bench.compile_report.config import KernelConfig, kernel_config
from horse.kernels import runtime

# MLP GEMM tables, each with a bias and gated ("gated_<table>": gated, no bias), built with the
# epilogue that keeps the most values live (Epilogue.store: the stored pre-activation, the recomputed
# h): kernel (module of horse.kernels.mlp and name), unit strides as constexprs (x, dy and the weights
# row-major; the backward reads W_out transposed, unit stride along N), and each TMA descriptor's
# block as (rows, columns) dims.
MLP_GEMMS = {
    "fwd": (
        "forward._fwd_kernel",
        {"x_strides[1]": 1, "w_strides[1]": 1},
        {"X": "mk", "W": "nk", "WU": "nk"},
    ),
    "dh_bwd": (
        "backward._dh_act_bwd_kernel",
        {"dy_strides[1]": 1, "w_strides[0]": 1},
        {"DY": "mk", "W": "kn"},
    ),
}


# The forwards' persistent kernel (TMA only): its descriptors (the outputs' in epilogue subtiles, "s").
# Both forward kernels take GATED; a plain forward is passed W for WU and PRE for UP, which it does not read.
MLP_PERSISTENT_TILES = {"X": "mk", "W": "nk", "WU": "nk", "Y": "ms", "PRE": "ms", "UP": "ms"}


def _inline_ptx(arch: str) -> bool:
    """Epilogue.inline_ptx as the launchers set it (runtime.inline_ptx) on a GPU of family arch."""
    return not runtime.ARCHS[arch].hip_target


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
    """The KernelConfig of MLP GEMM ``table`` (a key of MLP_GEMMS, or gated_<key>) run with the
    horse.kernels.mlp.configs.GemmConfig ``cfg`` and activation, pointer or TMA loads, for GPU family
    arch; split_k: a forward's split-K variant (partial sums stored, no epilogue); persistent: a
    forward's persistent kernel (TMA)."""
    from horse.kernels.mlp.configs import Epilogue

    gated = table.startswith("gated_")
    kernel, unit_strides, tiles = MLP_GEMMS[table.removeprefix("gated_")]
    dims = {"m": cfg.block_m, "n": cfg.block_n, "k": cfg.block_k, "s": cfg.block_n // cfg.epilogue_split}
    epilogue = Epilogue(
        activation,
        gated,
        has_bias=not gated,
        store=True,
        split=cfg.epilogue_split,
        inline_ptx=_inline_ptx(arch),
    )
    constexprs = {
        "EPILOGUE": epilogue,
        **unit_strides,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        "TMA": tma,
    }
    if kernel == "forward._fwd_kernel":
        constexprs["SPLIT_K"] = split_k
    if persistent:
        kernel, tiles = "forward._fwd_persistent_kernel", MLP_PERSISTENT_TILES
        # no strides tuples: the persistent kernel reads only descriptors
        constexprs = {k: v for k, v in constexprs.items() if k not in ("TMA", "SPLIT_K") and "[" not in k}
    descriptors = {a: tuple(dims[d] for d in block) for a, block in tiles.items()} if tma else {}
    kind = " persistent" if persistent else " tma" if tma else ""
    shape = f"{shape_class}/{activation}{kind}{' split-k' if split_k else ''}"
    return kernel_config(
        f"mlp.{kernel}",
        shape,
        dtype,
        constexprs,
        cfg.num_warps,
        arch,
        cfg.num_stages,
        name=f"mlp_{table}",
        descriptors=descriptors,
        matmul=True,
    )


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
    from horse.kernels.mlp import configs

    kernel_configs = []
    for table, entries in configs.GEMM_CONFIGS[arch.name].items():
        for shape_class, cfg in entries.items():
            kernel_configs += mlp_entry_configs(table, shape_class, cfg, arch)
    # The split-K epilogue in the small tiles, and the elementwise backward, plain and gated.
    activations = ("gelu", "gelu_tanh")
    for gated, dtype, activation in itertools.product((False, True), configs.SUPPORTED_DTYPES, activations):
        cfg = configs.GEMM_CONFIGS[arch.name]["gated_fwd" if gated else "fwd"]["small"]
        # The forward's epilogue, unsplit, as _fwd_gemm passes it.
        epilogue = configs.Epilogue(
            activation, gated, has_bias=not gated, store=True, inline_ptx=_inline_ptx(arch.name)
        )
        constexprs = {"EPILOGUE": epilogue, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}
        kernel_configs.append(
            kernel_config(
                "mlp.forward._split_k_epilogue_kernel",
                f"small/{activation}",
                dtype,
                constexprs,
                configs.SPLIT_K_EPILOGUE_WARPS,
                arch.name,
                name=f"mlp_{'gated_' * gated}split_k_epilogue",
            )
        )
    row = configs.ACT_BWD_CONFIG
    for dtype, gated in itertools.product(configs.SUPPORTED_DTYPES, (False, True)):
        constexprs = {
            "EPILOGUE": configs.Epilogue("gelu", gated, has_bias=not gated, store=False),
            "dh_strides[1]": 1,
            "BLOCK_M": row.block_m,
            "BLOCK_N": row.block_n,
        }
        kernel_configs.append(
            kernel_config(
                "mlp.backward._act_bwd_kernel",
                "any/gelu",
                dtype,
                constexprs,
                row.num_warps,
                arch.name,
                name=f"mlp_{'gated_' * gated}act_bwd",
            )
        )
    return kernel_configs
