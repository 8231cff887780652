"""The attention passes' tiles: :class:`AttnConfig`, a table per pass with an entry per GPU family
(``horse.kernels.runtime.ARCHS``) and padded head dim, and the fixed tiles of the small passes.
"""

import dataclasses
from dataclasses import dataclass

import torch
import triton

from horse.kernels import runtime

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttnConfig:
    """Tile of one attention pass: BLOCK_M queries by BLOCK_N keys, its warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    column_splits: int = 1  # dk/dv pass: its head-dim columns shared among this many programs
    tma: bool = True  # q/k/v/o tiles by TMA (tensor descriptors) where the GPU and strides allow
    # Forward: 0 launches a program per tile; n > 0 launches n per SM, each looping over tiles.
    programs_per_sm: int = 0
    # The config taken when tiles move by pointers (None: this one), for entries whose TMA tile spills there.
    pointer: "AttnConfig | None" = None
    # dk/dv pass: dv and dk by two launches of their own, one accumulator live in each (5 GEMMs against
    # the fused pass's 4: the scores computed twice).
    split_outputs: bool = False

    def loads(self, tma: bool) -> "AttnConfig":
        """The config a launch takes with TMA loads (tma) or with pointers."""
        return self if tma or self.pointer is None else self.pointer


# Per GPU family (runtime.arch), pass and padded head dim. Every entry compiles for its family's
# target with tensor-core instructions, no spills and within its shared memory, in both dtypes and
# every mask, with pointer loads, on packed batches, and on sm_90 and sm_100 where tma is set with
# TMA loads: python -m bench.compile_report --filter attn builds them all, and its output is the
# record of how each builds. The sm_90 entries, here, are chosen for speed. The other families'
# (horse/kernels/configs/attention.json) are the first candidates, from sm_90's tile down, that compile
# clean there on triton 3.6 and 3.9 (python -m bench.tune attention --compile-only --arch FAMILY
# --start-from sm90; sm86's also for sm_89 and sm_120 with --capability 86 89 120); none is
# measured yet (python -m bench.tune attention on such a GPU refines them).
#
# sm_90: clean on triton 3.6 and 3.9, but the forward's TMA tiles at head dims 128 and 256, checked
# on 3.6 only; those entries take smaller key blocks with pointers (pointer), whose larger
# tiles spilled. TMA took fewer registers in most entries (221 against 255 in the 128x128
# head-dim-128 forward) and less shared memory (197 against 229 KB there); which is faster is for
# the bench to measure ("ours" against "ours-pointer").
_TABLES = runtime.load_configs("attention", AttnConfig)
FWD_CONFIGS = {
    "sm90": {
        16: AttnConfig(128, 64, 4, 3),
        32: AttnConfig(128, 64, 4, 3),
        64: AttnConfig(128, 64, 4, 3),
        # 128x128 by TMA, as the tutorial: clean at 221-255 registers, 192 KiB (triton 3.6; padded and
        # packed, every mask). Pointers keep 128x64: 128x128 spilled 8 bytes (head dim 128) and 48 (96)
        # there with a window once the offsets went 64-bit. bench.sass_loops, non-causal loop: 128x64
        # took 336 instructions, 66 FMUL, 12 HGMMA per 64 keys (641 per MFLOP); 128x128 takes 488, 66,
        # 16x 64x128x16 per 128 keys (465 per MFLOP; the tutorial 491, 66: 468); causal diagonal 625.
        128: AttnConfig(128, 128, 8, 3, pointer=AttnConfig(128, 64, 8, 3)),
        # 128x64 by TMA, K and V through shared memory as FA3's 128x80 (which fills it; Triton's
        # tiles are powers of two): bench.sass_loops, non-causal loop, 16x 64x64x16 + 4x 64x256x16
        # HGMMA, 442 instructions (422 per MFLOP), where the 128x32 pointer tile issued 16x 64x32x16
        # + 2x 64x256x16 in 376 (717 per MFLOP); 250-255 registers, no spill, 128 KiB (triton 3.6).
        # Pointers keep 128x32: 128x64 spilled 8-48 bytes there (head dims 192, 256 local), as it
        # did on triton 3.9 with TMA and at 192 causal with pointers.
        256: AttnConfig(128, 64, 8, 2, pointer=AttnConfig(128, 32, 8, 2)),
    },
    **_TABLES["FWD_CONFIGS"],
}
# Packed batches' forward: the padded entries, TMA descriptors built on the device per sequence (the
# 128x128 head-dim-128 tile compiles as the padded one: 221-255 registers, no spill; its pointer
# tile, 128x64, is the one the packed batches took before at 180-234). The backward passes share the
# padded tables, by TMA with descriptors built on the device too (see BWD_DKDV_CONFIGS' 256). A dict
# of its own per family: tuning one table (bench.tune) never edits the other.
PACKED_FWD_CONFIGS = {arch: dict(table) for arch, table in FWD_CONFIGS.items()}
# block_n is the key block each program owns (dk, dv accumulate there); block_m the query step.
BWD_DKDV_CONFIGS = {
    # At head dim 256 no tile held dk and dv whole without spilling (808 bytes at 64x64, 8 warps),
    # so two programs share each key block's columns, recomputing the scores: 1.5x this pass's
    # FLOPs. At 128 the TMA variant of this tile spills 16-32 bytes (only block_m 16 did not).
    "sm90": {
        16: AttnConfig(64, 128, 8, 2),
        32: AttnConfig(64, 128, 8, 2),
        # Per iteration (python -m bench.sass_loops attn_bwd_dkdv, fp16) after lse in log2 units from
        # the preprocess, block-relative query rows and the causal mask in PTX, before -> after:
        # 64 (TMA): full 327 -> 266, causal 369 -> 301; 128: full 291 -> 261 (555 -> 498 per MFLOP),
        # causal 329 -> 291 (628 -> 555), local 369 -> 341.
        # Causal, the mask behind a uniform branch (only query blocks crossing the diagonal), the loop's
        # two paths (diagonal / off-diagonal, against non-causal): 128: 291 -> 286 / 253 (261); 64: 301
        # -> 303 / 269 (266); 32: 476 -> 478 / 412 (409); 16: 473 -> 475 / 409 (406). Registers: 128
        # causal 244-254 -> 245-255, clean; two loops instead (masked, then unmasked) spilled 32-64 bytes.
        64: AttnConfig(32, 128, 8, 2),
        # 2 stages spilled 8 bytes packed with the local mask (64-bit rows, flat grid; triton 3.6);
        # 1 stage compiled at 226-235 registers, clean, in the local and causal masks.
        128: AttnConfig(32, 128, 8, 1, tma=False),
        # Split outputs: dv, then dk, each a launch of its own holding one accumulator (64 registers a
        # thread at 8 warps, against 128 for both), the scores computed in both: 5 GEMMs against 4
        # (1.25x; the column split it replaces recomputed 1.5x). 64 queries x 128 keys at 8 warps, a
        # warpgroup per 64 keys: no GEMM split over N. bench.sass_loops (triton 3.6, fp16), per
        # iteration, dv / dk: full 356 / 486 instructions, causal 413 / 539, local 531 / 638; HGMMA 16x
        # 64x64x16 + 4x 64x256x16 / 32x 64x64x16 + 4x 64x256x16 (smallest N 64); 340 / 309 per MFLOP,
        # the pair 321 (401 per MFLOP of the fused pass's work). Before: 16x64, 2 column splits, 437
        # instructions, 64x 64x8x16 + 2x 64x64x16 (N 8, 1,334 per MFLOP issued, 2,001 of the work).
        # Compile report: 230-247 registers (dv), 255 (dk), no spill, 128 / 192 KiB shared, both dtypes,
        # head dims 256 and 192, every mask, float32 partials; q and dO by TMA, K and V by pointers (see
        # _attn_bwd_dkdv_kernel). Not taken (spill bytes): 2 stages 8-312 (dk 257 KiB), 64x64 at 4 warps
        # 8 (dk, window), pointer q and dO 104-184 at 64x128, both outputs in one launch (a program
        # each, both paths in one kernel; built before delta went into dk's accumulator and the per-key
        # window bound) 16 at 64x128, 176-248 at 64x64; earlier, fused: 64x64 456-656
        # (N 32), 128x64 888-1,320, scores by query 128x64 264-320. Pointer loads (unaligned inputs)
        # keep the fused column split: with q and dO by pointers no N >= 64 tile was clean. Checked on
        # triton 3.6 only. Packed batches take this tile by TMA too (descriptors built per sequence on
        # the device; before, the pointer tile: full 436 instructions, 64x 64x8x16 + 2x 64x64x16, 1,331
        # per MFLOP issued): dv / dk full 290 / 446 (277 / 284 per MFLOP), causal 369 / 598 (352 / 380;
        # the dk launch as the window (-1, 0): causal spilled 8 bytes), local 470 / 599 (448 / 381),
        # the same HGMMA; 231-245 registers (dv), 255 (dk), no spill, 128 / 192 KiB shared.
        256: AttnConfig(64, 128, 8, 1, split_outputs=True, pointer=AttnConfig(16, 64, 8, 2, column_splits=2)),
    },
    **_TABLES["BWD_DKDV_CONFIGS"],
}
BWD_DQ_CONFIGS = {
    # At 256 the TMA variant compiles clean on triton 3.6 (250 registers) but spilled 544 bytes on 3.9.
    "sm90": {
        16: AttnConfig(128, 64, 8, 3),
        32: AttnConfig(128, 64, 8, 3),
        64: AttnConfig(128, 64, 8, 3),
        128: AttnConfig(128, 64, 8, 2),
        256: AttnConfig(64, 32, 8, 2, tma=False),
    },
    **_TABLES["BWD_DQ_CONFIGS"],
}
# Decode (flash_attention_with_kvcache): BLOCK_M query rows (a GQA group's heads x the new tokens)
# by BLOCK_N cached keys, pointer loads (the rows are gathered across heads), the same rule on every
# family; a tile of 16 rows (the smallest tl.dot) when the group's rows fit in it.
# At head dim 256 a 64-row tile spilled 96 bytes with the window (sm_80, sm_86, sm_90): 16 rows.
DECODE_CONFIGS = {
    arch: {
        block_d: AttnConfig(16, 32, 4, 2, tma=False)
        if block_d == 256
        else AttnConfig(64, 64, 4, 2, tma=False)
        for block_d in (16, 32, 64, 128, 256)
    }
    for arch in ("sm80", "sm86", "sm90", "sm100", "gfx942")
}
DECODE_REDUCE_NUM_WARPS = 8  # at 4 the head-dim-256 reduce spilled 8 bytes on sm_80
DECODE_REDUCE_BLOCK_S = 16  # splits the reduce loads at a time: up to 2 per SM, 264 on an H200
# Small, unequal tiles in the interpreter: quick there, and several blocks cross every boundary.
INTERPRETER_BLOCKS = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1, "pointer": None}
PREPROCESS_BLOCK_M = 64
# At 4 warps the 64 x 128 tiles of o and dO spilled 8-32 bytes on sm_100 (at 48-56 registers).
PREPROCESS_NUM_WARPS = 8


def head_dim_block(head_dim: int) -> int:
    """Head dims are padded to a power of two of at least 16, the smallest tl.dot reduction."""
    return max(16, triton.next_power_of_2(head_dim))


def attn_config(table: dict, head_dim: int, device: torch.device) -> AttnConfig:
    """The entry of table (FWD_CONFIGS, ...) for head_dim on device's GPU family."""
    cfg = table[runtime.arch(device).name][head_dim_block(head_dim)]
    return dataclasses.replace(cfg, **INTERPRETER_BLOCKS) if runtime.INTERPRET else cfg


def dkdv_outputs(cfg: AttnConfig) -> tuple[str, ...]:
    """The dk/dv pass's launches under cfg, by their OUTPUT: one for both, or one each."""
    return ("dv", "dk") if cfg.split_outputs else ("dkdv",)
