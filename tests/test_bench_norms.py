"""CPU tests of the norm benchmark's logic: byte counts, statistics, targets, checks and the report.

Timing itself needs a GPU and is never asserted on; here the GPU-only pieces are replaced by fakes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import norms, timing

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def test_forward_bytes_layer_norm_fp16():
    # Read x, write y; read weight and bias.
    assert norms.forward_bytes(4096, 1024, 2, 2, has_bias=True) == 2 * 4096 * 1024 * 2 + 2 * 1024 * 2


def test_forward_bytes_rms_norm_fp16():
    assert norms.forward_bytes(4096, 1024, 2, 2, has_bias=False) == 2 * 4096 * 1024 * 2 + 1024 * 2


def test_forward_bytes_counts_parameters_in_their_own_dtype():
    assert norms.forward_bytes(16384, 4096, 2, 4, has_bias=True) == 2 * 16384 * 4096 * 2 + 2 * 4096 * 4


def test_backward_bytes_layer_norm_fp16():
    # Read x and dy, write dx; read weight, write dweight and dbias.
    assert norms.backward_bytes(4096, 1024, 2, 2, has_bias=True) == 3 * 4096 * 1024 * 2 + 3 * 1024 * 2


def test_backward_bytes_rms_norm_fp16():
    # Read x and dy, write dx; read weight, write dweight.
    assert norms.backward_bytes(65536, 8192, 2, 2, has_bias=False) == 3 * 65536 * 8192 * 2 + 2 * 8192 * 2


def test_summarize_gives_median_and_20th_80th_percentiles():
    summary = timing.summarize([float(ms) for ms in (11, 1, 10, 2, 9, 3, 8, 4, 7, 5, 6)])
    assert summary == timing.Timing(median_ms=6.0, p20_ms=3.0, p80_ms=9.0, samples=11)


def test_summarize_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2 samples"):
        timing.summarize([1.0])


@pytest.mark.parametrize(
    ("bytes_per_copy", "budget_bytes", "expected"),
    [
        (16 * MIB, 10 * 2**30, 7),  # ceil(2 × 50 MiB / 16 MiB)
        (100 * MIB, 10 * 2**30, 1),  # one copy already spans two L2 caches
        (2 * 2**30, 10 * 2**30, 1),
        (16 * MIB, 32 * MIB, 2),  # capped by the memory budget
        (16 * MIB, 1 * MIB, 1),  # always at least one copy
    ],
)
def test_rotation_copies_span_two_l2_caches_within_the_budget(bytes_per_copy, budget_bytes, expected):
    assert timing.rotation_copies(bytes_per_copy, 50 * MIB, budget_bytes) == expected


@pytest.mark.parametrize(
    ("direction", "rows", "hidden", "copy_fraction", "speedup_vs_compile", "expected"),
    [
        ("forward", 16384, 4096, 0.91, 1.5, True),
        ("forward", 16384, 4096, 0.89, 1.5, False),
        ("backward", 65536, 16384, 0.81, 1.5, True),
        ("backward", 65536, 16384, 0.79, 1.5, False),
        ("forward", 4096, 16384, 0.50, 1.5, True),  # too few rows for the bandwidth target
        ("backward", 65536, 1024, 0.50, 1.5, True),  # rows too short for the bandwidth target
        ("forward", 4096, 1024, 0.95, 0.99, False),  # slower than torch.compile
    ],
)
def test_meets_targets(direction, rows, hidden, copy_fraction, speedup_vs_compile, expected):
    assert norms.meets_targets(direction, rows, hidden, copy_fraction, speedup_vs_compile) is expected


def test_normalized_error_is_absolute_on_small_outputs_and_relative_on_large_ones():
    expected = torch.tensor([0.5, -1.0])
    assert norms.normalized_error(torch.tensor([0.5, -0.99]), expected) == pytest.approx(0.01)
    assert norms.normalized_error(100 * torch.tensor([0.5, -0.99]), 100 * expected) == pytest.approx(0.01)


def test_check_fails_on_nan():
    check = norms.Check("LayerNorm", 8, 64, {"y": 0.0, "dx": float("nan")}, tolerance=2e-2)
    assert not check.ok
    assert "FAIL" in check.describe()


def _eager_layer_norm_off_by_5_percent(x, weight, bias):
    return 1.05 * norms._eager_layer_norm(x, weight, bias)


@pytest.mark.parametrize(
    ("ours", "expected_ok"),
    [(norms._eager_layer_norm, True), (_eager_layer_norm_off_by_5_percent, False)],
)
def test_check_against_reference_tells_right_from_wrong(ours, expected_ok):
    layer_norm = norms.NORMS[0]
    candidate = norms.Norm("LayerNorm", True, ours, layer_norm.eager, layer_norm.reference)
    check = norms.check_against_reference(candidate, 16, 96, torch.float32, torch.device("cpu"))
    assert list(check.errors) == ["y", "dx", "dweight", "dbias"]
    assert check.ok is expected_ok


def test_table_rows_line_up_with_the_header():
    ours = norms.Result(
        "RMSNorm", "backward", 65536, 16384, "ours", 1.5, 1.4, 1.6, 4321.0, 0.95, 1.3, 1.1, True, True
    )
    eager = norms.Result("RMSNorm", "backward", 65536, 16384, "eager", 2.0, 1.9, 2.1, 3200.0, 0.7)
    header = norms.format_row([name for name, _, _ in norms.COLUMNS])
    lines = [norms.format_row(norms.result_cells(result)) for result in (ours, eager)]
    assert {len(line) for line in lines} == {len(header)}
    assert lines[0].split()[-3:] == ["1.10x", "ok", "PASS"]


def test_run_benchmark_report_with_gpu_pieces_faked(monkeypatch, capsys):
    fixed = timing.Timing(median_ms=1.0, p20_ms=0.9, p80_ms=1.1, samples=100)

    def call_once(fn, inputs):
        fn(inputs[0])
        return fixed

    machine_without_gpu = timing.machine_info()
    monkeypatch.setattr(timing, "machine_info", lambda device: machine_without_gpu | {"gpu": "fake"})
    monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda device: 1.0)
    monkeypatch.setattr(timing, "matmul_tflops", lambda device: 1.0)
    monkeypatch.setattr(timing, "rotating_inputs", lambda make_copy, bytes_per_copy, device: [make_copy()])
    monkeypatch.setattr(timing, "time_gpu", call_once)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # Inductor takes ~30 s on the CPU

    report, all_correct = norms.run_benchmark([(8, 64)], torch.float32, torch.device("cpu"))

    assert all_correct
    results = report["results"]
    assert len(results) == len(norms.NORMS) * 2 * 3  # norms × directions × implementations
    ours_forward = results[0]
    assert ours_forward["implementation"] == "ours" and ours_forward["direction"] == "forward"
    assert ours_forward["gbps"] == pytest.approx(norms.forward_bytes(8, 64, 4, 4, True) / 1e-3 / 1e9)
    assert ours_forward["speedup_vs_compile"] == 1.0 and ours_forward["meets_targets"]
    json.dumps(report)  # what --json writes
    assert capsys.readouterr().out.count("\n") > len(results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark times instead")
def test_without_gpu_the_benchmark_checks_correctness_in_the_interpreter(tmp_path):
    report_path = tmp_path / "norms.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "bench.norms", "--quick", "--json", str(report_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,  # the exit status is asserted below, with the output for context
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "needs a GPU" in completed.stdout
    report = json.loads(report_path.read_text())
    assert report["results"] == []
    assert len(report["checks"]) == len(norms.INTERPRETER_SHAPES) * len(norms.NORMS)
    assert all(check["ok"] for check in report["checks"])
