"""CPU tests of the MoE benchmark: FLOP counts, its correctness check, its cases and their baselines. Timing
needs a GPU and is never asserted on."""

import pytest
import torch

from bench import correctness, moe, suite

TINY, TINY_TOP1 = (layer for layer, _ in moe.INTERPRETER_CASES)


def test_flops_count_the_routed_pairs_gemms():
    pairs = 33 * TINY.top_k
    forward = 2 * pairs * 40 * 2 * 24 + 2 * pairs * 24 * 40
    assert moe.moe_flops(TINY, 33, "forward") == forward == 6 * pairs * 40 * 24
    assert moe.moe_flops(TINY, 33, "backward") == 2 * forward
    assert moe.moe_flops(TINY, 33, "forward+backward") == 3 * forward


@pytest.mark.interpreter
def test_interpreter_checks_pass():
    results = moe.interpreter_checks()
    assert len(results) == len(moe.INTERPRETER_CASES)
    assert all(ok for _, _, ok in results), results
    assert set(results[0][1]) == {"y", "dx", "dexpert_weights", "dgate_up_proj", "ddown_proj"}


def test_a_wrong_kernel_fails_the_check(monkeypatch):
    monkeypatch.setattr(moe, "ours_moe", lambda layer, t: 1.05 * moe.reference_moe(layer, t))
    errors, ok = moe.check(TINY, 33, "cpu", torch.float32)
    assert not ok and errors["y"] > moe.TOLERANCE


def test_cases_cover_both_layers_every_direction_and_baseline():
    cases = moe.cases(quick=False)
    assert {c.kernel for c in cases} == {"moe_mlp"}
    assert {c.implementation for c in cases} == {"ours", "ours-pointer", "loop", "grouped_mm"}
    assert len(cases) == len(moe.LAYERS) * 4 * len(suite.DIRECTIONS)
    assert all((c.check is not None) == (c.implementation == "ours") for c in cases)
    qwen3 = {"tokens": 8192, "experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
    [case] = [
        c
        for c in cases
        if c.params == qwen3 and c.direction == "forward+backward" and c.implementation == "ours"
    ]
    assert case.work == 3 * 6 * 8192 * 8 * 2048 * 768 and case.unit == "flop"
    assert {c.params["experts"] for c in cases} == {128, 8}
    quick = moe.cases(quick=True)
    assert {c.direction for c in quick} == {"forward+backward"} and len(quick) == len(moe.LAYERS) * 4


@pytest.mark.interpreter
@pytest.mark.parametrize("layer", [TINY, TINY_TOP1], ids=["top2", "top1"])
def test_every_timed_call_runs_and_the_baselines_compute_the_experts(layer, monkeypatch):
    # The cases' setups on the CPU, float16, with one copy of the inputs: every call the GPU would time
    # runs, and transformers' loop and grouped_mm compute what the reference computes.
    monkeypatch.setattr(
        moe.timing, "rotating_inputs", lambda make_copy, bytes_per_copy, device: [make_copy()]
    )
    cases = moe.layer_cases(layer, 17, device="cpu", dtype=moe.INTERPRETER_DTYPE)
    for case in cases:
        result = case.setup()()
        if case.direction == "forward":
            assert result.shape == (17, layer.hidden)
        else:
            e, h, i = layer.experts, layer.hidden, layer.inter
            weights = [(e, 2 * i, h), (e, h, i)]
            assert [g.shape for g in result] == [(17, layer.hidden), (17, layer.top_k), *weights]
    torch.manual_seed(0)
    tensors = moe.make_inputs(layer, 17, "cpu", torch.float16)
    exact = {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}
    expected = moe.reference_moe(layer, exact)
    for implementation in ("loop", "grouped_mm"):
        got = moe.transformers_experts(implementation, layer, tensors)
        assert correctness.normalized_error(got, expected) < 2e-3, implementation
