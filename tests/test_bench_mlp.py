"""CPU tests of the MLP benchmark: FLOP counts, the saved-activation measurement, its correctness
check and its cases. Timing needs a GPU and is never asserted on."""

import pytest
import torch

from bench import correctness, mlp, suite, timing

GPT2 = mlp.Model("tiny", 48, 80, gated=False)
LLAMA = mlp.Model("tiny", 40, 100, gated=True)


def test_flops_count_the_gemms():
    assert mlp.gemm_flops(3, 5, 7) == 2 * 3 * 5 * 7
    assert mlp.up_projection_flops(GPT2, 64) == 2 * 64 * 80 * 48
    assert mlp.up_projection_flops(LLAMA, 64) == 2 * 2 * 64 * 100 * 40  # gate and up
    forward = 2 * 2 * 64 * 80 * 48
    assert mlp.mlp_flops(GPT2, 64, "forward") == forward
    assert mlp.mlp_flops(GPT2, 64, "backward") == 2 * forward
    assert mlp.mlp_flops(GPT2, 64, "forward+backward") == 3 * forward
    assert mlp.mlp_flops(LLAMA, 64, "forward") == 3 * 2 * 64 * 100 * 40


@pytest.mark.interpreter
@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_ours_saves_half_of_what_eager_saves(model):
    # Ours keeps the pre-activation (gate and up when gated); eager keeps it and h (gated: gate,
    # silu(gate), up and h). Measured with autograd's saved-tensor hooks.
    tokens = 33
    tensors = mlp.make_inputs(model, tokens, "cpu", requires_grad=True)
    hidden_bytes = tokens * model.hidden * mlp.DTYPE.itemsize
    ours = mlp.saved_activation_bytes(lambda t: mlp.ours_mlp(model, t), tensors)
    eager = mlp.saved_activation_bytes(lambda t: mlp.eager_mlp(model, t), tensors)
    assert ours == (2 if model.gated else 1) * hidden_bytes
    assert eager == (4 if model.gated else 2) * hidden_bytes
    with torch.no_grad():
        assert mlp.saved_activation_bytes(lambda t: mlp.ours_mlp(model, t), tensors) == 0


@pytest.mark.interpreter
def test_interpreter_checks_pass():
    results = mlp.interpreter_checks()
    assert len(results) == 2 * len(mlp.INTERPRETER_CASES)
    assert all(ok for _, _, ok in results), results
    assert set(results[-1][1]) == {"y", "dx", "dw_gate", "dw_up", "dw_down"}


def test_a_wrong_kernel_fails_the_check(monkeypatch):
    monkeypatch.setattr(mlp, "ours_mlp", lambda model, t: 1.05 * mlp.eager_mlp(model, t))
    errors, ok = mlp.check(GPT2, 64, "cpu", whole_mlp=True)
    assert not ok and errors["y"] > mlp.TOLERANCE


def test_cases_cover_every_model_direction_and_baseline():
    cases = mlp.cases(quick=False)
    kernels = {c.kernel for c in cases}
    assert kernels == {"linear_act", "gated_linear", "mlp", "mlp_gated"}
    shapes = len(mlp.MODELS) * len(mlp.TOKENS)
    decode = [c for c in cases if c.params["tokens"] in mlp.DECODE_TOKENS]
    cases = [c for c in cases if c not in decode]
    gelu_tanh_models = sum(m.activation == "gelu_tanh" for m in mlp.MODELS)
    # decode-sized batches: the up projection forward, ours and the GEMM baselines (gated: no addmm-gelu)
    assert len(decode) == len(mlp.DECODE_TOKENS) * (
        4 * len(mlp.MODELS) - (len(mlp.MODELS) - gelu_tanh_models)
    )
    assert {c.implementation for c in decode} == {"ours", "matmul", "addmm-gelu", "eager"}
    assert {c.direction for c in decode} == {"forward"} and all(
        c.kernel.endswith(("linear", "act")) for c in decode
    )
    up = [c for c in cases if c.kernel.endswith("linear") or c.kernel == "linear_act"]
    assert {c.implementation for c in up} == {
        "ours",
        "ours+save",
        "ours-pointer",
        "matmul",
        "addmm-gelu",
        "eager",
        "compile",
    }
    # cuBLASLt's fused GELU epilogue only where the activation is gelu_tanh (the GPT-2 models).
    gelu_tanh_shapes = gelu_tanh_models * len(mlp.TOKENS)
    assert {c.kernel for c in up if c.implementation == "addmm-gelu"} == {"linear_act"}
    assert len(up) == 6 * shapes + gelu_tanh_shapes and {c.direction for c in up} == {"forward"}
    whole = [c for c in cases if c.kernel.startswith("mlp")]
    assert {c.implementation for c in whole} == {"ours", "ours-pointer", "eager", "compile"}
    assert len(whole) == 4 * len(suite.DIRECTIONS) * shapes
    assert all((c.check is not None) == (c.implementation == "ours") for c in cases)
    [gpt2_124m] = [c for c in whole if c.params == {"tokens": 8192, "d_model": 768, "hidden": 3072}
                   and c.direction == "forward+backward" and c.implementation == "ours"]  # fmt: skip
    assert gpt2_124m.work == 3 * 2 * 2 * 8192 * 768 * 3072 and gpt2_124m.unit == "flop"
    quick = mlp.cases(quick=True)
    compiled = [c for c in quick if c.implementation == "compile"]  # each case compiles afresh
    assert len(quick) < len(cases) and len(compiled) == len(mlp.QUICK_CASES)
    assert not any(c.params["tokens"] in mlp.DECODE_TOKENS for c in quick)
    assert all(c.kernel.startswith("mlp") and c.direction == "forward+backward" for c in compiled)


@pytest.mark.interpreter
@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_every_timed_call_runs_and_checks(model, monkeypatch):
    # The cases' setups on the CPU with one copy of the inputs and no Inductor (~30 s here): every
    # call the GPU would time runs, ours's check passes, and the gradients are those of eager.
    monkeypatch.setattr(
        mlp.timing, "rotating_inputs", lambda make_copy, bytes_per_copy, device: [make_copy()]
    )
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    cases = mlp.model_cases(model, 33, device="cpu")
    assert len(cases) == 6 + (not model.gated) + 4 * len(suite.DIRECTIONS)
    for case in cases:
        result = case.setup()()
        if case.implementation == "addmm-gelu":  # cuBLASLt's fused epilogue (torch's on the CPU)
            torch.manual_seed(0)
            tensors = mlp.make_inputs(model, 33, "cpu")
            expected = mlp.reference_up(model, {k: t.float() for k, t in tensors.items()})
            assert correctness.normalized_error(mlp.addmm_gelu(model, tensors), expected) < 2e-3
        if case.direction == "forward":
            width = model.hidden * (2 if case.implementation == "matmul" and model.gated else 1)
            expected = (
                (33, width)
                if case.kernel.endswith("linear") or case.kernel == "linear_act"
                else (33, model.d_model)
            )
            assert result.shape == expected, case.id
        else:
            assert len(result) == len(mlp.make_inputs(model, 1, "cpu")), case.id  # a gradient per input
        if case.check is not None:
            errors, ok = case.check()
            assert ok, (case.id, errors)


def test_addmm_gelu_is_tanh_gelu_with_bias_and_refuses_other_activations():
    # torch._addmm_activation on the CPU: bias and GELU (erf there, tanh on CUDA: 5e-4 apart at
    # most), within 4.8e-4 (measured, normalized) of the float32 reference of linear_act(gelu_tanh),
    # and far from the bias-free result; the gated model's silu has no cuBLASLt epilogue.
    torch.manual_seed(0)
    tensors = mlp.make_inputs(GPT2, 33, "cpu")
    exact = {k: t.float() for k, t in tensors.items()}
    got = mlp.addmm_gelu(GPT2, tensors)
    assert got.dtype == mlp.DTYPE and got.shape == (33, GPT2.hidden)
    assert correctness.normalized_error(got, mlp.reference_up(GPT2, exact)) < 1e-3
    no_bias = torch.nn.functional.gelu(exact["x"] @ exact["w_in"].t(), approximate="tanh")
    assert correctness.normalized_error(got, no_bias) > 1e-2
    with pytest.raises(ValueError, match="silu"):
        mlp.addmm_gelu(LLAMA, mlp.make_inputs(LLAMA, 3, "cpu"))


def test_ours_pointer_times_every_gemm_without_tma(monkeypatch):
    from horse.kernels.mlp import launch as kernels_mlp

    seen = []
    call = timing.without_tma(lambda: seen.append(kernels_mlp.USE_TMA), "horse.kernels.mlp.launch")
    call()
    assert seen == [False] and kernels_mlp.USE_TMA is True
    pointer = [c for c in mlp.cases(quick=True) if c.implementation == "ours-pointer"]
    assert {c.direction for c in pointer} == {"forward", *suite.DIRECTIONS}
    monkeypatch.setattr(timing, "timed_call", lambda *args: lambda: seen.append(kernels_mlp.USE_TMA))
    for case in pointer:
        case.setup()()
    assert seen == [False] * (1 + len(pointer)) and kernels_mlp.USE_TMA is True


@pytest.mark.interpreter
@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_decode_cases_run_and_check(model, monkeypatch):
    # One token: ours takes the split-K path (horse.kernels.mlp.configs.split_k) and its check passes.
    monkeypatch.setattr(
        mlp.timing, "rotating_inputs", lambda make_copy, bytes_per_copy, device: [make_copy()]
    )
    cases = mlp.decode_cases(model, 1, device="cpu")
    cublaslt = [] if model.gated else ["addmm-gelu"]
    assert [c.implementation for c in cases] == ["ours", "matmul", "eager", *cublaslt]
    for case in cases:
        assert case.setup()().shape[0] == 1, case.id
    errors, ok = cases[0].check()
    assert ok, errors
