"""The bench suite's own logic on the CPU: metrics, gates, the report, the timer, the no-GPU path."""

import json
import subprocess
import types

import pytest
import torch
from helpers import STAND_IN_CEILINGS, FakeClock, fake_cuda_events, name_it_an_h200

from bench import __main__ as bench_main
from bench import suite, timing

CEILINGS = STAND_IN_CEILINGS


def result(kernel="layer_norm", impl="ours", ms=1.0, direction="forward", unit="byte", work=3.6e9, **params):
    params = params or {"rows": 16384, "hidden": 4096}
    return suite.Result(kernel, params, direction, impl, unit, work, ms, ms * 0.9, ms * 1.1, 30)


def test_metrics_rate_ceiling_fraction_and_speedups():
    results = [result(ms=1.0), result(impl="eager", ms=2.0), result(impl="compile", ms=1.5),
               result(kernel="attention", unit="flop", work=4e11, ms=1.0, seqlen=4096)]  # fmt: skip
    suite.add_metrics(results, CEILINGS)
    ours = results[0]
    assert ours.throughput == pytest.approx(3600.0)  # 3.6e9 bytes in 1 ms
    assert ours.ceiling_fraction == pytest.approx(0.9)
    assert ours.speedups == pytest.approx({"eager": 2.0, "compile": 1.5})
    assert results[1].speedups == {}
    assert results[3].throughput == pytest.approx(400.0) and results[3].ceiling_fraction == pytest.approx(0.5)


def gates_of(toml: str, tmp_path):
    path = tmp_path / "gates.toml"
    path.write_text(toml)
    return suite.load_gates(path)


def test_a_result_below_its_gate_fails_and_above_passes(tmp_path):
    [gate] = gates_of(
        '[[gate]]\nkernel = "*_norm"\ndirection = "forward"\nmetric = "ceiling_fraction"\nmin = 0.9\n'
        'where = { hidden = ">= 4096" }\n',
        tmp_path,
    )
    fast, slow, narrow = result(ms=0.99), result(ms=1.1), result(ms=5.0, rows=16384, hidden=1024)
    slow_backward = result(ms=5.0, direction="backward")
    suite.add_metrics([fast, slow, narrow, slow_backward], CEILINGS)
    verdicts = suite.evaluate_gates([fast, slow, narrow, slow_backward], [gate])
    assert [(v.result, v.passed) for v in verdicts] == [(fast, True), (slow, False)]  # others do not match
    assert "FAIL layer_norm forward [rows=16384 hidden=4096]" in verdicts[1].describe()


def test_speedup_gates_against_one_baseline_and_the_best_of_several(tmp_path):
    gates = gates_of(
        '[[gate]]\nkernel = "attention"\nmetric = "speedup"\nbaseline = "best:sdpa-*"\nmin = 1.0\n'
        '[[gate]]\nkernel = "attention"\nmetric = "speedup"\nbaseline = "compile"\nmin = 1.0\n',
        tmp_path,
    )
    ours = result("attention", ms=1.0, unit="flop", seqlen=4096)
    flash = result("attention", "sdpa-flash", ms=1.2, unit="flop", seqlen=4096)
    cudnn = result("attention", "sdpa-cudnn", ms=0.95, unit="flop", seqlen=4096)
    suite.add_metrics([ours, flash, cudnn], CEILINGS)
    best, compile_gate = suite.evaluate_gates([ours, flash, cudnn], gates)
    assert best.value == pytest.approx(0.95) and not best.passed  # cuDNN, the fastest, beats ours
    # A best: gate names the baselines it took the minimum over (sdpa-efficient was not measured).
    assert best.over == pytest.approx({"sdpa-flash": 1.2, "sdpa-cudnn": 0.95})
    assert "0.950 (min over sdpa-flash 1.200, sdpa-cudnn 0.950)" in best.describe()
    assert compile_gate.value is None and not compile_gate.passed  # no compile baseline measured
    assert "not measured (compile)" in compile_gate.describe()


def test_an_optional_gate_passes_where_its_baseline_was_not_measured_and_nowhere_else(tmp_path):
    # flash-attn not installed, a past revision without git history: the gate says so and passes;
    # measured, it holds ours as any gate does; a wrong result of ours fails it either way.
    [gate] = gates_of(
        '[[gate]]\nkernel = "attention"\nmetric = "speedup"\nbaseline = "flash-attn"\nmin = 1.0\n'
        "optional = true\n",
        tmp_path,
    )
    alone, wrong = result("attention", ms=1.0, unit="flop"), result("attention", ms=1.0, unit="flop")
    wrong.correct = False
    ours, faster = (
        result("attention", ms=1.0, unit="flop", seqlen=8),
        result("attention", "flash-attn", ms=0.5, unit="flop", seqlen=8),
    )
    suite.add_metrics([alone, wrong, ours, faster], CEILINGS)
    verdicts = suite.evaluate_gates([alone, wrong, ours, faster], [gate])
    assert [(v.result, v.value, v.passed) for v in verdicts] == [
        (alone, None, True),
        (wrong, None, False),
        (ours, 0.5, False),
    ]
    assert "PASS attention forward" in verdicts[0].describe()
    assert "not measured (flash-attn), optional" in verdicts[0].describe()


def test_a_gated_case_of_ours_without_a_result_fails_as_not_measured(tmp_path):
    # ours broke (or was interrupted) on one of two gated shapes: its gate fails there, never
    # passes for lack of a result; a shape no gate holds ours to gets no verdict.
    [gate] = gates_of(
        '[[gate]]\nkernel = "*_norm"\nmetric = "speedup"\nbaseline = "eager"\nmin = 1.0\n', tmp_path
    )
    shapes = [{"rows": 16384, "hidden": 4096}, {"rows": 16384, "hidden": 1024}]
    expected = [
        suite.Case("layer_norm", p, "forward", impl, 1.0, "byte", None)
        for p in shapes
        for impl in ("ours", "eager")
    ] + [suite.Case("attention", {}, "forward", "ours", 1.0, "flop", None)]
    results = [result(ms=1.0, **shapes[0]), result(impl="eager", ms=2.0, **shapes[0])]
    suite.add_metrics(results, CEILINGS)
    measured, missing = suite.evaluate_gates(results, [gate], expected)
    assert measured.passed and measured.result is results[0]
    assert not missing.passed and missing.result is None
    assert missing.describe().startswith(
        "FAIL layer_norm forward [rows=16384 hidden=1024]: not measured (ours)"
    )


def test_the_quick_cases_are_the_gated_ones(tmp_path):
    # ours where a gate holds it, and there the baselines those gates name; nothing else.
    gates = gates_of(
        '[[gate]]\nkernel = "attention"\ndirection = "forward"\nmetric = "speedup"\n'
        'baseline = "best:sdpa-*"\nmin = 1.0\nwhere = { seqlen = ">= 4096" }\n'
        '[[gate]]\nkernel = "attention"\ndirection = "forward"\nmetric = "ceiling_fraction"\nmin = 0.5\n',
        tmp_path,
    )
    impls = ("ours", "ours-pointer", "sdpa-flash", "sdpa-cudnn", "flash-attn", "compile")
    cases = [suite.Case("attention", {"seqlen": n}, direction, impl, 1.0, "flop", None)
             for n in (1024, 4096) for direction in ("forward", "backward") for impl in impls]  # fmt: skip
    kept = [(c.params["seqlen"], c.direction, c.implementation) for c in suite.gated_cases(cases, gates)]
    assert kept == [(1024, "forward", "ours"), (4096, "forward", "ours"), (4096, "forward", "sdpa-flash"),
                    (4096, "forward", "sdpa-cudnn")]  # fmt: skip


def test_a_wrong_result_fails_every_gate(tmp_path):
    [gate] = gates_of('[[gate]]\nkernel = "*"\nmetric = "ceiling_fraction"\nmin = 0.1\n', tmp_path)
    wrong = result(ms=1.0)
    wrong.correct = False
    suite.add_metrics([wrong], CEILINGS)
    [verdict] = suite.evaluate_gates([wrong], [gate])
    assert not verdict.passed and "wrong against the reference" in verdict.describe()


def test_gate_conditions_are_checked():
    assert suite._holds(4096, ">= 4096") and not suite._holds(4095, ">=4096") and suite._holds(128, "== 128")
    with pytest.raises(ValueError, match="expected an operator"):
        suite._holds(1, "4096")


def test_the_shipped_gates_load_and_name_real_metrics():
    gates = suite.load_gates()
    assert gates and all(g.metric in ("ceiling_fraction", "speedup", "memory") for g in gates)
    assert all(g.baseline for g in gates if g.metric in ("speedup", "memory"))


def test_every_gate_meets_a_quick_case_and_its_baseline_runs_beside_it():
    # A quick run (the device check's) must time each gated shape with the baseline its gate names,
    # or the gate reads "not measured" and --gate fails however fast ours is.
    gates = suite.load_gates()
    families = bench_main._families(bench_main.FAMILIES)
    cases = suite.gated_cases([case for family in families for case in family.cases(quick=True)], gates)
    results = [
        result(c.kernel, c.implementation, 1.0, c.direction, c.unit, c.work, **c.params) for c in cases
    ]
    for r in results:  # what SuitePlugin records of every case on a GPU, for the memory gates
        r.extra["peak_memory_bytes"] = 2**30
    suite.add_metrics(results, CEILINGS)
    verdicts = suite.evaluate_gates(results, gates)
    assert all(any(v.gate is g for v in verdicts) for g in gates)  # every gate is met
    assert [v.describe() for v in verdicts if v.value is None] == []


def test_json_report_schema(tmp_path):
    results = [result(), result(impl="eager", ms=2.0)]
    suite.add_metrics(results, CEILINGS)
    [gate] = gates_of('[[gate]]\nkernel = "*"\nmetric = "speedup"\nbaseline = "eager"\nmin = 1.5\n', tmp_path)
    verdicts = suite.evaluate_gates(results, [gate])
    suite.write_json(tmp_path / "r.json", {"gpu": "NVIDIA H200"}, CEILINGS, results, verdicts)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["schema"] == "little-horse-bench/1" and report["ceilings"] == CEILINGS
    assert report["machine"]["gpu"] == "NVIDIA H200"
    assert set(report["results"][0]) >= {"kernel", "params", "direction", "implementation", "median_ms",
                                         "throughput", "ceiling_fraction", "speedups", "correct"}  # fmt: skip
    [verdict] = report["gates"]
    assert verdict == {"gate": gate.describe(), "kernel": "layer_norm", "direction": "forward",
                       "shape": {"rows": 16384, "hidden": 4096}, "value": 2.0, "over": {"eager": 2.0},
                       "passed": True}  # fmt: skip


def test_table_has_a_row_per_result():
    results = [result(), result(impl="eager", ms=2.0)]
    suite.add_metrics(results, CEILINGS)
    lines = suite.format_table(results).splitlines()
    assert (
        len(lines) == 3
        and lines[0].startswith("kernel")
        and "2.00x" in lines[1]
        and "3600.0 GB/s" in lines[1]
    )


def test_plots_one_png_per_kernel(tmp_path):
    pytest.importorskip("matplotlib")
    results = [result(ms=ms, impl=impl, rows=16384, hidden=h) for impl, ms in (("ours", 1.0), ("eager", 2.0))
               for h in (1024, 4096)]  # fmt: skip
    suite.add_metrics(results, CEILINGS)
    [path] = suite.plot(results, tmp_path)
    assert path.name == "layer_norm.png" and path.read_bytes().startswith(b"\x89PNG")


class FakeEvent:
    def __init__(self, ms):
        self.ms, self.synchronized = ms, False

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, later):
        return later.ms - self.ms


def test_event_stamps_subtract_to_gpu_seconds():
    start, end = timing.EventStamp(FakeEvent(2.0)), timing.EventStamp(FakeEvent(5.5))
    assert end - start == pytest.approx(3.5e-3)
    assert end.event.synchronized  # waits for the later event only


@pytest.mark.parametrize("driver_api", [None, 12080])
def test_machine_info_on_a_torch_with_or_without_the_driver_api_probe(monkeypatch, driver_api):
    """torch._C._cuda_getDriverVersion is absent from this CPU build and from some CUDA builds."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    h200 = types.SimpleNamespace(L2_cache_size=50 << 20, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    monkeypatch.setattr(timing, "_first_line", lambda command, cwd=None: "550.54.15")  # nvidia-smi, git
    monkeypatch.delattr(torch._C, "_cuda_getDriverVersion", raising=False)
    if driver_api is not None:
        monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: driver_api, raising=False)
    info = timing.machine_info(torch.device("cuda", 0))
    assert info["gpu"] == "NVIDIA H200" and info["nvidia_driver"] == "550.54.15"
    assert info["cuda_driver_api"] == driver_api
    assert info["l2_cache_bytes"] == 50 << 20 and info["sm_count"] == 132


def test_rotate_cycles_through_the_copies():
    seen = []
    call = timing.rotate([1, 2, 3], seen.append)
    for _ in range(5):
        call()
    assert seen == [1, 2, 3, 1, 2]


def test_without_gpu_bench_checks_in_the_interpreter_and_runs_the_compile_report(monkeypatch, capsys):
    calls = []

    def fake_run(cmd, env, cwd):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_main.subprocess, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main.main(["--only", "norms"]) == 0
    out = capsys.readouterr().out
    assert "timing needs a GPU" in out and "ok" in out and "FAIL" not in out
    [(cmd, env)] = calls
    assert cmd[-4:] == ["-m", "bench.compile_report", "--arch", "sm90"] and "TRITON_INTERPRET" not in env


class StandInGPU:
    """bench's gpu_main() whole on the CPU: CUDA events on a fake clock that each timed call moves,
    and the device's ceilings as CEILINGS. A call that finds the GPU idle adds LAUNCH_MS, the host's
    launch, to its time; a spin (torch.cuda._sleep) queued before it keeps the GPU busy instead."""

    LAUNCH_MS = 0.15

    def __init__(self, monkeypatch):
        self.clock = FakeClock()
        fake_cuda_events(monkeypatch, self.clock)
        name_it_an_h200(monkeypatch)
        self.busy = False
        monkeypatch.setattr(torch.cuda, "_sleep", self.spin)
        monkeypatch.setattr(timing, "_spin_cycles_per_ms", lambda device: 1000.0)
        # bench's own pytest session is no xdist worker, even inside one: else pytest-benchmark,
        # reading this variable, switches itself off and times nothing.
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        self.monkeypatch = monkeypatch

    def spin(self, cycles: int) -> None:
        assert cycles >= 100  # at least the 0.1 ms for the events
        self.busy = True

    def timed(self, ms: float = 0.0, error: BaseException | None = None):
        """A case's setup: a call that takes ms of GPU time, or raises error."""

        def call():
            if error is not None:
                raise error
            self.clock.now += (ms + (0.0 if self.busy else self.LAUNCH_MS)) * 1e-3
            self.busy = False

        return lambda: call

    def run(self, cases, gates, out, *flags) -> tuple[int, dict]:
        """gpu_main with cases as the one family and gates as gates.toml; exit code and results.json."""
        family = types.SimpleNamespace(cases=lambda quick: cases)
        self.monkeypatch.setattr(bench_main, "_families", lambda names: [family])
        self.monkeypatch.setattr(suite, "load_gates", lambda: gates)
        code = bench_main.gpu_main(*bench_main._parse(["--gate", "--out", str(out), *flags]))
        return code, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(
    "scenario", ["skipped baseline", "failing ours-pointer", "interrupted", "ours out of memory"]
)
def test_the_gpu_path_on_a_stand_in_gpu_times_skips_gates_and_keeps_what_it_measured(
    scenario, monkeypatch, tmp_path, capsys
):
    # ours at 1 ms and eager at 2 ms are timed. The third case is a baseline that cannot run
    # (skipped, so its gate reads "not measured" and fails), or a variant of ours that fails (a
    # failed test, never a skip), or is interrupted as the device check's SIGINT does (the run
    # stops there, and what it measured is still written).
    gpu = StandInGPU(monkeypatch)
    third, error = {
        "skipped baseline": ("compile", RuntimeError("no kernel for this shape")),
        "failing ours-pointer": ("ours-pointer", RuntimeError("out of resources")),
        "interrupted": ("compile", KeyboardInterrupt()),
        "ours out of memory": ("ours-pointer", None),
    }[scenario]
    shape = ("layer_norm", {"rows": 16384, "hidden": 4096}, "forward")
    cases = [
        suite.Case(*shape, "ours", 3.6e9, "byte", gpu.timed(1.0), lambda: ({"y": 0.0}, True)),
        suite.Case(*shape, "eager", 3.6e9, "byte", gpu.timed(2.0)),
        suite.Case(*shape, third, 3.6e9, "byte", gpu.timed(error=error)),
    ]
    if scenario == "ours out of memory":  # on a second gated shape: broken, never skipped
        wide = (shape[0], {"rows": 16384, "hidden": 8192}, shape[2])
        cases[2] = suite.Case(
            *wide, "ours", 7.2e9, "byte", gpu.timed(error=torch.OutOfMemoryError("CUDA oom"))
        )
    gates = gates_of(
        '[[gate]]\nkernel = "*"\nmetric = "speedup"\nbaseline = "eager"\nmin = 1.5\n'
        '[[gate]]\nkernel = "*"\nmetric = "speedup"\nbaseline = "compile"\nmin = 1.0\n',
        tmp_path,
    )
    code, report = gpu.run(cases, gates, tmp_path)
    out = capsys.readouterr().out
    ours, eager = report["results"][:2]
    # One call a round behind a spin: no launch in the time, and every round kept.
    assert ours["implementation"] == "ours" and ours["median_ms"] == pytest.approx(1.0)
    assert ours["samples_ms"] == pytest.approx([1.0] * 100) and ours["rounds"] == 100
    assert ours["correct"] is True and ours["speedups"] == pytest.approx({"eager": 2.0})
    assert eager["median_ms"] == pytest.approx(2.0) and len(report["results"]) == 2
    if scenario == "ours out of memory":
        assert code == pytest.ExitCode.TESTS_FAILED and "CUDA oom" in out and "SKIPPED" not in out
        assert [g["passed"] for g in report["gates"]] == [True, False, False, False]
        assert "FAIL layer_norm forward [rows=16384 hidden=8192]: not measured (ours)" in out
        return
    assert [g["passed"] for g in report["gates"]] == [True, False]  # compile: not measured
    assert "FAIL layer_norm forward [rows=16384 hidden=4096]: not measured" in out
    assert (tmp_path / "layer_norm.png").exists()
    if scenario == "skipped baseline":
        assert code == 1 and "compile unavailable: no kernel for this shape" in out  # --gate
    elif scenario == "failing ours-pointer":
        assert code == pytest.ExitCode.TESTS_FAILED and "FAILED" in out and "out of resources" in out
    else:
        assert code == pytest.ExitCode.INTERRUPTED


def test_compare_prints_each_ratio_and_fails_where_ours_regressed(monkeypatch, tmp_path, capsys):
    gpu = StandInGPU(monkeypatch)
    shape = ("layer_norm", {"rows": 16384, "hidden": 4096}, "forward")
    cases = [suite.Case(*shape, "ours", 3.6e9, "byte", gpu.timed(1.0)),
             suite.Case(*shape, "eager", 3.6e9, "byte", gpu.timed(2.0))]  # fmt: skip
    [gate] = gates_of('[[gate]]\nkernel = "*"\nmetric = "speedup"\nbaseline = "eager"\nmin = 1.5\n', tmp_path)
    for earlier_ours_ms, code in ((0.99, 0), (0.9, 1)):  # now 1.0 ms: 1 % slower passes, 11 % fails
        earlier = tmp_path / "earlier.json"
        previous = [result(ms=earlier_ours_ms), result(impl="eager", ms=1.0), result(kernel="other_norm")]
        suite.write_json(earlier, {}, CEILINGS, previous, [])
        assert gpu.run(cases, [gate], tmp_path, "--compare", str(earlier))[0] == code
        out = capsys.readouterr().out
        ratio = 1.0 / earlier_ours_ms
        assert f"layer_norm forward [rows=16384 hidden=4096] ours: {ratio:.3f}x the earlier time" in out
        assert "[rows=16384 hidden=4096] eager: 2.000x" in out  # a slower baseline is shown, not failed
        assert "other_norm" not in out  # not selected in this run
        assert ("REGRESSION layer_norm" in out) == (code == 1)
