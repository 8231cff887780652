"""The grouped GEMMs' table (an entry per GPU family and kernel, data in configs.json), the
interpreter's small tiles, the rules of the sort and the combine, and the epilogue's constexpr group.
"""

import pathlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from horse.kernels import runtime

# The Triton path's dtypes: every table entry is built for both.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of a grouped GEMM: a (block_m, block_n) output tile (for the weight gradients
    block_m and block_n tile the weight, block_k steps over the expert's rows), and its pipeline."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False  # the down and dx GEMMs' tiles by TMA where the GPU and strides allow (TUNING.md)


class Epilogue(NamedTuple):
    """What the gated kernels' epilogues compute: the constexpr group EPILOGUE."""

    activation: str  # "silu" or "gelu_tanh"
    limit: float | None  # gpt-oss's clamped SwiGLU (activation "silu") at this limit; None: plain
    interleaved: bool  # gate_up_proj's gate and up rows alternate (gpt-oss); else gate rows, then up
    has_bias: bool  # the forward adds gate_up_bias
    store: bool  # the forward stores gate and up for the backward


# GEMM_CONFIGS[family][kernel]: gate_up (the forward's gated GEMM), down (the down projection and the
# backward's dx rows), dh (the backward's dh GEMM with act' in its epilogue), weight_grad (dW by
# expert, a program a weight tile). TUNING.md says why each entry is what it is.
CONFIG_FILE = pathlib.Path(__file__).with_name("configs.json")
GEMM_CONFIGS = runtime.load_configs(CONFIG_FILE, GemmConfig)["GEMM_CONFIGS"]

# Small tiles in the interpreter: quick there, and several tiles cross every edge at the tests' sizes.
# TMA where it is allowed, so that the tests run that path too (the interpreter emulates sm_90's TMA).
INTERPRETER_GEMM_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1, tma=True)


def gemm_config(kernel: str, device: torch.device) -> GemmConfig:
    """The GEMM_CONFIGS entry of kernel on device's GPU family (the interpreter's small tiles there)."""
    return INTERPRETER_GEMM_CONFIG if runtime.INTERPRET else GEMM_CONFIGS[runtime.arch(device).name][kernel]


# The sort's programs hold a (BLOCK_PAIRS, experts) one-hot block in registers: at most this many
# elements. In the interpreter, blocks of 4 pairs, so that the tests' few pairs span several blocks.
SORT_ELEMENTS = 4096
INTERPRETER_SORT_PAIRS = 4
MAX_EXPERTS = 1024
SORT_WARPS = 4


def sort_blocks(experts: int) -> tuple[int, int]:
    """(BLOCK_PAIRS, BLOCK_EXPERTS) of the counting sort for this many experts (at most MAX_EXPERTS)."""
    block_experts = triton.next_power_of_2(max(experts, 1))
    block_pairs = INTERPRETER_SORT_PAIRS if runtime.INTERPRET else max(4, SORT_ELEMENTS // block_experts)
    return block_pairs, block_experts


COMBINE_BLOCK_N = 1024  # the combine's columns a program: one 16-byte load a thread on 4 warps (fp16)
COMBINE_WARPS = 4
