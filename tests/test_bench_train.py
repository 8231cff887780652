"""bench.train on the CPU: the training-step harness end to end on the tiny preset, tokens/s and MFU
from known step times, the GPU path with a stand-in GPU (fake CUDA events and clock), the JSON
report, the bench suite's train family, and the no-GPU message. Nothing here times anything."""

import json
import math
import types

import pytest
import torch
from helpers import FakeClock, fake_cuda_events, name_it_an_h200

from bench import __main__ as bench_main
from bench import suite
from bench import train as bench_train
from horse.model import preset
from horse.train import TrainConfig

GPT2 = TrainConfig(preset="gpt2-124m", batch_size=16, precision="fp16")
# By hand: N = V·d + L·(12·d² + 13·d) + 2·d without the position table (V 50304, d 768, L 12), then
# 6·N + 12·L·d·T at T = 1024.
GPT2_FLOPS_PER_TOKEN = 6 * (50304 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768) + 12 * 12 * 768 * 1024


def test_tokens_per_second_and_mfu_from_known_step_times():
    assert GPT2_FLOPS_PER_TOKEN == 855_383_040
    r = bench_train.step_result(GPT2, preset("gpt2-124m"), "triton", [90.0, 100.0, 100.0, 110.0, 300.0],
                                2**30, 1, 10.8, 989e12)  # fmt: skip
    assert (r.q1_ms, r.median_ms, r.q3_ms, r.rounds) == (100.0, 100.0, 110.0, 5)
    assert r.extra["tokens_per_step"] == 16 * 1024
    assert r.extra["tokens_per_s"] == pytest.approx(163_840.0)  # 16,384 tokens in the median 100 ms
    assert r.extra["flops_per_token"] == GPT2_FLOPS_PER_TOKEN
    assert r.extra["mfu"] == pytest.approx(0.141705, rel=1e-5)  # 163,840 · 855,383,040 / 989e12
    assert r.work == GPT2_FLOPS_PER_TOKEN * 16 * 1024 and r.unit == "flop"
    assert r.implementation == "ours" and r.correct is True
    assert bench_train.model_flops_utilization(1e5, 10**9, None) is None  # a GPU of unknown peak
    nan = bench_train.step_result(GPT2, preset("gpt2-124m"), "triton", [1.0, 2.0], 0, 0, math.nan, None)
    assert nan.correct is False  # an inf/NaN loss fails every gate of ours


def test_report_schema_and_the_train_gate(tmp_path):
    config = preset("gpt2-124m")
    results = [
        bench_train.step_result(GPT2, config, backend, [ms, ms], 2**30, 0, 10.8, 989e12)
        for backend, ms in (("triton", 100.0), ("reference-compile", 125.0))
    ]
    suite.add_metrics(results, {"matmul_tflops": 800.0})
    ours = results[0]
    assert ours.speedups == pytest.approx({"compile": 1.25})
    assert ours.throughput == pytest.approx(163_840 * GPT2_FLOPS_PER_TOKEN / 1e12)  # TFLOP/s
    [verdict] = suite.evaluate_gates(results, suite.load_gates())  # the shipped train_step gate
    assert verdict.passed and verdict.value == pytest.approx(1.25)
    suite.write_json(tmp_path / "train.json", {"gpu": "NVIDIA H200"}, {"matmul_tflops": 800.0}, results,
                     [verdict])  # fmt: skip
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["machine"] == {"gpu": "NVIDIA H200"}
    [first, second] = report["results"]
    assert first["kernel"] == "train_step" and first["implementation"] == "ours"
    assert first["params"] == {"layers": 12, "d_model": 768, "batch": 16, "seq_len": 1024, "grad_accum": 1}
    assert set(first["extra"]) >= {"backend", "preset", "precision", "tokens_per_s", "mfu",
                                   "peak_memory_bytes", "skipped_steps", "loss"}  # fmt: skip
    assert second["extra"]["backend"] == "reference-compile" and second["implementation"] == "compile"
    assert report["gates"][0]["passed"] is True
    table = bench_train.format_table(results).splitlines()
    assert table[0].split()[:4] == ["backend", "step", "ms", "q1-q3"] and "1.25x" in table[1]


def fake_gpu(monkeypatch, clock: FakeClock):
    """CUDA events reading the fake clock, and no-op synchronization and memory statistics."""
    fake_cuda_events(monkeypatch, clock)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(bench_train, "time", types.SimpleNamespace(perf_counter=clock))


def test_time_steps_leaves_out_the_warmup_and_stops_on_the_budget(monkeypatch):
    clock = FakeClock()
    fake_gpu(monkeypatch, clock)
    calls = []

    def step():
        calls.append(clock.now)
        clock.now += 0.5 if len(calls) <= 2 else 0.005  # the warm-up steps compile: slow
        return torch.tensor(5.5), len(calls) == 3

    times, memory, skipped, loss = bench_train.time_steps(step, warmup=2, steps=100, seconds=0.02)
    assert times == pytest.approx([5.0] * 5)  # 5 ms each; past 0.02 s after the fifth
    assert len(calls) == 7 and (memory, skipped, loss) == (3 * 2**30, 1, 5.5)
    times, *_ = bench_train.time_steps(step, warmup=0, steps=3, seconds=None)
    assert len(times) == 3


def test_a_deadline_counts_the_warmup_and_still_times_two_steps(monkeypatch):
    clock = FakeClock()
    fake_gpu(monkeypatch, clock)

    def step():
        clock.now += 0.5 if clock.now < 1.0 else 0.005  # two slow warm-up steps (compilation)
        return torch.tensor(5.5), False

    times, *_ = bench_train.time_steps(step, warmup=2, steps=100, seconds=None, stop_at=1.018)
    assert times == pytest.approx([5.0] * 4)  # 1.0 s of warm-up; past 1.018 s after the fourth
    times, *_ = bench_train.time_steps(step, warmup=1, steps=100, seconds=60, stop_at=clock.now)
    assert len(times) == 2  # out of time before timing began: two steps all the same


def stand_in_h200(monkeypatch) -> FakeClock:
    """fake_gpu, named an H200 with a measured matmul of 800 TFLOP/s; its clock."""
    clock = FakeClock()
    fake_gpu(monkeypatch, clock)
    name_it_an_h200(monkeypatch)
    return clock


def test_the_gpu_path_with_a_stand_in_gpu_writes_the_report(monkeypatch, tmp_path, capsys):
    # gpu_main() whole, with the tiny model's real steps on the CPU and a fake clock: each triton
    # step takes 2.5 ms of it, each reference-compile step 3.75 ms. One sequence a step: the triton
    # steps run in the interpreter, where 4 took ~4x as long.
    clock = stand_in_h200(monkeypatch)
    make_step = bench_train.make_step

    def make_step_on_the_cpu(cfg, config, backend, device, document_length=None):
        step = make_step(cfg, config, backend, "cpu", document_length=document_length)

        def timed():
            clock.now += 0.0025 if backend == "triton" else 0.00375
            return step()

        return timed

    monkeypatch.setattr(bench_train, "make_step", make_step_on_the_cpu)
    argv = ["--preset", "tiny", "--batch-size", "1", "--precision", "fp32", "--warmup", "0", "--steps", "2",
            "--out", str(tmp_path), "--gate"]  # fmt: skip
    assert bench_train.gpu_main(*bench_train.parse_args(argv)) == 0
    out = capsys.readouterr().out
    assert "train_step tiny fp32 triton: 25,600 tokens/s, MFU 0.1%" in out  # 64 tokens in 2.5 ms
    assert "PASS train_step forward+backward" in out
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["machine"]["gpu"] == "NVIDIA H200" and "git_commit" in report["machine"]
    ours, compiled = report["results"]
    assert ours["extra"]["tokens_per_s"] == pytest.approx(25_600.0)
    # tiny: 6·N + 12·L·d·T with N = 256·256 + 4·(12·256² + 13·256) + 2·256, T = 64, over the H200's peak
    assert ours["extra"]["mfu"] == pytest.approx(25_600 * 20_136_960 / 989e12)
    assert ours["speedups"] == pytest.approx({"compile": 1.5})
    assert (
        ours["extra"]["peak_memory_bytes"] == 3 * 2**30
        and compiled["extra"]["backend"] == "reference-compile"
    )
    assert all(math.isfinite(r["extra"]["loss"]) for r in report["results"])


def steps_on_a_stand_in_h200(monkeypatch, failing: str, error: BaseException) -> None:
    """bench.train's steps run on the CPU, 10 ms each on a stand-in H200's clock; the failing
    backend's raises error as it is built."""
    clock = stand_in_h200(monkeypatch)
    make_step = bench_train.make_step

    def make_step_on_the_cpu(cfg, config, backend, device, document_length=None):
        if backend == failing:
            raise error
        step = make_step(cfg, config, backend, "cpu", document_length=document_length)

        def timed():
            clock.now += 0.010
            return step()

        return timed

    monkeypatch.setattr(bench_train, "make_step", make_step_on_the_cpu)


@pytest.mark.parametrize(
    "error", [RuntimeError("inductor failed"), KeyboardInterrupt()], ids=lambda e: type(e).__name__
)
def test_a_backend_that_fails_or_is_interrupted_costs_only_its_result(error, monkeypatch, tmp_path, capsys):
    # reference-compile raises as it is built: an error skips it and the next backend still runs; an
    # interrupt (the device check's time limit sends SIGINT) ends the measuring. Either way the
    # report keeps what was measured and the exit code says something is missing.
    steps_on_a_stand_in_h200(monkeypatch, failing="reference-compile", error=error)
    argv = ["--preset", "tiny", "--batch-size", "1", "--precision", "fp32", "--warmup", "0", "--steps", "2",
            "--backends", "triton", "reference-compile", "reference", "--out", str(tmp_path)]  # fmt: skip
    assert bench_train.gpu_main(*bench_train.parse_args(argv)) == 1
    out = capsys.readouterr()
    report = json.loads((tmp_path / "train.json").read_text())
    measured = [r["extra"]["backend"] for r in report["results"]]
    if isinstance(error, KeyboardInterrupt):
        assert measured == ["triton"] and "reference-compile: interrupted" in out.out
    else:
        assert measured == ["triton", "reference"] and "inductor failed" in out.err
        assert report["results"][0]["speedups"] == pytest.approx({"eager": 1.0})
    assert "no result from reference-compile: failed or interrupted" in out.out


def test_without_gpu_it_says_so_and_checks_the_harness(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_train.main(["--backends", "reference"]) == 0  # fp16 (autocast on the CPU)
    out = capsys.readouterr().out
    assert "No CUDA device: timing needs a GPU" in out and "harness ok" in out
    losses = [line.split("losses")[1].split("->") for line in out.splitlines() if "losses" in line]
    [(first, last)] = losses
    assert float(first) == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at the start
    assert float(last) < float(first)  # the second step has learnt from the same batch


@pytest.mark.interpreter
def test_interpreter_checks_compare_every_backend_with_the_reference():
    checks = bench_train.interpreter_checks()
    assert [label.split(": ")[1] for label, _, _ in checks] == [
        "triton against reference", "reference-compile against reference"]  # fmt: skip
    assert all(ok for _, _, ok in checks), checks


def test_bad_flags_are_named(capsys):
    for argv, message in ((["--seq-len", "2048"], "exceeds gpt2-124m's block size 1024"),
                          (["--steps", "1"], "--steps at least 2"),
                          (["--batch-size", "0"], "--batch-size must be at least 1")):  # fmt: skip
        with pytest.raises(SystemExit):
            bench_train.parse_args(argv)
        assert message in capsys.readouterr().err


def test_the_bench_suite_runs_the_training_step():
    assert "train" in bench_main.FAMILIES
    quick = bench_train.cases(quick=True)
    assert [(c.kernel, c.implementation) for c in quick] == [
        ("train_step", "ours"), ("train_step", "compile"), ("train_step", "eager")]  # fmt: skip
    assert quick[0].params == {"layers": 12, "d_model": 768, "batch": 16, "seq_len": 1024, "grad_accum": 1}
    assert quick[0].work == GPT2_FLOPS_PER_TOKEN * 16 * 1024
    assert len(bench_train.cases(quick=False)) == 6


def test_triton_out_of_memory_is_broken_and_its_gate_not_measured(monkeypatch, tmp_path, capsys):
    steps_on_a_stand_in_h200(
        monkeypatch, failing="triton", error=torch.cuda.OutOfMemoryError("CUDA out of memory")
    )
    argv = ["--preset", "tiny", "--batch-size", "1", "--precision", "fp32", "--warmup", "0", "--steps", "2",
            "--backends", "triton", "reference-compile", "--out", str(tmp_path)]  # fmt: skip
    assert bench_train.gpu_main(*bench_train.parse_args(argv)) == 1  # without --gate too
    out = capsys.readouterr().out
    assert "triton: out of memory" in out and "no result from triton" in out
    assert (
        "FAIL train_step forward+backward [layers=4 d_model=256 batch=1 seq_len=64 grad_accum=1]: "
        "not measured (ours)" in out
    )


@pytest.mark.interpreter
def test_document_masking_step_times_on_the_cpu_reference_path(capsys):
    argv = [
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--document-length",
        "8",
        "--warmup",
        "0",
        "--steps",
        "2",
    ]
    assert bench_train.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tiny: 2 x 64 tokens a step, documents of 8 tokens" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["document", "off", "on"]
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--document-length", "0"])
