"""Compile configs with Triton for their GPU family's targets, and read each one's row from what was
built (:class:`CompileResult`): registers and spills (cuobjdump), shared memory (Triton's metadata),
instruction counts (the SASS of all of a worker's kernels for one target from one nvdisasm call; on
AMD, the amdgcn), and the 32-bit stride products of the TTIR. A change to this code invalidates
every cached row (``bench.compile_report.cache.ROW_READERS``).
"""

import dataclasses
import math
import re
import subprocess
import tempfile
from concurrent.futures import Executor

import triton
from triton._C.libtriton import ir
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from bench.compile_report.config import KernelConfig
from bench.compile_report.disassembly import (
    CUOBJDUMP,
    count_sass,
    disassemble,
    machine_code,
    narrow_stride_products,
    parse_amdgcn,
    parse_resource_usage,
)
from horse.kernels import runtime
from horse.kernels.runtime import ARCHS

MAX_CHUNK = 32  # configs a worker compiles before disassembling them together
FLOAT_SCALARS = {"eps", "softmax_scale", "label_smoothing", "z_loss"}  # every other scalar: an i32


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


def _elements(cfg: KernelConfig, name: str) -> tuple[str, ...]:
    """The names of the elements of tuple argument (or tuple element) name: ``"x_strides[i]"`` for a
    strides tuple, cfg.tuples' names for another."""
    elements = cfg.tuples[name]
    return tuple(f"{name}[{i}]" for i in range(elements)) if isinstance(elements, int) else elements


def _signature(cfg: KernelConfig) -> tuple[dict, dict]:
    """The signature of cfg's kernel as Triton's compiler takes it, and the alignment attributes of its
    arguments by path (an argument (index,), a tuple's element (index, i), a nested one's (index, i,
    j)). A tuple's element is typed as an argument of its name would be; a strides tuple's elements
    are i32 multiples of 16, as pointers are 16-aligned and N and K multiples of 16."""
    attrs = {}

    def typed(name: str, path: tuple[int, ...], in_strides: bool = False):
        if name in cfg.constexprs:
            return "constexpr"
        if name in cfg.descriptors:
            block_shape = ",".join(str(d) for d in cfg.descriptors[name])
            return f"tensordesc<{cfg.pointer_types[name]}[{block_shape}]>"
        if name in cfg.pointer_types:
            attrs[path] = [["tt.divisibility", 16]]
            return "*" + cfg.pointer_types[name]
        if name in cfg.tuples:
            strides = isinstance(cfg.tuples[name], int)
            elements = _elements(cfg, name)
            return tuple(typed(element, (*path, i), strides) for i, element in enumerate(elements))
        if name in FLOAT_SCALARS:
            return "fp32"
        if in_strides or name in ("N", "K") or name.startswith("stride"):
            attrs[path] = [["tt.divisibility", 16]]
        return "i32"

    signature = {name: typed(name, (index,)) for index, name in enumerate(cfg.fn.arg_names)}
    return signature, attrs


def _constexprs(cfg: KernelConfig) -> dict:
    """cfg.constexprs as ASTSource takes them: an argument by its name, a tuple's element (``"x_strides[1]"``,
    or a name cfg.tuples gives) by its path."""
    paths = {}

    def visit(name: str, path: tuple[int, ...]):
        paths[name] = path
        for i, element in enumerate(_elements(cfg, name) if name in cfg.tuples else ()):
            visit(element, (*path, i))

    for index, name in enumerate(cfg.fn.arg_names):
        visit(name, (index,))
    return {key if key in cfg.fn.arg_names else paths[key]: value for key, value in cfg.constexprs.items()}


def compile_kernel(cfg: KernelConfig):
    """Triton's compiled kernel of cfg for its target: its asm has "ptx" and "cubin" (NVIDIA), or
    "amdgcn" and "hsaco" (AMD)."""
    signature, attrs = _signature(cfg)
    source = ASTSource(cfg.fn, signature, constexprs=_constexprs(cfg), attrs=attrs)
    return triton.compile(source, target=cfg.gpu_target, options=_options(cfg))


def _options(cfg: KernelConfig) -> dict:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **runtime.COMPILE_OPTIONS}


def front_end_ir(cfg: KernelConfig) -> str:
    """cfg's kernel as Triton's first stage hands it to the rest of the compiler for cfg's target: its
    TTIR, the jit functions it calls inlined and the whole canonicalised, printed without source
    locations. Comments, docstrings, the names of locals and helpers and where the helpers sit in
    their files are not in it; what the kernel computes, its signature's types and alignment and
    its constexprs are. About 0.06 s a config where compiling one takes about 1 s."""
    signature, attrs = _signature(cfg)
    source = ASTSource(cfg.fn, signature, constexprs=_constexprs(cfg), attrs=attrs)
    target = cfg.gpu_target
    backend = make_backend(target)
    options = backend.parse_options(_options(cfg))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = source.make_ir(target, options, codegen, backend.get_module_map(), context)
    stages = {}
    backend.add_stages(stages, options, source.language)
    return stages["ttir"](module, {}).str_nodebug()


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


def in_pool(pool: Executor, work, configs: list[KernelConfig], workers: int) -> list:
    """work (a list of configs -> a result each) over a pool of workers, in chunks of up to MAX_CHUNK
    configs, the results in the order of configs."""
    chunk = max(1, min(MAX_CHUNK, math.ceil(len(configs) / workers)))
    chunks = [configs[i : i + chunk] for i in range(0, len(configs), chunk)]
    return [result for results in pool.map(work, chunks) for result in results]


def compile_in_pool(pool: Executor, configs: list[KernelConfig], workers: int) -> list[CompileResult]:
    """compile_configs over a pool of workers (:func:`in_pool`): each chunk one disassembly per target."""
    return in_pool(pool, compile_configs, configs, workers)
