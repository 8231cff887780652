"""The compile report's parsing and gate, its GPU families, and one real compile of a kernel family."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import compile_report
from bench.compile_report import CompileResult, KernelConfig
from kernels import runtime

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
    assert compile_report.parse_amdgcn(AMDGCN) == (256, 412, 2, 2)
    with pytest.raises(ValueError, match="private_segment_fixed_size"):
        compile_report.parse_amdgcn(AMDGCN.replace(".private_segment_fixed_size", ".other"))


def test_parse_resource_usage_counts_stack_and_local_as_spills():
    assert compile_report.parse_resource_usage(RESOURCE_USAGE) == (70, 24)


def test_count_sass_finds_tensor_core_ops_wide_loads_and_tma_loads():
    assert compile_report.count_sass(SASS) == (3, 2, 1)


def _result(spill_bytes=0, shared_bytes=0, arch="sm90", matmul=False, tensor_cores=0, warps=4):
    fn = "kernels.layernorm._norm_fwd_kernel"
    cfg = KernelConfig("k", "N<=64", torch.float16, fn, {}, {"BLOCK_N": 64}, warps, arch=arch, matmul=matmul)
    return CompileResult(cfg, 40, spill_bytes, shared_bytes, tensor_cores, 4, 0)


def test_gate_fails_spills_and_shared_memory_over_the_family_limit():
    assert compile_report.failures([_result()]) == []
    assert compile_report.failures([_result(shared_bytes=runtime.SM90.max_shared_bytes)]) == []
    [spill] = compile_report.failures([_result(spill_bytes=8)])
    assert "spills 8 bytes" in spill
    [smem] = compile_report.failures([_result(shared_bytes=runtime.SM90.max_shared_bytes + 1)])
    assert "shared memory" in smem
    # What fits an H100's block does not fit an RTX 4090's (99 KiB).
    [smem] = compile_report.failures([_result(shared_bytes=runtime.SM86.max_shared_bytes + 1, arch="sm86")])
    assert smem.startswith("sm86 ") and "max 101376" in smem


def test_gate_fails_more_than_1024_threads_a_block():
    assert compile_report.failures([_result(warps=32), _result(arch="gfx942", warps=16)]) == []
    [wide] = compile_report.failures([_result(arch="gfx942", warps=32)])  # wavefronts of 64
    assert wide.startswith("gfx942 ") and "2048 threads a block (max 1024)" in wide
    [smem] = compile_report.failures([_result(shared_bytes=65537, arch="gfx942")])  # 64 KiB of LDS
    assert "max 65536" in smem


def test_a_config_triton_cannot_compile_is_a_failing_row_and_the_report_goes_on(monkeypatch):
    """A compiler crash (triton 3.4's on the sm_100 dk/dv configs) names its config, in the
    table and the gate, and the configs after it are still built and read."""
    crashing, built = (_result(arch="gfx942", warps=w).config for w in (4, 8))

    def compile_kernel(cfg):
        if cfg is crashing:
            raise RuntimeError("PassManager::run failed\n  in TritonGPUHoistTMEMAlloc")
        return SimpleNamespace(asm={"amdgcn": AMDGCN}, metadata=SimpleNamespace(shared=1024, arch="gfx942"))

    monkeypatch.setattr(compile_report, "compile_kernel", compile_kernel)
    results = compile_report.compile_configs([crashing, built])
    assert results[0].error == "PassManager::run failed in TritonGPUHoistTMEMAlloc"
    assert results[1].error == "" and (results[1].registers, results[1].target) == (256, "gfx942")
    [crash, scratch] = compile_report.failures(results)  # AMDGCN's 412 bytes of scratch: a spill
    assert crash.startswith("gfx942 k N<=64 fp16") and crash.endswith("does not compile: " + results[0].error)
    assert "warps 8: spills 412 bytes" in scratch
    crashed_row = compile_report.format_table(results).splitlines()[1].split()
    assert crashed_row[-7:] == ["-"] * 6 + ["error"]


def test_gate_fails_a_matmul_kernel_without_tensor_cores():
    [slow] = compile_report.failures([_result(matmul=True)])
    assert "no tensor-core instructions" in slow
    assert compile_report.failures([_result(matmul=True, tensor_cores=16)]) == []


def test_every_family_has_an_entry_in_every_table():
    from kernels import attention, mlp

    for table in (attention.FWD_CONFIGS, attention.PACKED_FWD_CONFIGS, attention.BWD_DKDV_CONFIGS,
                  attention.BWD_DQ_CONFIGS):  # fmt: skip
        assert set(table) == set(runtime.ARCHS)
        assert all(set(entries) == {16, 32, 64, 128, 256} for entries in table.values())
    assert set(mlp.GEMM_CONFIGS) == set(runtime.ARCHS)
    for tables in mlp.GEMM_CONFIGS.values():
        assert {k: set(v) for k, v in tables.items()} == {
            k: set(v) for k, v in mlp.GEMM_CONFIGS["sm90"].items()
        }
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
    from kernels import layernorm

    for arch in runtime.ARCHS.values():
        reported = {(c.dtype, c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"], c.num_warps)
                    for c in compile_report.norm_configs(arch) if "BLOCK_M" in c.constexprs}  # fmt: skip
        for n, backward, dtype in itertools.product(
            range(1, layernorm.MAX_HIDDEN + 1, 97), (False, True), compile_report.TRITON_TYPES
        ):
            cfg = layernorm.row_config(n, backward, dtype, arch)
            assert (dtype, cfg.block_m, cfg.block_n, cfg.num_warps) in reported, (
                arch.name,
                n,
                backward,
                dtype,
            )


def test_real_compile_of_one_kernel_for_three_gpu_families():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.compile_report",
            "--arch",
            "sm90",
            "sm86",
            "gfx942",
            "--filter",
            "rms_norm_bwd_row_coeffs",
            "--jobs",
            "2",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if " rms_norm_bwd_row_coeffs " in line]
    assert sorted(row[0] for row in rows) == ["gfx942"] * 3 + ["sm86"] * 3 + ["sm90"] * 3  # a dtype each
    targets = {(row[0], row[-1]) for row in rows}
    assert targets == {("sm86", "sm_86"), ("sm90", "sm_90a"), ("gfx942", "gfx942")}
    for row in rows:
        registers, spills = int(row[7]), int(row[8])
        assert registers > 0 and spills == 0
    assert "9 configs compiled for sm_90, sm_86, gfx942" in run.stdout


AMD_MATMUL = """
import json
from bench import compile_report as cr

[cfg] = [c for c in cr.all_configs(["gfx942"]) if c.kernel == "mlp_fwd" and c.dtype_name == "fp16"][:1]
[r] = cr.compile_configs([cfg])
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
        command = [sys.executable, "-m", "bench.compile_report", "--filter", "rms_norm_bwd_row_coeffs", *args]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    run = report("--arch", "sm86", "--capability", "120")  # an RTX 5090 takes the sm86 entries
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 configs compiled for sm_120 " in run.stdout and "sm86 (RTX" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if " rms_norm_bwd_row_coeffs " in line]
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
    from kernels import attention, mlp

    cfg = attention.AttnConfig(128, 64, 8, 3, tma=True)
    padded = compile_report.attention_entry_configs("FWD_CONFIGS", cfg, 128, runtime.SM90)
    assert len(padded) == 3 * 2 * 2 * 2  # masks, head dims 128 and 96, dtypes, TMA and pointers
    assert padded[0].constexprs["LOCAL"] and not any(c.constexprs["VARLEN"] for c in padded)
    assert {c.constexprs["HEAD_DIM"] for c in padded} == {128, 96} and sum(
        bool(c.descriptors) for c in padded
    ) == 12
    packed = compile_report.attention_entry_configs("PACKED_FWD_CONFIGS", cfg, 128, runtime.SM90)
    assert len(packed) == 12 and all(c.constexprs["VARLEN"] and not c.descriptors for c in packed)
    bwd = compile_report.attention_entry_configs("BWD_DQ_CONFIGS", cfg, 128, runtime.SM80)
    assert len(bwd) == 24 and not any(c.descriptors for c in bwd)  # padded and packed, no TMA on sm_80
    gemm = mlp.GemmConfig(128, 128, 64, 8, 8, 4)
    assert len(compile_report.mlp_entry_configs("fwd", "large", gemm, runtime.SM90)) == 8
    assert len(compile_report.mlp_entry_configs("fwd", "large", gemm, runtime.SM86)) == 4
    assert all(c in compile_report.all_configs(["sm86"]) for c in compile_report.attention_entry_configs(
        "BWD_DKDV_CONFIGS", attention.BWD_DKDV_CONFIGS["sm86"][64], 64, runtime.SM86))  # fmt: skip


SASS_AGREEMENT = """
import json, subprocess, tempfile
from bench import compile_report as cr

wanted = [("sm90", "mlp_fwd"), ("sm90", "rms_norm_bwd_row_coeffs"), ("sm80", "mlp_fwd"),
          ("sm90", "attn_bwd_preprocess")]
configs = []
for arch, kernel in wanted:
    found = [c for c in cr.all_configs([arch]) if c.kernel == kernel and c.dtype_name == "fp16"]
    configs += [c for c in found if c.shape_class.startswith("small")][:2] or found[:1]
batched = cr.compile_configs(configs)
alone = []
for cfg in configs:  # cuobjdump's SASS of each cubin on its own: what the batch must agree with
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(cr.compile_kernel(cfg).asm["cubin"])
        cubin.flush()
        sass = subprocess.run([cr.CUOBJDUMP, "--dump-sass", cubin.name], capture_output=True,
                              text=True, check=True).stdout
    alone.append(cr.count_sass(sass))
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
    contraction, which Triton 3.10 stops doing by default): every kernel's launch is checked."""
    from triton.runtime.interpreter import GridExecutor  # runs every launch in the interpreter

    import kernels
    from kernels import attention, layernorm, mlp

    interpreted = type(layernorm._norm_fwd_kernel)  # the interpreter's stand-in for a JIT function
    launches = []
    launch = GridExecutor.__call__

    def recording_launch(self, *args, **kwargs):
        launches.append((self.fn.__name__, {k: kwargs.get(k) for k in runtime.COMPILE_OPTIONS}))
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
    x = torch.randn(20, 32, **f16, requires_grad=True)
    w1, w2, w3 = (torch.randn(48, 32, **f16).mul_(0.2).requires_grad_() for _ in range(3))
    backward(kernels.linear_act(x, w1, None, activation="gelu"))
    backward(kernels.gated_linear(x, w1, w2, activation="silu"))
    backward(kernels.fused_mlp(x, w1, None, w3.t().contiguous(), None, activation="gelu"))
    backward(kernels.fused_gated_mlp(x, w1, w2, w3.t().contiguous(), activation="silu"))
    defined = {name for module in (attention, layernorm, mlp) for name, value in vars(module).items()
               if isinstance(value, interpreted) and name.endswith("_kernel")}  # fmt: skip
    assert {name for name, _ in launches} == defined
    assert all(options == runtime.COMPILE_OPTIONS for _, options in launches), launches


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
