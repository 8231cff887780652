"""GPU timing shared by the benchmarks: CUDA-event timings, rotated inputs, machine ceilings.

Every GPU time here comes from CUDA events recorded on the stream around each call, never from a
wall clock around asynchronous launches. Three things keep the samples honest:

* warm-up calls first (Triton and ``torch.compile`` compile on the first call, the caching
  allocator grows, clocks ramp up);
* each call reads one of several copies of its inputs, enough copies that together they exceed
  twice the L2 cache, so no call finds its inputs left in L2 by an earlier one;
* a spin kernel (``torch.cuda._sleep``) queued ahead of each timed call (the bench suite's rounds:
  one call each) or batch of calls (:func:`time_gpu`) keeps the GPU busy while the host enqueues
  it, so host overhead (Python, op dispatch, autograd, guards) never shows up inside a call's
  pair of events: from an idle GPU it is 10-15 % of a 60-100 microsecond norm.

Reported: the median of the samples and their 20th and 80th percentiles as the spread.
Throughputs are in decimal units: GB/s = 1e9 bytes per second, TFLOP/s = 1e12 FLOPs per second.
"""

import contextlib
import functools
import importlib
import itertools
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

H200_L2_BYTES = 50 * 2**20  # used where the device does not report its L2 size
L2_MULTIPLE = 2  # rotated inputs span at least this many L2 caches
MEMORY_FRACTION = 0.25  # of the free device memory, at most, for rotated copies
MAX_SPIN_MS = 200.0  # never spin longer than this ahead of one batch


@dataclass(frozen=True)
class Timing:
    """Summary of the per-call GPU times of one benchmark, in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int


def summarize(samples_ms: Sequence[float]) -> Timing:
    """Median and 20th/80th percentiles (inclusive method) of per-call times in ms."""
    if len(samples_ms) < 2:
        raise ValueError(f"need at least 2 samples to summarize, got {len(samples_ms)}")
    deciles = statistics.quantiles(samples_ms, n=10, method="inclusive")
    return Timing(statistics.median(samples_ms), deciles[1], deciles[7], len(samples_ms))


def rotation_copies(bytes_per_copy: int, l2_bytes: int, budget_bytes: int) -> int:
    """Copies of the inputs to rotate among: enough to span ``L2_MULTIPLE`` L2 caches.

    At least one; at most as many as fit in ``budget_bytes`` (one copy is always allowed: a
    benchmark that cannot hold one copy fails on its own).
    """
    wanted = -(-L2_MULTIPLE * l2_bytes // max(1, bytes_per_copy))  # ceiling division
    affordable = budget_bytes // max(1, bytes_per_copy)
    return max(1, min(wanted, affordable))


def l2_cache_bytes(device: torch.device) -> int:
    """The L2 cache size the device reports, or the H200's 50 MiB where it reports none."""
    reported = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return reported or H200_L2_BYTES


def rotating_inputs(make_copy: Callable[[], T], bytes_per_copy: int, device: torch.device) -> list[T]:
    """Independent copies of a benchmark's inputs, built by ``make_copy``, to rotate among.

    ``bytes_per_copy`` is what one call reads from its copy; the count is from
    :func:`rotation_copies`, with a budget of ``MEMORY_FRACTION`` of the free device memory.
    """
    free_bytes, _ = torch.cuda.mem_get_info(device)
    budget = int(free_bytes * MEMORY_FRACTION)
    return [make_copy() for _ in range(rotation_copies(bytes_per_copy, l2_cache_bytes(device), budget))]


def rotate(copies: list, fn: Callable, no_grad: bool = False) -> Callable[[], object]:
    """A zero-argument call of fn on the next of copies, cycling, so no call finds its inputs in
    L2 from the call before (copies from :func:`rotating_inputs`)."""
    items = itertools.cycle(copies)

    def call():
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            return fn(next(items))

    return call


def timed_call(
    fn: Callable,
    make_inputs: Callable,
    direction: str,
    bytes_per_copy: int,
    device="cuda",
    grad: bool = False,
) -> Callable[[], object]:
    """The call a benchmark times: one direction of fn on rotated copies of its inputs.

    ``make_inputs(requires_grad)`` builds one copy: a list of tensors, passed as ``fn(*inputs)``, or
    a dict, passed whole; ``bytes_per_copy`` is what one call reads of it. forward: fn under
    no_grad, unless grad (a forward that saves for its backward); backward: ``autograd.grad`` of an
    output built once per copy w.r.t. the inputs that require grad, its graph retained;
    forward+backward: both in each call. The cotangent is random, made with each copy (none for a
    scalar output)."""

    def run(inputs):
        return fn(inputs) if isinstance(inputs, dict) else fn(*inputs)

    device = torch.device(device)
    if direction == "forward":
        copies = rotating_inputs(lambda: make_inputs(grad), bytes_per_copy, device)
        return rotate(copies, run, no_grad=not grad)

    def make_copy():
        inputs = make_inputs(True)
        leaves = [t for t in (inputs.values() if isinstance(inputs, dict) else inputs) if t.requires_grad]
        out = run(inputs)  # forward+backward: only for the cotangent's shape
        dout = torch.randn_like(out) if out.ndim else None
        return inputs, leaves, (out if direction == "backward" else None), dout

    copies = rotating_inputs(make_copy, bytes_per_copy, device)
    if direction == "backward":
        return rotate(copies, lambda c: torch.autograd.grad(c[2], c[1], c[3], retain_graph=True))
    return rotate(copies, lambda c: torch.autograd.grad(run(c[0]), c[1], c[3]))


def without_tma(call: Callable[[], T], module: str) -> Callable[[], T]:
    """call with the TMA switch of kernels module ``module`` (its USE_TMA) off: every launch on
    pointer loads, the backward's included. The switch is read at each launch, so it wraps the timed
    call, not fn (the ours-pointer cases)."""
    kernels_module = importlib.import_module(module)

    def timed():
        previous, kernels_module.USE_TMA = kernels_module.USE_TMA, False
        try:
            return call()
        finally:
            kernels_module.USE_TMA = previous

    return timed


def setup(
    make_fn: Callable[[], Callable],
    make_inputs: Callable,
    direction: str,
    bytes_per_copy: int,
    device="cuda",
    grad: bool = False,
    tma_off: str | None = None,
) -> Callable:
    """A case's setup (``suite.Case.setup``): on the device, fn = make_fn() and its :func:`timed_call`,
    with tma_off (a kernels module) :func:`without_tma`."""

    def build():
        call = timed_call(make_fn(), make_inputs, direction, bytes_per_copy, device, grad)
        return without_tma(call, tma_off) if tma_off else call

    return build


@functools.cache
def _spin_cycles_per_ms(device_index: int) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured with events once."""
    cycles = 10_000_000
    with torch.cuda.device(device_index):
        torch.cuda._sleep(1000)  # the first launch pays one-time costs
        start = cuda_event_timer()
        torch.cuda._sleep(cycles)
        seconds = cuda_event_timer() - start
    return cycles / (seconds * 1e3)


def spin(ms: float) -> None:
    """Queue a kernel that keeps the current CUDA device busy for about ``ms`` (at most MAX_SPIN_MS)."""
    torch.cuda._sleep(int(min(MAX_SPIN_MS, ms) * _spin_cycles_per_ms(torch.cuda.current_device())))


def host_ms_per_call(call: Callable[[], object], calls: int = 5) -> float:
    """Host time to enqueue one ``call()``, in ms, from an idle GPU; only to size a spin, never a result."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return elapsed_ms / calls


def spin_ahead_ms(host_ms: float, calls: int = 1) -> float:
    """How long to spin so the GPU is still busy when the last of ``calls`` calls is enqueued:
    twice their host time (the host may run slower while timing), plus 0.1 ms for the events."""
    return 2 * host_ms * calls + 0.1


def time_gpu(
    fn: Callable[[T], object], inputs: Sequence[T], warmup: int = 10, repeats: int = 100, batch: int = 20
) -> Timing:
    """GPU time of ``fn(inputs[i])`` on the current CUDA device and stream, i cycling over inputs.

    ``warmup`` untimed calls, then ``repeats`` calls, each between its own pair of CUDA events,
    in batches of ``batch`` calls with a spin kernel queued ahead of each batch.
    """
    call = rotate(inputs, fn)
    for _ in range(warmup):
        call()
    host_ms = host_ms_per_call(call, batch)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for first in range(0, repeats, batch):
        batch_calls = range(first, min(first + batch, repeats))
        spin(spin_ahead_ms(host_ms, len(batch_calls)))
        for i in batch_calls:
            starts[i].record()
            call()
            ends[i].record()
    torch.cuda.synchronize()
    return summarize([start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)])


def copy_bandwidth_gbps(device: torch.device, size_bytes: int = 2**31) -> float:
    """Device-to-device ``copy_`` bandwidth in GB/s, counting read + write (2 × size bytes)."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    with torch.cuda.device(device):
        measured = time_gpu(lambda pair: pair[1].copy_(pair[0]), [(src, dst)], warmup=5, repeats=30)
    return 2 * size_bytes / (measured.median_ms * 1e-3) / 1e9


def matmul_tflops(device: torch.device, size: int = 8192, dtype: torch.dtype = torch.float16) -> float:
    """Throughput of a ``size``³ ``torch.matmul`` in TFLOP/s, counting 2·M·N·K FLOPs."""
    # Random operands: all-zero ones draw less power and clock higher than real data does.
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    with torch.cuda.device(device):
        measured = time_gpu(lambda pair: torch.matmul(*pair), [(a, b)], warmup=5, repeats=30)
    return 2 * size**3 / (measured.median_ms * 1e-3) / 1e12


def _first_line(command: list[str], cwd: Path | None = None) -> str | None:
    """The first line of a command's output, or None where it fails or prints nothing."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.splitlines()[0].strip() if result.stdout.strip() else None


def machine_info(device: torch.device | None = None) -> dict:
    """What a result was measured on: GPU, driver, CUDA, torch, triton, git commit and time."""
    # Imported here: a benchmark may have to set TRITON_INTERPRET before triton's first import.
    import triton

    driver_api = getattr(torch._C, "_cuda_getDriverVersion", None)  # absent from some CUDA builds too
    # The kernel-module driver version (e.g. 550.54.15); torch only knows the CUDA driver API level.
    nvidia_smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    info = {
        "gpu": torch.cuda.get_device_name(device) if device is not None else None,
        "nvidia_driver": _first_line(nvidia_smi) if device is not None else None,
        "cuda_driver_api": driver_api() if device is not None and driver_api is not None else None,
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_commit": _first_line(["git", "rev-parse", "HEAD"], Path(__file__).resolve().parent),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if device is not None:
        info["l2_cache_bytes"] = l2_cache_bytes(device)
        info["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
    return info


def announce_machine() -> tuple[torch.device, dict]:
    """The current CUDA device and its machine_info, its GPU and versions printed as a bench's first line."""
    device = torch.device("cuda", torch.cuda.current_device())
    machine = machine_info(device)
    versions = f"CUDA {machine['cuda_runtime']}  torch {machine['torch']}  triton {machine['triton']}"
    print(f"{machine['gpu']}  {versions}")
    return device, machine


class EventStamp(float):
    """What :func:`cuda_event_timer` returns: a float (0.0) carrying a recorded CUDA event.

    pytest-benchmark times a round as ``timer() - timer()``; the difference of two stamps is the
    GPU time between their events, in seconds, so the harness measures with CUDA events.
    """

    def __new__(cls, event):
        stamp = super().__new__(cls, 0.0)
        stamp.event = event
        return stamp

    def __sub__(self, other: "EventStamp") -> float:
        self.event.synchronize()
        return other.event.elapsed_time(self.event) / 1e3


def cuda_event_timer() -> EventStamp:
    """A pytest-benchmark timer: records a CUDA event on the current stream, never synchronizes."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return EventStamp(event)
