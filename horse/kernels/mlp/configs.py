"""The GEMM tables and the rules that pick from them: an entry per GPU family, kernel and shape class
(GEMM_CONFIGS), the interpreter's small tiles, the split-K rule for decode-sized batches, and the
elementwise backward's one config.
"""

import dataclasses
from dataclasses import dataclass

import torch
import triton

from horse.kernels import runtime

# The Triton path's dtypes: every table entry is built and chosen for both.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of a GEMM kernel: a (block_m, block_n) output tile, its K step, group and pipeline."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    epilogue_split: int = 1  # the epilogue runs on 1, 2 or 4 column subtiles, one after another
    tma: bool = True  # x, weight and dy tiles by TMA (tensor descriptors) where the GPU and strides allow
    # A forward's persistent kernel (one program an SM walking the tiles, epilogue stored by TMA) where
    # its operands and outputs take TMA (:func:`_persistent`); the tiled kernel otherwise.
    persistent: bool = False


# Per GPU family (runtime.arch), kernel and shape class (see shape_class). float16 and bfloat16 share
# every entry: the same element size, tensor-core instruction shapes and shared-memory footprint;
# the compile report builds each entry in both dtypes for its family's target, with pointer loads
# and on sm_90+ where tma is set with TMA loads, and every one lowers to tensor-core instructions
# with no spills, for every activation (python -m bench.compile_report --filter mlp: its output is
# the record of how each builds). The sm_90 entries, here, are chosen for speed. The other families'
# (horse/kernels/configs/mlp.json) are the first candidates, from sm_90's tile and the deepest pipeline
# down, that compile clean there on triton 3.6 and 3.9 (python -m bench.tune mlp --compile-only
# --arch FAMILY --start-from sm90); none is measured yet (python -m bench.tune mlp on such a GPU
# refines them).
#
# sm_90: TMA took fewer registers in the forwards (170 against 223 in the large gelu_tanh one, 174
# against 242 in the medium gated one), about as many in the backwards, and 24-64 bytes more
# shared memory (its barriers); which is faster is for the bench to measure ("ours" against
# "ours-pointer"). 8 warps are two warpgroups, each owning a 64-row half of the tile. The gated
# forward holds two accumulators, so its tiles are half as wide. The epilogue split keeps the
# activation's temporaries within the registers the accumulator leaves: unsplit, a 128 x 256
# forward with gelu spilled 224 bytes and the backward 2136, a 128 x 128 gated backward 1000.
# gelu_tanh by tanh.approx in the forward epilogues (issue 25; sm_90 SASS, fp16, TMA, before ->
# after): MUFU an element of the tile 2 (EX2 + RCP) -> 1 (TANH) in fwd and gated_fwd, every class;
# kernel instructions fwd large 3312 -> 2288, medium 1888 -> 1368, small 1144 -> 888, gated_fwd
# 2088 -> 1568, 2120 -> 1608, 1336 -> 1080; main loop per K step unchanged (87, 83, 81; 122, 123,
# 120); registers (pointer / TMA) fwd large 220/169 -> 190/167, medium 136/104 -> 142/104, small
# 72/58 -> 72/58, gated large 190/160 -> 184/160, medium 242/168 -> 204/172, small 128/96 ->
# 122/96; no spills before or after.
# Split-K at decode sizes (issue 25; the small entries of fwd and gated_fwd, sm_90, fp16, TMA):
# programs for GPT-2 124M's up projection at M <= 64 48 -> 144 (3 splits, then a 48-program
# epilogue pass); the split variant's main loop 82 instructions a K step (81 unsplit; gated 120
# both), registers fwd 58 (as unsplit), gated 108 (96 unsplit), no spills; the epilogue kernel
# (SPLIT_K_EPILOGUE_WARPS) 48 registers (gated 58-64), no spills.
# The gated backward writes [dgate | dup] into one buffer (dW_gate and dW_up: 2 cuBLAS GEMMs ->
# 1 of 2N rows): gated_dh_bwd registers (pointer / TMA) large 128/132 -> 136/134, medium
# 128/126 -> 135/136, small 78/76 -> 88/87; dh_bwd within 3 of before; no spills.
# Persistent forwards (issue 25; sm_90 SASS, fp16, gelu_tanh, tiled TMA kernel -> persistent):
# programs on an H200's 132 SMs, GPT-2 at M = 8192 tokens: fwd large (128 x 256) 124M (N = 3072) 768
# tiles -> 132 programs of 5-6 tiles, 350M (N = 4096) 1024 -> 132 of 7-8; gated large (128 x 128)
# at the same shapes 1536 / 2048 -> 132 of 11-12 / 15-16; one program resident an SM before and
# after. TMA stores (UTMASTG) in the epilogue 0 -> one per output subtile (fwd large 8: y and pre
# in 4 quarters; medium 4; gated large 12, medium 6), each copy twice in the SASS (the flattened
# loop's pipelined and remainder versions); plain STG 32/16/24/24 -> 0. wgmma shapes unchanged
# (4x 64x256x16, 4x 64x128x16, 8x 64x128x16 a K step). The flattened loop (tile and K loops as one,
# the epilogue under a branch) takes per K step fwd large 87 -> 166 instructions, medium 83 -> 168,
# gated large 122 -> 216, medium 123 -> 217 (the next tile's coordinates and predicates ride
# along; unflattened the K loop was 89, 85, 127, 130, with the next tile's loads only after the
# epilogue). Registers 167 -> 186, 104 -> 119, 160 -> 176, 172 -> 166; shared memory (KiB) 144 ->
# 160, 128 -> 144, 192 -> 200, 160 -> 168 (the epilogue's staging buffer); no spills. The medium
# fwd entry's epilogue is split in two for its subtiled stores: tiled kernel registers (pointer /
# TMA) 142/104 -> 116/101. Which kernel is faster is for bench.mlp on an H200 to say.
# dh backward (issue 25): loading the first subtile's saved pre (and up) before the K loop put its
# LDG.E.128 ahead of the HGMMA loop and the last wgmma wait in the sm_90 SASS (after it before),
# but Triton's layout pass then computed that subtile's act twice (see _dh_act_bwd_kernel), and the
# large entries spilled 56-120 bytes on sm_90 (gelu, TMA and pointer), 8-104 on sm_80 and sm_86,
# 248 on gfx942. Not kept: the load stays after the loop.
GEMM_CONFIGS = {
    "sm90": {
        "fwd": {
            "large": GemmConfig(128, 256, 64, 8, 8, 3, epilogue_split=4, persistent=True),
            "medium": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=2, persistent=True),
            "small": GemmConfig(64, 64, 64, 8, 4, 4),
        },
        "gated_fwd": {
            "large": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=4, persistent=True),
            "medium": GemmConfig(64, 128, 64, 8, 4, 4, epilogue_split=2, persistent=True),
            "small": GemmConfig(64, 64, 64, 8, 4, 4),
        },
        "dh_bwd": {
            "large": GemmConfig(128, 256, 64, 8, 8, 3, epilogue_split=4),
            "medium": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=2),
            "small": GemmConfig(64, 64, 64, 8, 4, 4, epilogue_split=2),
        },
        "gated_dh_bwd": {
            "large": GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=4),
            "medium": GemmConfig(64, 128, 64, 8, 4, 4, epilogue_split=4),
            "small": GemmConfig(64, 64, 64, 8, 4, 4, epilogue_split=2),
        },
    },
    **runtime.load_configs("mlp", GemmConfig)["GEMM_CONFIGS"],
}


# Small, unequal tiles in the interpreter: quick there, several tiles cross every edge, and the
# epilogue runs split, so the CPU tests run the subtile code too.
INTERPRETER_GEMM_BLOCKS = {"block_m": 32, "block_n": 64, "block_k": 32, "group_m": 2, "num_warps": 4,
                           "num_stages": 1, "epilogue_split": 4}  # fmt: skip


# From this many outputs on, the large class's 128 x 256 tiles fill about two waves of an H200's
# 132 SMs (256 tiles); below, smaller tiles keep more SMs busy.
LARGE_OUTPUTS = 2**23
SMALL_ROWS = 64

# The split-K epilogue (elementwise, in the small GEMM entry's tiles) on 8 warps: on 4, sm100's
# fwd tile spilled 8 bytes with gelu_tanh in bfloat16.
SPLIT_K_EPILOGUE_WARPS = 8


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of the elementwise backward: (block_m, block_n) tiles, and its warps."""

    block_m: int
    block_n: int
    num_warps: int


# 4 warps (32 values a thread) spilled 8 bytes with gelu in bfloat16 on triton 3.9.
ACT_BWD_CONFIG = RowConfig(16, 256, 8)


def shape_class(M: int, N: int) -> str:
    """The GEMM table's key for an (M, N) output: ``small`` (M <= 64: decoding, tiny batches),
    ``large`` (at least LARGE_OUTPUTS elements) or ``medium``."""
    if M <= SMALL_ROWS:
        return "small"
    return "large" if M * N >= LARGE_OUTPUTS else "medium"


def gemm_config(kernel: str, M: int, N: int, device: torch.device) -> GemmConfig:
    """The GEMM_CONFIGS entry of kernel for an (M, N) output on device's GPU family."""
    cfg = GEMM_CONFIGS[runtime.arch(device).name][kernel][shape_class(M, N)]
    return dataclasses.replace(cfg, **INTERPRETER_GEMM_BLOCKS) if runtime.INTERPRET else cfg


def output_tiles(cfg: GemmConfig, M: int, N: int) -> int:
    """How many (block_m, block_n) tiles cover an (M, N) output."""
    return triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)


def split_k(cfg: GemmConfig, M: int, N: int, K: int, device: torch.device) -> int:
    """How many programs share each output tile's K loop in a forward GEMM (1: no split).

    Decode-sized M (at most SMALL_ROWS rows) gives too few output tiles to occupy the GPU: GPT-2
    124M's up projection at M <= 64 is 48 tiles of 64 x 64 for 132 SMs. Its K loop is then split
    until at least one program runs per SM (runtime.num_sms: the device's count; a fixed stand-in
    in the interpreter), with at least one K step a split; the partial sums (float32, M x N a split)
    are added in split order by _split_k_epilogue_kernel, which runs the epilogue: repeatable, no
    atomics. GPT-2 124M at M = 1: 48 programs -> 144 (3 splits of 4 K steps each).
    """
    tiles = output_tiles(cfg, M, N)
    sms = runtime.num_sms(device)
    if M > SMALL_ROWS or tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, tiles), triton.cdiv(K, cfg.block_k)))
