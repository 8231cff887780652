"""The attention kernels' configs (horse.kernels.attention, its tables in
horse.kernels.attention.configs): every table entry in every variant it can be launched in, the
backward's preprocess and the decode kernels.
"""

import itertools

import torch

from bench.compile_report.config import KernelConfig, kernel_config
from horse.kernels import runtime

# Attention passes: kernel (module.function in horse.kernels.attention), the arguments tiled along the
# queries and along the keys (their TMA descriptors' block rows are BLOCK_M and BLOCK_N).
ATTENTION_PASSES = {
    "attn_fwd": ("forward._attn_fwd_kernel", ("Q", "OUT"), ("K", "V")),
    "attn_bwd_dkdv": ("backward._attn_bwd_dkdv_kernel", ("Q", "DO"), ("K", "V", "DK", "DV")),
    "attn_bwd_dq": ("backward._attn_bwd_dq_kernel", ("Q", "DO", "DQ"), ("K", "V")),
}
# Each attention table: the pass it configures and the batches it configures it for (padded, packed).
ATTENTION_TABLES = {
    "FWD_CONFIGS": ("attn_fwd", (False,)),
    "PACKED_FWD_CONFIGS": ("attn_fwd", (True,)),
    "BWD_DKDV_CONFIGS": ("attn_bwd_dkdv", (False, True)),
    "BWD_DQ_CONFIGS": ("attn_bwd_dq", (False, True)),
}


# The mask variants each pass compiles to (its MASK): none, the causal diagonal, a sliding window.
ATTENTION_MASKS = ("full", "causal", "local")

# The kernels' tuple arguments, element by element, as the launchers pack them (each tensor's strides
# a tuple of its own): the report types an element as it would an argument of its name.
SEQUENCES = {
    "cu_seqlens": ("CU_SEQLENS_Q", "CU_SEQLENS_K"),
    "seqlens": ("seqlen_q", "seqlen_k"),
    "window": ("window_left", "window_right"),
}
KERNEL_TUPLES = {
    "forward._attn_fwd_kernel": {
        **SEQUENCES,
        "sizes": ("batch", "heads", "group_size"),
        "strides": ("q_strides", "k_strides", "v_strides", "o_strides", "lse_strides"),
    },
    "backward._attn_bwd_dkdv_kernel": {
        **SEQUENCES,
        "row_stats": ("LSE_LOG2", "DELTA"),
        "sizes": ("heads", "kv_heads", "group_size", "heads_per_split", "split_seqs"),
        "strides": (
            "q_strides",
            "k_strides",
            "v_strides",
            "do_strides",
            "dk_strides",
            "dv_strides",
            "lse_strides",
        ),
    },
    "backward._attn_bwd_dq_kernel": {
        **SEQUENCES,
        "row_stats": ("LSE", "DELTA"),
        "sizes": ("heads", "group_size"),
        "strides": ("q_strides", "k_strides", "v_strides", "do_strides", "dq_strides", "lse_strides"),
    },
    "decode._attn_decode_kernel": {
        "window": SEQUENCES["window"],
        "sizes": ("kv_heads", "group_size"),
        "strides": ("q_strides", "k_strides", "v_strides"),
    },
}


def attention_pass_config(
    name: str,
    cfg,
    head_dim: int,
    dtype: torch.dtype,
    mask: str,
    tma: bool,
    packed: bool = False,
    arch: str = "sm90",
    head_split: bool = False,
    output: str = "dkdv",
):
    """The KernelConfig of attention pass ``name`` (a key of ATTENTION_PASSES) run with the AttnConfig
    ``cfg`` (horse.kernels.attention.configs) at ``head_dim``, mask one of ATTENTION_MASKS, pointer or
    TMA loads, on a padded batch or a packed one (flash_attention_varlen: a program per tile; its TMA
    descriptors built on the device, one per sequence), for GPU family arch; with head_split, the dk/dv
    pass writing float32 partials (a GQA group's query heads split over programs); output, the dk/dv
    launch's gradients (configs.dkdv_outputs: one alone reads K and V by pointers)."""
    from horse.kernels.attention import configs as attention_configs

    kernel, by_query, by_key = ATTENTION_PASSES[name]
    block_d = attention_configs.head_dim_block(head_dim)
    pointers = {"DK": "fp32", "DV": "fp32"} if head_split else {}
    constexprs = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "MASK": mask,
        "TMA": tma,
        "VARLEN": packed,
    }
    if name == "attn_bwd_dkdv":
        constexprs |= {"BLOCK_D_OUT": block_d // cfg.column_splits, "OUTPUT": output}
        by_key = by_key if output == "dkdv" else ("DK", "DV")
    # A packed batch's descriptors are built on the device, one per sequence.
    block_rows = dict.fromkeys(by_query, cfg.block_m) | dict.fromkeys(by_key, cfg.block_n)
    descriptors = {a: (1, rows, 1, block_d) for a, rows in block_rows.items()} if tma and not packed else {}
    flags = (
        (mask, mask != "full"),
        ("tma", tma),
        ("varlen", packed),
        ("head split", head_split),
        (output, output != "dkdv"),
    )
    shape_class = " ".join([f"d={head_dim}", *(mode for mode, on in flags if on)])
    return kernel_config(
        f"attention.{kernel}",
        shape_class,
        dtype,
        constexprs,
        cfg.num_warps,
        arch,
        cfg.num_stages,
        pointers=pointers,
        tuples=KERNEL_TUPLES[kernel],
        descriptors=descriptors,
        matmul=True,
    )


def attention_entry_configs(table: str, cfg, block_d: int, arch: runtime.Arch) -> list[KernelConfig]:
    """Every KernelConfig that entry cfg of horse.kernels.attention's table (a key of ATTENTION_TABLES)
    at block_d compiles to on arch: the local mask first (the most live values: a search stops at the
    first failure), then causal and full; a power-of-two head dim and a padded one (3/4 of the
    block); both dtypes; on the table's batches, padded ones with pointer loads (always selectable:
    USE_TMA off, unaligned inputs) and, on sm_90+ where cfg.tma, TMA loads; packed ones likewise. The
    pointer configs take cfg.loads(False)'s tile; a dk/dv entry with split outputs compiles each of its
    launches."""
    from horse.kernels.attention import configs as attention_configs

    name, batches = ATTENTION_TABLES[table]
    outputs = attention_configs.dkdv_outputs if name == "attn_bwd_dkdv" else lambda _: ("dkdv",)
    tiles = {tma: cfg.loads(tma) for tma in ((False, True) if cfg.tma and arch.tma else (False,))}
    # (head dims, dtypes, head split): the dk/dv pass also writes float32 partials (GQA head splits), in
    # one head dim and dtype, as the store differs, not the loop
    variants = [(dict.fromkeys((block_d, block_d * 3 // 4)), (torch.float16, torch.bfloat16), False)]
    if name == "attn_bwd_dkdv":
        variants.append(((block_d,), (torch.float16,), True))
    configs = []
    for head_dims, dtypes, head_split in variants:
        for mask, head_dim, dtype, packed, (tma, tile) in itertools.product(
            reversed(ATTENTION_MASKS), head_dims, dtypes, batches, tiles.items()
        ):
            args = (name, tile, head_dim, dtype, mask, tma, packed, arch.name, head_split)
            configs += [attention_pass_config(*args, output) for output in outputs(tile)]
    return configs


def attention_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every table entry of horse.kernels.attention for arch (:func:`attention_entry_configs`), the
    backward's preprocess for each head dim, padded and packed, and the decode kernels."""
    from horse.kernels.attention import configs as attention_configs

    configs, dtypes = [], (torch.float16, torch.bfloat16)
    block_dims = sorted(attention_configs.FWD_CONFIGS[arch.name])
    for dtype, block_d, packed in itertools.product(dtypes, block_dims, (0, 1)):
        for head_dim in dict.fromkeys((block_d, block_d * 3 // 4)):
            constexprs = {
                "HEAD_DIM": head_dim,
                "BLOCK_D": block_d,
                "HAS_DLSE": True,
                "VARLEN": bool(packed),
                "BLOCK_M": attention_configs.PREPROCESS_BLOCK_M,
            }
            configs.append(
                kernel_config(
                    "attention.backward._attn_bwd_preprocess_kernel",
                    f"d={head_dim}" + " varlen" * packed,
                    dtype,
                    constexprs,
                    attention_configs.PREPROCESS_NUM_WARPS,
                    arch.name,
                )
            )
    for table in ATTENTION_TABLES:
        for block_d, cfg in sorted(getattr(attention_configs, table)[arch.name].items()):
            configs += attention_entry_configs(table, cfg, block_d, arch)
    decode = sorted(attention_configs.DECODE_CONFIGS[arch.name].items())
    for (block_d, cfg), mask, dtype in itertools.product(decode, reversed(ATTENTION_MASKS), dtypes):
        # The decode pass with a tile of 16 rows and of the entry's block_m (the launcher takes the
        # smaller that holds a GQA group's rows), at a padded head dim (masked head-dim columns).
        head_dim = block_d * 3 // 4 if block_d > 16 else block_d
        shape_class = f"d={head_dim}" + ("" if mask == "full" else f" {mask}")
        dims = {"HEAD_DIM": head_dim, "BLOCK_D": block_d}
        for block_m in dict.fromkeys((16, cfg.block_m)):
            constexprs = {**dims, "BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "MASK": mask}
            configs.append(
                kernel_config(
                    "attention.decode._attn_decode_kernel",
                    shape_class,
                    dtype,
                    constexprs,
                    cfg.num_warps,
                    arch.name,
                    cfg.num_stages,
                    tuples=KERNEL_TUPLES["decode._attn_decode_kernel"],
                    matmul=True,
                )
            )
        if mask == "full":  # and its reduce of the split keys' partial outputs
            configs.append(
                kernel_config(
                    "attention.decode._attn_decode_reduce_kernel",
                    shape_class,
                    dtype,
                    dims | {"BLOCK_S": attention_configs.DECODE_REDUCE_BLOCK_S},
                    attention_configs.DECODE_REDUCE_NUM_WARPS,
                    arch.name,
                )
            )
    return configs
