"""CPU tests of the fused-loss benchmark: FLOP and byte counts, its correctness check and its cases.
Timing needs a GPU and is never asserted on."""

import pytest
import torch

from bench import loss, suite


def test_flops_count_the_gemms_and_bytes_the_logits():
    assert loss.linear_loss_flops(3, 5, 7, "forward") == 2 * 3 * 5 * 7
    assert loss.linear_loss_flops(3, 5, 7, "forward+backward") == 3 * 2 * 3 * 5 * 7  # and dx, dW
    assert loss.cross_entropy_bytes(16, 50304, 2, "forward") == 16 * 50304 * 2
    assert loss.cross_entropy_bytes(16, 50304, 2, "forward+backward") == 2 * 16 * 50304 * 2


@pytest.mark.interpreter
def test_interpreter_checks_pass():
    results = loss.interpreter_checks()
    assert len(results) == len(loss.INTERPRETER_SHAPES)
    assert all(ok for _, _, ok in results), results
    assert set(results[0][1]) == {"loss", "dx", "dw"}


def test_a_wrong_kernel_fails_the_check(monkeypatch):
    from horse import kernels

    real = kernels.linear_cross_entropy
    monkeypatch.setattr(kernels, "linear_cross_entropy", lambda *args, **kw: 1.05 * real(*args, **kw))
    errors, ok = loss.check(33, 16, 40, "cpu")
    assert not ok and errors["loss"] > loss.TOLERANCE


def test_cases_cover_every_head_direction_and_baseline():
    cases = loss.cases(quick=False)
    heads = [c for c in cases if c.kernel == "linear_cross_entropy"]
    assert {c.implementation for c in heads} == {"ours", "eager", "compile", "liger"}
    assert len(heads) == 4 * len(loss.DIRECTIONS) * len(loss.TOKENS) * len(loss.HEADS)
    assert all((c.check is not None) == (c.implementation == "ours") for c in heads)
    logits = [c for c in cases if c.kernel == "cross_entropy"]
    assert {c.unit for c in logits} == {"byte"} and {c.unit for c in heads} == {"flop"}
    quick = loss.cases(quick=True)
    compiled = [c for c in quick if c.implementation == "compile"]  # each case compiles afresh
    assert [c.direction for c in compiled] == ["forward+backward"]


@pytest.mark.interpreter
def test_every_timed_call_runs(monkeypatch):
    # The cases' setups on the CPU with one copy of the inputs and no Inductor: every call the GPU
    # would time runs, and returns a loss (forward) or a gradient per float input.
    monkeypatch.setattr(loss.timing, "rotating_inputs", lambda make_copy, nbytes, device: [make_copy()])
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    cases = loss.linear_cases(33, 16, 40, device="cpu") + loss.cross_entropy_cases(9, 70, device="cpu")
    ran = 0
    for case in cases:
        try:
            call = case.setup()
        except suite.UnavailableError:
            assert case.implementation == "liger"
            continue
        result = call()
        ran += 1
        if case.direction == "forward":
            assert result.shape == () and torch.isfinite(result), case.id
        else:
            assert len(result) == (2 if case.kernel == "linear_cross_entropy" else 1), case.id
    assert ran >= len(cases) - len(loss.DIRECTIONS)
