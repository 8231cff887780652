"""The compile report's parsing and gate, its GPU families, and one real compile of a kernel family."""

import dataclasses
import functools
import importlib.util
import inspect
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton

from bench import compile_report
from bench.compile_report import cache, compiler, disassembly, gate
from bench.compile_report.attention import SOFTCAP, attention_entry_configs, score_mod_configs
from bench.compile_report.compiler import CompileResult
from bench.compile_report.config import TRITON_TYPES, KernelConfig, describe
from bench.compile_report.mlp import mlp_entry_configs
from bench.compile_report.norms import norm_configs
from horse.kernels import runtime

ROOT = Path(__file__).resolve().parents[1]

RESOURCE_USAGE = """Resource usage:
 Common:
  GLOBAL:0
 Function _norm_fwd_kernel:
  REG:70 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:412 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

SASS = """
        /*0080*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0090*/                   LDG.E.128.CONSTANT R8, desc[UR4][R2.64+0x10] ;
        /*00a0*/                   LDG.E.64 R12, desc[UR4][R2.64] ;
        /*00b0*/                   HGMMA.64x128x16.F32 R24, gdesc[UR8], RZ, !UPT ;
        /*00c0*/                   HMMA.16816.F32 R0, R4, R8, R0 ;
        /*00d0*/                   FMUL R1, R2, R3 ;
        /*00e0*/                   UTMALDG.4D [UR8], [UR4] ;
        /*00f0*/                   UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR11], UPT ;
"""


AMDGCN = """
	global_load_dwordx4 v[6:9], v[38:39], off
	buffer_load_dwordx4 v[10:13], v14, s[4:7], 0 offen
	global_load_dwordx2 v[2:3], v[40:41], off
	s_load_dwordx4 s[12:15], s[0:1], 0x28
	v_mfma_f32_32x32x8_f16 v[50:65], v[134:135], v[118:119], v[50:65]
	v_mfma_f32_16x16x16_bf16 a[0:3], v[4:5], v[6:7], a[0:3]
	v_add_f32_e32 v1, v2, v3
amdhsa.kernels:
  - .group_segment_fixed_size: 0
    .private_segment_fixed_size: 412
    .sgpr_count:     34
    .sgpr_spill_count: 12
    .vgpr_count:     256
    .vgpr_spill_count: 100
"""


def test_parse_amdgcn_counts_registers_scratch_mfma_and_wide_loads():
    assert disassembly.parse_amdgcn(AMDGCN) == (256, 412, 2, 2)
    with pytest.raises(ValueError, match="private_segment_fixed_size"):
        disassembly.parse_amdgcn(AMDGCN.replace(".private_segment_fixed_size", ".other"))


def test_parse_resource_usage_counts_stack_and_local_as_spills():
    assert disassembly.parse_resource_usage(RESOURCE_USAGE) == (70, 24)


def test_count_sass_finds_tensor_core_ops_wide_loads_and_tma_loads():
    assert disassembly.count_sass(SASS) == (3, 2, 1)


def _result(spill_bytes=0, shared_bytes=0, arch="sm90", matmul=False, tensor_cores=0, warps=4):
    fn = "horse.kernels.layernorm._norm_fwd_kernel"
    cfg = KernelConfig("k", "N<=64", torch.float16, fn, {}, {"BLOCK_N": 64}, warps, arch=arch, matmul=matmul)
    return CompileResult(cfg, 40, spill_bytes, shared_bytes, tensor_cores, 4, 0)


def test_gate_fails_spills_and_shared_memory_over_the_family_limit():
    assert gate.failures([_result()]) == []
    assert gate.failures([_result(shared_bytes=runtime.SM90.max_shared_bytes)]) == []
    [spill] = gate.failures([_result(spill_bytes=8)])
    assert "spills 8 bytes" in spill
    [smem] = gate.failures([_result(shared_bytes=runtime.SM90.max_shared_bytes + 1)])
    assert "shared memory" in smem
    # What fits an H100's block does not fit an RTX 4090's (99 KiB).
    [smem] = gate.failures([_result(shared_bytes=runtime.SM86.max_shared_bytes + 1, arch="sm86")])
    assert smem.startswith("sm86 ") and "max 101376" in smem


def test_gate_fails_more_than_1024_threads_a_block():
    assert gate.failures([_result(warps=32), _result(arch="gfx942", warps=16)]) == []
    [wide] = gate.failures([_result(arch="gfx942", warps=32)])  # wavefronts of 64
    assert wide.startswith("gfx942 ") and "2048 threads a block (max 1024)" in wide
    [smem] = gate.failures([_result(shared_bytes=65537, arch="gfx942")])  # 64 KiB of LDS
    assert "max 65536" in smem


def test_a_config_triton_cannot_compile_is_a_failing_row_and_the_report_goes_on(monkeypatch):
    """A compiler crash (triton 3.4's on the sm_100 dk/dv configs) names its config, in the
    table and the gate, and the configs after it are still built and read."""
    crashing, built = (_result(arch="gfx942", warps=w).config for w in (4, 8))

    def compile_kernel(cfg):
        if cfg is crashing:
            raise RuntimeError("PassManager::run failed\n  in TritonGPUHoistTMEMAlloc")
        return SimpleNamespace(
            asm={"amdgcn": AMDGCN, "ttir": ""}, metadata=SimpleNamespace(shared=1024, arch="gfx942")
        )

    monkeypatch.setattr(compiler, "compile_kernel", compile_kernel)
    results = compiler.compile_configs([crashing, built])
    assert results[0].error == "PassManager::run failed in TritonGPUHoistTMEMAlloc"
    assert results[1].error == "" and (results[1].registers, results[1].target) == (256, "gfx942")
    [crash, scratch] = gate.failures(results)  # AMDGCN's 412 bytes of scratch: a spill
    assert crash.startswith("gfx942 k N<=64 fp16") and crash.endswith("does not compile: " + results[0].error)
    assert "warps 8: spills 412 bytes" in scratch
    crashed_row = gate.format_table(results).splitlines()[1].split()
    assert crashed_row[-7:] == ["-"] * 6 + ["error"]


def test_gate_fails_a_matmul_kernel_without_tensor_cores():
    [slow] = gate.failures([_result(matmul=True)])
    assert "no tensor-core instructions" in slow
    assert gate.failures([_result(matmul=True, tensor_cores=16)]) == []


KEYED_KERNEL = """{above}
import triton.language as tl
from triton.runtime.jit import JITFunction  # not triton.jit: the tests run in the interpreter


@JITFunction
def _scale(x):
    return x * {factor}


@JITFunction
def _kernel(X, Y, N, BLOCK_N: tl.constexpr):
    offs = tl.arange(0, BLOCK_N)
    tl.store(Y + offs, _scale(tl.load(X + offs, mask=offs < N)), mask=offs {compare} N)
"""


def _keyed_module(
    tmp_path, monkeypatch, name: str, factor: int = 2, compare: str = "<", above: str = "", replace=()
) -> KernelConfig:
    """KEYED_KERNEL as module name, with factor, compare and above filled in and each (old, new) of
    replace replaced; its config at BLOCK_N 64 (a config of another constexpr name: replace its
    constexprs)."""
    text = KEYED_KERNEL.format(factor=factor, compare=compare, above=above)
    for old, new in replace:
        text = text.replace(old, new)
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    pointers = {"X": "fp16", "Y": "fp16"}
    return KernelConfig(
        "k", "any", torch.float16, f"{name}._kernel", pointers, {"BLOCK_N": 64}, 4, arch="sm90"
    )


TUPLE_KERNEL = """
import triton.language as tl
from triton.runtime.jit import JITFunction


@JITFunction
def _gather(X, Y, x_strides, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs * x_strides[0] + x_strides[1]))
"""


def _tuple_config(tmp_path, monkeypatch) -> KernelConfig:
    path = tmp_path / "tupled.py"
    path.write_text(TUPLE_KERNEL)
    spec = importlib.util.spec_from_file_location("tupled", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tupled", module)
    spec.loader.exec_module(module)
    pointers = {"X": "fp16", "Y": "fp16"}
    constexprs = {"BLOCK": 64, "x_strides[1]": 1}
    return KernelConfig("k", "any", torch.float16, "tupled._gather", pointers, constexprs, arch="sm90",
                        tuples={"x_strides": 2})  # fmt: skip


def test_a_strides_tuple_compiles_as_aligned_i32s_with_its_unit_stride_a_constexpr(tmp_path, monkeypatch):
    cfg = _tuple_config(tmp_path, monkeypatch)
    signature, attrs = compiler._signature(cfg)
    assert signature["x_strides"] == ("i32", "constexpr") and attrs[(2, 0)] == [["tt.divisibility", 16]]
    ttir = compiler.compile_kernel(cfg).asm["ttir"]
    assert "%x_strides: i32 {tt.divisibility = 16 : i32}" in ttir and "%x_strides_0" not in ttir
    [product] = disassembly.narrow_stride_products(ttir)  # offs * x_strides[0] (splat as %2), 32 bits
    assert product.startswith("%3 = arith.muli %offs, %2 : tensor<64xi32>")


GROUPED_KERNEL = """
import triton.language as tl
from triton.runtime.jit import JITFunction


@JITFunction
def _grouped(tensors, sizes, strides, BLOCK: tl.constexpr):
    X, Y = tensors
    rows, N = sizes
    x_strides, y_strides = strides
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs * x_strides[0] + x_strides[1], mask=offs < rows)
    tl.store(Y + offs * y_strides[0], x, mask=offs < N)
"""


def test_a_tuple_of_named_elements_types_each_as_an_argument_of_its_name(tmp_path, monkeypatch):
    # Grouped arguments compile as the arguments they group would: pointers and N 16-aligned, a plain
    # size not, a strides tuple inside the group as any strides tuple (its unit stride a constexpr).
    path = tmp_path / "grouped.py"
    path.write_text(GROUPED_KERNEL)
    spec = importlib.util.spec_from_file_location("grouped", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "grouped", module)
    spec.loader.exec_module(module)
    tuples = {"tensors": ("X", "Y"), "sizes": ("rows", "N"), "strides": ("x_strides", "y_strides")}
    tuples |= {"x_strides": 2, "y_strides": 2}
    cfg = KernelConfig("k", "any", torch.float16, "grouped._grouped", {"X": "fp16", "Y": "fp16"},
                       {"BLOCK": 64, "y_strides[1]": 1}, arch="sm90", tuples=tuples)  # fmt: skip
    signature, attrs = compiler._signature(cfg)
    assert signature == {
        "tensors": ("*fp16", "*fp16"),
        "sizes": ("i32", "i32"),
        "strides": (("i32", "i32"), ("i32", "constexpr")),
        "BLOCK": "constexpr",
    }
    aligned = [["tt.divisibility", 16]]
    assert attrs == {(0, 0): aligned, (0, 1): aligned, (1, 1): aligned, (2, 0, 0): aligned,
                     (2, 0, 1): aligned, (2, 1, 0): aligned}  # fmt: skip
    assert compiler._constexprs(cfg) == {"BLOCK": 64, (2, 1, 1): 1}
    ttir = compiler.compile_kernel(cfg).asm["ttir"]
    assert "%sizes: i32 loc" in ttir  # rows: no alignment
    assert ttir.count("tt.divisibility = 16") == 6


@pytest.mark.interpreter
def test_a_gpu_compile_after_an_interpreted_launch_is_the_compilers_own(tmp_path, monkeypatch):
    """Triton's interpreter leaves triton.language patched after each device-function call (here
    rms_norm's tl.sum); runtime.launch puts it back, or a kernel compiled for sm_90 afterwards fails
    in Triton's code generator. Triton's on-disk cache would hide that: the compile here is fresh."""
    from horse import kernels

    x = torch.randn(3, 40, dtype=torch.float16)
    kernels.rms_norm(x, (40,), torch.ones(40, dtype=torch.float16))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton-cache"))
    ttir = compiler.compile_kernel(_tuple_config(tmp_path, monkeypatch)).asm["ttir"]
    assert "%x_strides: i32 {tt.divisibility = 16 : i32}" in ttir


def test_a_rows_key_changes_with_the_code_config_target_toolchain_and_reader(tmp_path, monkeypatch):
    cfg = _keyed_module(tmp_path, monkeypatch, "keyed_a")
    key = cache.row_key(cfg)
    assert cache.row_key(_keyed_module(tmp_path, monkeypatch, "keyed_same")) == key  # by content
    # Lines added above the kernels (another kernel) move them in the file, not in their code.
    moved = _keyed_module(tmp_path, monkeypatch, "keyed_moved", above="\n# a comment\n\n")
    assert moved.fn.starting_line_number != cfg.fn.starting_line_number
    assert cache.row_key(moved) == key
    changed = {
        "a called jit function's source": _keyed_module(tmp_path, monkeypatch, "keyed_helper", factor=3),
        "the kernel's source": _keyed_module(tmp_path, monkeypatch, "keyed_body", compare="<="),
        "num_warps": dataclasses.replace(cfg, num_warps=8),
        "num_stages": dataclasses.replace(cfg, num_stages=3),
        "a constexpr": dataclasses.replace(cfg, constexprs={"BLOCK_N": 128}),
        "a pointer's dtype": dataclasses.replace(cfg, pointer_types={"X": "fp32", "Y": "fp16"}),
        "the family": dataclasses.replace(cfg, arch="sm80"),
        "the target": dataclasses.replace(cfg, capability=100),
    }
    keys = {what: cache.row_key(c) for what, c in changed.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys), keys
    # A Triton release (its own cache of the toolchain string), and the code that reads a row.
    monkeypatch.setattr(cache, "toolchain", functools.cache(cache.toolchain.__wrapped__))
    monkeypatch.setattr(triton, "__version__", triton.__version__ + ".post1")
    assert cache.row_key(cfg) != key
    monkeypatch.undo()
    assert cache.row_key(_keyed_module(tmp_path, monkeypatch, "keyed_a")) == key
    monkeypatch.setattr(cache, "reader_hash", functools.cache(cache.reader_hash.__wrapped__))
    monkeypatch.setattr(cache, "ROW_READERS", (*cache.ROW_READERS, describe))
    assert cache.row_key(cfg) != key


def _fake_build(built: list):
    """A compile that records what it was asked to build and returns rows that say which config."""

    def build(configs):
        built.extend(configs)
        return [
            CompileResult(c, 32 + c.num_warps, 0, len(c.kernel), 0, 0, 0, f"sm_{c.arch}") for c in configs
        ]

    return build


_IR_SERIALS = itertools.count()


def _no_ir(configs):
    """IR keys new at every call: no cached row is found by its IR key."""
    return [f"ir {next(_IR_SERIALS)}" for _ in configs]


def test_cached_rows_are_reused_a_sample_is_verified_and_a_tampered_row_fails():
    configs = [c for c in compile_report.all_configs(["sm90", "sm80"]) if c.kernel.startswith("layer_norm")]
    keys = [f"key{i}" for i in range(len(configs))]
    groups = {(c.arch, c.kernel) for c in configs}
    assert len(configs) > 100 and len(groups) == 6
    built = []
    first = cache.prove(configs, keys, {}, 60, 0, _fake_build(built), _no_ir)
    assert (first.built, first.reused, first.verified, first.differ) == (len(configs), 0, 0, [])
    entries = cache.updated_entries({}, first, set(keys))
    assert list(entries) == keys and entries["key0"]["config"] == describe(configs[0])

    built.clear()
    again = cache.prove(configs, keys, entries, 60, 0, _fake_build(built), _no_ir)
    assert (again.built, again.reused, again.verified, again.differ) == (0, len(configs), 60, [])
    assert len(built) == 60 and {(c.arch, c.kernel) for c in built} == groups
    assert [cache.row_values(r) for r in again.results] == [e["row"] for e in entries.values()]
    sample = cache.verification_sample
    assert built == [configs[i] for i in sample(configs, 60, 0)]  # the same sample for the same seed
    assert sample(configs, 60, 1) != sample(configs, 60, 0)
    assert len(sample(configs, 2, 0)) == 6 and sample(configs, 0, 0) == []  # one of each (family, kernel)

    built.clear()
    trusted = cache.prove(configs, keys, entries, 0, 0, _fake_build(built), _no_ir)
    assert (trusted.built, trusted.verified, built) == (0, 0, [])
    tampered = {key: {**entry, "row": list(entry["row"])} for key, entry in entries.items()}
    tampered["key5"]["row"][0] += 1
    checked = cache.prove(configs, keys, tampered, len(configs), 0, _fake_build([]), _no_ir)
    [line] = checked.differ
    assert line.startswith(describe(configs[5]) + ": cached row [")
    # A cached row goes through the gate like a fresh one: a spill in the file fails the report.
    tampered["key5"]["row"][1] = 8
    [spill] = gate.failures(cache.prove(configs, keys, tampered, 0, 0, _fake_build([]), _no_ir).results)
    assert spill.endswith("spills 8 bytes")
    tampered["key5"]["row"][1] = 0
    tampered["key5"]["row"][-1] = ["%9 = arith.muli %x, %stride_xm : i32"]  # narrow_stride_products
    [narrow] = gate.failures(cache.prove(configs, keys, tampered, 0, 0, _fake_build([]), _no_ir).results)
    assert "a 32-bit stride product" in narrow and "%9 = arith.muli" in narrow

    changed = ["changed0", *keys[1:]]
    built.clear()
    after = cache.prove(configs, changed, entries, 0, 0, _fake_build(built), _no_ir)
    assert (after.built, after.reused, built) == (1, len(configs) - 1, configs[:1])
    failed = dataclasses.replace(after.results[0], error="ptxas died")
    after.fresh["changed0"] = failed
    assert "key0" not in cache.updated_entries(entries, after, set(changed))  # stale: dropped
    assert "changed0" not in cache.updated_entries(entries, after, set(changed))  # errors: not kept


def test_a_row_whose_source_changed_but_not_its_ir_is_found_by_its_ir_key_and_rekeyed():
    configs = [c for c in compile_report.all_configs(["sm90"]) if c.kernel.startswith("layer_norm")][:20]
    keys = [f"key{i}" for i in range(len(configs))]
    asked = []

    def find_ir_keys(some):
        asked.extend(some)
        return [f"ir{configs.index(c)}" for c in some]

    first = cache.prove(configs, keys, {}, 0, 0, _fake_build([]), find_ir_keys)
    entries = cache.updated_entries({}, first, set(keys))
    assert [entry["ir"] for entry in entries.values()] == [f"ir{i}" for i in range(20)]  # built: both keys
    asked.clear()
    same = cache.prove(configs, keys, entries, 0, 0, _fake_build([]), find_ir_keys)
    assert (same.built, same.reused, same.by_ir, asked) == (0, 20, 0, [])  # no front end when keys match

    # A docstring edit: every row key new, every IR key the same: nothing built, the rows re-keyed.
    edited = [f"edited{i}" for i in range(20)]
    built = []
    again = cache.prove(configs, edited, entries, 3, 0, _fake_build(built), find_ir_keys)
    assert (again.built, again.reused, again.by_ir, again.verified, again.differ) == (0, 20, 20, 3, [])
    assert asked == configs and len(built) == 3  # only the verification sample compiled
    rekeyed = cache.updated_entries(entries, again, set(edited))
    assert list(rekeyed) == edited and [e["ir"] for e in rekeyed.values()] == [f"ir{i}" for i in range(20)]
    assert [e["row"] for e in rekeyed.values()] == [e["row"] for e in entries.values()]

    # A real change to two of them: their IR keys new, exactly they are built.
    built.clear()

    def two_changed(some):
        return ["new0", "new1", *find_ir_keys(some)[2:]]

    partly = cache.prove(configs, edited, entries, 0, 0, _fake_build(built), two_changed)
    assert (partly.built, partly.by_ir, built) == (2, 18, configs[:2])


def test_a_cache_without_ir_keys_gains_them_by_front_ends_alone():
    configs = [c for c in compile_report.all_configs(["sm90"]) if c.kernel.startswith("layer_norm")][:5]
    keys = [f"key{i}" for i in range(5)]
    entries = {key: {"config": describe(c), "row": [1]} for key, c in zip(keys, configs, strict=True)}
    entries["key4"]["ir"] = "ir kept"
    given = cache.attach_ir_keys(entries, configs, keys, lambda some: [f"ir of {c.kernel}" for c in some])
    assert given == 4 and [e["ir"] for e in entries.values()][3:] == [f"ir of {configs[3].kernel}", "ir kept"]
    assert cache.attach_ir_keys(entries, configs, keys, lambda some: pytest.fail(f"asked for {some}")) == 0


def test_an_ir_key_ignores_comments_docstrings_names_and_order_and_sees_a_real_change(tmp_path, monkeypatch):
    cfg = _keyed_module(tmp_path, monkeypatch, "ir_a")
    key = cache.ir_key(cfg)
    edited = KEYED_KERNEL.replace(
        "def _scale(x):\n    return x *", 'def _twice(value):\n    """Doubled."""\n    return value *'
    )
    edited = edited.replace("_scale(", "_twice(").replace("offs", "columns")
    helper, kernel = edited.split("\n\n@JITFunction\n")[1:]
    reordered = (
        edited.split("\n\n@JITFunction\n")[0]
        + "\n# comment\n\n@JITFunction\n"
        + kernel
        + "\n@JITFunction\n"
        + helper
    )
    path = tmp_path / "ir_b.py"
    path.write_text(reordered.format(factor=2, compare="<", above=""))
    spec = importlib.util.spec_from_file_location("ir_b", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ir_b", module)
    spec.loader.exec_module(module)
    same = dataclasses.replace(cfg, fn_path="ir_b._kernel")
    assert "columns" in same.fn.src and "_twice" in same.fn.src and cache.row_key(same) != cache.row_key(cfg)
    assert cache.ir_key(same) == key
    # A constexpr renamed: not in the compiled code (the configs name it as the kernel does).
    renamed = _keyed_module(tmp_path, monkeypatch, "ir_constexpr", replace=(("BLOCK_N", "BLOCK"),))
    assert cache.ir_key(dataclasses.replace(renamed, constexprs={"BLOCK": 64})) == key
    changed = {
        "a called jit function's code": _keyed_module(tmp_path, monkeypatch, "ir_helper", factor=3),
        "the kernel's code": _keyed_module(tmp_path, monkeypatch, "ir_body", compare="<="),
        "num_warps": dataclasses.replace(cfg, num_warps=8),
        "a constexpr": dataclasses.replace(cfg, constexprs={"BLOCK_N": 128}),
        "a pointer's dtype": dataclasses.replace(cfg, pointer_types={"X": "fp32", "Y": "fp16"}),
        "the target": dataclasses.replace(cfg, capability=100),
        "an argument's name (the stride reader reads names)": dataclasses.replace(
            _keyed_module(tmp_path, monkeypatch, "ir_arg", replace=(("X", "SOURCE"),)),
            pointer_types={"SOURCE": "fp16", "Y": "fp16"},
        ),
    }
    keys = {what: cache.ir_key(c) for what, c in changed.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys), keys


EDITED_NORMS = """
import ast, dataclasses, importlib.util, inspect, json, sys
from bench.compile_report import all_configs, cache
from horse.kernels import layernorm

tree = ast.parse(inspect.getsource(layernorm))
functions = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.decorator_list]
jit = [f for f in functions if ast.unparse(f.decorator_list[0]) == "triton.jit"]
for f in jit:  # every docstring edited; in each kernel a local renamed
    if ast.get_docstring(f):
        f.body[0].value.value = "Edited. " + f.body[0].value.value
    arguments = {a.arg for a in f.args.args}
    assigned = [t.id for node in ast.walk(f) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name) and t.id not in arguments]
    for node in ast.walk(f):
        if isinstance(node, ast.Name) and assigned and node.id == assigned[0]:
            node.id = "renamed_" + node.id
helpers = [f for f in jit if not f.name.endswith("_kernel")]
tree.body = [node for node in tree.body if node not in helpers] + helpers[::-1]  # helpers last, reversed
path = sys.argv[1]
open(path, "w").write(ast.unparse(tree))  # no comments, the formatter's layout gone
spec = importlib.util.spec_from_file_location("edited_layernorm", path)
sys.modules["edited_layernorm"] = module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
configs = [c for c in all_configs(["sm90", "gfx942"]) if c.fn_path.startswith("horse.kernels.layernorm.")]
configs = [c for i, c in enumerate(configs) if i % 40 == 0]
moved = [c.fn_path.replace("horse.kernels.layernorm", "edited_layernorm") for c in configs]
edited = [dataclasses.replace(c, fn_path=path) for c, path in zip(configs, moved)]
print(json.dumps({
    "kernels": sorted({c.fn_path for c in configs}),
    "source_keys_differ": all(cache.row_key(a) != cache.row_key(b) for a, b in zip(configs, edited)),
    "ir_keys_equal": [cache.ir_key(a) == cache.ir_key(b) for a, b in zip(configs, edited)],
}))
"""


def test_the_norm_kernels_rewritten_without_their_comments_and_layout_keep_every_ir_key(tmp_path):
    """Their file as ast.unparse writes it, every docstring edited, a local of each jit function
    renamed, the helpers moved below the kernels in reverse: every source key new, no IR key."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", EDITED_NORMS, str(tmp_path / "edited_layernorm.py")]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    found = json.loads(run.stdout)
    assert found["kernels"] == [
        "horse.kernels.layernorm._norm_bwd_kernel",
        "horse.kernels.layernorm._norm_fwd_kernel",
    ]
    assert found["source_keys_differ"] and len(found["ir_keys_equal"]) > 4 and all(found["ir_keys_equal"])


def test_every_family_has_an_entry_in_every_table():
    from horse.kernels import mlp, moe
    from horse.kernels.attention import configs as attention_configs

    for table in (attention_configs.FWD_CONFIGS, attention_configs.PACKED_FWD_CONFIGS,
                  attention_configs.BWD_DKDV_CONFIGS, attention_configs.BWD_DQ_CONFIGS):  # fmt: skip
        assert set(table) == set(runtime.ARCHS)
        assert all(set(entries) == {16, 32, 64, 128, 256, 512} for entries in table.values())
    gemm_tables = mlp.configs.GEMM_CONFIGS
    assert set(gemm_tables) == set(runtime.ARCHS)
    for tables in gemm_tables.values():
        assert {k: set(v) for k, v in tables.items()} == {k: set(v) for k, v in gemm_tables["sm90"].items()}
    moe_tables = moe.configs.GEMM_CONFIGS
    assert set(moe_tables) == set(runtime.ARCHS)
    assert all(set(tables) == {"gate_up", "down", "dh", "weight_grad"} for tables in moe_tables.values())
    for name, arch in runtime.ARCHS.items():
        configs = compile_report.all_configs([name])
        assert {c.arch for c in configs} == {name}
        if not arch.tma:  # no TMA variants before Hopper, nor on AMD
            assert not any(c.descriptors for c in configs)
        assert all(c.gpu_target.backend == ("hip" if arch.hip_target else "cuda") for c in configs[:1])


def test_gpus_map_to_their_family():
    families = {(8, 0): "sm80", (8, 7): "sm80", (8, 6): "sm86", (8, 9): "sm86", (9, 0): "sm90",
                (10, 0): "sm100", (10, 3): "sm100", (12, 0): "sm86"}  # fmt: skip
    for capability, name in families.items():
        assert runtime.arch_of_capability(*capability).name == name
    for old in ((7, 0), (7, 5), (6, 1)):
        with pytest.raises(RuntimeError, match=rf"Tesla is {old[0]}\.{old[1]}"):
            runtime.arch_of_capability(*old, name="Tesla")
    assert runtime.arch(torch.device("cpu")) is runtime.SM90  # the interpreter emulates sm_90
    assert runtime.arch_of_amd_target("gfx942:sramecc+:xnack-") is runtime.GFX942
    with pytest.raises(RuntimeError, match=r"gfx942 \(MI300X.*; AMD Instinct MI250X is gfx90a"):
        runtime.arch_of_amd_target("gfx90a:sramecc+:xnack-", name="AMD Instinct MI250X")


def test_an_amd_gpu_takes_its_family_by_its_target(monkeypatch):
    properties = SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X")
    monkeypatch.setattr(torch.version, "hip", "7.0.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    assert runtime._cuda_arch.__wrapped__(0) is runtime.GFX942
    assert not runtime.GFX942.tma and runtime.SM90.tma and not runtime.SM86.tma


def test_every_selectable_norm_config_is_in_the_report():
    from horse.kernels import layernorm

    for arch in runtime.ARCHS.values():
        reported = {
            (c.dtype, c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"], c.num_warps)
            for c in norm_configs(arch)
            if "BLOCK_M" in c.constexprs
        }
        for n, backward, dtype in itertools.product(
            range(1, layernorm.MAX_HIDDEN + 1, 97), (False, True), TRITON_TYPES
        ):
            cfg = layernorm.row_config(n, backward, dtype, arch)
            assert (dtype, cfg.block_m, cfg.block_n, cfg.num_warps) in reported, (
                arch.name,
                n,
                backward,
                dtype,
            )


def test_real_compile_of_one_kernel_for_three_gpu_families_then_its_rows_from_the_cache(tmp_path):
    """Built and written by --update; then taken from the file, a row of each family compiled again
    to check it: a tampered row fails that check; stale rows go at the next --update."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    cache = tmp_path / "cache.json"

    def report(*args):
        command = [sys.executable, "-m", "bench.compile_report", "--arch", "sm90", "sm86", "gfx942"]
        command += ["--filter", "rms_norm_bwd_split_row", "--jobs", "2", "--cache", str(cache), *args]
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        lines = [line for line in run.stdout.splitlines() if not line.startswith("FAIL ")]
        return run, [line.split() for line in lines if " rms_norm_bwd_split_row " in line]  # the table's

    run, rows = report("--update")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(row[0] for row in rows) == ["gfx942"] * 3 + ["sm86"] * 3 + ["sm90"] * 3  # a dtype each
    targets = {(row[0], row[-1]) for row in rows}
    assert targets == {("sm86", "sm_86"), ("sm90", "sm_90a"), ("gfx942", "gfx942")}
    for row in rows:
        registers, spills = int(row[7]), int(row[8])
        assert registers > 0 and spills == 0
    assert "9 configs for sm_90, sm_86, gfx942 (triton " in run.stdout
    assert (
        f"9 built (key new or changed), 0 reused from {cache} (0 found by their IR key), 0 of them"
        in run.stdout
    )
    assert f"wrote 9 rows to {cache} (0 dropped, 0 given their IR key)" in run.stdout

    written = json.loads(cache.read_text())
    assert len(written["rows"]) == 9 and written["columns"][:2] == ["registers", "spill_bytes"]
    written["rows"]["0" * 32] = {"config": "a kernel since changed", "row": [1, 0, 0, 0, 0, 0, "sm_90a"]}
    for entry in written["rows"].values():
        entry["row"][0] += entry["config"].startswith("sm90 ")  # sm90's registers, tampered with
    cache.write_text(json.dumps(written))
    again, cached_rows = report("--verify", "1")  # at least one row per family and kernel: 3
    assert again.returncode == 1
    assert "0 built (key new or changed), 9 reused" in again.stdout
    assert "3 of them re-verified" in again.stdout
    [differ] = [line for line in again.stdout.splitlines() if line.startswith("FAIL ")]
    assert differ.startswith("FAIL sm90 rms_norm_bwd_split_row") and "but a fresh compile gives" in differ
    assert [row for row in cached_rows if row[0] != "sm90"] == [row for row in rows if row[0] != "sm90"]
    assert json.loads(cache.read_text()) == written  # read, never written without --update

    updated, _ = report("--update", "--verify", "0")
    assert updated.returncode == 0 and "0 built" in updated.stdout, updated.stdout + updated.stderr
    assert f"wrote 9 rows to {cache} (1 dropped, 0 given their IR key)" in updated.stdout  # the tampered stay
    assert "0" * 32 not in json.loads(cache.read_text())["rows"]

    # Every source key changed (a docstring edit), every IR key kept: the rows found by their IR
    # keys, none built, and --update files them under their new keys.
    rows = json.loads(cache.read_text())["rows"]
    rekeyed = {f"{i:032x}": entry for i, entry in enumerate(rows.values())}
    cache.write_text(json.dumps({"rows": rekeyed}))
    moved, _ = report("--update", "--verify", "0")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert (
        "0 built (key new or changed), 9 reused" in moved.stdout
        and "(9 found by their IR key)" in moved.stdout
    )
    assert f"wrote 9 rows to {cache} (9 dropped, 0 given their IR key)" in moved.stdout
    assert sorted(json.loads(cache.read_text())["rows"].values(), key=str) == sorted(rows.values(), key=str)


AMD_MATMUL = """
import json
from bench.compile_report import all_configs, compiler, disassembly

[cfg] = [c for c in all_configs(["gfx942"]) if c.kernel == "mlp_fwd" and c.dtype_name == "fp16"][:1]
[r] = compiler.compile_configs([cfg])
print(json.dumps([r.registers, r.spill_bytes, r.shared_bytes, r.tensor_core_instructions, r.target]))
"""


def test_an_amd_matmul_compiles_to_mfma_instructions():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", AMD_MATMUL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    registers, spills, shared, mfma, target = json.loads(run.stdout.splitlines()[-1])
    assert target == "gfx942" and 0 < registers <= 512 and spills == 0
    assert 0 < shared <= runtime.GFX942.max_shared_bytes and mfma > 0


def test_capability_builds_a_familys_entries_for_another_gpu_that_takes_them():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}

    def report(*args):
        command = [sys.executable, "-m", "bench.compile_report", "--rebuild", "--filter",
                   "rms_norm_bwd_split_row", *args]  # fmt: skip
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    run = report("--arch", "sm86", "--capability", "120")  # an RTX 5090 takes the sm86 entries
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 configs for sm_120 " in run.stdout and "sm86 (RTX" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if " rms_norm_bwd_split_row " in line]
    assert len(rows) == 3 and all(row[0] == "sm86" and row[-1] == "sm_120a" for row in rows), rows
    for args, message in (
        (("--arch", "sm90", "--capability", "120"), "takes sm86's entries, not sm90's"),
        (("--arch", "sm86", "--capability", "75"), "takes no family's entries"),
        (("--arch", "sm86", "sm90", "--capability", "89"), "name it alone with --arch"),
        (("--arch", "gfx942", "--capability", "90"), "takes sm90's entries, not gfx942's"),
    ):
        run = report(*args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)


def test_an_entry_compiles_in_every_variant_it_can_be_launched_in():
    from horse.kernels import mlp
    from horse.kernels.attention import configs as attention_configs

    cfg = attention_configs.AttnConfig(128, 64, 8, 3, tma=True)
    padded = attention_entry_configs("FWD_CONFIGS", cfg, 128, runtime.SM90)
    assert len(padded) == 3 * 2 * 2 * 2  # masks, head dims 128 and 96, dtypes, TMA and pointers
    assert padded[0].constexprs["MASK"] == "local" and not any(c.constexprs["VARLEN"] for c in padded)
    assert {c.constexprs["HEAD_DIM"] for c in padded} == {128, 96} and sum(
        bool(c.descriptors) for c in padded
    ) == 12
    # A packed batch's forward builds its descriptors on the device: TMA configs without descriptor
    # arguments.
    packed = attention_entry_configs("PACKED_FWD_CONFIGS", cfg, 128, runtime.SM90)
    assert len(packed) == 24 and all(c.constexprs["VARLEN"] and not c.descriptors for c in packed)
    assert sum(c.constexprs["TMA"] for c in packed) == 12
    # An entry with a pointer key block of its own compiles its pointer configs at that block.
    split = attention_entry_configs(
        "FWD_CONFIGS",
        dataclasses.replace(cfg, pointer=dataclasses.replace(cfg, block_n=32)),
        128,
        runtime.SM90,
    )
    assert {(c.constexprs["TMA"], c.constexprs["BLOCK_N"]) for c in split} == {(True, 64), (False, 32)}
    # A dk/dv entry with split outputs compiles each launch (dv, dk), K and V by pointers under TMA;
    # its pointer tile, the fused pass.
    fused = attention_configs.AttnConfig(16, 64, 8, 2, column_splits=2)
    split_dkdv = attention_configs.AttnConfig(64, 128, 8, 1, split_outputs=True, pointer=fused)
    dkdv = attention_entry_configs("BWD_DKDV_CONFIGS", split_dkdv, 256, runtime.SM90)
    # Packed batches' by TMA too, their descriptors built on the device (no descriptor arguments).
    tma = [c for c in dkdv if c.constexprs["TMA"]]
    assert [c.constexprs["OUTPUT"] for c in tma] == ["dv", "dk"] * (len(tma) // 2) and len(tma) == 60
    assert {c.fn.fn.__name__ for c in tma} == {"_attn_bwd_dkdv_split_outputs_kernel"}
    assert all(set(c.descriptors) == {"Q", "DO", "DK", "DV"} for c in tma if not c.constexprs["VARLEN"])
    assert sum(not c.descriptors for c in tma if c.constexprs["VARLEN"]) == 30
    pointer = {(c.fn.fn.__name__, c.constexprs["BLOCK_M"]) for c in dkdv if not c.constexprs["TMA"]}
    assert pointer == {("_attn_bwd_dkdv_kernel", 16)}
    bwd = attention_entry_configs("BWD_DQ_CONFIGS", cfg, 128, runtime.SM80)
    assert len(bwd) == 24 and not any(c.descriptors for c in bwd)  # padded and packed, no TMA on sm_80
    gemm = mlp.configs.GemmConfig(128, 128, 64, 8, 8, 4)
    assert len(mlp_entry_configs("fwd", "large", gemm, runtime.SM90)) == 8
    assert len(mlp_entry_configs("fwd", "large", gemm, runtime.SM86)) == 4
    sm86_dkdv = attention_entry_configs(
        "BWD_DKDV_CONFIGS", attention_configs.BWD_DKDV_CONFIGS["sm86"][64], 64, runtime.SM86
    )
    sm86_configs = compile_report.all_configs(["sm86"])
    assert all(c in sm86_configs for c in sm86_dkdv)


def test_every_family_builds_every_pass_with_the_score_modifications_on_their_softcap_tiles():
    # Every family builds every pass with the score modifications: the forward (padded and packed) with
    # the softcap and the sinks, the decode pass with the softcap and its reduce with the sinks, the
    # gradient passes with the softcap on each entry's softcap tile: sm_100's dq at 128 takes 2 stages
    # (its own 3 spilled with the softcap), and no dk/dv row with the softcap is a split-output launch.
    passes = {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "attn_decode", "attn_decode_reduce"}
    for arch in runtime.ARCHS.values():
        configs = score_mod_configs(arch)
        assert {c.kernel for c in configs} == passes
        assert not any("split_outputs" in c.kernel for c in configs)
        forward = [c for c in configs if c.kernel == "attn_fwd"]
        assert {c.constexprs["SOFTCAP"] for c in forward} == {SOFTCAP}
        assert {"varlen" in c.shape_class for c in forward} == {False, True}
        assert all("sinks" in c.shape_class for c in forward)
        decode = [c for c in configs if c.kernel == "attn_decode"]
        assert {c.constexprs["SOFTCAP"] for c in decode} == {SOFTCAP}
        reduce = [c for c in configs if c.kernel == "attn_decode_reduce"]
        assert reduce and all("SINKS" not in c.constexprs for c in reduce)  # the sinks passed, not None
    sm100_dq = [
        c
        for c in score_mod_configs(runtime.ARCHS["sm100"])
        if c.kernel == "attn_bwd_dq" and c.constexprs["HEAD_DIM"] == 128
    ]
    assert sm100_dq and {c.num_stages for c in sm100_dq} == {2}
    # sm_100's forward at 32 with the softcap takes its softcap tile, pointer loads (by TMA it spilled)
    sm100_fwd = [
        c
        for c in score_mod_configs(runtime.ARCHS["sm100"])
        if c.kernel == "attn_fwd" and c.constexprs["HEAD_DIM"] == 32
    ]
    assert sm100_fwd and not any(c.constexprs["TMA"] for c in sm100_fwd)
    # gfx942's at 128 takes 64 keys a step (128 spilled with the softcap and the window)
    gfx942_fwd = [
        c
        for c in score_mod_configs(runtime.ARCHS["gfx942"])
        if c.kernel == "attn_fwd" and c.constexprs["HEAD_DIM"] == 128
    ]
    assert gfx942_fwd and {c.constexprs["BLOCK_N"] for c in gfx942_fwd} == {64}


def test_the_moe_down_and_dx_gemms_compile_by_tma_and_pointers_with_the_unit_strides_they_run_with():
    from bench.compile_report.moe import moe_configs

    plain = [c for c in moe_configs(runtime.SM90) if c.kernel in ("moe_down", "moe_dx")]
    plain = [c for c in plain if "gpt-oss" not in c.shape_class]  # transformers' layout
    # sm_90's down entry, for down and dx, in both dtypes, by pointers and by TMA (the sorted rows' tiles
    # and one expert's weight tile as stored: down_proj (experts, N, K), gate_up_proj (experts, K, N)).
    tma = {(c.kernel, c.constexprs["TMA"], c.descriptors["W"]) for c in plain if c.descriptors}
    assert tma == {("moe_down", "nk", (1, 128, 64)), ("moe_dx", "kn", (1, 64, 128))}
    assert len(plain) == 8 and sum(c.constexprs["TMA"] is None and not c.descriptors for c in plain) == 4
    # The weight's stride of 1 that Triton specialises at run time: down_proj read as stored (along k),
    # gate_up_proj transposed (along n).
    assert all(c.constexprs["w_strides[2]" if c.kernel == "moe_down" else "w_strides[1]"] == 1 for c in plain)
    assert not any(c.descriptors for c in moe_configs(runtime.SM100))  # the other families: pointers


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["transformers", "gpt-oss"])
def test_every_moe_gemm_launch_in_either_weight_layout_has_its_row_in_every_family(monkeypatch, layout):
    """Each grouped GEMM moe_mlp launches, forward and backward, with transformers' weights as stored or
    gpt-oss's as horse.hf.moe.gpt_oss_experts_forward passes them (transposed views, interleaved gate
    and up rows, biases, the clamp at its limit), has a report row in every family and dtype with the
    same flags and epilogue and the weights' strides of 1 that Triton specialises at that launch."""
    from bench.compile_report.moe import moe_configs
    from horse import kernels
    from horse.kernels.moe import launch

    launches = []
    real_launch = launch._launch

    def recording_launch(plan, *args):
        names = plan.kernel.arg_names[: len(args)]  # the constexprs, last, come from the plan
        units = {
            f"{name}[{i}]"
            for name, arg in zip(names, args, strict=True)
            if name.endswith("strides")
            for i, stride in enumerate(arg)
            if stride == 1
        }
        flags = {k: v for k, v in plan.constexprs.items() if not k.startswith("BLOCK_")}
        launches.append((plan.kernel.fn.__name__, flags, units))
        real_launch(plan, *args)

    monkeypatch.setattr(launch, "_launch", recording_launch)
    torch.manual_seed(0)
    f16 = {"dtype": torch.float16}
    experts, hidden, inter = 3, 32, 48
    x = torch.randn(5, hidden, **f16, requires_grad=True)
    ids, weights = torch.tensor([[0, 2], [2, 1], [0, 1], [1, 2], [0, 0]]), torch.rand(5, 2, **f16)
    gate_up, down = torch.randn(experts, 2 * inter, hidden, **f16), torch.randn(experts, hidden, inter, **f16)
    if layout == "gpt-oss":  # stored (experts, hidden, 2 inter) and (experts, inter, hidden)
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    gate_up, down = gate_up.mul_(0.2).requires_grad_(), down.mul_(0.2).requires_grad_()
    biases = (torch.randn(experts, 2 * inter, **f16), torch.randn(experts, hidden, **f16))
    gate_up_bias, down_bias = (b.mul_(0.1).requires_grad_() for b in biases)
    options = dict(activation="silu", gate_up_bias=gate_up_bias, down_bias=down_bias)
    if layout == "gpt-oss":
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        options |= dict(limit=7.0, gate_up_interleaved=True)
    y = kernels.moe_mlp(x, ids, weights.requires_grad_(), gate_up, down, **options)
    y.float().sum().backward()
    gemms = [launched for launched in launches if launched[0] not in ("_count_kernel", "_place_kernel")]
    gemms = [launched for launched in gemms if launched[0] != "_combine_kernel"]
    assert len(gemms) == 6  # gate_up, down, dh, dx, both weight gradients
    for arch in runtime.ARCHS.values():
        rows = moe_configs(arch)
        for dtype in (torch.float16, torch.bfloat16):
            built = [(c.fn_path.rsplit(".", 1)[1], c.constexprs) for c in rows if c.dtype == dtype]
            for kernel, flags, units in gemms:
                # The pointer rows stand in every family (TMA ones where it takes TMA), so pointers.
                flags = flags | {"TMA": None} if "TMA" in flags else flags
                assert any(
                    name == kernel
                    and all(constexprs.get(k) == v for k, v in flags.items())
                    # the weight's and dW's (w_strides, dw_strides): the layouts' difference
                    and {k for k, v in constexprs.items() if "w_strides" in k and v == 1}
                    == {u for u in units if "w_strides" in u}
                    for name, constexprs in built
                ), (arch.name, dtype, kernel, flags, units)


def test_dkdv_entries_compile_with_float32_partials_for_gqa_head_splits():
    from horse.kernels.attention.configs import AttnConfig

    cfg = AttnConfig(32, 128, 8, 2, tma=True)
    configs = attention_entry_configs("BWD_DKDV_CONFIGS", cfg, 64, runtime.SM90)
    split = [c for c in configs if "head split" in c.shape_class]
    assert len(configs) == 48 + 12 and len(split) == 12  # masks x (padded, packed) x (TMA, pointers)
    assert all(c.pointer_types["DK"] == c.pointer_types["DV"] == "fp32" for c in split)
    assert all(c.pointer_types["DK"] == "fp16" or c in split for c in configs if c.dtype == torch.float16)


SASS_AGREEMENT = """
import json, subprocess, tempfile
from bench.compile_report import all_configs, compiler, disassembly

wanted = [("sm90", "mlp_fwd"), ("sm90", "rms_norm_bwd_split_row"), ("sm80", "mlp_fwd"),
          ("sm90", "attn_bwd_preprocess")]
configs = []
for arch, kernel in wanted:
    found = [c for c in all_configs([arch]) if c.kernel == kernel and c.dtype_name == "fp16"]
    configs += [c for c in found if c.shape_class.startswith("small")][:2] or found[:1]
batched = compiler.compile_configs(configs)
alone = []
for cfg in configs:  # cuobjdump's SASS of each cubin on its own: what the batch must agree with
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiler.compile_kernel(cfg).asm["cubin"])
        cubin.flush()
        sass = subprocess.run([disassembly.CUOBJDUMP, "--dump-sass", cubin.name], capture_output=True,
                              text=True, check=True).stdout
    alone.append(disassembly.count_sass(sass))
print(json.dumps({"archs": [c.arch for c in configs], "kernels": [r.config.kernel for r in batched],
                  "expected": [c.kernel for c in configs], "batched": [[r.tensor_core_instructions,
                  r.global_loads_128, r.tma_loads] for r in batched], "alone": alone}))
"""


def test_batched_disassembly_counts_each_kernel_as_cuobjdump_does_alone():
    """compile_configs disassembles the machine code of all kernels of a target in one nvdisasm call
    and attributes instructions by offset; each kernel's counts must be cuobjdump's of its cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-c", SASS_AGREEMENT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["kernels"] == report["expected"]
    assert report["archs"].count("sm90") >= 4 and "sm80" in report["archs"]  # two targets, one batch
    assert report["batched"] == [list(counts) for counts in report["alone"]]
    counts = {tuple(c) for c in report["alone"]}
    assert len(counts) >= 3, counts  # kernels that differ, so a misattributed instruction shows
    assert any(tc > 0 for tc, _, _ in counts) and any(tma > 0 for _, _, tma in counts)


@pytest.mark.interpreter
def test_every_kernel_launch_asks_for_the_compile_options_the_report_compiles_with(monkeypatch):
    """The report's cubins are the launches' only if both pass runtime.COMPILE_OPTIONS (FMA
    contraction, which Triton 3.10 stops doing by default) and name their stages, as the report
    compiles their plans with theirs (Triton's default is 3): every kernel's launch is checked."""
    from triton.runtime.interpreter import GridExecutor  # runs every launch in the interpreter

    from horse import kernels
    from horse.kernels import attention, layernorm, mlp, moe

    interpreted = type(layernorm._norm_fwd_kernel)  # the interpreter's stand-in for a JIT function
    launches = []
    launch = GridExecutor.__call__

    def recording_launch(self, *args, **kwargs):
        options = ("num_stages", *runtime.COMPILE_OPTIONS)
        launches.append((self.fn.__name__, {k: kwargs.get(k) for k in options}))
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(GridExecutor, "__call__", recording_launch)
    torch.manual_seed(0)
    f16 = {"dtype": torch.float16}

    def backward(out):
        out.float().sum().backward()

    for n in (64, layernorm.FWD_MAX_ROW_IN_REGISTERS + 1):  # a row in registers, and one in chunks
        x, w = torch.randn(3, n, requires_grad=True), torch.randn(n, requires_grad=True)
        backward(kernels.layer_norm(x, (n,), w, torch.randn(n, requires_grad=True)))
    q, k, v = (torch.randn(1, 2, 24, 16, **f16, requires_grad=True) for _ in range(3))
    backward(kernels.flash_attention(q, k, v, causal=True))
    dkdv_table = attention.configs.BWD_DKDV_CONFIGS[runtime.arch(q.device).name]
    monkeypatch.setitem(
        dkdv_table, 16, dataclasses.replace(dkdv_table[16], split_outputs=True, column_splits=1)
    )
    backward(kernels.flash_attention(q, k, v, causal=True))  # dv and dk by launches of their own
    x = torch.randn(20, 32, **f16, requires_grad=True)
    w1, w2, w3 = (torch.randn(48, 32, **f16).mul_(0.2).requires_grad_() for _ in range(3))
    backward(kernels.linear_act(x, w1, None, activation="gelu"))
    split_k_rows = x[:1, :].repeat(1, 3)  # K = 96: split-K
    backward(kernels.linear_act(split_k_rows, w1.repeat(1, 3), None, activation="gelu_tanh"))
    backward(kernels.gated_linear(x, w1, w2, activation="silu"))
    rows = x.detach().repeat(4, 1)  # M = 80, past the small class: the persistent forwards
    backward(kernels.linear_act(rows, w1, None, activation="gelu"))
    backward(kernels.gated_linear(rows, w1, w2, activation="silu"))
    backward(kernels.fused_mlp(x, w1, None, w3.t().contiguous(), None, activation="gelu"))
    backward(kernels.fused_gated_mlp(x, w1, w2, w3.t().contiguous(), activation="silu"))
    ids, weights = torch.tensor([[0, 2], [2, 1], [0, 1]]), torch.rand(3, 2, **f16, requires_grad=True)
    gate_up, down = torch.randn(3, 96, 32, **f16).mul_(0.2), torch.randn(3, 32, 48, **f16).mul_(0.2)
    backward(kernels.moe_mlp(x[:3], ids, weights, gate_up.requires_grad_(), down, activation="silu"))
    cache = torch.randn(1, 8, 2, 16, **f16)
    kernels.flash_attention_with_kvcache(q[:, :1], cache, cache.clone(), cache_seqlens=3)  # decode
    logits, target = torch.randn(5, 70, requires_grad=True), torch.randint(0, 70, (5,))
    backward(kernels.cross_entropy(logits, target))
    loss = sys.modules["horse.kernels.cross_entropy"]  # the module, which horse.kernels.cross_entropy hides
    one_rank = loss.VocabShard(0, 70, all_reduce_max=lambda t: None, all_reduce_sum=lambda t: None)
    xs, ws = torch.randn(5, 16), torch.randn(70, 16)
    loss.linear_cross_entropy_chunks(xs, ws, None, target, torch.ones(5), -100, 0.0, 0.0, True, one_rank)
    modules = (
        attention.forward,
        attention.backward,
        attention.decode,
        layernorm,
        mlp.forward,
        mlp.backward,
        moe.routing,
        moe.gemm,
        loss,
    )
    defined = {name for module in modules for name, value in vars(module).items()
               if isinstance(value, interpreted) and name.endswith("_kernel")}  # fmt: skip
    assert {name for name, _ in launches} == defined
    compile_options = [{k: options.pop(k) for k in runtime.COMPILE_OPTIONS} for _, options in launches]
    assert all(options == runtime.COMPILE_OPTIONS for options in compile_options), launches
    assert not {name for name, options in launches if options["num_stages"] is None}


NARROW_TTIR = """
  tt.func public @k(%X: !tt.ptr<f16> loc("X"(#loc)), %stride_xs: i32 {tt.divisibility = 16 : i32},
                    %o_strides_1: i32 {tt.divisibility = 16 : i32}) {
    %offs = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32> loc(#loc1)
    %offs_2 = tt.expand_dims %offs {axis = 1 : i32} : tensor<64xi32> -> tensor<64x1xi32> loc(#loc2)
    %tile = tt.splat %stride_xs : i32 -> tensor<64x1xi32> loc(#loc3)
    %tile_3 = arith.muli %offs_2, %tile : tensor<64x1xi32> loc(#loc4)
    %rows = arith.extsi %offs_2 : tensor<64x1xi32> to tensor<64x1xi64> loc(#loc5)
    %wide = arith.extsi %stride_xs : i32 to i64 loc(#loc6)
    %wide_4 = tt.splat %wide : i64 -> tensor<64x1xi64> loc(#loc7)
    %rows_5 = arith.muli %rows, %wide_4 : tensor<64x1xi64> loc(#loc8)
    %start = arith.muli %offs_2, %offs_2 : tensor<64x1xi32> loc(#loc9)
    %step = arith.muli %stride_xs, %c64_i32 : i32 loc(#loc10)
    %head = arith.muli %h, %o_strides_1 : i32 loc(#loc11)
"""


def test_gate_fails_32_bit_stride_products():
    products = disassembly.narrow_stride_products(NARROW_TTIR)
    assert [p.split(" = ")[0] for p in products] == ["%tile_3", "%step", "%head"]  # not the 64-bit one
    [narrow] = gate.failures([dataclasses.replace(_result(), narrow_stride_products=products)])
    assert "a 32-bit stride product, which wraps past 2**31 elements: %tile_3 = arith.muli" in narrow
    assert "(and 2 more)" in narrow


WIDE_OFFSETS = """
import json
from bench.compile_report import all_configs, compiler, disassembly

configs = {}
for c in all_configs(["sm90"]):
    if not c.descriptors and c.kernel.startswith(("attn", "mlp")):
        configs.setdefault((c.kernel, c.constexprs.get("VARLEN")), c)
print(json.dumps({f"{k} {v}": r.narrow_stride_products for (k, v), r in
                  zip(configs, compiler.compile_configs(list(configs.values())), strict=True)}))
"""


def test_the_pointer_paths_compile_no_32_bit_stride_product():
    # Each attention pass (padded and packed), the decode pass and its reduce, and each MLP GEMM on its
    # pointer path, built for sm_90.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", WIDE_OFFSETS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr
    products = json.loads(run.stdout)
    # with the MLP's two split-K epilogues and the dk/dv pass's split outputs (packed: no descriptor argument)
    assert len(products) == 19, sorted(products)
    assert {kernel: found for kernel, found in products.items() if found} == {}


def test_sass_loops_finds_the_innermost_hgmma_loop_without_the_out_of_line_waits():
    from bench import sass_loops

    sass = "\n".join(
        f"        /*{offset:04x}*/  {text} ;"
        for offset, text in enumerate(
            [
                "MOV R1, c[0x0][0x28]",
                "FMUL R2, R3, R4",  # 0x10: the loop's first instruction
                "HGMMA.64x128x16.F32 R24, R212, gdesc[UR12], RZ, !UPT",
                "@!P1 BRA 0x90",  # into the wait at the end
                "FFMA R5, R6, R7, R8",
                "MUFU.EX2 R9, R9",
                "@P0 BRA 0x10",  # 0x60: the loop's backward branch
                "EXIT",
                "BRA 0x70",
                "@!P1 BRA 0x90",  # 0x90: the out-of-line wait, branching back into the loop
                "BRA 0x40",
            ]
        )
        for offset in [offset * 16]
    )
    [loop] = sass_loops.main_loops(sass)
    assert (loop.start, loop.end, len(loop.instructions)) == (0x10, 0x60, 6)
    assert (loop.count("FMUL"), loop.count("FFMA"), loop.count("MUFU"), loop.count("HGMMA")) == (1, 1, 1, 1)
    assert loop.tensor_flops(num_warps=8) == 2 * 2 * 64 * 128 * 16  # two warpgroups issue it


def _arguments(kernel) -> tuple[set, list]:
    """(its constexprs' names, its other arguments' names) of a kernel, INLINE_PTX aside (the report
    sets it per target)."""
    parameters = inspect.signature(kernel.fn).parameters
    constexprs = {n for n, p in parameters.items() if p.annotation is triton.language.constexpr}
    return constexprs - {"INLINE_PTX"}, [n for n in parameters if n not in constexprs]


def _launched(kernel, args: tuple, kwargs: dict):
    """What a launch compiles: its kernel, constexprs (INLINE_PTX aside: the report sets it per target),
    warps, stages, and each other argument as its kind and type (a tuple's element by element)."""

    def kind(value):
        if value is None:  # an argument off (the attention's sinks): a constexpr None
            return "None"
        if isinstance(value, triton.language.constexpr):  # a tuple's constexpr element
            # The only bool among them is the attention mask's INLINE_PTX, set per target by the report.
            return ("constexpr", "INLINE_PTX" if isinstance(value.value, bool) else repr(value.value))
        if isinstance(value, tuple):
            return tuple(kind(v) for v in value)
        if isinstance(value, torch.Tensor):
            return ("ptr", {torch.int32: "i32", **TRITON_TYPES}[value.dtype])
        if hasattr(value, "block_shape"):  # a host-built TMA descriptor
            return ("desc", TRITON_TYPES[value.base.dtype], tuple(value.block_shape))
        return "scalar"

    bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    constexprs, others = _arguments(kernel)
    values = tuple((name, kind(bound[name])) for name in others)
    return (
        kernel.fn.__name__,
        {n: bound[n] for n in sorted(constexprs)},
        kwargs["num_warps"],
        kwargs["num_stages"],
        values,
    )


def _compiled(config: KernelConfig):
    """A config as _launched describes a launch."""

    def kind(name, in_tuple=False):
        if name == "INLINE_PTX":  # a tuple's element, as _launched gives it (one of its own: _arguments)
            return ("constexpr", "INLINE_PTX")
        if name in config.constexprs and in_tuple and config.constexprs[name] is not None:
            return ("constexpr", repr(config.constexprs[name]))
        if name in config.constexprs:  # an argument off, as _launched gives it
            return repr(config.constexprs[name])
        if name in config.descriptors:
            return ("desc", config.pointer_types[name], tuple(config.descriptors[name]))
        elements = config.tuples.get(name)
        if isinstance(elements, int):  # a strides tuple
            return ("scalar",) * elements
        if elements is not None:
            return tuple(kind(e, in_tuple=True) for e in elements)
        return ("ptr", config.pointer_types[name]) if name in config.pointer_types else "scalar"

    kernel = config.fn
    annotated = _arguments(kernel)[0]  # an argument off (None) is among the others, as _launched has it
    constexprs = {n: config.constexprs[n] for n in sorted(config.constexprs) if n in annotated}
    values = tuple((name, kind(name)) for name in _arguments(kernel)[1])
    return kernel.fn.__name__, constexprs, config.num_warps, config.num_stages, values


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_attention_configs_are_the_launchers_plans(use_tma, monkeypatch):
    # The sm90 tables' own tiles (the interpreter emulates sm_90), walked without running a kernel:
    # every attention pass the launchers start, padded and packed, at a padded head dim, at 256 and 512
    # (their dk/dv entries launch dv and dk apart by TMA, their pointer tiles fused), with document masking
    # too, is one the compile report builds; the decode pass's too.
    from horse import kernels
    from horse.kernels.attention import configs as attention_configs
    from horse.kernels.attention import launch

    monkeypatch.setattr(attention_configs, "INTERPRETER_BLOCKS", {})
    monkeypatch.setattr(launch, "USE_TMA", use_tma)
    launches = []
    monkeypatch.setattr(
        runtime, "launch", lambda kernel, grid, *args, **kw: launches.append((kernel, args, kw))
    )
    passes = (
        "_attn_fwd_kernel",
        "_attn_bwd_dkdv_kernel",
        "_attn_bwd_dkdv_split_outputs_kernel",
        "_attn_bwd_dq_kernel",
        "_attn_decode_kernel",
    )
    built = {repr(_compiled(c)) for c in compile_report.all_configs(["sm90"]) if c.fn.fn.__name__ in passes}
    # GQA with its heads split at the power-of-two head dims: the report builds the float32 partials'
    # store at those alone (the loop is the padded head dim's).
    for (head_dim, kv_heads), window in itertools.product(
        ((64, 2), (96, 4), (128, 2), (256, 2), (512, 2)), ((-1, -1), (7, 0))
    ):
        shapes = ((2, 40, heads, head_dim) for heads in (4, kv_heads, kv_heads))
        q, k, v = (torch.randn(shape, dtype=torch.float16, requires_grad=True) for shape in shapes)
        kernels.flash_attention(q, k, v, causal=True, window_size=window).sum().backward()
        starts = torch.tensor([[0] * 15 + [15] * 25] * 2, dtype=torch.int32)  # documents of 15 and 25
        documents = kernels.flash_attention(q, k, v, causal=True, window_size=window, document_starts=starts)
        documents.sum().backward()
        cu = torch.tensor([0, 30, 40], dtype=torch.int32)
        packed = [t.detach().flatten(0, 1)[:40].requires_grad_() for t in (q, k, v)]
        kernels.flash_attention_varlen(*packed, cu, cu, 30, 30, causal=False).sum().backward()
        if head_dim == 96:  # the decode pass, at the padded head dim the report builds it in
            for seqlen_q in (1, 40):  # a tile of 16 rows, of the entry's 64
                lengths = torch.full((2,), 40, dtype=torch.int32)  # a tensor: never the prefill kernel
                cache = {"cache_seqlens": lengths, "causal": True, "window_size": window}
                kernels.flash_attention_with_kvcache(
                    q.detach()[:, :seqlen_q], k.detach(), v.detach(), **cache
                )
        else:  # softcap and sinks together (the report's rows), at the power-of-two head dims, forward and
            # backward (the gradient passes on their entries' softcap tiles) and the decode pass
            mods = {"softcap": SOFTCAP, "sinks": torch.zeros(4, requires_grad=True)}
            out = kernels.flash_attention(q, k, v, causal=True, window_size=window, **mods)
            packed_out = kernels.flash_attention_varlen(*packed, cu, cu, 30, 30, **mods)
            (out.sum() + packed_out.sum()).backward()
            for seqlen_q in (1, 40):
                lengths = torch.full((2,), 40, dtype=torch.int32)
                cache = {"cache_seqlens": lengths, "causal": True, "window_size": window, **mods}
                kernels.flash_attention_with_kvcache(
                    q.detach()[:, :seqlen_q], k.detach(), v.detach(), **cache
                )
    launched = [_launched(*launch) for launch in launches if launch[0].fn.__name__ in passes]
    split_outputs = "_attn_bwd_dkdv_split_outputs_kernel"  # the 256 entry's TMA launches alone
    assert {name for name, *_ in launched} == set(passes) - ({split_outputs} if not use_tma else set())
    assert any(c[1].get("TMA") for c in launched) == use_tma
    for signature in launched:
        assert repr(signature) in built, signature
