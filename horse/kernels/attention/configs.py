"""The attention passes' tiles: :class:`AttnConfig`; a table per pass with an entry per GPU family
(``horse.kernels.runtime.ARCHS``) and padded head dim, read from ``configs.json`` beside this file;
the rules and fixed tiles of the small passes (decode and its reduce, the backward's preprocess).

Every table entry compiles for its family's target with tensor-core instructions, no spills and
within its shared memory, in both dtypes and every mask, with pointer loads, on packed batches and,
where tma is set on sm_90 and sm_100, with TMA loads: ``python -m bench.compile_report --filter attn``
builds them all, and its output is the record of how each builds. The sm90 entries were chosen for
speed; the other families' are the first candidates, from sm90's tile down, that compile clean there
(``python -m bench.tune attention --compile-only --arch FAMILY --start-from sm90 --write``), not
measured yet. A forward or gradient pass's entry may hold a tile of its own for the softcap
(``softcap``), where its tile spills with the softcap's work added: :func:`attn_config` takes it when
the softcap is on.
What was tried for each entry and why it stands: TUNING.md beside this file.
"""

import dataclasses
import pathlib
from dataclasses import dataclass

import torch
import triton

from horse.kernels import runtime

MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class AttnConfig:
    """Tile of one attention pass: BLOCK_M queries by BLOCK_N keys, its warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    column_splits: int = 1  # dk/dv pass: its head-dim columns shared among this many programs
    tma: bool = True  # q/k/v/o tiles by TMA (tensor descriptors) where the GPU and strides allow
    # The config taken when tiles move by pointers (None: this one), for entries whose TMA tile spills there.
    pointer: "AttnConfig | None" = None
    # dk/dv pass: dv and dk by two launches of their own, one accumulator live in each (5 GEMMs against
    # the fused pass's 4: the scores computed twice), whole rows of the head dim (no column_splits).
    split_outputs: bool = False
    # Forward and gradient passes: the config taken with the softcap on (None: this one), for entries whose
    # tile spills with the softcap's tanh (and in a gradient pass its derivative) live (TUNING.md); never
    # split_outputs (that kernel has no softcap).
    softcap: "AttnConfig | None" = None

    def __post_init__(self):
        if self.split_outputs and self.column_splits != 1:
            raise ValueError(
                f"split_outputs takes whole head-dim rows: column_splits {self.column_splits}, expected 1"
            )
        if self.softcap is not None and self.softcap.split_outputs:
            raise ValueError(
                "softcap: the split-output dk/dv kernel has no softcap; expected split_outputs False"
            )

    def loads(self, tma: bool) -> "AttnConfig":
        """The config a launch takes with TMA loads (tma) or with pointers."""
        return self if tma or self.pointer is None else self.pointer

    def scored(self, softcap: float | None) -> "AttnConfig":
        """The config a forward or gradient pass takes with the softcap softcap (None or 0: off)."""
        return self if not softcap or self.softcap is None else self.softcap


CONFIG_FILE = pathlib.Path(__file__).with_name("configs.json")  # bench.tune --write updates it
_TABLES = runtime.load_configs(CONFIG_FILE, AttnConfig)
# Each table: GPU family (runtime.arch) -> padded head dim (16 ... 512) -> entry.
FWD_CONFIGS = _TABLES["FWD_CONFIGS"]
# Packed batches' forward: the padded entries (TMA descriptors built per sequence on the device), a
# dict of its own per family, so that an entry measured for packed batches (bench.tune) can differ.
PACKED_FWD_CONFIGS = {arch: dict(table) for arch, table in FWD_CONFIGS.items()}
# block_n is the key block each program owns (dk, dv accumulate there); block_m the query step.
BWD_DKDV_CONFIGS = _TABLES["BWD_DKDV_CONFIGS"]
BWD_DQ_CONFIGS = _TABLES["BWD_DQ_CONFIGS"]
# Decode (flash_attention_with_kvcache): BLOCK_M query rows (a GQA group's heads x the new tokens)
# by BLOCK_N cached keys, pointer loads (the rows are gathered across heads), the same rule on every
# family; a tile of 16 rows (the smallest tl.dot) when the group's rows fit in it, and at head dims
# 256 and 512, where 64 rows spilled with the window.
DECODE_CONFIGS = {
    arch: {
        block_d: AttnConfig(16, 32, 4, 2, tma=False)
        if block_d >= 256
        else AttnConfig(64, 64, 4, 2, tma=False)
        for block_d in (16, 32, 64, 128, 256, 512)
    }
    for arch in ("sm80", "sm86", "sm90", "sm100", "gfx942")
}
DECODE_REDUCE_NUM_WARPS = 8  # at 4 the head-dim-256 reduce spilled 8 bytes on sm_80
DECODE_REDUCE_BLOCK_S = 16  # splits the reduce loads at a time: up to 2 per SM, 264 on an H200
# Small, unequal tiles in the interpreter: quick there, and several blocks cross every boundary.
INTERPRETER_BLOCKS = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1}
# At 4 warps the 64 x 128 tiles of o and dO spilled 8-32 bytes on sm_100 (at 48-56 registers).
PREPROCESS_NUM_WARPS = 8


def head_dim_block(head_dim: int) -> int:
    """Head dims are padded to a power of two of at least 16, the smallest tl.dot reduction."""
    return max(16, triton.next_power_of_2(head_dim))


def preprocess_block_m(head_dim: int) -> int:
    """Rows of the backward preprocess's tiles of o and dO: 64, of at most 256 head-dim columns (32 rows at
    512, whose 64-row bfloat16 tiles spilled 8 bytes on sm_86)."""
    return min(64, 64 * 256 // head_dim_block(head_dim))


def attn_config(table: dict, head_dim: int, device: torch.device, softcap: float | None = None) -> AttnConfig:
    """The entry of table (FWD_CONFIGS, ...) for head_dim on device's GPU family; with the softcap on
    (softcap neither None nor 0), a forward or gradient pass's softcap tile (AttnConfig.scored), taken
    before the interpreter's blocks replace the tile's (they keep its column_splits and split_outputs),
    its pointer tile's too (a dk/dv entry with split outputs takes that for document masking)."""
    cfg = table[runtime.arch(device).name][head_dim_block(head_dim)].scored(softcap)
    if not runtime.INTERPRET:
        return cfg
    pointer = None if cfg.pointer is None else dataclasses.replace(cfg.pointer, **INTERPRETER_BLOCKS)
    return dataclasses.replace(cfg, **INTERPRETER_BLOCKS, pointer=pointer)
