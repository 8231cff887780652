"""The rows already proven: bench/compile_report_cache.json, one row per config under its key.

A config's key (:func:`row_key`) hashes everything that decides its compiled code and its row, with
the kernel's source text; each row also holds its IR key (:func:`ir_key`), the same with the
kernel's front-end IR in place of its source. A run takes the rows whose keys are in the file; for
the others it computes their IR keys and takes the rows that hold them (a comment, docstring or
rename changed the source, not the IR), and compiles the rest and a sample of the reused rows to
check the file (:func:`prove`); ``--update`` writes the file anew (:func:`updated_entries`).
"""

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import random
import sys
import tempfile

import triton
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

from bench.compile_report import compiler, disassembly
from bench.compile_report.compiler import CompileResult
from bench.compile_report.config import KernelConfig, describe

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_FILE = os.path.join(BENCH_DIR, "compile_report_cache.json")
VERIFY_AT_LEAST = 60  # reused rows compiled afresh each run to check the file against the compiler
# The code that turns a config into its row: a change to any of it invalidates every cached row.
ROW_READERS = (
    compiler._elements,
    compiler._signature,
    compiler._constexprs,
    compiler._options,
    compiler.compile_kernel,
    compiler.compile_configs,
    compiler._read_amd,
    compiler._read_nvidia,
    disassembly.parse_resource_usage,
    disassembly.count_sass,
    disassembly.parse_amdgcn,
    disassembly.machine_code,
    disassembly.disassemble,
)
ROW_FIELDS = (
    "registers",
    "spill_bytes",
    "shared_bytes",
    "tensor_core_instructions",
    "global_loads_128",
    "tma_loads",
    "target",
    "narrow_stride_products",
)


@functools.cache
def reader_hash() -> str:
    code = [inspect.getsource(f) for f in ROW_READERS]
    result_fields = [f.name for f in dataclasses.fields(CompileResult)]
    constants = (disassembly.INSTRUCTION_BYTES, sorted(compiler.FLOAT_SCALARS))
    code.append(repr((ROW_FIELDS, result_fields, *constants)))
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
    signature, attrs = compiler._signature(cfg)
    target = cfg.gpu_target
    environment = sorted(get_cache_invalidating_env_vars().items())
    options = sorted(compiler._options(cfg).items())
    code = (source_key(cfg.fn), signature, attrs, sorted(cfg.constexprs.items()), options)
    parts = (*code, repr(target), toolchain(target), environment, reader_hash())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def ir_key(cfg: KernelConfig) -> str:
    """row_key with the kernel's front-end IR (compiler.front_end_ir: no comments, docstrings, names
    of locals or helpers, source lines) in place of its source key, signature and constexprs, which
    the IR holds. The names of the arguments the compiled kernel takes stay, as the stride-product
    reader finds strides by name; a constexpr's name is in no compiled code, so one removed or renamed
    leaves the key. Costs a front end (about 0.06 s), so a run computes it only for the configs whose
    row_key is new."""
    target = cfg.gpu_target
    environment = sorted(get_cache_invalidating_env_vars().items())
    options = sorted(compiler._options(cfg).items())
    arguments = [name for name in cfg.fn.arg_names if name not in cfg.constexprs]
    code = (compiler.front_end_ir(cfg), arguments, options)
    parts = (*code, repr(target), toolchain(target), environment, reader_hash())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def ir_keys(configs: list[KernelConfig]) -> list[str]:
    """ir_key of each config (what a pool's worker is given)."""
    return [ir_key(cfg) for cfg in configs]


def row_values(r: CompileResult) -> list:
    """r's fields as JSON holds them (tuples as lists)."""
    values = (getattr(r, name) for name in ROW_FIELDS)
    return [list(value) if isinstance(value, tuple) else value for value in values]


def cached_result(cfg: KernelConfig, row: list) -> CompileResult:
    """The CompileResult a cached row (:func:`row_values`) stands for."""
    fields = dict(zip(ROW_FIELDS, row, strict=True))
    return CompileResult(cfg, **fields | {"narrow_stride_products": tuple(fields["narrow_stride_products"])})


def load_cache(path: str) -> dict[str, dict]:
    """The cached entries by row key, each {"config": its description, "row": row_values, "ir": its
    ir_key}; {} when there is no file."""
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

    keys: list[str]  # each config's row_key
    results: list[CompileResult]  # one a config, fresh or cached
    built: int  # configs whose row was in the cache under neither key (or all, with --rebuild)
    reused: int  # cached rows taken for their row key or their IR key
    by_ir: int  # of the reused, those taken for their IR key (the source changed, its IR did not)
    verified: int  # reused rows compiled afresh as well
    differ: list[str]  # a line per verified row whose fresh compile disagrees with the cache
    fresh: dict[str, CompileResult]  # row key -> fresh result, for --update
    ir: dict[str, str]  # row key -> IR key, for the configs whose row key was not in the cache


def prove(
    configs: list[KernelConfig], keys: list[str], cached: dict, verify: int, seed: int, build, find_ir_keys
) -> Proof:
    """Each config's row: taken from cached (entries by key, :func:`load_cache`) where its key is
    there; else where its IR key (find_ir_keys: a list of configs -> their :func:`ir_key`) is
    there; built with build (a list of configs -> their CompileResults) where neither is; and a
    sample of the reused rows (:func:`verification_sample`) built as well and compared."""
    missing = [i for i, key in enumerate(keys) if key not in cached]
    ir = dict(zip(missing, find_ir_keys([configs[i] for i in missing]) if missing else [], strict=True))
    by_ir = {entry["ir"]: entry for entry in cached.values() if "ir" in entry}
    entries = {i: cached[key] for i, key in enumerate(keys) if key in cached}
    entries |= {i: by_ir[ir[i]] for i in missing if ir[i] in by_ir}
    reused = sorted(entries)
    checked = [reused[j] for j in verification_sample([configs[i] for i in reused], verify, seed)]
    to_build = [i for i in missing if i not in entries] + checked
    built = dict(zip(to_build, build([configs[i] for i in to_build]), strict=True))
    results, differ = [], []
    for i, cfg in enumerate(configs):
        result = built.get(i) or cached_result(cfg, entries[i]["row"])
        if i in checked and (result.error or row_values(result) != entries[i]["row"]):
            fresh, row = result.error or row_values(result), entries[i]["row"]
            differ.append(f"{describe(cfg)}: cached row {row} but a fresh compile gives {fresh}")
        results.append(result)
    fresh = {keys[i]: result for i, result in built.items()}
    ir_by_key = {keys[i]: key for i, key in ir.items()}
    counts = (len(configs) - len(reused), len(reused), len(reused) - (len(configs) - len(missing)))
    return Proof(keys, results, *counts, len(checked), differ, fresh, ir_by_key)


def updated_entries(cached: dict, proof: Proof, current: set[str]) -> dict[str, dict]:
    """The cache after a run: the rows found by their IR key under their new row key, and the fresh
    rows (those without an error) over the cached ones, only keys in current (the other keys belong
    to code that no longer exists). A row keeps its IR key, or takes the one this run computed."""
    entries = {key: entry for key, entry in cached.items() if key in current}
    for key, result in zip(proof.keys, proof.results, strict=True):
        result = proof.fresh.get(key, result)
        if result.error:  # a crash may be the machine's: never cached, built again next run
            entries.pop(key, None)
        elif key in proof.fresh or key in proof.ir:
            ir = proof.ir.get(key) or entries[key].get("ir")
            entries[key] = {"config": describe(result.config), "row": row_values(result)}
            entries[key] |= {"ir": ir} if ir else {}
    return entries


def attach_ir_keys(
    entries: dict[str, dict], configs: list[KernelConfig], keys: list[str], find_ir_keys
) -> int:
    """Give the entries of configs (by their keys) that hold no IR key theirs (find_ir_keys: a list of
    configs -> their IR keys): a cache written before IR keys gains them by front ends alone, no
    compile. Returns how many it gave (configs that share a key, one)."""
    lacking = {
        key: cfg for cfg, key in zip(configs, keys, strict=True) if "ir" not in entries.get(key, {"ir": 0})
    }
    for key, ir in zip(lacking, find_ir_keys(list(lacking.values())) if lacking else [], strict=True):
        entries[key]["ir"] = ir
    return len(lacking)
