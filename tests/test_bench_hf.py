"""CPU tests of the bench suite's hf family (a transformers model's training step with horse.hf.apply): its
cases, its gates (tokens/s and peak memory against sdpa, Liger optional) and its interpreter check. Timing
needs a GPU and is never asserted on."""

import pytest
import torch

from bench import suite

pytest.importorskip("transformers")
from bench import hf  # noqa: E402


def test_cases_cover_every_model_on_every_implementation_and_quick_keeps_the_gated_ones():
    cases = hf.cases(quick=False)
    assert [(c.params["model"], c.implementation) for c in cases] == [
        (model.name, name)
        for model in hf.MODELS
        for name in (hf.IMPLEMENTATIONS if model.attention == "sdpa" else ("ours", "eager", "liger"))
    ]
    llama, gpt2, phi3, gemma3, gemma2, qwen3_moe, gpt_oss = (c for c in cases if c.implementation == "ours")
    shapes = {"model": "llama-1b", "layers": 16, "d_model": 2048, "batch": 1, "seq_len": 4096}
    assert llama.params == shapes | {"sdpa": True}
    shapes = {"model": "gpt2-124m", "layers": 12, "d_model": 768, "batch": 16, "seq_len": 1024}
    assert gpt2.params == shapes | {"sdpa": True}
    shapes = {"model": "phi3-mini", "layers": 32, "d_model": 3072, "batch": 2, "seq_len": 2048}
    assert phi3.params == shapes | {"sdpa": True}
    assert gemma3.params == {
        "model": "gemma3-1b-softcap",
        "layers": 26,
        "d_model": 1152,
        "batch": 1,
        "seq_len": 4096,
        "sdpa": True,
    }
    assert gemma2.params == {
        "model": "gemma2-2b",
        "layers": 26,
        "d_model": 2304,
        "batch": 1,
        "seq_len": 2048,
        "sdpa": False,  # transformers' Gemma 2 refuses sdpa (softcapping): eager is its baseline
    }
    shapes = {"model": "qwen3-moe-4l", "layers": 4, "d_model": 2048, "batch": 1, "seq_len": 4096}
    assert qwen3_moe.params == shapes | {"sdpa": True}
    shapes = {"model": "gpt-oss-4l", "layers": 4, "d_model": 2880, "batch": 2, "seq_len": 2048}
    assert gpt_oss.params == shapes | {"sdpa": False}  # transformers' gpt-oss refuses sdpa (its sinks)
    assert hf.GEMMA3_1B.make_config().final_logit_softcapping == 30.0
    gemma2_config = hf.GEMMA2_2B.make_config()
    assert (gemma2_config.attn_logit_softcapping, gemma2_config.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2_config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert all(c.direction == "forward+backward" and c.unit == "flop" for c in cases)
    # 6 N + 12 L d T a token: N is Llama 3.2 1B's 1.236 B parameters (tied head), GPT-2's 124.4 M,
    # Phi-3-mini's 3.821 B, Gemma 3 1B's 1.000 B (tied head), Gemma 2 2B's 2.614 B (tied head), the
    # Qwen3-MoE's 0.8499 B active of 3.115 B (each layer's 604 M expert weights, 8 of 128 experts' share).
    assert llama.work == pytest.approx((6 * 1.2358e9 + 12 * 16 * 2048 * 4096) * 4096, rel=1e-3)
    assert gpt2.work == pytest.approx((6 * 124.44e6 + 12 * 12 * 768 * 1024) * 16 * 1024, rel=1e-3)
    assert phi3.work == pytest.approx((6 * 3.8211e9 + 12 * 32 * 3072 * 2048) * 2 * 2048, rel=1e-3)
    assert gemma3.work == pytest.approx((6 * 0.99989e9 + 12 * 26 * 1152 * 4096) * 4096, rel=1e-3)
    assert gemma2.work == pytest.approx((6 * 2.6142e9 + 12 * 26 * 2304 * 2048) * 2048, rel=1e-3)
    active = 3.1148e9 - 4 * 128 * 3 * 768 * 2048 * (128 - 8) // 128
    assert qwen3_moe.work == pytest.approx((6 * active + 12 * 4 * 2048 * 4096) * 4096, rel=1e-3)
    assert active == pytest.approx(0.8499e9, rel=1e-3)
    # gpt-oss: 4.451 B, each layer's 32 experts' weights and biases 796.5 M, 4 of 32 experts' share routed
    experts = 4 * 32 * (2880 * 2 * 2880 + 2 * 2880 + 2880 * 2880 + 2880)
    active = 4.4510e9 - experts * (32 - 4) // 32
    assert gpt_oss.work == pytest.approx((6 * active + 12 * 4 * 2880 * 2048) * 2 * 2048, rel=1e-3)
    assert active == pytest.approx(1.6631e9, rel=1e-3)
    gpt_oss_config = hf.GPT_OSS.make_config()
    assert gpt_oss_config.layer_types[:2] == ["sliding_attention", "full_attention"]
    quick = suite.gated_cases(hf.cases(quick=True), suite.load_gates())
    assert [(c.params["model"], c.implementation) for c in quick] == [
        (model.name, name)
        for model in hf.MODELS
        for name in ("ours", "sdpa" if model.attention == "sdpa" else "eager", "liger")
    ]


def _result(implementation: str, median_ms: float, peak_bytes: int, spec=hf.LLAMA_1B) -> suite.Result:
    params = spec.params
    return suite.Result(hf.KERNEL, params, "forward+backward", implementation, "flop", 1e12, median_ms,
                        median_ms, median_ms, 100, True if implementation == "ours" else None,
                        extra={"peak_memory_bytes": peak_bytes})  # fmt: skip


@pytest.mark.parametrize(
    "ours_ms, ours_gib, failing",
    [(90.0, 10, []), (110.0, 10, ["speedup over sdpa"]), (90.0, 13, ["memory over sdpa"])],
)
def test_gates_hold_ours_to_sdpas_tokens_per_second_and_peak_memory(ours_ms, ours_gib, failing):
    results = [_result("ours", ours_ms, ours_gib * 2**30), _result("sdpa", 100.0, 12 * 2**30)]
    suite.add_metrics(results, {"matmul_tflops": 800.0})
    assert results[0].memory_ratios == pytest.approx({"sdpa": 12 / ours_gib})
    verdicts = [v for v in suite.evaluate_gates(results, suite.load_gates()) if v.gate.kernel == hf.KERNEL]
    assert len(verdicts) == 3  # speedup and memory over sdpa, speedup over Liger (not measured: optional)
    assert (
        sorted(v.gate.describe().split(": ")[1].split(" >=")[0] for v in verdicts if not v.passed) == failing
    )
    [liger] = [v for v in verdicts if v.gate.baseline == "liger"]
    assert liger.value is None and liger.passed


def test_a_family_without_sdpa_is_gated_against_eager():
    results = [
        _result("ours", 90.0, 10 * 2**30, hf.GEMMA2_2B),
        _result("eager", 100.0, 9 * 2**30, hf.GEMMA2_2B),
    ]
    suite.add_metrics(results, {"matmul_tflops": 800.0})
    verdicts = [v for v in suite.evaluate_gates(results, suite.load_gates()) if v.gate.kernel == hf.KERNEL]
    assert sorted((v.gate.metric, v.gate.baseline, v.passed) for v in verdicts) == [
        ("memory", "eager", False),  # ours 10 GiB, eager 9
        ("speedup", "eager", True),
        ("speedup", "liger", True),  # not measured: optional
    ]


def test_liger_is_unavailable_for_gpt2_and_where_it_is_not_installed():
    assert set(hf.LIGER_PATCHES) == {spec.family for spec in hf.MODELS} - {"gpt2"}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(suite.UnavailableError, match="no gpt2"):
        hf._apply_liger(model, hf.GPT2_124M)
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(suite.UnavailableError, match="Liger-Kernel"):
            hf._apply_liger(model, hf.LLAMA_1B)


@pytest.mark.interpreter
def test_interpreter_check_passes_and_fails_on_a_wrong_gradient(monkeypatch):
    checks = hf.interpreter_checks()
    assert [label.split()[1] for label, _, _ in checks] == [
        "llama-tiny",
        "gpt2-tiny",
        "phi3-tiny",
        "qwen3-moe-tiny",
        "gpt-oss-tiny",
        "gemma3-tiny-softcap",
        "gemma2-tiny-softcap",
    ]
    assert all(ok for _, _, ok in checks), checks
    from horse.hf import forwards

    original = forwards.rms_norm_forward

    def half_the_gradient(self, x):  # the same output, half its gradient: the check must see it
        y = original(self, x)
        return y * 0.5 + (y * 0.5).detach()

    monkeypatch.setattr(forwards, "rms_norm_forward", half_the_gradient)
    errors, ok = hf.interpreter_check(hf.INTERPRETER_MODELS[0])
    assert not ok, errors


@pytest.mark.interpreter
@pytest.mark.parametrize("model", ["gemma3-tiny-softcap", "gemma2-tiny-softcap"])
def test_interpreter_check_fails_without_the_gemmas_final_logit_softcap(model, monkeypatch):
    from horse.hf import forwards

    monkeypatch.setattr(forwards, "final_logit_softcap", lambda config: None)
    [spec] = [spec for spec in hf.INTERPRETER_MODELS if spec.name == model]
    errors, ok = hf.interpreter_check(spec)
    assert not ok, errors


@pytest.mark.interpreter
def test_interpreter_check_fails_without_gemma2s_attention_softcap(monkeypatch):
    from horse.hf import attention

    flash_attention = attention.flash_attention
    monkeypatch.setattr(
        attention, "flash_attention", lambda *a, **kw: flash_attention(*a, **kw | {"softcap": 0})
    )
    errors, ok = hf.interpreter_check(hf.INTERPRETER_MODELS[-1])
    assert not ok, errors


@pytest.mark.interpreter
def test_interpreter_check_fails_without_gpt_osss_clamped_swiglu(monkeypatch):
    from horse.hf import moe

    moe_mlp = moe.moe_mlp
    monkeypatch.setattr(moe, "moe_mlp", lambda *a, **kw: moe_mlp(*a, **kw | {"limit": None}))
    [spec] = [spec for spec in hf.INTERPRETER_MODELS if spec.name == "gpt-oss-tiny"]
    errors, ok = hf.interpreter_check(spec)
    assert not ok, errors
