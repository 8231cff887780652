"""LayerNorm and RMSNorm benchmark: ours against torch eager and torch.compile, forward and backward.

    python -m bench.norms [--quick] [--json PATH] [--dtype float16|bfloat16|float32]

For each shape (rows, hidden) and norm, ours (``kernels.layer_norm`` / ``kernels.rms_norm``, with
weight and, for LayerNorm, bias) is first checked against the float32 reference of
``kernels.reference``, output and gradients; a shape that fails is marked FAIL. Then three
implementations are timed: ours, torch eager (``torch.nn.functional.layer_norm`` / ``rms_norm``) and
``torch.compile`` of that same eager function.

* forward: one call under ``torch.no_grad()``;
* backward: ``torch.autograd.grad`` of y w.r.t. x, weight (and bias) for a fixed dy, on a graph
  built once and kept with ``retain_graph=True``; only the backward call is timed.

GB/s counts the bytes that must move (:func:`forward_bytes`, :func:`backward_bytes`), and is also
given as a fraction of the measured device-to-device copy bandwidth. The issue's targets for an
H200 get a PASS/FAIL column; they are reported, never asserted. The exit status is non-zero only
when a correctness check fails.

Without a CUDA device there is nothing to time: the kernels run in Triton's interpreter on two
small shapes, and only the correctness check is made.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from bench import timing

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads TRITON_INTERPRET once, when kernels first imports it. Without it, CPU tensors
    # would run the float32 reference and the check would compare the reference with itself.
    os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from kernels import reference, runtime  # noqa: E402

LAYER_NORM_EPS = 1e-5
# Passed explicitly, so that every implementation normalises with the same eps.
RMS_NORM_EPS = 1e-6

ROWS = (4096, 16384, 65536)
HIDDEN = (1024, 4096, 8192, 16384)
QUICK_SHAPES = ((4096, 1024), (16384, 4096), (16384, 16384))
# Rows held in registers; and rows longer than 16,384, for the chunked forward and backward.
INTERPRETER_SHAPES = ((64, 1000), (8, 20000))
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Largest normalized error (see normalized_error) allowed against the float32 reference.
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-3}

# The targets, set for an H200.
FORWARD_COPY_FRACTION = 0.90
BACKWARD_COPY_FRACTION = 0.80
BANDWIDTH_TARGET_MIN_ROWS = 16384
BANDWIDTH_TARGET_MIN_HIDDEN = 4096
_LARGE_SHAPES = f"hidden >= {BANDWIDTH_TARGET_MIN_HIDDEN} and rows >= {BANDWIDTH_TARGET_MIN_ROWS}"
TARGETS = (
    f"ours forward >= {FORWARD_COPY_FRACTION:.0%} of measured copy bandwidth at {_LARGE_SHAPES}",
    f"ours backward >= {BACKWARD_COPY_FRACTION:.0%} of measured copy bandwidth at {_LARGE_SHAPES}",
    "ours never slower than torch.compile of the eager function (and correct)",
)


# ----------------------------------------------------------------------------------------------
# The implementations, each called as fn(x, weight) or fn(x, weight, bias)
# ----------------------------------------------------------------------------------------------


def _ours_layer_norm(x, weight, bias):
    return kernels.layer_norm(x, (x.shape[-1],), weight, bias, LAYER_NORM_EPS)


def _eager_layer_norm(x, weight, bias):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, LAYER_NORM_EPS)


def _reference_layer_norm(x, weight, bias):
    return reference.layer_norm(x, (x.shape[-1],), weight, bias, LAYER_NORM_EPS)


def _ours_rms_norm(x, weight):
    return kernels.rms_norm(x, (x.shape[-1],), weight, RMS_NORM_EPS)


def _eager_rms_norm(x, weight):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, RMS_NORM_EPS)


def _reference_rms_norm(x, weight):
    return reference.rms_norm(x, (x.shape[-1],), weight, RMS_NORM_EPS)


@dataclass(frozen=True)
class Norm:
    """One normalisation and its implementations."""

    name: str
    has_bias: bool
    ours: Callable[..., torch.Tensor]
    eager: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]  # float32, the truth ours is checked against


NORMS = (
    Norm("LayerNorm", True, _ours_layer_norm, _eager_layer_norm, _reference_layer_norm),
    Norm("RMSNorm", False, _ours_rms_norm, _eager_rms_norm, _reference_rms_norm),
)


# ----------------------------------------------------------------------------------------------
# Bytes, errors and targets
# ----------------------------------------------------------------------------------------------


def forward_bytes(
    rows: int, hidden: int, element_bytes: int, weight_element_bytes: int, has_bias: bool
) -> int:
    """Bytes a norm's forward must move: read x and write y, read weight (and bias).

    2·rows·hidden·element_bytes + (2 if has_bias else 1)·hidden·weight_element_bytes. The per-row
    statistics the forward also writes for the backward (LayerNorm's mean and rstd, RMSNorm's
    rstd) are not counted: the output needs none of them, and at 4–8 bytes a row they are noise.
    """
    parameters = 2 if has_bias else 1
    return 2 * rows * hidden * element_bytes + parameters * hidden * weight_element_bytes


def backward_bytes(
    rows: int, hidden: int, element_bytes: int, weight_element_bytes: int, has_bias: bool
) -> int:
    """Bytes a norm's backward must move: read x and dy, write dx; read weight, write dweight (and dbias).

    3·rows·hidden·element_bytes + (3 if has_bias else 2)·hidden·weight_element_bytes. The per-row
    statistics saved by the forward are not counted, as in :func:`forward_bytes`.
    """
    parameter_vectors = 3 if has_bias else 2
    return 3 * rows * hidden * element_bytes + parameter_vectors * hidden * weight_element_bytes


def normalized_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest ``|actual - expected|`` divided by ``max(1, largest |expected|)``.

    An absolute error on outputs of O(1) (y, dx), a relative one on larger outputs (dweight and
    dbias sum over all rows). NaN anywhere in ``actual`` gives NaN, which fails every tolerance.
    """
    difference = (actual.float() - expected.float()).abs().max().item()
    return difference / max(1.0, expected.float().abs().max().item())


def meets_targets(
    direction: str, rows: int, hidden: int, copy_fraction: float, speedup_vs_compile: float
) -> bool:
    """Whether ours meets the issue's targets on one (correct) shape; see TARGETS."""
    if speedup_vs_compile < 1.0:
        return False
    if rows < BANDWIDTH_TARGET_MIN_ROWS or hidden < BANDWIDTH_TARGET_MIN_HIDDEN:
        return True
    required = FORWARD_COPY_FRACTION if direction == "forward" else BACKWARD_COPY_FRACTION
    return copy_fraction >= required


# ----------------------------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------------------------


def make_inputs(
    norm: Norm, rows: int, hidden: int, dtype: torch.dtype, device: torch.device, requires_grad: bool = False
) -> list[torch.Tensor]:
    """``[x, weight]`` or ``[x, weight, bias]``: x ~ N(0, 1), weight ~ 1 + 0.1·N(0, 1), bias ~ 0.1·N(0, 1)."""
    tensors = [
        torch.randn(rows, hidden, dtype=dtype, device=device),
        1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device),
    ]
    if norm.has_bias:
        tensors.append(0.1 * torch.randn(hidden, dtype=dtype, device=device))
    return [t.requires_grad_(requires_grad) for t in tensors]


@dataclass(frozen=True)
class Check:
    """Ours against the float32 reference on one shape: the normalized error of each output."""

    norm: str
    rows: int
    hidden: int
    errors: dict[str, float]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(error <= self.tolerance for error in self.errors.values())

    def describe(self) -> str:
        errors = "  ".join(f"{name} {error:.1e}" for name, error in self.errors.items())
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"{self.norm:<9}  rows {self.rows:>6}  hidden {self.hidden:>6}  {verdict:<4}  errors: {errors}"
            f"  (tolerance {self.tolerance:.0e})"
        )


def check_against_reference(
    norm: Norm, rows: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> Check:
    """Output and gradients of ours for a random dy, against the reference computed in float32."""
    torch.manual_seed(0)
    tensors = make_inputs(norm, rows, hidden, dtype, device, requires_grad=True)
    dy = torch.randn(rows, hidden, dtype=dtype, device=device)
    # NaN-filled output buffers, so that an element the kernels never write fails the check.
    with runtime.poison_outputs():
        y = norm.ours(*tensors)
        grads = torch.autograd.grad(y, tensors, dy)
    exact_inputs = [t.detach().float().requires_grad_() for t in tensors]
    y_exact = norm.reference(*exact_inputs)
    grads_exact = torch.autograd.grad(y_exact, exact_inputs, dy.float())
    names = ("y", "dx", "dweight", "dbias")[: 1 + len(tensors)]
    errors = {
        name: normalized_error(actual, expected)
        for name, actual, expected in zip(names, (y, *grads), (y_exact, *grads_exact), strict=True)
    }
    return Check(norm.name, rows, hidden, errors, TOLERANCE[dtype])


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def time_forward(
    fn: Callable[..., torch.Tensor],
    norm: Norm,
    rows: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> timing.Timing:
    """GPU time of one forward call, without autograd, on rotated inputs."""
    x_bytes = rows * hidden * dtype.itemsize
    copies = timing.rotating_inputs(lambda: make_inputs(norm, rows, hidden, dtype, device), x_bytes, device)
    with torch.no_grad():
        return timing.time_gpu(lambda tensors: fn(*tensors), copies)


def time_backward(
    fn: Callable[..., torch.Tensor],
    norm: Norm,
    rows: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> timing.Timing:
    """GPU time of ``torch.autograd.grad`` of y w.r.t. all inputs, on rotated prebuilt graphs."""

    def build_graph() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        tensors = make_inputs(norm, rows, hidden, dtype, device, requires_grad=True)
        y = fn(*tensors)
        return y, tensors, torch.randn_like(y)

    # A call reads x and dy; the weight and the saved per-row statistics are small.
    x_and_dy_bytes = 2 * rows * hidden * dtype.itemsize
    graphs = timing.rotating_inputs(build_graph, x_and_dy_bytes, device)
    return timing.time_gpu(
        lambda graph: torch.autograd.grad(graph[0], graph[1], graph[2], retain_graph=True), graphs
    )


@dataclass(frozen=True)
class Result:
    """One timed (norm, direction, shape, implementation); speedups and verdicts on ours only."""

    norm: str
    direction: str
    rows: int
    hidden: int
    implementation: str
    median_ms: float
    p20_ms: float
    p80_ms: float
    gbps: float
    copy_fraction: float
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    correct: bool | None = None
    meets_targets: bool | None = None


def summarize_group(
    norm: Norm,
    direction: str,
    rows: int,
    hidden: int,
    timings: dict[str, timing.Timing],
    bytes_moved: int,
    copy_gbps: float,
    correct: bool,
) -> list[Result]:
    """Results of the three implementations of one (norm, direction, shape), ours first."""
    results = []
    for implementation, measured in timings.items():
        gbps = bytes_moved / (measured.median_ms * 1e-3) / 1e9
        verdicts = {}
        if implementation == "ours":
            speedup_vs_compile = timings["compile"].median_ms / measured.median_ms
            verdicts = {
                "speedup_vs_eager": timings["eager"].median_ms / measured.median_ms,
                "speedup_vs_compile": speedup_vs_compile,
                "correct": correct,
                "meets_targets": correct
                and meets_targets(direction, rows, hidden, gbps / copy_gbps, speedup_vs_compile),
            }
        results.append(
            Result(
                norm.name, direction, rows, hidden, implementation, measured.median_ms, measured.p20_ms,
                measured.p80_ms, gbps, gbps / copy_gbps, **verdicts,
            )
        )  # fmt: skip
    return results


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

# (header, width, alignment) of each column of the terminal table.
COLUMNS = (
    ("norm", 9, "<"),
    ("direction", 9, "<"),
    ("rows", 6, ">"),
    ("hidden", 6, ">"),
    ("impl", 7, "<"),
    ("ms", 8, ">"),
    ("p20-p80 ms", 15, ">"),
    ("GB/s", 6, ">"),
    ("copy", 5, ">"),
    ("vs eager", 8, ">"),
    ("vs compile", 10, ">"),
    ("check", 5, ">"),
    ("target", 6, ">"),
)


def format_row(cells: Sequence[str]) -> str:
    """One line of the table, each cell padded to its column's width."""
    return "  ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, COLUMNS, strict=True))


def _verdict(value: bool | None, passed: str) -> str:
    return "" if value is None else passed if value else "FAIL"


def result_cells(result: Result) -> list[str]:
    """The table cells of one result; empty where a column applies to ours only."""
    speedups = [
        f"{s:.2f}x" if s is not None else "" for s in (result.speedup_vs_eager, result.speedup_vs_compile)
    ]
    return [
        result.norm,
        result.direction,
        str(result.rows),
        str(result.hidden),
        result.implementation,
        f"{result.median_ms:.4f}",
        f"{result.p20_ms:.4f}-{result.p80_ms:.4f}",
        f"{result.gbps:.0f}",
        f"{result.copy_fraction:.0%}",
        *speedups,
        _verdict(result.correct, "ok"),
        _verdict(result.meets_targets, "PASS"),
    ]


def run_benchmark(
    shapes: Sequence[tuple[int, int]], dtype: torch.dtype, device: torch.device
) -> tuple[dict, bool]:
    """Check and time every norm on every shape, printing as it goes; returns (report, all correct)."""
    machine = timing.machine_info(device)
    versions = f"CUDA {machine['cuda_runtime']}  torch {machine['torch']}  triton {machine['triton']}"
    print(f"{machine['gpu']}  {versions}")
    copy_gbps = timing.copy_bandwidth_gbps(device)
    matmul_tflops = timing.matmul_tflops(device)
    print(f"measured copy bandwidth {copy_gbps:.0f} GB/s, fp16 matmul {matmul_tflops:.0f} TFLOP/s")
    print("targets (H200; reported, not asserted):")
    for target in TARGETS:
        print(f"  - {target}")
    print()
    print(format_row([header for header, _, _ in COLUMNS]))

    checks, results = [], []
    for rows, hidden in shapes:
        for norm in NORMS:
            check = check_against_reference(norm, rows, hidden, dtype, device)
            checks.append(check)
            if not check.ok:
                print(f"FAIL {check.describe()}")
            # A fresh static compile per shape: never a dynamic-shape kernel, never the recompile limit.
            torch._dynamo.reset()
            implementations = {
                "ours": norm.ours,
                "eager": norm.eager,
                "compile": torch.compile(norm.eager, dynamic=False),
            }
            for direction, time_fn, bytes_fn in (
                ("forward", time_forward, forward_bytes),
                ("backward", time_backward, backward_bytes),
            ):
                timings = {
                    name: time_fn(fn, norm, rows, hidden, dtype, device)
                    for name, fn in implementations.items()
                }
                bytes_moved = bytes_fn(rows, hidden, dtype.itemsize, dtype.itemsize, norm.has_bias)
                group = summarize_group(
                    norm, direction, rows, hidden, timings, bytes_moved, copy_gbps, check.ok
                )
                for result in group:
                    print(format_row(result_cells(result)))
                results.extend(group)

    report = {
        "benchmark": "norms",
        "dtype": str(dtype),
        "machine": machine,
        "copy_bandwidth_gbps": copy_gbps,
        "matmul_fp16_tflops": matmul_tflops,
        "targets": list(TARGETS),
        "checks": [asdict(check) | {"ok": check.ok} for check in checks],
        "results": [asdict(result) for result in results],
    }
    return report, all(check.ok for check in checks)


def run_interpreter_check(dtype: torch.dtype) -> tuple[dict, bool]:
    """The correctness check alone, on small shapes in Triton's interpreter; returns (report, all correct)."""
    print(
        "No CUDA device: timing needs a GPU. Running only the correctness check, in Triton's "
        f"interpreter, on {len(INTERPRETER_SHAPES)} small shapes."
    )
    if not runtime.INTERPRET:
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so the kernels would not run; "
            "run this as `python -m bench.norms`"
        )
    device = torch.device("cpu")
    checks = []
    for rows, hidden in INTERPRETER_SHAPES:
        for norm in NORMS:
            check = check_against_reference(norm, rows, hidden, dtype, device)
            print(check.describe())
            checks.append(check)
    all_correct = all(check.ok for check in checks)
    print("correctness: " + ("ok" if all_correct else "FAIL"))
    report = {
        "benchmark": "norms",
        "dtype": str(dtype),
        "machine": timing.machine_info(),
        "note": "no CUDA device: correctness check only, in Triton's interpreter",
        "checks": [asdict(check) | {"ok": check.ok} for check in checks],
        "results": [],
    }
    return report, all_correct


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.norms", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only the shapes {list(QUICK_SHAPES)}")
    parser.add_argument("--json", metavar="PATH", help="write every check and timing, and the machine, here")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="x, y and parameters")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]

    if HAS_CUDA:
        shapes = QUICK_SHAPES if args.quick else tuple((rows, hidden) for rows in ROWS for hidden in HIDDEN)
        report, all_correct = run_benchmark(shapes, dtype, torch.device("cuda", torch.cuda.current_device()))
    else:
        report, all_correct = run_interpreter_check(dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all_correct else 1


if __name__ == "__main__":
    sys.exit(main())
