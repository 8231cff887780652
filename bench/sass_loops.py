"""Per-iteration figures of the main loops of an attention pass in its sm_90 SASS (ANCHORS.md's anchors).

    python -m bench.sass_loops attn_fwd --head-dim 128 [--mask full|causal|local] [--pointer]

A loop is a backward branch and the instructions from its target to it, without the kernel's EXIT:
the out-of-line mbarrier waits sit after the EXIT and branch back into the loop, which excludes
them; a main loop is an innermost one holding tensor-core
instructions (HGMMA). For each main loop, in code order: instructions per iteration (nop padding
included, as the anchors count), HGMMA, FMUL, FFMA, MUFU, and instructions per MFLOP of tensor work
(instructions x warps / MFLOP, the wgmma shapes giving the FLOPs). The config is the entry of the
pass's sm90 table (``horse.kernels.attention.configs``) at the head dim, compiled as
``bench.compile_report`` compiles it (fp16, padded batch; with --pointer, the entry's pointer tile; a
dk/dv entry with split outputs, each of its launches); needs no GPU.
"""

import argparse
import collections
import math
import re
from dataclasses import dataclass

import torch

from bench.compile_report import compiler, disassembly
from bench.compile_report.attention import (
    ATTENTION_MASKS,
    ATTENTION_PASSES,
    ATTENTION_TABLES,
    attention_pass_configs,
)
from bench.compile_report.config import KernelConfig

INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
WARPGROUP = 4  # warps that issue one wgmma together


@dataclass(frozen=True)
class Loop:
    start: int  # byte offsets of the first instruction and of the backward branch
    end: int
    instructions: list[str]

    def count(self, opcode: str) -> int:
        """Instructions whose opcode (predicate stripped) is opcode or opcode.<modifiers>."""
        pattern = re.compile(rf"^(?:@!?U?P\w+\s+)?{re.escape(opcode)}(?:\.|\s|$)")
        return sum(bool(pattern.match(i)) for i in self.instructions)

    def hgmma_shapes(self) -> list[str]:
        """The shape of each HGMMA of one iteration, as "64x256x16"."""
        return [re.search(r"HGMMA\.(\d+x\d+x\d+)", i).group(1) for i in self.instructions if "HGMMA" in i]

    def wgmma_shapes(self) -> str:
        """The HGMMA shapes of one iteration with their counts, as "8x 64x64x16, 4x 64x256x16"."""
        return ", ".join(f"{n}x {shape}" for shape, n in collections.Counter(self.hgmma_shapes()).items())

    def tensor_flops(self, num_warps: int) -> int:
        """FLOPs of the wgmma in one iteration: each HGMMA.MxNxK is issued by one warpgroup."""
        flops = sum(2 * math.prod(map(int, shape.split("x"))) for shape in self.hgmma_shapes())
        return flops * num_warps // WARPGROUP


def parse(sass: str) -> list[tuple[int, str]]:
    """(byte offset, instruction text) of each SASS line of nvdisasm's output."""
    return [(int(m.group(1), 16), m.group(2)) for m in INSTRUCTION.finditer(sass)]


def main_loops(sass: str) -> list[Loop]:
    """The innermost loops holding HGMMA, in code order."""
    code = parse(sass)
    at = {offset: i for i, (offset, _) in enumerate(code)}
    loops = []
    for i, (offset, text) in enumerate(code):
        branch = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if branch is None or int(branch.group(1), 16) >= offset or int(branch.group(1), 16) not in at:
            continue
        body = [t for _, t in code[at[int(branch.group(1), 16)] : i + 1]]
        if any("HGMMA" in t for t in body) and not any(t.split()[-1] == "EXIT" for t in body):
            loops.append(Loop(int(branch.group(1), 16), offset, body))
    return [
        loop
        for loop in loops
        if not any(o is not loop and loop.start <= o.start and o.end <= loop.end for o in loops)
    ]


def describe(loops: list[Loop], num_warps: int) -> str:
    rows = ["loop (bytes)        instr  HGMMA  FMUL  FFMA  MUFU  instr/MF  wgmma shapes"]
    for loop in loops:
        mflop = loop.tensor_flops(num_warps) / 1e6
        per_mf = len(loop.instructions) * num_warps / mflop
        rows.append(
            f"{loop.start:#07x}-{loop.end:#07x}  {len(loop.instructions):5d}  {loop.count('HGMMA'):5d}  "
            f"{loop.count('FMUL'):4d}  {loop.count('FFMA'):4d}  {loop.count('MUFU'):4d}  {per_mf:8.0f}  "
            f"{loop.wgmma_shapes()}"
        )
    return "\n".join(rows)


def sass_of(config: KernelConfig) -> str:
    kernel = compiler.compile_kernel(config)
    target = re.search(r"^\.target sm_(\w+)", kernel.asm["ptx"], re.M).group(1)
    return disassembly.disassemble([disassembly.machine_code(kernel.asm["cubin"])], target)[0]


def main(argv: list[str] | None = None) -> int:
    from horse.kernels.attention import configs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=sorted(ATTENTION_PASSES))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mask", choices=sorted(ATTENTION_MASKS), default="full")
    parser.add_argument("--pointer", action="store_true", help="pointer loads even where the entry takes TMA")
    args = parser.parse_args(argv)
    table = next(t for t, (name, _) in ATTENTION_TABLES.items() if name == args.kernel)
    entry = getattr(configs, table)["sm90"][configs.head_dim_block(args.head_dim)]
    tma = entry.tma and not args.pointer
    cfg = entry.loads(tma)
    # A dk/dv entry with split outputs: each of its launches.
    for config in attention_pass_configs(args.kernel, entry, args.head_dim, torch.float16, args.mask, tma):
        output = config.constexprs.get("OUTPUT", "dkdv")
        launch = "" if output == "dkdv" else f" {output}"
        print(f"{args.kernel}{launch} d={args.head_dim} {args.mask} {'tma' if tma else 'pointer'} {cfg}")
        print(describe(main_loops(sass_of(config)), cfg.num_warps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
