"""The sm_90 compile report's parsing and gate, and one real compile of a kernel family."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import compile_report
from bench.compile_report import CompileResult, KernelConfig

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
"""


def test_parse_resource_usage_counts_stack_and_local_as_spills():
    assert compile_report.parse_resource_usage(RESOURCE_USAGE) == (70, 24)


def test_count_sass_finds_tensor_core_ops_wide_loads_and_tma_loads():
    assert compile_report.count_sass(SASS) == (2, 2, 1)


def _result(spill_bytes=0, shared_bytes=0) -> CompileResult:
    cfg = KernelConfig("k", "N<=64", torch.float16, "kernels.layernorm._norm_fwd_kernel", {}, {"BLOCK_N": 64})
    return CompileResult(cfg, 40, spill_bytes, shared_bytes, 0, 4, 0)


def test_gate_fails_spills_and_shared_memory_over_the_limit():
    assert compile_report.failures([_result()]) == []
    assert compile_report.failures([_result(shared_bytes=compile_report.SM90_MAX_SHARED_BYTES)]) == []
    [spill] = compile_report.failures([_result(spill_bytes=8)])
    assert "spills 8 bytes" in spill
    [smem] = compile_report.failures([_result(shared_bytes=compile_report.SM90_MAX_SHARED_BYTES + 1)])
    assert "shared memory" in smem


def test_every_selectable_norm_config_is_in_the_report():
    from kernels import layernorm

    reported = {(c.dtype, c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"], c.num_warps)
                for c in compile_report.norm_configs() if "BLOCK_M" in c.constexprs}  # fmt: skip
    for n, backward, dtype in itertools.product(
        range(1, layernorm.MAX_HIDDEN + 1, 97), (False, True), compile_report.TRITON_TYPES
    ):
        cfg = layernorm.row_config(n, backward, dtype)
        assert (dtype, cfg.block_m, cfg.block_n, cfg.num_warps) in reported, (n, backward, dtype)


def test_real_compile_of_one_family_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-m", "bench.compile_report", "--filter", "rms_norm_bwd_row_coeffs", "--jobs", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [
        line.split() for line in run.stdout.splitlines() if line.strip().startswith("rms_norm_bwd_row_coeffs")
    ]
    assert len(rows) == 3  # one per dtype
    for row in rows:
        registers, spills = int(row[6]), int(row[7])
        assert registers > 0 and spills == 0
    assert "3 configs compiled for sm_90" in run.stdout
