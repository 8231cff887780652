"""The compile report: every kernel config the package can select, compiled for the GPU that selects it.

    python -m bench.compile_report [--arch sm80 sm86 sm90 sm100 gfx942] [--filter TEXT] [--jobs N]
    python -m bench.compile_report --arch sm86 --capability 120   # an RTX 5090's build of sm86's

Needs no GPU: Triton compiles for a ``GPUTarget("cuda", capability, 32)`` or ``GPUTarget("hip",
"gfx942", 64)`` on the CPU; the ``cuobjdump`` and ``nvdisasm`` in Triton's wheel read a cubin, and
an AMD kernel's assembly (amdgcn) says its own registers, scratch and instructions. Each GPU family
of ``horse.kernels.runtime.ARCHS`` (A100: sm_80; the 99-KiB Ampere, Ada and consumer Blackwell chips:
sm_86; H100/H200: sm_90; B200/GB300: sm_100; MI300X/MI325X: gfx942) has its own entry in every
config table, compiled for its target. One row per config: family, kernel, shape class, dtype,
block sizes, warps, stages, registers (AMD: VGPRs and AGPRs), spill bytes (stack + local; AMD:
scratch), shared memory (AMD: LDS), tensor-core instructions (HMMA on sm_80/86, HGMMA on sm_90,
UTCHMMA on sm_100, MFMA on gfx942), 128-bit global loads, TMA loads (UTMALDG) and the target
compiled for. Exits 1 if any config spills, needs more shared memory than a block may have on its
family or more than 1024 threads, or is a matmul kernel without tensor-core instructions. Each
kernel family adds its configs to ``CONFIG_FAMILIES``. ``--capability`` builds one NVIDIA family's
entries for another GPU that takes them (sm_89 or sm_120 for sm86).

Pointers, strides, N and K are compiled as multiples of 16, the specialisation Triton picks on a
GPU for aligned tensors with hidden sizes that are multiples of 16 (the usual case); a stride of 1
is a constexpr there, so configs name their unit strides in their constexprs (an element of a
strides tuple as ``"x_strides[1]"``). The report
must run without ``TRITON_INTERPRET=1``, which replaces the kernels by interpreted functions.
"""

import argparse
import bisect
import dataclasses
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import Executor, ProcessPoolExecutor
from unittest import mock

import torch
import triton
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from bench import report
from horse.kernels import layernorm, runtime
from horse.kernels.runtime import ARCHS

NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CUOBJDUMP, NVDISASM = os.path.join(NVIDIA_BIN, "cuobjdump"), os.path.join(NVIDIA_BIN, "nvdisasm")
MAX_CHUNK = 32  # configs a worker compiles before disassembling them together
INSTRUCTION_BYTES = 16  # every SASS instruction since sm_70
FLOAT_SCALARS = {"eps", "softmax_scale", "label_smoothing", "z_loss"}  # every other scalar: an i32
TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compilation: a kernel with its pointer dtypes, constexprs and launch options."""

    kernel: str
    shape_class: str
    dtype: torch.dtype
    fn_path: str  # "module.function" of the @triton.jit kernel; a path, since JIT functions don't pickle
    pointer_types: dict = dataclasses.field(repr=False)  # argument name -> triton type of the pointee
    constexprs: dict = dataclasses.field(repr=False)
    num_warps: int = 4
    num_stages: int = 1
    # argument name -> block shape of a TMA descriptor argument (its dtype from pointer_types)
    descriptors: dict = dataclasses.field(default_factory=dict, repr=False)
    arch: str = "sm90"  # the horse.kernels.runtime.ARCHS family whose table holds this config
    # tuple argument name -> its length: a kernel's strides tuples (``x.stride()``), i32 elements
    tuples: dict = dataclasses.field(default_factory=dict, repr=False)
    matmul: bool = False  # its tl.dot must lower to tensor-core instructions
    capability: int = 0  # the target compiled for; 0: its family's own (another with --capability)

    @property
    def fn(self):
        module, name = self.fn_path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    @property
    def target_capability(self) -> int:
        return self.capability or ARCHS[self.arch].capability

    @property
    def gpu_target(self) -> GPUTarget:
        """What Triton compiles this config for."""
        arch = ARCHS[self.arch]
        backend, target = ("hip", arch.hip_target) if arch.hip_target else ("cuda", self.target_capability)
        return GPUTarget(backend, target, arch.warp_size)

    @property
    def blocks(self) -> str:
        return "x".join(str(v) for k, v in self.constexprs.items() if k.startswith("BLOCK_"))

    @property
    def dtype_name(self) -> str:
        return TRITON_TYPES[self.dtype]


@dataclasses.dataclass(frozen=True)
class CompileResult:
    config: KernelConfig
    registers: int
    spill_bytes: int
    shared_bytes: int
    tensor_core_instructions: int
    global_loads_128: int
    tma_loads: int
    target: str = ""  # the machine code's: "sm_90a" (as the PTX names it), "gfx942"
    error: str = ""  # why Triton could not compile it ("" when it did; the counts are then 0)
    narrow_stride_products: tuple[str, ...] = ()  # see narrow_stride_products()


def _signature(cfg: KernelConfig) -> tuple[dict, dict]:
    signature, attrs = {}, {}
    for index, name in enumerate(cfg.fn.arg_names):
        if name in cfg.constexprs:
            signature[name] = "constexpr"
        elif name in cfg.descriptors:
            block_shape = ",".join(str(d) for d in cfg.descriptors[name])
            signature[name] = f"tensordesc<{cfg.pointer_types[name]}[{block_shape}]>"
        elif name in cfg.pointer_types:
            signature[name] = "*" + cfg.pointer_types[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in cfg.tuples:
            elements = []
            for i in range(cfg.tuples[name]):
                elements.append("constexpr" if f"{name}[{i}]" in cfg.constexprs else "i32")
                if elements[-1] == "i32":
                    attrs[(index, i)] = [["tt.divisibility", 16]]
            signature[name] = tuple(elements)
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in ("N", "K") or name.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _constexprs(cfg: KernelConfig) -> dict:
    """cfg.constexprs as ASTSource takes them: a tuple element ``"x_strides[1]"`` by its path."""
    constexprs = {}
    for key, value in cfg.constexprs.items():
        name, _, element = key.partition("[")
        constexprs[(cfg.fn.arg_names.index(name), int(element[:-1])) if element else key] = value
    return constexprs


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


def compile_kernel(cfg: KernelConfig):
    """Triton's compiled kernel of cfg for its target: its asm has "ptx" and "cubin" (NVIDIA), or
    "amdgcn" and "hsaco" (AMD)."""
    signature, attrs = _signature(cfg)
    source = ASTSource(cfg.fn, signature, constexprs=_constexprs(cfg), attrs=attrs)
    return triton.compile(source, target=cfg.gpu_target, options=_options(cfg))


def _options(cfg: KernelConfig) -> dict:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **runtime.COMPILE_OPTIONS}


def compile_configs(configs: list[KernelConfig]) -> list[CompileResult]:
    """Compile configs, then read each cubin's registers and spills (cuobjdump) and the SASS of all
    that share a target in one disassembly; an AMD kernel's from its assembly. A config Triton
    fails to compile (a compiler crash on some Triton version) is a result with its error, so the
    report goes on and names it."""
    results: list[CompileResult | None] = [None] * len(configs)
    nvidia = []  # (index in configs, compiled kernel)
    ttirs = {}  # index in configs -> its kernel's TTIR
    for i, cfg in enumerate(configs):
        try:
            kernel = compile_kernel(cfg)
        except Exception as error:
            results[i] = CompileResult(cfg, 0, 0, 0, 0, 0, 0, error=" ".join(str(error).split())[:200])
            continue
        ttirs[i] = kernel.asm["ttir"]
        if ARCHS[cfg.arch].hip_target:
            results[i] = _read_amd(cfg, kernel)
        else:
            nvidia.append((i, kernel))
    read = _read_nvidia([configs[i] for i, _ in nvidia], [kernel for _, kernel in nvidia])
    for (i, _), result in zip(nvidia, read, strict=True):
        results[i] = result
    for i, ttir in ttirs.items():
        results[i] = dataclasses.replace(results[i], narrow_stride_products=narrow_stride_products(ttir))
    return results


def _read_amd(cfg: KernelConfig, kernel) -> CompileResult:
    registers, spills, mfma, loads_128 = parse_amdgcn(kernel.asm["amdgcn"])
    shared = kernel.metadata.shared
    return CompileResult(cfg, registers, spills, shared, mfma, loads_128, 0, kernel.metadata.arch)


def _read_nvidia(configs: list[KernelConfig], compiled: list) -> list[CompileResult]:
    usage = []
    for kernel in compiled:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage.append(parse_resource_usage(subprocess.run(
                [CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
            ).stdout))  # fmt: skip
    targets = [re.search(r"^\.target sm_(\w+)", kernel.asm["ptx"], re.M).group(1) for kernel in compiled]
    sass = [""] * len(compiled)
    for target in set(targets):
        indices = [i for i, t in enumerate(targets) if t == target]
        codes = [machine_code(compiled[i].asm["cubin"]) for i in indices]
        for i, text in zip(indices, disassemble(codes, target), strict=True):
            sass[i] = text
    return [
        CompileResult(cfg, *usage[i], compiled[i].metadata.shared, *count_sass(sass[i]), f"sm_{targets[i]}")
        for i, cfg in enumerate(configs)
    ]


def compile_in_pool(pool: Executor, configs: list[KernelConfig], workers: int) -> list[CompileResult]:
    """compile_configs over a pool of workers, in chunks of up to MAX_CHUNK configs (each chunk one
    disassembly per target), the results in the order of configs."""
    chunk = max(1, min(MAX_CHUNK, math.ceil(len(configs) / workers)))
    chunks = [configs[i : i + chunk] for i in range(0, len(configs), chunk)]
    return [result for results in pool.map(compile_configs, chunks) for result in results]


# ----------------------------------------------------------------------------------------------
# The rows already proven: bench/compile_report_cache.json
# ----------------------------------------------------------------------------------------------

CACHE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_report_cache.json")
VERIFY_AT_LEAST = 60  # reused rows compiled afresh each run to check the file against the compiler
# The code that turns a config into its row: a change to any of it invalidates every cached row.
ROW_READERS = (_signature, _constexprs, _options, compile_kernel, compile_configs, _read_amd, _read_nvidia,
               parse_resource_usage, count_sass, parse_amdgcn, machine_code, disassemble)  # fmt: skip
ROW_FIELDS = ("registers", "spill_bytes", "shared_bytes", "tensor_core_instructions", "global_loads_128",
              "tma_loads", "target", "narrow_stride_products")  # fmt: skip


@functools.cache
def reader_hash() -> str:
    code = [inspect.getsource(f) for f in ROW_READERS]
    code.append(repr((ROW_FIELDS, [f.name for f in dataclasses.fields(CompileResult)], INSTRUCTION_BYTES,
                      sorted(FLOAT_SCALARS))))  # fmt: skip
    return hashlib.sha256("\n".join(code).encode()).hexdigest()


@functools.cache
def toolchain(target: GPUTarget) -> str:
    """Triton's version and its backend's own hash for target: on NVIDIA the version of the ptxas
    that assembles it (Triton's wheel brings it; TRITON_PTXAS_PATH may replace it)."""
    return f"triton {triton.__version__} {make_backend(target).hash()}"


@functools.cache
def source_key(fn) -> str:
    """Triton's cache key of the jit function fn (its source, the source of the jit functions it
    calls, the constexpr globals it reads) with every jit function's first line taken as line 0.
    Where a function sits in its file decides only the line numbers of its debug information, never
    its registers, spills or instructions: a kernel added above others leaves their rows standing."""
    jit_functions = {
        id(f): f
        for module in list(sys.modules.values())
        for f in list(getattr(module, "__dict__", {}).values())
        if issubclass(type(f), triton.runtime.jit.JITFunction)  # type(): no deprecated attribute warns
    }
    jit_functions[id(fn)] = fn
    saved = [(f, f.starting_line_number, f.hash) for f in jit_functions.values()]
    try:
        for f, _, _ in saved:
            f.starting_line_number, f.hash = 0, None
        return fn.cache_key
    finally:
        for f, line, key in saved:
            f.starting_line_number, f.hash = line, key


def row_key(cfg: KernelConfig) -> str:
    """What decides cfg's compiled code and its row, hashed: the kernel's source key (its source,
    the source of the jit functions it calls, the constexpr globals it reads), the signature with
    its alignment attributes, the constexprs, the compile options, the target and its toolchain,
    the environment variables Triton's own cache keys on, and the code that reads a row from the
    compiled kernel (reader_hash)."""
    signature, attrs = _signature(cfg)
    target = cfg.gpu_target
    environment = sorted(get_cache_invalidating_env_vars().items())
    options = sorted(_options(cfg).items())
    code = (source_key(cfg.fn), signature, attrs, sorted(cfg.constexprs.items()), options)
    parts = (*code, repr(target), toolchain(target), environment, reader_hash())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def row_values(r: CompileResult) -> list:
    """r's fields as JSON holds them (tuples as lists)."""
    values = (getattr(r, name) for name in ROW_FIELDS)
    return [list(value) if isinstance(value, tuple) else value for value in values]


def cached_result(cfg: KernelConfig, row: list) -> CompileResult:
    """The CompileResult a cached row (:func:`row_values`) stands for."""
    fields = dict(zip(ROW_FIELDS, row, strict=True))
    return CompileResult(cfg, **fields | {"narrow_stride_products": tuple(fields["narrow_stride_products"])})


def load_cache(path: str) -> dict[str, dict]:
    """The cached entries by row key, each {"config": its description, "row": row_values}; {} when
    there is no file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["rows"]
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError) as error:
        raise SystemExit(f"{path} is not a compile report cache ({error!r}): --update rewrites it") from error


def save_cache(path: str, entries: dict[str, dict]) -> None:
    """One row a line, in the order of their descriptions, so that a kernel change reads as a diff."""
    ordered = sorted(entries.items(), key=lambda item: (item[1]["config"], item[0]))
    lines = [f"    {json.dumps(key)}: {json.dumps(entry)}" for key, entry in ordered]
    text = '{\n  "columns": ' + json.dumps(ROW_FIELDS) + ',\n  "rows": {\n' + ",\n".join(lines) + "\n  }\n}\n"
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), delete=False) as f:
        f.write(text)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)  # a report killed while writing leaves the old file whole


def verification_sample(configs: list[KernelConfig], count: int, seed: int) -> list[int]:
    """Indices of the reused configs to compile afresh: one of each (GPU family, kernel), then more
    at random up to count; none if count is 0. The same for the same configs and seed."""
    if count <= 0:
        return []
    rng = random.Random(seed)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault((c.arch, c.kernel), []).append(i)
    chosen = {rng.choice(members) for members in groups.values()}
    rest = [i for i in range(len(configs)) if i not in chosen]
    chosen.update(rng.sample(rest, min(len(rest), max(0, count - len(chosen)))))
    return sorted(chosen)


@dataclasses.dataclass
class Proof:
    """What a report run proved for its configs, and how."""

    results: list[CompileResult]  # one a config, fresh or cached
    built: int  # configs whose key was missing from the cache (or all, with --rebuild)
    reused: int  # cached rows taken for their key
    verified: int  # reused rows compiled afresh as well
    differ: list[str]  # a line per verified row whose fresh compile disagrees with the cache
    fresh: dict[str, CompileResult]  # key -> fresh result, for --update


def prove(configs: list[KernelConfig], keys: list[str], cached: dict, verify: int, seed: int, build) -> Proof:
    """Each config's row: taken from cached (entries by key, :func:`load_cache`) where its key is
    there, built with build (a list of configs -> their CompileResults) where it is not; and a
    sample of the reused rows (:func:`verification_sample`) built as well and compared."""
    reused = [i for i, key in enumerate(keys) if key in cached]
    checked = [reused[j] for j in verification_sample([configs[i] for i in reused], verify, seed)]
    to_build = [i for i, key in enumerate(keys) if key not in cached] + checked
    built = dict(zip(to_build, build([configs[i] for i in to_build]), strict=True))
    results, differ = [], []
    for i, (cfg, key) in enumerate(zip(configs, keys, strict=True)):
        result = built.get(i) or cached_result(cfg, cached[key]["row"])
        if i in checked and (result.error or row_values(result) != cached[key]["row"]):
            fresh, row = result.error or row_values(result), cached[key]["row"]
            differ.append(f"{describe(cfg)}: cached row {row} but a fresh compile gives {fresh}")
        results.append(result)
    fresh = {keys[i]: result for i, result in built.items()}
    return Proof(results, len(configs) - len(reused), len(reused), len(checked), differ, fresh)


def updated_entries(cached: dict, proof: Proof, current: set[str]) -> dict[str, dict]:
    """The cache after a run: the fresh rows (those without an error) over the cached ones, only
    keys in current (the other keys belong to code that no longer exists)."""
    entries = {key: entry for key, entry in cached.items() if key in current}
    for key, result in proof.fresh.items():
        if result.error:  # a crash may be the machine's: never cached, built again next run
            entries.pop(key, None)
        else:
            entries[key] = {"config": describe(result.config), "row": row_values(result)}
    return entries


# ----------------------------------------------------------------------------------------------
# Configs per kernel family
# ----------------------------------------------------------------------------------------------


def row_sizes(limit: int) -> list[int]:
    """The row sizes that reach every config of a row-wise rule: each power of two up to limit (the
    largest held in registers), and one past it."""
    return [2**p for p in range(limit.bit_length())] + [2 * limit]


# Each kernel module's pointer arguments, over all its kernels: in the input's dtype, in float32, and
# of other types. A padded attention batch passes a float32 placeholder for cu_seqlens (a packed one, i32).
KERNEL_POINTERS = {
    "layernorm": (("X", "RESIDUAL", "W", "B", "Y", "RESIDUAL_OUT", "DY", "DRESIDUAL_OUT", "DX"),
                  ("MEAN", "RSTD", "DW_PARTIAL", "DB_PARTIAL"), {}),
    "attention": (("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"), ("LSE", "LSE_LOG2", "DLSE", "DELTA",
                  "O_SPLIT", "LSE_SPLIT", "CU_SEQLENS_Q", "CU_SEQLENS_K"), {"SEQLENS_K": "i32"}),
    "mlp": (("X", "W", "B", "Y", "PRE", "WU", "UP", "DY", "DH", "DPRE", "DUP", "H"),
            ("DB_PARTIAL", "PARTIAL"), {}),
    "cross_entropy": (("LOGITS", "DLOGITS"), ("DLOSS", "LOSS", "LSE", "STATS", "SCALE"), {"TARGET": "i64"}),
}  # fmt: skip


def kernel_config(
    kernel: str, shape_class: str, dtype: torch.dtype, constexprs: dict, warps: int, arch: str,
    stages: int = 1, name: str = "", pointers: dict | None = None, **fields,
) -> KernelConfig:  # fmt: skip
    """The KernelConfig of horse.kernels.<kernel> (``"module._<name>_kernel"``), named <name> unless name is
    given. Its pointer types come from KERNEL_POINTERS (pointers: overrides); its strides tuples from
    the kernel's ``<tensor>_strides`` arguments, as the launchers pass them (an attention tile's
    (batch, seqlen, heads), lse's (batch, heads), an MLP matrix's ``x.stride()``); INLINE_PTX, where
    the kernel takes it, as runtime.inline_ptx sets it (on NVIDIA); with VARLEN (a packed batch), i32
    cu_seqlens and lse (heads, total_q) read by first row, as flash_attention_varlen passes them.
    fields: descriptors, matmul."""
    module, function = kernel.split(".")
    typed, fp32, others = KERNEL_POINTERS[module]
    types = dict.fromkeys(typed, TRITON_TYPES[dtype]) | dict.fromkeys(fp32, "fp32") | others
    arg_names = getattr(importlib.import_module(f"horse.kernels.{module}"), function).arg_names
    strides = [a for a in arg_names if a.endswith("_strides")]
    tuples = {a: 2 if module == "mlp" or a == "lse_strides" else 3 for a in strides}
    if "INLINE_PTX" in arg_names:
        constexprs = constexprs | {"INLINE_PTX": not ARCHS[arch].hip_target}
    if constexprs.get("VARLEN"):
        constexprs = constexprs | {"lse_strides[0]": 1}
        types |= dict.fromkeys(("CU_SEQLENS_Q", "CU_SEQLENS_K"), "i32")
    name = name or function[1:].removesuffix("_kernel")
    fn_path = f"horse.kernels.{kernel}"
    return KernelConfig(name, shape_class, dtype, fn_path, types | (pointers or {}), constexprs,
                        warps, stages, arch=arch, tuples=tuples, **fields)  # fmt: skip


# The norm kernels by direction: the constexpr that holds a row in registers, the longest row it holds,
# and the flags that keep the most values live (a residual; in the backward every gradient) with the
# kernel's other constexprs.
NORM_KERNELS = {
    "fwd": ("ROW_IN_REGISTERS", layernorm.FWD_MAX_ROW_IN_REGISTERS, {"HAS_RESIDUAL": True}),
    "bwd": ("ROW_IN_TILE", layernorm.BWD_MAX_ROW_IN_REGISTERS, {"HAS_DRESIDUAL": True, "HAS_DX": True,
            "HAS_DW": True, "SWEEP_BLOCK_N": layernorm.BWD_SWEEP_BLOCK_N}),
}  # fmt: skip


def norm_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every RowConfig that layernorm.row_config can return on arch, for LayerNorm (residual, weight,
    bias) and RMSNorm (residual, weight), the variants with the most live values, in every dtype."""
    configs = []
    for dtype, (norm, rms), (direction, (in_registers, limit, flags)) in itertools.product(
        TRITON_TYPES, (("layer_norm", False), ("rms_norm", True)), NORM_KERNELS.items()
    ):
        for n in row_sizes(limit):
            cfg = layernorm.row_config(n, direction == "bwd", dtype, arch)
            constexprs = {"IS_RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, **flags,
                          "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                          in_registers: cfg.row_in_registers}  # fmt: skip
            # The backward's row split into column blocks, each sweeping the others: its own name.
            split = "" if cfg.row_in_registers or direction == "fwd" else "_split_row"
            shape_class = f"N<={n}" if cfg.row_in_registers else f"N>{limit}"
            kernel = f"layernorm._norm_{direction}_kernel"
            configs.append(kernel_config(kernel, shape_class, dtype, constexprs, cfg.num_warps, arch.name,
                                         name=f"{norm}_{direction}{split}"))  # fmt: skip
    return configs


# Attention passes: kernel, the arguments tiled along the queries and along the keys (their TMA
# descriptors' block rows are BLOCK_M and BLOCK_N).
ATTENTION_PASSES = {
    "attn_fwd": ("_attn_fwd_kernel", ("Q", "OUT"), ("K", "V")),
    "attn_bwd_dkdv": ("_attn_bwd_dkdv_kernel", ("Q", "DO"), ("K", "V", "DK", "DV")),
    "attn_bwd_dq": ("_attn_bwd_dq_kernel", ("Q", "DO", "DQ"), ("K", "V")),
}
# Each attention table: the pass it configures and the batches it configures it for (padded, packed).
ATTENTION_TABLES = {
    "FWD_CONFIGS": ("attn_fwd", (False,)),
    "PACKED_FWD_CONFIGS": ("attn_fwd", (True,)),
    "BWD_DKDV_CONFIGS": ("attn_bwd_dkdv", (False, True)),
    "BWD_DQ_CONFIGS": ("attn_bwd_dq", (False, True)),
}


# The mask variants each pass compiles to: none, the causal diagonal, a sliding window.
ATTENTION_MASKS = {
    "full": {"CAUSAL": False, "LOCAL": False},
    "causal": {"CAUSAL": True, "LOCAL": False},
    "local": {"CAUSAL": False, "LOCAL": True},
}


def attention_pass_config(
    name: str, cfg, head_dim: int, dtype: torch.dtype, mask: str, tma: bool, packed: bool = False,
    arch: str = "sm90", head_split: bool = False, output: str = "dkdv",
):  # fmt: skip
    """The KernelConfig of attention pass ``name`` (a key of ATTENTION_PASSES) run with the
    horse.kernels.attention.AttnConfig ``cfg`` at ``head_dim``, mask a key of ATTENTION_MASKS, pointer or
    TMA loads, on a padded batch or a packed one (flash_attention_varlen: a program per tile; its TMA
    descriptors built on the device, one per sequence), for GPU family arch; with head_split, the dk/dv
    pass writing float32 partials (a GQA group's query heads split over programs); output, the dk/dv
    launch's gradients (horse.kernels.attention.dkdv_outputs: one alone reads K and V by pointers)."""
    from horse.kernels import attention

    kernel, by_query, by_key = ATTENTION_PASSES[name]
    block_d = attention.head_dim_block(head_dim)
    pointers = {"DK": "fp32", "DV": "fp32"} if head_split else {}
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  **ATTENTION_MASKS[mask], "TMA": tma, "VARLEN": packed}  # fmt: skip
    persistent = cfg.programs_per_sm > 0 and not packed
    if name == "attn_fwd":
        constexprs["PERSISTENT"] = persistent
    if name == "attn_bwd_dkdv":
        constexprs |= {"BLOCK_D_OUT": block_d // cfg.column_splits, "OUTPUT": output}
        by_key = by_key if output == "dkdv" else ("DK", "DV")
    # A packed batch's descriptors are built on the device, one per sequence.
    block_rows = dict.fromkeys(by_query, cfg.block_m) | dict.fromkeys(by_key, cfg.block_n)
    descriptors = {a: (1, rows, 1, block_d) for a, rows in block_rows.items()} if tma and not packed else {}
    flags = ((mask, mask != "full"), ("tma", tma), ("persistent", persistent), ("varlen", packed),
             ("head split", head_split), (output, output != "dkdv"))  # fmt: skip
    shape_class = " ".join([f"d={head_dim}", *(mode for mode, on in flags if on)])
    return kernel_config(f"attention.{kernel}", shape_class, dtype, constexprs, cfg.num_warps, arch,
                         cfg.num_stages, pointers=pointers, descriptors=descriptors, matmul=True)  # fmt: skip


def attention_entry_configs(table: str, cfg, block_d: int, arch: runtime.Arch) -> list[KernelConfig]:
    """Every KernelConfig that entry cfg of horse.kernels.attention's table (a key of ATTENTION_TABLES) at
    block_d compiles to on arch: the local mask first (the most live values: a search stops at the
    first failure), then causal and full; a power-of-two head dim and a padded one (3/4 of the
    block); both dtypes; on the table's batches, padded ones with pointer loads (always selectable:
    USE_TMA off, unaligned inputs) and, on sm_90+ where cfg.tma, TMA loads; packed ones likewise. The
    pointer configs take cfg.loads(False)'s tile; a dk/dv entry with split outputs compiles each of its
    launches."""
    from horse.kernels import attention

    name, batches = ATTENTION_TABLES[table]
    outputs = attention.dkdv_outputs if name == "attn_bwd_dkdv" else lambda _: ("dkdv",)
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
    from horse.kernels import attention

    configs, dtypes = [], (torch.float16, torch.bfloat16)
    for dtype, block_d, packed in itertools.product(dtypes, sorted(attention.FWD_CONFIGS[arch.name]), (0, 1)):
        for head_dim in dict.fromkeys((block_d, block_d * 3 // 4)):
            constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "HAS_DLSE": True, "VARLEN": bool(packed),
                          "BLOCK_M": attention.PREPROCESS_BLOCK_M}  # fmt: skip
            configs.append(kernel_config(
                "attention._attn_bwd_preprocess_kernel", f"d={head_dim}" + " varlen" * packed, dtype,
                constexprs, attention.PREPROCESS_NUM_WARPS, arch.name,
            ))  # fmt: skip
    for table in ATTENTION_TABLES:
        for block_d, cfg in sorted(getattr(attention, table)[arch.name].items()):
            configs += attention_entry_configs(table, cfg, block_d, arch)
    decode = sorted(attention.DECODE_CONFIGS[arch.name].items())
    for (block_d, cfg), mask, dtype in itertools.product(decode, reversed(ATTENTION_MASKS), dtypes):
        # The decode pass with a tile of 16 rows and of the entry's block_m (the launcher takes the
        # smaller that holds a GQA group's rows), at a padded head dim (masked head-dim columns).
        head_dim = block_d * 3 // 4 if block_d > 16 else block_d
        shape_class = f"d={head_dim}" + ("" if mask == "full" else f" {mask}")
        dims = {"HEAD_DIM": head_dim, "BLOCK_D": block_d}
        for block_m in dict.fromkeys((16, cfg.block_m)):
            constexprs = {**dims, "BLOCK_M": block_m, "BLOCK_N": cfg.block_n, **ATTENTION_MASKS[mask]}
            configs.append(kernel_config("attention._attn_decode_kernel", shape_class, dtype, constexprs,
                                         cfg.num_warps, arch.name, cfg.num_stages, matmul=True))  # fmt: skip
        if mask == "full":  # and its reduce of the split keys' partial outputs
            configs.append(kernel_config("attention._attn_decode_reduce_kernel", shape_class, dtype,
                                         dims | {"BLOCK_S": attention.DECODE_REDUCE_BLOCK_S},
                                         attention.DECODE_REDUCE_NUM_WARPS, arch.name))  # fmt: skip
    return configs


# MLP GEMM tables, each with a bias and gated ("gated_<table>": GATED on, no bias): kernel, the flags
# that keep the most values live (stored pre-activation, recomputed h) with unit strides as constexprs
# (x, dy and the weights row-major; the backward reads W_out transposed, unit stride along N), and each
# TMA descriptor's block as (rows, columns) dims.
MLP_GEMMS = {
    "fwd": ("_fwd_kernel", {"STORE_PRE": True, "x_strides[1]": 1, "w_strides[1]": 1},
            {"X": "mk", "W": "nk", "WU": "nk"}),
    "dh_bwd": ("_dh_act_bwd_kernel", {"STORE_H": True, "dy_strides[1]": 1, "w_strides[0]": 1},
               {"DY": "mk", "W": "kn"}),
}  # fmt: skip


# The forwards' persistent kernel (TMA only): its descriptors (the outputs' in epilogue subtiles, "s").
# Both forward kernels take GATED; a plain forward is passed W for WU and PRE for UP, which it does not read.
MLP_PERSISTENT_TILES = {"X": "mk", "W": "nk", "WU": "nk", "Y": "ms", "PRE": "ms", "UP": "ms"}


def mlp_gemm_config(
    table: str, shape_class: str, cfg, dtype: torch.dtype, activation: str, tma: bool, arch: str = "sm90",
    split_k: bool = False, persistent: bool = False,
):  # fmt: skip
    """The KernelConfig of MLP GEMM ``table`` (a key of MLP_GEMMS, or gated_<key>) run with the
    horse.kernels.mlp.GemmConfig ``cfg`` and activation, pointer or TMA loads, for GPU family arch; split_k: a
    forward's split-K variant (partial sums stored, no epilogue); persistent: a forward's persistent
    kernel (TMA)."""
    gated = table.startswith("gated_")
    kernel, flags, tiles = MLP_GEMMS[table.removeprefix("gated_")]
    dims = {"m": cfg.block_m, "n": cfg.block_n, "k": cfg.block_k, "s": cfg.block_n // cfg.epilogue_split}
    constexprs = {"ACTIVATION": activation, "GATED": gated, "HAS_BIAS": not gated, **flags,
                  "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "GROUP_M": cfg.group_m, "EPILOGUE_SPLIT": cfg.epilogue_split, "TMA": tma}  # fmt: skip
    if kernel == "_fwd_kernel":
        constexprs["SPLIT_K"] = split_k
    if persistent:
        kernel, tiles = "_fwd_persistent_kernel", MLP_PERSISTENT_TILES
        # no strides tuples: the persistent kernel reads only descriptors
        constexprs = {k: v for k, v in constexprs.items() if k not in ("TMA", "SPLIT_K") and "[" not in k}
    descriptors = {a: tuple(dims[d] for d in block) for a, block in tiles.items()} if tma else {}
    kind = " persistent" if persistent else " tma" if tma else ""
    shape = f"{shape_class}/{activation}{kind}{' split-k' if split_k else ''}"
    return kernel_config(f"mlp.{kernel}", shape, dtype, constexprs, cfg.num_warps, arch, cfg.num_stages,
                         name=f"mlp_{table}", descriptors=descriptors, matmul=True)  # fmt: skip


def mlp_entry_configs(table: str, shape_class: str, cfg, arch: runtime.Arch) -> list[KernelConfig]:
    """Every KernelConfig that entry cfg of horse.kernels.mlp.GEMM_CONFIGS[arch][table] at shape_class
    compiles to on arch: in both dtypes, for the two activations with the heaviest epilogues (gelu's
    erf and gelu_tanh), with pointer loads (always selectable: USE_TMA off, unaligned inputs) and,
    on sm_90+ where cfg.tma, TMA loads; a forward's small entry (decode-sized M) also in its
    split-K variant (horse.kernels.mlp.split_k), and a forward entry with cfg.persistent also as the
    persistent kernel (TMA loads and stores)."""
    from horse.kernels import mlp

    tma_modes = (False, True) if cfg.tma and arch.tma else (False,)
    split_modes = (False, True) if table in ("fwd", "gated_fwd") and shape_class == "small" else (False,)
    variants = [(split_modes, tma_modes, False)]  # (split-K modes, TMA modes, persistent)
    if cfg.persistent and arch.tma:  # its tiled TMA and pointer kernels stay selectable (mlp._persistent)
        variants.append(((False,), (True,), True))
    return [
        mlp_gemm_config(table, shape_class, cfg, dtype, activation, tma, arch.name, split, persistent)
        for splits, tmas, persistent in variants
        for split, dtype, activation, tma in itertools.product(
            splits, mlp.SUPPORTED_DTYPES, ("gelu", "gelu_tanh"), tmas
        )
    ]


def mlp_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every GEMM table entry of horse.kernels.mlp for arch (:func:`mlp_entry_configs`), and the
    elementwise backward, plain and gated, in both dtypes."""
    from horse.kernels import mlp

    configs = []
    for table, entries in mlp.GEMM_CONFIGS[arch.name].items():
        for shape_class, cfg in entries.items():
            configs += mlp_entry_configs(table, shape_class, cfg, arch)
    # The split-K epilogue in the small tiles, and the elementwise backward, plain and gated.
    activations = ("gelu", "gelu_tanh")
    for gated, dtype, activation in itertools.product((False, True), mlp.SUPPORTED_DTYPES, activations):
        cfg = mlp.GEMM_CONFIGS[arch.name]["gated_fwd" if gated else "fwd"]["small"]
        constexprs = {"ACTIVATION": activation, "HAS_BIAS": not gated, "STORE_PRE": True, "GATED": gated,
                      "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}  # fmt: skip
        configs.append(kernel_config("mlp._split_k_epilogue_kernel", f"small/{activation}", dtype, constexprs,
                                     mlp.SPLIT_K_EPILOGUE_WARPS, arch.name,
                                     name=f"mlp_{'gated_' * gated}split_k_epilogue"))  # fmt: skip
    row = mlp.ACT_BWD_CONFIG
    for dtype, gated in itertools.product(mlp.SUPPORTED_DTYPES, (False, True)):
        constexprs = {"ACTIVATION": "gelu", "GATED": gated, "HAS_BIAS": not gated, "dh_strides[1]": 1,
                      "BLOCK_M": row.block_m, "BLOCK_N": row.block_n}  # fmt: skip
        configs.append(kernel_config("mlp._act_bwd_kernel", "any/gelu", dtype, constexprs, row.num_warps,
                                     arch.name, name=f"mlp_{'gated_' * gated}act_bwd"))  # fmt: skip
    return configs


# The loss kernels (horse.kernels.cross_entropy._<name>_kernel) and the flags with the most live values (the
# fused one with smoothing and the gradient).
LOSS_KERNELS = {
    "cross_entropy": {"HAS_SMOOTHING": True, "WRITE_GRAD": True},
    "cross_entropy_stats": {"HAS_SMOOTHING": True},
    "cross_entropy_grad": {},
}


def loss_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every RowConfig that horse.kernels.cross_entropy.row_config can return on arch (one per block size),
    for its three kernels (LOSS_KERNELS: the fused one, the vocabulary shard's statistics and
    gradient passes), in every dtype."""
    loss = importlib.import_module("horse.kernels.cross_entropy")  # the module: also the name of a function
    limit = loss.MAX_BLOCK_V
    configs = []
    for dtype, n in itertools.product(TRITON_TYPES, row_sizes(limit)):
        cfg = loss.row_config(n, arch)
        shape_class = f"V<={n}" if n <= limit else f"V>{limit}"
        for name, flags in LOSS_KERNELS.items():
            constexprs = flags | {"BLOCK_V": cfg.block_v}
            kernel = f"cross_entropy._{name}_kernel"
            configs.append(kernel_config(kernel, shape_class, dtype, constexprs, cfg.num_warps, arch.name))
    return configs


CONFIG_FAMILIES = {
    "norms": norm_configs,
    "attention": attention_configs,
    "mlp": mlp_configs,
    "loss": loss_configs,
}


def all_configs(archs=tuple(ARCHS)) -> list[KernelConfig]:
    """Every family's configs for each GPU family named in archs (keys of horse.kernels.runtime.ARCHS)."""
    return [cfg for name in archs for family in CONFIG_FAMILIES.values() for cfg in family(ARCHS[name])]


def describe(c: KernelConfig) -> str:
    """A config in words: "sm90 attn_fwd d=128 causal fp16 blocks 128x64x128 warps 8" (not unique)."""
    family = f"{c.arch} as sm_{c.capability}" if c.capability else c.arch
    return f"{family} {c.kernel} {c.shape_class} {c.dtype_name} blocks {c.blocks} warps {c.num_warps}"


def failures(results: list[CompileResult]) -> list[str]:
    """One line per config that Triton cannot compile, spills registers, exceeds its GPU family's
    shared-memory limit or threads a block, or is a matmul kernel without tensor-core instructions."""
    bad = []
    for r in results:
        c = r.config
        if r.error:  # nothing was built to count
            bad.append(f"{describe(c)}: does not compile: {r.error}")
            continue
        limit, threads = ARCHS[c.arch].max_shared_bytes, c.num_warps * ARCHS[c.arch].warp_size
        product, *more = r.narrow_stride_products or ("",)
        product += f" (and {len(more)} more)" if more else ""
        gates = (  # (failing, why)
            (r.spill_bytes > 0, f"spills {r.spill_bytes} bytes"),
            (r.shared_bytes > limit, f"needs {r.shared_bytes} bytes of shared memory (max {limit})"),
            (c.matmul and r.tensor_core_instructions == 0, "no tensor-core instructions"),
            (threads > runtime.MAX_THREADS, f"{threads} threads a block (max {runtime.MAX_THREADS})"),
            (product, f"a 32-bit stride product, which wraps past 2**31 elements: {product}"),
        )
        bad += [f"{describe(c)}: {why}" for failing, why in gates if failing]
    return bad


COLUMNS = ("arch", "kernel", "shape", "dtype", "blocks", "warps", "stages", "regs", "spill", "smem", "tc",
           "ldg128", "tma", "target")  # fmt: skip


def format_table(results: list[CompileResult]) -> str:
    def cells(r: CompileResult) -> tuple:
        c = r.config
        counts = row_values(r)[:-1]  # but the stride products, which a FAIL line names
        if r.error:  # nothing was built to count; the FAIL line below the table says why
            counts = ("-",) * (len(counts) - 1) + ("error",)
        return (c.arch, c.kernel, c.shape_class, c.dtype_name, c.blocks, c.num_warps, c.num_stages, *counts)

    return report.format_table([COLUMNS, *map(cells, results)], right=True)


def check_capabilities(parser: argparse.ArgumentParser, capabilities: list[int], family: str) -> None:
    """Refuse (parser.error) a build of family's entries for a compute capability (86 for 8.6) whose
    GPU takes another family's entries, or none: the --capability check of this CLI and bench.tune's."""
    for capability in capabilities:
        try:
            takes = runtime.arch_of_capability(capability // 10, capability % 10).name
        except RuntimeError:
            takes = None
        if takes != family:
            parser.error(f"--capability {capability}: a GPU of compute capability {capability / 10:.1f} "
                         f"takes {takes or 'no family'}'s entries, not {family}'s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", choices=list(ARCHS), default=list(ARCHS),
                        help="GPU families (default: all)")  # fmt: skip
    parser.add_argument("--filter", default="", help="only kernels whose name contains this text")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compilations")
    parser.add_argument("--capability", type=int, help="build one --arch family's entries for another GPU "
                        "that takes them: 87 (sm80), 89 or 120 (sm86), 103 (sm100)")  # fmt: skip
    parser.add_argument("--update", action="store_true", help="rewrite --cache: this run's rows (only those "
                        "whose key changed are compiled) over its rows of unchanged code; stale keys "
                        "dropped")  # fmt: skip
    parser.add_argument("--rebuild", action="store_true", help="compile every config, reusing no cached row")
    parser.add_argument("--verify", type=int, default=VERIFY_AT_LEAST, metavar="N", help="compile N reused "
                        "rows afresh, at least one per GPU family and kernel, and fail if one differs "
                        f"(default {VERIFY_AT_LEAST}; 0: none)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="which reused rows --verify picks (default 0)")
    parser.add_argument("--cache", default=CACHE_FILE, help="the rows already proven (default: %(default)s)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    configs = [c for c in all_configs(args.arch) if args.filter in c.kernel]
    if not configs:
        parser.error(f"no kernel config matches --filter {args.filter!r}")
    if args.capability is not None:
        if len(args.arch) != 1:
            parser.error("--capability builds one family's entries: name it alone with --arch")
        check_capabilities(parser, [args.capability], args.arch[0])
        configs = [dataclasses.replace(c, capability=args.capability) for c in configs]
    keys = [row_key(c) for c in configs]
    cached = load_cache(args.cache)
    jobs = max(1, args.jobs)
    # An empty Triton cache: a row re-verified from Triton's on-disk cache would not be a fresh compile.
    # Patched for the run alone: a caller in this process (a test) keeps its own cache.
    with tempfile.TemporaryDirectory(prefix="compile-report-") as triton_cache:
        with mock.patch.dict(os.environ, TRITON_CACHE_DIR=triton_cache), ProcessPoolExecutor(jobs) as pool:
            proof = prove(configs, keys, {} if args.rebuild else cached, args.verify, args.seed,
                          functools.partial(compile_in_pool, pool, workers=jobs))  # fmt: skip
    results = proof.results
    print(format_table(results) + "\n")
    bad = proof.differ + failures(results)
    built_for = {a: ARCHS[a].hip_target or f"sm_{args.capability or ARCHS[a].capability}" for a in args.arch}
    for name in args.arch:
        count = sum(r.config.arch == name for r in results)
        print(f"{name} ({ARCHS[name].gpus}): {count} configs for {built_for[name]}")
    targets, cache = ", ".join(built_for.values()), os.path.relpath(args.cache)
    cache = args.cache if cache.startswith("..") else cache
    print(f"{len(results)} configs for {targets} (triton {triton.__version__}): {proof.built} built (key new "
          f"or changed), {proof.reused} reused from {cache}, {proof.verified} of them re-verified by a fresh "
          f"compile; {len(bad)} failing")  # fmt: skip
    if args.update:
        entries = updated_entries(cached, proof, current={row_key(c) for c in all_configs()} | set(keys))
        save_cache(args.cache, entries)
        print(f"wrote {len(entries)} rows to {cache} ({len(cached.keys() - entries.keys())} dropped)")
    for line in bad:
        print(f"FAIL {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
