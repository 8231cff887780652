"""The attention kernels' configs (horse.kernels.attention, its tables in
horse.kernels.attention.configs): every table entry in every variant it can be launched in, the
backward's preprocess and the decode kernels; the score modifications (softcap and sinks) on sm_90, the
softcap's gradient passes on every family; document masking on sm_90 (DOCUMENT_ARCHS).
"""

import itertools

import torch

from bench.compile_report.config import KernelConfig, plan_config
from horse.kernels import runtime

# Attention passes: their plan functions in horse.kernels.attention.launch.
ATTENTION_PASSES = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")
# Each attention table: the pass it configures and the batches it configures it for (padded, packed).
ATTENTION_TABLES = {
    "FWD_CONFIGS": ("attn_fwd", (False,)),
    "PACKED_FWD_CONFIGS": ("attn_fwd", (True,)),
    "BWD_DKDV_CONFIGS": ("attn_bwd_dkdv", (False, True)),
    "BWD_DQ_CONFIGS": ("attn_bwd_dq", (False, True)),
}


# The mask variants each pass compiles to (its MASK): none, the causal diagonal, a sliding window.
ATTENTION_MASKS = ("full", "causal", "local")
# The softcap the score-modification rows compile with (Gemma 2's): a constexpr, each value its own build.
SOFTCAP = 50.0
# The families whose forward and decode rows with the score modifications are built: sm_90; every family
# builds its gradient passes' softcap rows (the tiles of AttnConfig.softcap are chosen by them).
SCORE_MOD_ARCHS = ("sm90",)
# The families whose document-masking rows are built: sm_90. On sm_80 the dk/dv pass spilled 8 bytes at
# head dims 24 and 32 (blocks 32x64x128x32, 8 warps; the causal rows do not), sm86, sm100, gfx942 not built.
DOCUMENT_ARCHS = ("sm90",)


def attention_pass_configs(
    name: str,
    entry,
    head_dim: int,
    dtype: torch.dtype,
    mask: str,
    tma: bool,
    packed: bool = False,
    arch: str = "sm90",
    head_split: bool = False,
    score_mods: bool = False,
    documents: bool = False,
) -> list[KernelConfig]:
    """The KernelConfigs of attention pass ``name`` (one of ATTENTION_PASSES) launched with the table
    entry ``entry`` (horse.kernels.attention.configs.AttnConfig) at ``head_dim``, mask one of
    ATTENTION_MASKS, pointer or TMA loads, on a padded batch or a packed one, for GPU family arch:
    the launcher's own plans (horse.kernels.attention.launch: a launch each, the dk/dv pass's split
    outputs two); with head_split, the dk/dv pass writing float32 partials (a GQA group's query heads
    split over programs); with score_mods, the softcap SOFTCAP and (the forward) the sinks; with
    documents, document masking (mask "causal")."""
    from horse.kernels.attention import launch

    shape = (1, 1, 1, 2, 1, head_dim)  # (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim): the grid's
    softcap = SOFTCAP if score_mods else None
    if name == "attn_bwd_dkdv":
        splits = 2 if head_split else 1
        plans = launch.dkdv_plans(entry, shape, mask, tma, packed, splits, softcap, documents)
    elif name == "attn_fwd":
        plans = [launch.fwd_plan(entry, shape, mask, tma, packed, softcap, score_mods, documents)]
    else:
        plans = [launch.dq_plan(entry, shape, mask, tma, packed, softcap, documents)]
    configs = []
    for plan in plans:
        output = plan.constexprs.get("OUTPUT", "dkdv")
        flags = (
            (mask, mask != "full"),
            ("tma", tma),
            ("varlen", packed),
            ("head split", head_split),
            (output, output != "dkdv"),
            ("softcap", score_mods),
            ("sinks", score_mods and name == "attn_fwd"),
            ("documents", documents),
        )
        shape_class = " ".join([f"d={head_dim}", *(mode for mode, on in flags if on)])
        configs.append(plan_config(plan, shape_class, dtype, arch, matmul=True))
    return configs


def attention_entry_configs(table: str, cfg, block_d: int, arch: runtime.Arch) -> list[KernelConfig]:
    """Every KernelConfig that entry cfg of horse.kernels.attention's table (a key of ATTENTION_TABLES)
    at block_d compiles to on arch: the local mask first (the most live values: a search stops at the
    first failure), then causal and full; a power-of-two head dim and a padded one (3/4 of the
    block); both dtypes; on the table's batches, padded ones with pointer loads (always selectable:
    USE_TMA off, unaligned inputs) and, on sm_90+ where cfg.tma, TMA loads; packed ones likewise. The
    pointer configs take cfg.loads(False)'s tile; a dk/dv entry with split outputs compiles each of its
    launches."""
    name, batches = ATTENTION_TABLES[table]
    loads = (False, True) if cfg.tma and arch.tma else (False,)
    # (head dims, dtypes, head split): the dk/dv pass also writes float32 partials (GQA head splits), in
    # one head dim and dtype, as the store differs, not the loop
    variants = [(dict.fromkeys((block_d, block_d * 3 // 4)), (torch.float16, torch.bfloat16), False)]
    if name == "attn_bwd_dkdv":
        variants.append(((block_d,), (torch.float16,), True))
    configs = []
    for head_dims, dtypes, head_split in variants:
        for mask, head_dim, dtype, packed, tma in itertools.product(
            reversed(ATTENTION_MASKS), head_dims, dtypes, batches, loads
        ):
            configs += attention_pass_configs(
                name, cfg, head_dim, dtype, mask, tma, packed, arch.name, head_split
            )
    return configs


def score_mod_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """The passes with the score modifications on (softcap; the forward's sinks too; the decode pass's
    softcap and its reduce's sinks): every table entry at its power-of-two head dim, every mask, both
    dtypes, on the table's batches, by pointer loads and (where the entry may) TMA; the dk/dv pass's
    float32 partials too. The gradient passes take each entry's softcap tile, as the launchers do
    (configs.attn_config). On SCORE_MOD_ARCHS every pass; on the other families the gradient passes."""
    from horse.kernels.attention import configs as attention_configs
    from horse.kernels.attention import launch

    configs, dtypes, every_pass = [], (torch.float16, torch.bfloat16), arch.name in SCORE_MOD_ARCHS
    for table, (name, batches) in ATTENTION_TABLES.items():
        if name == "attn_fwd" and not every_pass:
            continue
        for block_d, entry in sorted(getattr(attention_configs, table)[arch.name].items()):
            cfg = entry if name == "attn_fwd" else entry.scored(SOFTCAP)
            loads = (False, True) if cfg.tma and arch.tma else (False,)
            # the dk/dv pass's float32 partials (GQA head splits) in one dtype, as attention_entry_configs
            variants = [(dtypes, False)] + [((torch.float16,), True)] * (name == "attn_bwd_dkdv")
            for kinds, head_split in variants:
                for mask, dtype, packed, tma in itertools.product(
                    reversed(ATTENTION_MASKS), kinds, batches, loads
                ):
                    configs += attention_pass_configs(
                        name, cfg, block_d, dtype, mask, tma, packed, arch.name, head_split, score_mods=True
                    )
    decode = sorted(attention_configs.DECODE_CONFIGS[arch.name].items()) if every_pass else []
    for (block_d, cfg), mask, dtype in itertools.product(decode, reversed(ATTENTION_MASKS), dtypes):
        shape_class = f"d={block_d}" + ("" if mask == "full" else f" {mask}") + " softcap"
        plans = (
            launch.decode_plan(cfg, (1, rows, 4096, 1, 1, block_d), mask, 132, SOFTCAP)[0]
            for rows in (1, cfg.block_m)
        )
        by_block_m = {plan.constexprs["BLOCK_M"]: plan for plan in plans}
        configs += [
            plan_config(plan, shape_class, dtype, arch.name, matmul=True) for plan in by_block_m.values()
        ]
        if mask == "full":  # and its reduce, which adds the sinks
            reduce = launch.decode_reduce_plan(1, block_d, sinks=True)
            configs.append(plan_config(reduce, f"d={block_d} sinks", dtype, arch.name))
    return configs


def document_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """The passes with document masking (flash_attention's document_starts: padded batches, causal):
    every table entry at its power-of-two head dim and a padded one, both dtypes, by pointer loads and
    (where the entry may) TMA; the dk/dv pass's float32 partials too. A dk/dv entry with split outputs
    takes its pointer tile for documents (launch._bwd_dkdv), so only that one builds."""
    from horse.kernels.attention import configs as attention_configs

    configs, dtypes = [], (torch.float16, torch.bfloat16)
    for table, (name, batches) in ATTENTION_TABLES.items():
        if False not in batches:
            continue  # the packed forward's table: document masking runs on padded batches
        for block_d, cfg in sorted(getattr(attention_configs, table)[arch.name].items()):
            tma_allowed = cfg.tma and arch.tma and not cfg.split_outputs
            loads = (False, True) if tma_allowed else (False,)
            head_dims = dict.fromkeys((block_d, block_d * 3 // 4))
            variants = [(head_dims, dtypes, False)]
            if name == "attn_bwd_dkdv":
                variants.append(((block_d,), (torch.float16,), True))
            for dims, kinds, head_split in variants:
                for head_dim, dtype, tma in itertools.product(dims, kinds, loads):
                    configs += attention_pass_configs(
                        name,
                        cfg,
                        head_dim,
                        dtype,
                        "causal",
                        tma,
                        False,
                        arch.name,
                        head_split,
                        documents=True,
                    )
    return configs


def attention_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every table entry of horse.kernels.attention for arch (:func:`attention_entry_configs`), the
    backward's preprocess for each head dim, padded and packed, and the decode kernels."""
    from horse.kernels.attention import configs as attention_configs
    from horse.kernels.attention import launch

    configs, dtypes = [], (torch.float16, torch.bfloat16)
    block_dims = sorted(attention_configs.FWD_CONFIGS[arch.name])
    for dtype, block_d, packed in itertools.product(dtypes, block_dims, (False, True)):
        for head_dim in dict.fromkeys((block_d, block_d * 3 // 4)):
            plan = launch.preprocess_plan(1, 1, 1, head_dim, has_dlse=True, packed=packed)
            shape_class = f"d={head_dim}" + " varlen" * packed
            configs.append(plan_config(plan, shape_class, dtype, arch.name))
    for table in ATTENTION_TABLES:
        for block_d, cfg in sorted(getattr(attention_configs, table)[arch.name].items()):
            configs += attention_entry_configs(table, cfg, block_d, arch)
    decode = sorted(attention_configs.DECODE_CONFIGS[arch.name].items())
    for (block_d, cfg), mask, dtype in itertools.product(decode, reversed(ATTENTION_MASKS), dtypes):
        # The decode pass's plans with a tile of 16 rows (one query of MHA) and of the entry's block_m (as
        # many rows), at a padded head dim (masked head-dim columns).
        head_dim = block_d * 3 // 4 if block_d > 16 else block_d
        shape_class = f"d={head_dim}" + ("" if mask == "full" else f" {mask}")
        plans = (
            launch.decode_plan(cfg, (1, rows, 4096, 1, 1, head_dim), mask, 132)[0]
            for rows in (1, cfg.block_m)
        )
        by_block_m = {plan.constexprs["BLOCK_M"]: plan for plan in plans}
        configs += [
            plan_config(plan, shape_class, dtype, arch.name, matmul=True) for plan in by_block_m.values()
        ]
        if mask == "full":  # and its reduce of the split keys' partial outputs
            reduce = launch.decode_reduce_plan(1, head_dim)
            configs.append(plan_config(reduce, shape_class, dtype, arch.name))
    configs += score_mod_configs(arch)
    if arch.name in DOCUMENT_ARCHS:
        configs += document_configs(arch)
    return configs
