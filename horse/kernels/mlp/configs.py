"""The GEMM tables and the rules that pick from them: an entry per GPU family, kernel and shape class
(GEMM_CONFIGS), the interpreter's small tiles, the split-K rule for decode-sized batches, and the
elementwise backward's one config.
"""

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import NamedTuple

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
    # its operands and outputs take TMA (launch._persistent); the tiled kernel otherwise.
    persistent: bool = False


class Epilogue(NamedTuple):
    """What a kernel's epilogue computes: the one constexpr group (EPILOGUE) every MLP kernel takes."""

    activation: str  # act: one of horse.kernels.mlp.ACTIVATIONS
    gated: bool  # act(gate) ⊙ up: a second accumulator in the forward, the product rule in the backward
    has_bias: bool  # the forward adds b; the backward sums db's partials
    store: bool  # the forward stores pre (and up) for the backward; the dh GEMM stores h for dW_out
    split: int = 1  # the column subtiles it runs on, one after another (GemmConfig.epilogue_split)
    # An NVIDIA GPU, not the interpreter (runtime.inline_ptx): gelu_tanh by tanh.approx in the
    # forward, the dh GEMM's L2 prefetch of its saved tiles.
    inline_ptx: bool = False


# The GEMM tables, data beside this file: GEMM_CONFIGS[family][kernel][shape class], family as
# runtime.arch names it, shape class as shape_class does. TUNING.md says why each entry is what it is.
CONFIG_FILE = pathlib.Path(__file__).with_name("configs.json")
GEMM_CONFIGS = runtime.load_configs(CONFIG_FILE, GemmConfig)["GEMM_CONFIGS"]

# Small, unequal tiles in the interpreter: quick there, several tiles cross every edge, and the
# epilogue runs split, so the CPU tests run the subtile code too.
INTERPRETER_GEMM_BLOCKS = {
    "block_m": 32,
    "block_n": 64,
    "block_k": 32,
    "group_m": 2,
    "num_warps": 4,
    "num_stages": 1,
    "epilogue_split": 4,
}


# From this many outputs on, the large class's 128 x 256 tiles fill about two waves of an H200's
# 132 SMs (256 tiles); below, smaller tiles keep more SMs busy.
LARGE_OUTPUTS = 2**23
SMALL_ROWS = 64

# The split-K epilogue (elementwise, in the small GEMM entry's tiles) on 8 warps: on 4, sm100's
# fwd tile spilled (TUNING.md).
SPLIT_K_EPILOGUE_WARPS = 8


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of the elementwise backward: (block_m, block_n) tiles, and its warps."""

    block_m: int
    block_n: int
    num_warps: int


# 8 warps: on 4 (32 values a thread) it spilled on triton 3.9 (TUNING.md).
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
