"""Readers of what Triton builds, each a function of text or bytes: the 32-bit stride products in a
kernel's TTIR, the registers and spills cuobjdump reports of a cubin, the tensor-core instructions
and wide loads in its SASS (nvdisasm's), and the same figures in an AMD kernel's assembly (amdgcn).
No GPU: the ``cuobjdump`` and ``nvdisasm`` in Triton's wheel read the cubins.
"""

import bisect
import itertools
import os
import re
import struct
import subprocess
import tempfile

import triton

NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CUOBJDUMP, NVDISASM = os.path.join(NVIDIA_BIN, "cuobjdump"), os.path.join(NVIDIA_BIN, "nvdisasm")
INSTRUCTION_BYTES = 16  # every SASS instruction since sm_70

_TTIR_OP = re.compile(r"^\s*(%[\w.#]+) = ([\w.]+) (.*?)(?: loc\(.*)?$")
# Ops whose result holds its operand's values, reshaped: a stride stays a stride through them.
_TTIR_VALUE_PRESERVING = {"tt.splat", "tt.broadcast", "tt.expand_dims"}


def narrow_stride_products(ttir: str) -> tuple[str, ...]:
    """The 32-bit multiplications by a stride argument in a kernel's TTIR, as "%result = ..." lines:
    an offset ``index * stride`` in 32 bits wraps past 2**31 elements, into silent corruption or an
    illegal address. A kernel multiplies its strides by 64-bit indices (``offs.to(tl.int64)``)."""
    strides = set(re.findall(r"(%stride\w*|%\w*_strides(?:_\d+)?): i32", ttir))
    found = []
    for line in ttir.splitlines():
        match = _TTIR_OP.match(line)
        if not match:
            continue
        result, op, rest = match.groups()
        operands_text, _, result_type = rest.rpartition(" : ")
        operands = set(re.findall(r"%[\w.#]+", operands_text))
        if op in _TTIR_VALUE_PRESERVING and operands & strides:
            strides.add(result)
        elif op == "arith.muli" and operands & strides and re.search(r"\bi32\b|xi32>", result_type):
            found.append(f"{result} = {op} {rest}")
    return tuple(found)


def parse_resource_usage(text: str) -> tuple[int, int]:
    """(registers, spill bytes) from ``cuobjdump --dump-resource-usage``; spills = STACK + LOCAL."""
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", text)
    if match is None:
        raise ValueError(f"no resource usage line in cuobjdump output:\n{text}")
    registers, stack, local = (int(g) for g in match.groups())
    return registers, stack + local


def count_sass(text: str) -> tuple[int, int, int]:
    """(tensor-core instructions, 128-bit global loads, TMA loads) in SASS (nvdisasm's or cuobjdump's):
    HMMA (mma.sync, sm_80+), HGMMA (wgmma, sm_90), UTCHMMA/UTCIMMA/UTCQMMA (tcgen05, sm_100)."""
    tensor_core = len(re.findall(r"\b(?:H[G]?MMA|UTC[HIQ]MMA)\b", text))
    loads_128 = len(re.findall(r"\bLDG\.E[.\w]*\.128\b", text))
    tma_loads = len(re.findall(r"\bUTMALDG\b", text))
    return tensor_core, loads_128, tma_loads


def parse_amdgcn(text: str) -> tuple[int, int, int, int]:
    """(registers, spill bytes, MFMA instructions, 128-bit global loads) of an AMD kernel's assembly:
    its registers are VGPRs and AGPRs together (.vgpr_count), its spills the scratch memory a lane
    needs (.private_segment_fixed_size). SGPRs that spill go to VGPR lanes first, so a kernel
    without scratch has no spill to memory."""
    fields = {}
    for key in ("vgpr_count", "private_segment_fixed_size"):
        match = re.search(rf"^\s*\.{key}:\s+(\d+)", text, re.M)
        if match is None:
            raise ValueError(f"no .{key} in the kernel's amdgcn metadata")
        fields[key] = int(match.group(1))
    mfma = len(re.findall(r"^\s*v_mfma_", text, re.M))
    loads_128 = len(re.findall(r"^\s*(?:global|buffer)_load_dwordx4\b", text, re.M))
    return fields["vgpr_count"], fields["private_segment_fixed_size"], mfma, loads_128


def machine_code(cubin: bytes) -> bytes:
    """The instructions of an ELF64 cubin: its ``.text.*`` sections (one a kernel), end to end."""
    (section_headers,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, section_headers + i * entry_size) for i in range(count)]
    names = headers[names_index][4]

    def name(header) -> bytes:
        start = names + header[0]
        return cubin[start : cubin.index(b"\0", start)]

    return b"".join(cubin[h[4] : h[4] + h[5]] for h in headers if name(h).startswith(b".text."))


def disassemble(codes: list[bytes], target: str) -> list[str]:
    """The SASS of each of codes (the machine code of kernels for one target, e.g. "90a"), from one
    nvdisasm call on them end to end: its start-up (about 0.4 s) costs more than most kernels'
    disassembly. An instruction is its code's by the offset nvdisasm prints before it."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as raw:
        raw.write(b"".join(codes))
        raw.flush()
        text = subprocess.run(
            [NVDISASM, "--binary", f"SM{target}", raw.name], capture_output=True, text=True, check=True
        ).stdout
    ends = list(itertools.accumulate(len(code) for code in codes))
    lines: list[list[str]] = [[] for _ in codes]
    for line in text.splitlines():
        offset = re.match(r"\s*/\*([0-9a-f]+)\*/", line)
        if offset is not None:
            lines[bisect.bisect_right(ends, int(offset.group(1), 16))].append(line)
    printed, expected = [len(kernel) for kernel in lines], [len(code) // INSTRUCTION_BYTES for code in codes]
    if printed != expected:  # the offsets did not parse as this expects: no count would be right
        raise RuntimeError(f"nvdisasm --binary SM{target}: {printed} instructions per kernel, not {expected}")
    return ["\n".join(kernel) for kernel in lines]
