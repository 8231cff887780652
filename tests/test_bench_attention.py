"""CPU tests of the attention benchmark: FLOP counts, shapes, its correctness check and its cases."""

import functools

import pytest
import torch

from bench import attention, correctness, timing
from horse.kernels import reference


def test_forward_flops_non_causal():
    # batch 4, heads 16, seqlen 4096, head_dim 128: two matmuls of 2·S·S·D per (batch, head).
    assert attention.forward_flops(4, 16, 4096, 4096, 128, causal=False) == 4 * 4 * 16 * 4096 * 4096 * 128
    assert attention.forward_flops(4, 16, 4096, 4096, 128, causal=False) == 549_755_813_888


def test_forward_flops_causal_is_half():
    assert attention.forward_flops(4, 16, 4096, 4096, 128, causal=True) == 2 * 4 * 16 * 4096 * 4096 * 128


def test_forward_flops_unequal_lengths():
    assert attention.forward_flops(2, 3, 5, 7, 64, causal=False) == 4 * 2 * 3 * 5 * 7 * 64


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_is_2_5x_and_forward_backward_3_5x_the_forward(causal):
    forward = attention.forward_flops(4, 16, 4096, 4096, 128, causal)
    shape = attention.benchmark_shape(4096, 128)
    assert attention.direction_flops("backward", shape, causal) == 2.5 * forward
    assert attention.direction_flops("forward+backward", shape, causal) == 3.5 * forward


def test_benchmark_shapes_hold_16k_tokens_and_2048_channels():
    assert attention.benchmark_shape(4096, 128) == attention.Shape(
        batch=4, seqlen=4096, heads=16, head_dim=128
    )
    assert attention.benchmark_shape(512, 64) == attention.Shape(batch=32, seqlen=512, heads=32, head_dim=64)
    with pytest.raises(ValueError, match="seqlen must divide"):
        attention.benchmark_shape(3000, 128)


def test_direction_flops_use_the_shape():
    shape = attention.benchmark_shape(4096, 128)
    assert attention.direction_flops("forward+backward", shape, causal=True) == 7 * 4 * 16 * 4096 * 4096 * 128


@pytest.mark.parametrize(
    ("seqlen", "head_dim", "expected"),
    [
        (16384, 128, (1, 4)),  # 4 of 16 heads: 2**30 score elements
        (8192, 128, (1, 16)),
        (4096, 128, (4, 16)),  # every (batch, head) pair
        (2048, 64, (8, 32)),
        (512, 128, (32, 16)),
    ],
)
def test_reference_checks_a_leading_block_within_its_budget(seqlen, head_dim, expected):
    shape = attention.benchmark_shape(seqlen, head_dim)
    assert attention.checked_batch_heads(shape, 2**30) == expected


def test_reference_checks_at_least_one_pair():
    assert attention.checked_batch_heads(attention.benchmark_shape(16384, 128), 1) == (1, 1)


def test_normalized_error_is_relative_to_the_largest_value():
    expected = torch.tensor([0.01, -0.02])
    error = functools.partial(correctness.normalized_error, floor=0.0)  # attention's: no absolute floor
    assert error(torch.tensor([0.01, -0.0198]), expected) == pytest.approx(0.01, rel=1e-3)
    assert error(torch.tensor([0.01, float("nan")]), expected) != 0.0  # NaN
    assert not error(torch.tensor([float("nan"), 0.0]), expected) <= 1.0


def _half_precision_reference(causal):
    return lambda q, k, v: reference.attention(q, k, v, causal, upcast=False)[0]


def _off_by_5_percent(causal):
    return lambda q, k, v: 1.05 * reference.attention(q, k, v, causal, upcast=False)[0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("make", "expected_ok"), [(_half_precision_reference, True), (_off_by_5_percent, False)]
)
def test_check_tells_right_from_wrong(make, expected_ok, causal):
    errors, ok = attention.check(attention.Shape(2, 48, 2, 32), causal, "cpu", make(causal))
    assert list(errors) == ["out", "dq", "dk", "dv"]
    assert ok is expected_ok


def test_check_fails_on_non_finite_values_outside_the_checked_block(monkeypatch):
    monkeypatch.setattr(attention, "REFERENCE_SCORE_ELEMENTS", 16 * 16)  # the reference sees batch 0 only

    def nan_in_batch_1(q, k, v):
        out = reference.attention(q, k, v, upcast=False)[0]
        return out.index_put((torch.tensor([1]),), torch.tensor(float("nan"), dtype=out.dtype))

    errors, ok = attention.check(attention.Shape(2, 16, 1, 16), False, "cpu", nan_in_batch_1)
    assert all(e < attention.TOLERANCE for e in errors.values()) and not ok


def test_check_on_a_block_of_a_large_shape(monkeypatch):
    monkeypatch.setattr(attention, "REFERENCE_SCORE_ELEMENTS", 3 * 64 * 64)
    errors, ok = attention.check(attention.Shape(2, 64, 4, 16), True, "cpu", _half_precision_reference(True))
    assert ok and attention.checked_batch_heads(attention.Shape(2, 64, 4, 16), 3 * 64 * 64) == (1, 3)


def test_cases_cover_shapes_directions_and_baselines():
    cases = [c for c in attention.cases(quick=False) if c.kernel == "attention"]
    shapes = len(attention.SEQLENS) * len(attention.HEAD_DIMS)
    ours = [c for c in cases if c.implementation == "ours"]
    assert len(ours) == shapes * 2 * 3  # x causal x directions
    assert all(c.check is not None for c in ours) and all(c.unit == "flop" for c in cases)
    names = {c.implementation for c in cases}
    assert names == {
        "ours",
        "ours-pointer",
        "sdpa-flash",
        "sdpa-cudnn",
        "sdpa-efficient",
        "sdpa-math",
        "compile",
        "flash-attn",
        f"ours-{attention.FILED_AT}",  # head dim 128, causal: issue 25's baseline
    }
    assert {
        (c.params["head_dim"], c.params["causal"]) for c in cases if c.implementation.endswith("7b2e7b7")
    } == {(128, True)}
    assert (
        max(c.params["seqlen"] for c in cases if c.implementation == "sdpa-math") == attention.MATH_MAX_SEQLEN
    )
    quick = [c for c in attention.cases(quick=True) if c.kernel == "attention"]
    assert {(c.params["seqlen"], c.params["head_dim"]) for c in quick} == set(attention.QUICK_SHAPES)
    assert {c.implementation for c in quick} == names - {"compile"}  # ungated, and each case compiles


def test_window_and_packed_cases_in_full_runs_only():
    cases = attention.cases(quick=False)
    window = [c for c in cases if c.kernel == "attention_window"]
    packed = [c for c in cases if c.kernel == "attention_packed"]
    assert {c.implementation for c in window} == {"ours", "ours-causal", "sdpa-efficient-mask", "flash-attn"}
    assert {c.implementation for c in packed} == {"ours", "ours-padded", "sdpa-flash-padded", "flash-attn"}
    assert len(window) == len(attention.WINDOW_SEQLENS) * 4 * 3 and len(packed) == 4 * 3
    assert all(c.check is not None for c in window + packed if c.implementation == "ours")
    # Every implementation of a shape and direction is credited with the same work: the window's.
    for c in window:
        shape = attention.benchmark_shape(c.params["seqlen"], c.params["head_dim"])
        forward = attention.window_flops(
            shape.batch, shape.heads, shape.seqlen, shape.head_dim, attention.WINDOW
        )
        assert c.work == attention.direction_flops(c.direction, shape, True, forward)
    assert {c.work for c in packed if c.direction == "forward"} == {
        attention.packed_flops(attention.PACKED_LENGTHS, 16, 128)
    }
    quick_kernels = {c.kernel for c in attention.cases(quick=True)}
    assert not quick_kernels - {"attention", "attention_decode", "attention_score_mods"}


def test_decode_cases_read_the_cache_once():
    decode = [c for c in attention.cases(quick=False) if c.kernel == "attention_decode"]
    assert {c.implementation for c in decode} == {"ours", "ours-prefill", "sdpa", "flash-attn"}
    assert len(decode) == len(attention.DECODE_SHAPES) * 4 and {c.direction for c in decode} == {"forward"}
    assert all(c.check is not None for c in decode if c.implementation == "ours")
    for c in decode:
        p = c.params
        assert c.unit == "byte" and c.work == 2 * p["batch"] * p["cache"] * p["kv_heads"] * p["head_dim"] * 2


@pytest.mark.interpreter
def test_check_decode_passes_ours_and_fails_a_wrong_result(monkeypatch):
    from horse import kernels

    errors, ok = attention.check_decode(2, 70, 64, "cpu")
    assert ok and set(errors) == {"out"}, errors
    decode = kernels.flash_attention_with_kvcache
    monkeypatch.setattr(kernels, "flash_attention_with_kvcache", lambda *a, **kw: 1.05 * decode(*a, **kw))
    errors, ok = attention.check_decode(2, 70, 64, "cpu")
    assert not ok and errors["out"] > attention.TOLERANCE


def test_window_and_packed_flop_counts():
    # Seqlen 5, window 2: queries see 1, 2, 3, 3, 3 keys.
    assert attention.window_flops(2, 3, 5, 64, window=2) == 4 * 2 * 3 * 64 * 12
    # A window past the sequence is plain causal: S(S+1)/2 pairs, against forward_flops' S²/2.
    assert attention.window_flops(1, 1, 8, 16, window=100) == 4 * 16 * 36
    assert attention.packed_flops((3, 5), 2, 64) == 4 * 2 * 64 * (9 + 25) // 2


@pytest.mark.interpreter
def test_check_packed_passes_ours_and_fails_a_wrong_result(monkeypatch):
    from horse import kernels

    errors, ok = attention.check_packed((40, 1, 77, 0, 19), 2, 64, "cpu")
    assert ok and set(errors) == {"out", "dq", "dk", "dv"}, errors
    varlen = kernels.flash_attention_varlen
    monkeypatch.setattr(kernels, "flash_attention_varlen", lambda *a, **kw: 1.05 * varlen(*a, **kw))
    errors, ok = attention.check_packed((40, 1, 77, 0, 19), 2, 64, "cpu")
    assert not ok and errors["out"] > attention.TOLERANCE


def test_score_mod_cases_time_ours_and_flex_both_ways():
    for quick in (False, True):
        cases = [c for c in attention.cases(quick) if c.kernel == "attention_score_mods"]
        assert {c.implementation for c in cases} == {"ours", "flex", "sdpa"}
        plain = sum(
            len(directions) for modification, _, directions in attention.SCORE_MODS if modification == "none"
        )
        assert len(cases) == 2 * sum(len(directions) for _, _, directions in attention.SCORE_MODS) + plain
    assert all(c.check is not None for c in cases if c.implementation == "ours")
    with_sdpa = {(c.params["head_dim"], c.direction) for c in cases if c.implementation == "sdpa"}
    assert with_sdpa == {(512, "forward"), (512, "forward+backward")}
    plain_cases = [c for c in cases if not c.params["softcap"] and not c.params["sinks"]]
    assert {c.params["head_dim"] for c in plain_cases} == {512}
    softcapped = {(c.params["head_dim"], c.direction) for c in cases if c.params["softcap"]}
    assert softcapped == {(d, direction) for d in (128, 64) for direction in ("forward", "forward+backward")}
    with_sinks = {(c.params["head_dim"], c.direction) for c in cases if c.params["sinks"]}
    assert with_sinks == {(128, "forward"), (128, "forward+backward")}
    for c in cases:
        shape = attention.benchmark_shape(c.params["seqlen"], c.params["head_dim"])
        assert c.work == attention.direction_flops(c.direction, shape, causal=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("modification", ["softcap", "sinks", "none"])
def test_the_flex_baselines_compute_the_same_modification_as_the_reference(modification):
    """flex_attention (uncompiled, forward: its CPU path has no backward) with the score_mod or the sinks
    taken from its lse, against the float32 reference with softcap= or sinks=."""
    torch.manual_seed(0)
    shape = attention.Shape(2, 37, 3, 16)
    q, k, v = (t.float() for t in attention.make_qkv(shape, "cpu"))
    q = q * 30  # scores of ~±100 on the scaled scale: SOFTCAP (50) bends them
    sinks = attention.make_sinks(shape, "cpu") * 3
    flex = attention._flex(modification, shape.seqlen, "cpu")
    if modification == "softcap":
        got = flex(q, k, v)
        expected, _ = reference.attention(q, k, v, causal=True, softcap=attention.SOFTCAP)
        plain, _ = reference.attention(q, k, v, causal=True)
    elif modification == "sinks":
        got = flex(q, k, v, sinks)
        expected, _ = reference.attention(q, k, v, causal=True, sinks=sinks)
        plain, _ = reference.attention(q, k, v, causal=True)
    else:
        got = flex(q, k, v)
        expected, _ = reference.attention(q, k, v, causal=True)
        plain = None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if plain is not None:
        assert (plain - expected).abs().max() > 0.1  # the modification matters at these scores


def test_check_tells_sinks_from_none():
    def with_sinks(q, k, v, sinks):
        return reference.attention(q, k, v, True, upcast=False, sinks=sinks)[0]

    def ignoring_sinks(q, k, v, sinks):
        return reference.attention(q, k, v, True, upcast=False)[0] + 0 * sinks.sum()

    shape = attention.Shape(2, 48, 2, 32)
    errors, ok = attention.check(shape, True, "cpu", with_sinks, sinks=True)
    assert ok and list(errors) == ["out", "dq", "dk", "dv", "dsinks"], errors
    assert not attention.check(shape, True, "cpu", ignoring_sinks, sinks=True)[1]


@pytest.mark.interpreter
def test_check_with_a_softcap_fails_ours_without_it(monkeypatch):
    from horse import kernels

    shape = attention.INTERPRETER_SHAPES[0]
    assert attention.check(shape, True, "cpu", softcap=attention.SOFTCAP)[1]
    flash_attention = kernels.flash_attention
    monkeypatch.setattr(
        kernels, "flash_attention", lambda *a, **kw: flash_attention(*a, **kw | {"softcap": 0})
    )
    errors, ok = attention.check(shape, True, "cpu", softcap=attention.SOFTCAP)
    assert not ok and errors["out"] > attention.TOLERANCE


@pytest.mark.interpreter
def test_interpreter_checks_pass():
    results = attention.interpreter_checks()
    assert len(results) == 2 * len(attention.INTERPRETER_SHAPES) + 5
    assert all(ok for _, _, ok in results), results


def test_ours_pointer_times_every_pass_without_tma(monkeypatch):
    from horse.kernels.attention import launch

    seen = []
    call = timing.without_tma(lambda: seen.append(launch.USE_TMA), "horse.kernels.attention.launch")
    call()
    assert seen == [False] and launch.USE_TMA is True
    [case] = [c for c in attention.cases(quick=True) if c.implementation == "ours-pointer"][:1]
    monkeypatch.setattr(timing, "timed_call", lambda *args: lambda: seen.append(launch.USE_TMA))
    case.setup()()
    assert seen == [False, False] and launch.USE_TMA is True


@pytest.mark.interpreter
def test_the_kernels_of_issue_25s_day_load_beside_todays_and_pass_the_bench_check():
    """bench.revision: the kernels package at attention.FILED_AT from git history, renamed with its
    custom ops so that both register; its attention passes the bench's own check (out, dq, dk, dv
    against the float32 reference). An unknown revision is unavailable (a skipped baseline)."""
    import subprocess

    from bench import revision, suite

    history = subprocess.run(["git", "-C", str(revision.ROOT), "cat-file", "-e", attention.FILED_AT])
    if history.returncode:
        pytest.skip(f"this checkout's git history lacks {attention.FILED_AT} (a shallow clone)")
    from horse import kernels  # today's ops registered first

    old = revision.kernels_at(attention.FILED_AT)
    assert old.__name__ == f"kernels_{attention.FILED_AT}" and "horse-revisions" in old.attention.__file__
    assert hasattr(getattr(torch.ops, f"horse_{attention.FILED_AT}"), "flash_attn_fwd")
    assert kernels.flash_attention is not old.flash_attention
    shape = attention.Shape(2, 45, 2, 128)  # the baseline's maker, as the suite builds it
    make = attention.implementations(shape, causal=True, quick=True)[f"ours-{attention.FILED_AT}"]
    errors, ok = attention.check(shape, True, "cpu", make())
    assert ok, errors
    with pytest.raises(suite.UnavailableError, match="need git"):
        revision.kernels_at("0000000")
