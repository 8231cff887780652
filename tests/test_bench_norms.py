"""CPU tests of the norm benchmark: byte counts, statistics, rotation, its correctness check and cases."""

import pytest
import torch

from bench import correctness, norms, timing

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


def test_normalized_error_is_absolute_on_small_outputs_and_relative_on_large_ones():
    expected = torch.tensor([0.5, -1.0])
    assert correctness.normalized_error(torch.tensor([0.5, -0.99]), expected) == pytest.approx(0.01)
    assert correctness.normalized_error(100 * torch.tensor([0.5, -0.99]), 100 * expected) == pytest.approx(
        0.01
    )
    assert correctness.normalized_error(torch.tensor([float("nan"), 1.0]), expected) != 0.0


def _off_by_5_percent(fn):
    return lambda *args: 1.05 * fn(*args)


@pytest.mark.interpreter
@pytest.mark.parametrize("wrong", [False, True])
def test_check_tells_right_from_wrong(wrong):
    layer_norm = norms.norms()[0]
    ours = _off_by_5_percent(layer_norm.ours) if wrong else layer_norm.ours
    candidate = norms.Norm("layer_norm", True, ours, layer_norm.eager, layer_norm.reference)
    errors, ok = norms.check(candidate, 16, 96, "cpu")
    assert list(errors) == ["y", "dx", "dweight", "dbias"]
    assert ok is not wrong


def test_cases_cover_every_shape_direction_and_implementation():
    cases = norms.cases(quick=False)
    shapes = len(norms.ROWS) * len(norms.HIDDEN)
    assert len(cases) == 2 * shapes * 2 * 3  # norms x shapes x directions x (ours, eager, compile)
    assert {c.implementation for c in cases} == {"ours", "eager", "compile"}
    assert all((c.check is not None) == (c.implementation == "ours") for c in cases)
    rms_backward = next(c for c in cases if c.kernel == "rms_norm" and c.direction == "backward")
    rows, hidden = rms_backward.params["rows"], rms_backward.params["hidden"]
    assert rms_backward.unit == "byte" and rms_backward.work == norms.backward_bytes(
        rows, hidden, 2, 2, False
    )
    assert len(norms.cases(quick=True)) == 2 * len(norms.QUICK_SHAPES) * 2 * 3


@pytest.mark.interpreter
def test_interpreter_checks_pass():
    results = norms.interpreter_checks()
    assert len(results) == 2 * len(norms.INTERPRETER_SHAPES)
    assert all(ok for _, _, ok in results), results
