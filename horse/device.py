"""Where a run computes, and how it is watched: the device and backend choice, the GPU's peak FLOP/s
for MFU, NVTX ranges (``nsys profile``) and the torch.profiler trace of ``--profile-steps``."""

import contextlib
from pathlib import Path

import torch

from horse.kernels import runtime

try:  # the nvtx package's ranges are the cheapest; torch.cuda.nvtx needs a CUDA build
    import nvtx
except ImportError:
    nvtx = None

# Dense float16/bfloat16 tensor-core peaks, TFLOP/s; the first name contained in the device's wins.
PEAK_TFLOPS = {
    "GB300": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "A100": 312.0,
    "MI325X": 1307.4,
    "MI300X": 1307.4,
    "MI300A": 980.6,
}


def pick_device(requested: str | None) -> str:
    """The one asked for, else cuda where a GPU is visible; cuda asked for without one is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to this process")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def pick_backend(requested: str | None, device: str) -> tuple[str, str]:
    """(backend, why): the one asked for, else triton on a GPU the kernels have configs for and
    reference elsewhere. triton asked for on a GPU without configs (compute capability below 8.0,
    AMD GPUs other than gfx942) fails here, before anything is loaded, with the kernels' own error."""
    reason = ""
    if device == "cuda":
        try:
            runtime.arch(torch.device("cuda", torch.cuda.current_device()))
        except RuntimeError as error:
            if requested == "triton":
                raise
            reason = f" ({error})"
    if requested:
        return requested, ""
    if device == "cuda":
        return ("reference", reason) if reason else ("triton", "")
    return (
        "reference",
        " (on the CPU: the Triton kernels would run only in Triton's interpreter, far too slowly to train)",
    )


def peak_flops(device: str, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def nvtx_range(name: str):
    """An NVTX range for Nsight Systems (the nvtx package, else torch's binding on a GPU), also
    labelled in torch.profiler traces."""
    stack = contextlib.ExitStack()
    if nvtx is not None:
        stack.enter_context(nvtx.annotate(name))
    elif torch.cuda.is_available():
        stack.enter_context(torch.cuda.nvtx.range(name))
    stack.enter_context(torch.profiler.record_function(name))
    return stack


def profiler(steps: int, out_dir: Path, device: str):
    """A torch.profiler of ``steps`` steps after two warm-up steps, written to OUT/trace.json; a null
    context (None) when steps is 0."""
    if not steps:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(out_dir / "trace.json")),
    )
