"""The bench suite's core: cases, the pytest-benchmark plugin that times them, metrics, gates, report.

A kernel family's benchmark module (bench/norms.py, bench/attention.py, ...) describes its work as
:class:`Case` objects: one implementation, one direction, one shape, the FLOPs or bytes a call must
do, and a ``setup`` that builds rotated inputs on the GPU and returns the call to time. The
:class:`SuitePlugin` hands the cases to pytest-benchmark (``bench/bench_kernels.py``), which times
each with CUDA events (``timing.cuda_event_timer``), so ``--benchmark-save`` and
``--benchmark-compare`` work as usual: each round is one call, queued behind a spin kernel so that
the GPU is busy before the round's start event (the host's launch never shows in the time). Before
the first timing of ours on a shape, the case's ``check`` compares it with the float32 reference.
Metrics (TFLOP/s or GB/s, fraction of the device's measured ceiling, speedup over every baseline),
the gates of ``bench/gates.toml`` and the comparison with an earlier run are computed from the
results afterwards.
"""

import datetime
import fnmatch
import itertools
import json
import operator
import re
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pytest
import torch

from bench import report, timing

GATES_FILE = Path(__file__).with_name("gates.toml")
RESULTS_DIR = Path(__file__).with_name("results")
DIRECTIONS = ("forward", "backward", "forward+backward")
# unit -> (rate's name, its scale, the ceiling it is a fraction of)
RATES = {"flop": ("TFLOP/s", 1e12, "matmul_tflops"), "byte": ("GB/s", 1e9, "copy_gbps")}


class _Named:
    """What a Case and its Result share: the shape in words, and kernel, shape, direction and
    implementation as a key."""

    @property
    def shape(self) -> str:
        return shape_text(self.params)

    @property
    def key(self) -> tuple:
        return self.kernel, tuple(self.params.items()), self.direction, self.implementation


@dataclass(frozen=True)
class Case(_Named):
    """One timed call: an implementation of a kernel in one direction on one shape."""

    kernel: str  # e.g. "layer_norm", "attention", "linear_act"
    params: dict  # the shape, e.g. {"rows": 16384, "hidden": 4096}; numbers for tables and plots
    direction: str  # one of DIRECTIONS
    implementation: str  # "ours", or the baseline's name: "eager", "compile", "sdpa-flash", ...
    work: float  # FLOPs (unit "flop") or bytes that must move (unit "byte") per call
    unit: str
    setup: Callable[[], Callable[[], object]] = field(repr=False, compare=False)
    # Correctness of ours on this shape against the float32 reference: {output name: error} and
    # whether it passed. Run once per (kernel, params), before ours is timed.
    check: Callable[[], tuple[dict, bool]] | None = field(default=None, repr=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.kernel}[{self.shape}]-{self.direction}-{self.implementation}"


def family_cases(
    kernel: str,
    params: dict,
    implementations: dict,
    directions,
    work: Callable[[str], float],
    unit: str,
    setup: Callable,
    check: Callable | None = None,
) -> list[Case]:
    """A case per implementation (name -> what setup builds it from) and direction, in that order:
    work(direction) FLOPs or bytes, setup(name, implementation, direction), and check on ours alone."""
    return [
        Case(kernel, params, d, name, work(d), unit, setup(name, impl, d), check if name == "ours" else None)
        for (name, impl), d in itertools.product(implementations.items(), directions)
    ]


def shape_text(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


@dataclass
class Result(_Named):
    kernel: str
    params: dict
    direction: str
    implementation: str
    unit: str
    work: float
    median_ms: float
    q1_ms: float
    q3_ms: float
    rounds: int
    correct: bool | None = None  # ours only
    errors: dict | None = None
    throughput: float = 0.0  # TFLOP/s or GB/s
    ceiling_fraction: float = 0.0  # of the measured matmul TFLOP/s or copy GB/s
    speedups: dict = field(default_factory=dict)  # ours only: baseline -> baseline time / ours
    # ours only: baseline -> baseline's peak memory / ours (extra's peak_memory_bytes, where both have it)
    memory_ratios: dict = field(default_factory=dict)
    # A benchmark's own metrics beyond these (bench.train: tokens/s, MFU, peak memory; on a GPU every
    # case's peak_memory_bytes: what it allocated at most beyond what was allocated before its setup).
    extra: dict = field(default_factory=dict)
    samples_ms: list = field(default_factory=list)  # every timed round, in order


class UnavailableError(Exception):
    """Raised by a baseline's setup that cannot run on this machine or shape; the case is skipped."""


def compiled(fn, **options) -> Callable[[], Callable]:
    """A maker of a fresh static ``torch.compile`` of fn (options go to torch.compile), for a case's
    setup: never a dynamic-shape kernel, never dynamo's recompile limit (past it, a compiled function
    silently runs eager)."""

    def make():
        torch._dynamo.reset()
        return torch.compile(fn, dynamic=False, **options)

    return make


class SuitePlugin:
    """A pytest plugin that parametrizes ``bench/bench_kernels.py`` over cases and collects results.

    Each case: ``warmup`` untimed calls (compilation, the allocator, clocks), then ``rounds`` rounds
    of one call each, a spin kernel queued before each round's start event. 100 rounds: the median's
    standard error is then about an eighth of the spread between the quartiles.
    """

    def __init__(self, cases: list[Case], rounds: int = 100, warmup: int = 5):
        self.cases = cases
        self.rounds, self.warmup = rounds, warmup
        self.results: list[Result] = []
        self.checks: dict[tuple, tuple[dict, bool]] = {}

    def pytest_generate_tests(self, metafunc):
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", self.cases, ids=[c.id for c in self.cases])

    @pytest.fixture
    def suite(self):
        return self

    def run(self, benchmark, case: Case) -> None:
        key = case.key[:2]  # kernel and params: checked once, whatever the direction
        if case.check is not None and key not in self.checks:
            self.checks[key] = case.check()
        errors, correct = self.checks[key] if case.check is not None else (None, None)
        ours = case.implementation.startswith("ours")  # ours and its variants (ours-pointer, ...)
        allocated_before = _allocated_bytes()
        try:
            call = case.setup()
            if not ours:
                call()
        except (UnavailableError, RuntimeError) as error:
            # A baseline that cannot run here (a library not installed, an SDPA backend without a
            # kernel for the shape, out of memory) is skipped with its reason; ours never is.
            if ours:
                raise
            torch.cuda.empty_cache()
            pytest.skip(f"{case.implementation} unavailable: {' '.join(str(error).split())[:300]}")
        benchmark.group = f"{case.kernel} {case.direction} {case.shape}"
        benchmark.extra_info.update(
            kernel=case.kernel,
            params=case.params,
            direction=case.direction,
            implementation=case.implementation,
            work=case.work,
            unit=case.unit,
        )
        for _ in range(self.warmup):
            call()
        spin_ms = timing.spin_ahead_ms(timing.host_ms_per_call(call))
        # One call a round, behind a spin: the round's start event waits on the GPU until the host
        # has queued the call, so the event pair holds the call's GPU time alone.
        benchmark.pedantic(call, setup=lambda: timing.spin(spin_ms), rounds=self.rounds)
        stats = benchmark.stats.stats
        result = Result(
            case.kernel,
            case.params,
            case.direction,
            case.implementation,
            case.unit,
            case.work,
            median_ms=stats.median * 1e3,
            q1_ms=stats.q1 * 1e3,
            q3_ms=stats.q3 * 1e3,
            rounds=stats.rounds,
            correct=correct,
            errors=errors,
            samples_ms=[seconds * 1e3 for seconds in stats.data],
            extra=_peak_memory(allocated_before),
        )
        self.results.append(result)
        if correct is False:
            pytest.fail(f"{case.kernel} [{case.shape}] differs from the reference: {errors}")


def _allocated_bytes() -> int | None:
    """The CUDA allocator's bytes in use, its peak statistic reset to them (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_memory(allocated_before: int | None) -> dict:
    if allocated_before is None:
        return {}
    return {"peak_memory_bytes": torch.cuda.max_memory_allocated() - allocated_before}


def add_metrics(results: list[Result], ceilings: dict) -> None:
    """Throughput, fraction of the device ceiling, and (for ours) speedup over each baseline."""
    for r in results:
        _, scale, ceiling = RATES[r.unit]
        r.throughput = r.work / (r.median_ms * 1e-3) / scale
        r.ceiling_fraction = r.throughput / ceilings[ceiling]
    for ours in (r for r in results if r.implementation == "ours"):
        # Every other result of its kernel, shape and direction.
        others = [r for r in results if r.key[:3] == ours.key[:3] and r is not ours]
        ours.speedups = {r.implementation: r.median_ms / ours.median_ms for r in others}
        ours.memory_ratios = {
            r.implementation: r.extra["peak_memory_bytes"] / ours.extra["peak_memory_bytes"]
            for r in others
            if r.extra.get("peak_memory_bytes") and ours.extra.get("peak_memory_bytes")
        }


@dataclass(frozen=True)
class Gate:
    """A threshold from gates.toml: a metric of ours, on the cases it matches, at least ``min``."""

    kernel: str  # fnmatch pattern
    # "ceiling_fraction"; "speedup" over ``baseline``; "memory": the baseline's peak memory over ours
    metric: str
    min: float
    direction: str = "*"
    baseline: str = ""  # an implementation, or "best:PATTERN" for the fastest of those matching
    where: dict = field(default_factory=dict)  # param -> condition, e.g. {"hidden": ">= 4096"}
    note: str = ""
    # Passes where its baseline was not measured: one that some machines lack (a package that is not
    # installed, the git history of a past revision).
    optional: bool = False

    def matches(self, r: Result) -> bool:
        return (
            r.implementation == "ours"
            and fnmatch.fnmatch(r.kernel, self.kernel)
            and fnmatch.fnmatch(r.direction, self.direction)
            and all(_holds(r.params.get(name), condition) for name, condition in self.where.items())
        )

    def baselines(self) -> str:
        """The fnmatch pattern of the baselines this gate compares ours with ("" for none)."""
        return self.baseline.removeprefix("best:") if self.metric in ("speedup", "memory") else ""

    def measure(self, r: Result) -> tuple[float | None, dict]:
        """The gated metric of r (None where no baseline it names was measured on r's shape), and
        the speedups over each baseline it was taken from: a ``best:`` gate's minimum is over all
        the baselines matching its pattern that were measured."""
        if self.metric == "ceiling_fraction":
            return r.ceiling_fraction, {}
        # A plain baseline is a pattern that matches its own name alone (as in gated_cases).
        ratios = r.speedups if self.metric == "speedup" else r.memory_ratios
        over = {name: s for name, s in ratios.items() if fnmatch.fnmatch(name, self.baselines())}
        # Against the fastest baseline: the smallest speedup.
        return (min(over.values()) if over else None), over

    def describe(self) -> str:
        ceiling = self.metric == "ceiling_fraction"
        what = "fraction of the device ceiling" if ceiling else f"{self.metric} over {self.baseline}"
        where = " where " + ", ".join(f"{k} {v}" for k, v in self.where.items()) if self.where else ""
        return f"{self.kernel} {self.direction}: {what} >= {self.min:g}{where}"


_COMPARISONS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}


def _holds(value, condition: str) -> bool:
    match = re.fullmatch(r"\s*(>=|<=|==|>|<)\s*(\S+)\s*", str(condition))
    if match is None:
        raise ValueError(f"gate condition {condition!r}: expected an operator (>=, <=, ==, >, <) and a value")
    op, operand = match.groups()
    if value is None:
        return False
    if isinstance(value, bool) or operand in ("true", "false"):
        return _COMPARISONS[op](str(value).lower(), operand)
    return _COMPARISONS[op](float(value), float(operand))


def load_gates(path: Path = GATES_FILE) -> list[Gate]:
    with open(path, "rb") as f:
        return [Gate(**entry) for entry in tomllib.load(f)["gate"]]


@dataclass
class GateVerdict:
    gate: Gate
    subject: Result | Case  # the result of ours, or the case of ours that got no result
    value: float | None  # None: ours, or every baseline the gate names, not measured
    over: dict = field(default_factory=dict)  # baseline -> speedup, those the value was taken from

    @property
    def result(self) -> Result | None:
        return self.subject if isinstance(self.subject, Result) else None

    @property
    def passed(self) -> bool:
        if self.result is None or self.result.correct is False:  # ours not measured, or wrong
            return False
        return self.gate.optional if self.value is None else self.value >= self.gate.min

    def describe(self) -> str:
        s = self.subject
        if self.value is None:
            shown = "not measured" + (" (ours)" if self.result is None else f" ({self.gate.baseline})")
            shown += ", optional" if self.gate.optional and self.result is not None else ""
        else:
            shown = f"{self.value:.3f}"
            if self.gate.baseline.startswith("best:"):
                shown += " (min over " + ", ".join(f"{n} {v:.3f}" for n, v in self.over.items()) + ")"
        verdict = "PASS" if self.passed else "FAIL"
        wrong = " (and wrong against the reference)" if self.result and self.result.correct is False else ""
        return (
            f"{verdict} {s.kernel} {s.direction} [{s.shape}]: {shown} (gate: {self.gate.describe()}){wrong}"
        )


def evaluate_gates(results: list[Result], gates: list[Gate], expected: list[Case] = ()) -> list[GateVerdict]:
    """One verdict per (gate, matching result of ours); a wrong result fails every gate it meets.

    ``expected``: the cases that were to run. A gate never passes for lack of a result: each case
    of ours it matches that has no result (broken, interrupted) gets a verdict "not measured".
    """
    measured = {r.key for r in results}
    missing = [c for c in expected if c.implementation == "ours" and c.key not in measured]
    return [
        GateVerdict(g, r, *g.measure(r)) if isinstance(r, Result) else GateVerdict(g, r, None)
        for g in gates
        for r in [*results, *missing]
        if g.matches(r)
    ]


def gated_cases(cases: list[Case], gates: list[Gate]) -> list[Case]:
    """The cases a gate needs: ours on each shape and direction some gate holds it to, and there
    each baseline such a gate compares it with (the quick run's cases)."""
    patterns: dict[tuple, set[str]] = {}
    for case in cases:
        ours = replace(case, implementation="ours")
        for gate in gates:
            if gate.matches(ours):  # ours, and the baselines the gate names ("" matches none)
                patterns.setdefault(case.key[:3], {"ours"}).add(gate.baselines())
    return [
        c for c in cases if any(fnmatch.fnmatch(c.implementation, p) for p in patterns.get(c.key[:3], ()))
    ]


REGRESSION = 0.05  # --compare fails where ours got this much slower than in the earlier run


def compare(results: list[Result], previous: dict, expected: list[Case]) -> tuple[list[str], list[str]]:
    """Each case's median time over the same case's in an earlier run's results.json (``previous``,
    parsed), for the cases that were to run (``expected``) and that the earlier run measured.
    Returns the report's lines and the failures among them: ours (or a variant of ours) slower by
    more than REGRESSION, or not measured now."""
    now = {r.key: r for r in results}
    selected = {c.key for c in expected}
    lines, failures = [], []
    for old in previous["results"]:
        key = (old["kernel"], tuple(old["params"].items()), old["direction"], old["implementation"])
        if key not in selected:
            continue
        ours = old["implementation"].startswith("ours")
        label = f"{old['kernel']} {old['direction']} [{shape_text(old['params'])}] {old['implementation']}"
        if key not in now:
            line = f"{label}: not measured (was {old['median_ms']:.4f} ms)"
            bad = ours
        else:
            ratio = now[key].median_ms / old["median_ms"]
            times = f"{old['median_ms']:.4f} -> {now[key].median_ms:.4f} ms"
            line = f"{label}: {ratio:.3f}x the earlier time ({times})"
            bad = ours and ratio > 1 + REGRESSION
        lines.append(("REGRESSION " if bad else "           ") + line)
        if bad:
            failures.append(line)
    return lines, failures


TABLE_COLUMNS = (
    "kernel",
    "direction",
    "shape",
    "impl",
    "ms",
    "q1-q3 ms",
    "rate",
    "ceiling",
    "vs best other",
    "check",
)


def format_table(results: list[Result]) -> str:
    def cells(r: Result) -> tuple:
        best_other = f"{min(r.speedups.values()):.2f}x" if r.speedups else ""
        check = "" if r.correct is None else ("ok" if r.correct else "WRONG")
        return (
            r.kernel,
            r.direction,
            r.shape,
            r.implementation,
            f"{r.median_ms:.4f}",
            f"{r.q1_ms:.4f}-{r.q3_ms:.4f}",
            f"{r.throughput:.1f} {RATES[r.unit][0]}",
            f"{r.ceiling_fraction:.0%}",
            best_other,
            check,
        )

    return report.format_table([TABLE_COLUMNS, *map(cells, results)])


def results_dir(gpu: str) -> Path:
    """Where a run's results go by default: bench/results/<date>-<gpu>/."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower()
    return RESULTS_DIR / f"{datetime.date.today()}-{name}"


def write_json(
    path: Path, machine: dict, ceilings: dict, results: list[Result], verdicts: list[GateVerdict]
) -> None:
    gates = [
        {
            "gate": v.gate.describe(),
            "kernel": v.subject.kernel,
            "direction": v.subject.direction,
            "shape": v.subject.params,
            "value": v.value,
            "over": v.over,
            "passed": v.passed,
        }
        for v in verdicts
    ]
    document = {
        "schema": "little-horse-bench/1",
        "machine": machine,
        "ceilings": ceilings,
        "results": [asdict(r) for r in results],
        "gates": gates,
    }
    path.write_text(json.dumps(document, indent=2))


def save_and_gate(
    out: Path | None,
    name: str,
    machine: dict,
    ceilings: dict,
    results: list[Result],
    gates: list[Gate],
    expected: list[Case],
    table: Callable[[list[Result]], str] = format_table,
    plots: bool = False,
) -> list[GateVerdict]:
    """Add the metrics to results (:func:`add_metrics`) and print them as table formats them; gate
    them (:func:`evaluate_gates`: an expected case of ours without one is "not measured"), write them
    with their verdicts to out/name (out: default :func:`results_dir`), with plots a PNG per kernel
    beside it (:func:`plot`), and print what was written and each verdict. Returns the verdicts that
    failed."""
    add_metrics(results, ceilings)
    print("\n" + table(results))
    verdicts = evaluate_gates(results, gates, expected)
    out = out or results_dir(machine["gpu"])
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / name, machine, ceilings, results, verdicts)
    written = plot(results, out) if plots else []
    print(f"\nwrote {out / name}" + "".join(f", {p.name}" for p in written))
    failed = [v for v in verdicts if not v.passed]
    print(f"\ngates: {len(verdicts) - len(failed)} of {len(verdicts)} passed")
    for verdict in verdicts:
        print("  " + verdict.describe())
    return failed


def plot(results: list[Result], out_dir: Path) -> list[Path]:
    """One PNG per kernel: throughput against its x param, a panel per direction and other params,
    a line per implementation. Returns the files written (none without matplotlib)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    plt.switch_backend("Agg")  # files only, never a window
    written = []
    for kernel in sorted({r.kernel for r in results}):
        mine = [r for r in results if r.kernel == kernel]
        # The param with the most distinct values.
        x_param = max(mine[0].params, key=lambda name: len({r.params[name] for r in mine}))
        panels: dict[tuple, list[Result]] = {}
        for r in mine:
            rest = tuple((k, v) for k, v in r.params.items() if k != x_param)
            panels.setdefault((r.direction, rest), []).append(r)
        cols = min(3, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
        for ax, ((direction, rest), group) in zip(axes.flat, sorted(panels.items()), strict=False):
            for impl in sorted({r.implementation for r in group}, key=lambda name: name != "ours"):
                points = sorted((r.params[x_param], r.throughput) for r in group if r.implementation == impl)
                ax.plot(
                    *zip(*points, strict=True), marker="o", label=impl, linewidth=2.5 if impl == "ours" else 1
                )
            ax.set_title(f"{direction} {shape_text(dict(rest))}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set(xlabel=x_param, ylabel=RATES[group[0].unit][0])
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(kernel)
        fig.tight_layout()
        path = out_dir / f"{kernel}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
