"""The suite's one accuracy rule, after flash-attention's: a kernel's error against the truth (float64)
may be at most twice the error of plain PyTorch at the same precision, plus a floor that scales
with the tensor's magnitude (summation order alone moves float32 results by ~1e-6 relative)."""

import collections
import itertools
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import timing
from horse.kernels import runtime

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def assert_close(name: str, actual: torch.Tensor, truth: torch.Tensor, baseline: torch.Tensor) -> None:
    """Fail, naming the worst element, unless |actual - truth| <= 2 |baseline - truth| + floor.

    actual: the kernel's result; truth: float64 reference; baseline: the PyTorch reference run on
    the same low-precision inputs and rounded to actual's dtype. NaN anywhere fails.
    """
    assert actual.shape == truth.shape, f"{name}: shape {list(actual.shape)} != {list(truth.shape)}"
    assert actual.dtype == baseline.dtype, f"{name}: dtype {actual.dtype}, expected {baseline.dtype}"
    truth = truth.detach().double()
    error = (actual.detach().double() - truth).abs().nan_to_num(nan=float("inf"))
    baseline_error = (baseline.detach().double() - truth).abs().max().item() if truth.numel() else 0.0
    scale = max(1.0, truth.abs().max().item()) if truth.numel() else 1.0
    allowed = torch.full_like(truth, 2 * baseline_error + FLOOR[actual.dtype] * scale)
    if runtime.INTERPRET and actual.dtype == torch.bfloat16:
        # Triton's interpreter converts float32 to bfloat16 by truncation where a GPU rounds to
        # nearest: one more unit in the last place, at most 2**-7 of the value.
        allowed += 2**-7 * truth.abs()
    excess = error / allowed
    if excess.numel() and not excess.max().item() <= 1.0:
        worst = int(excess.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
        bad = int((excess > 1.0).sum())
        raise AssertionError(
            f"{name}: {bad} of {error.numel()} elements outside 2 x PyTorch's error "
            f"({baseline_error:.3g}) + floor; worst at {index}: got {actual.flatten()[worst].item()!r}, "
            f"truth {truth.flatten()[worst].item()!r}, allowed error {allowed.flatten()[worst].item():.3g}"
        )


def check_descriptor_strides_in_bytes() -> None:
    """Triton 3.5's interpreter refuses a tensor descriptor whose strides are not multiples
    of 16 elements, where a GPU (and the interpreter from 3.6) asks for 16 bytes: it would fail the
    float16 tiles of 8-element strides that the launchers rightly send by TMA. Make it check bytes,
    in this process (conftest) and in the ranks a test spawns. Nothing to do on 3.6 or a GPU."""
    if not runtime.INTERPRET or runtime.TRITON_VERSION >= (3, 6):
        return
    from triton.runtime import interpreter

    def validate(self):
        assert self.base.data.item() % 16 == 0, "base must be 16-byte aligned"
        assert len(self.strides) == len(self.block_shape) == self.ndim >= 1
        itemsize = self.base.dtype.element_ty.primitive_bitwidth // 8
        for stride in self.strides[:-1]:
            assert stride.data.item() * itemsize % 16 == 0, "stride must be 16-byte aligned"
        assert self.strides[-1].data.item() == 1, "last dim must be contiguous"

    interpreter.TensorDescHandle.validate = validate


def record_tma_choices(monkeypatch, module) -> list:
    """The verdicts of ``module.tma_usable`` (horse.kernels.attention.launch's or horse.kernels.mlp.launch's)
    for every launch from now on, in order."""
    choices = []
    decide = module.tma_usable

    def recording(cfg, *tensors, **options):
        choices.append(decide(cfg, *tensors, **options))
        return choices[-1]

    monkeypatch.setattr(module, "tma_usable", recording)
    return choices


def run_family_tables(monkeypatch, family: str, module, blocks: str, choose: str) -> set:
    """Make every launch from now on take GPU family ``family``'s table entries at their own tiles,
    not the interpreter's small ones (``module.<blocks>`` emptied), and return the set of configs
    that ``module.<choose>`` (attn_config, gemm_config) hands the launches."""
    monkeypatch.setattr(module, blocks, {})
    monkeypatch.setattr(runtime, "arch", lambda device: runtime.ARCHS[family])
    chosen, pick = set(), getattr(module, choose)

    def recording(*args):
        chosen.add(pick(*args))
        return pick(*args)

    monkeypatch.setattr(module, choose, recording)
    return chosen


def device_has_tma(device: str) -> bool:
    """The interpreter emulates TMA; a GPU has it from sm_90 on."""
    return device == "cpu" or runtime.arch(torch.device(device)).capability >= 90


class FakeClock:
    """Stands in for the GPU's timeline and the host's clock: only the timed calls move it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake_cuda_events(monkeypatch, clock: FakeClock) -> None:
    """CUDA events that read the fake clock, and a no-op torch.cuda.synchronize."""

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = clock.now

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


# What a stand-in H200 measures: device-to-device copy GB/s and float16 matmul TFLOP/s.
STAND_IN_CEILINGS = {"copy_gbps": 4000.0, "matmul_tflops": 800.0}


def name_it_an_h200(monkeypatch) -> None:
    """Device 0, an "NVIDIA H200" in name and machine info, whose ceilings measure STAND_IN_CEILINGS."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "NVIDIA H200")
    machine = timing.machine_info() | {"gpu": "NVIDIA H200"}
    monkeypatch.setattr(timing, "machine_info", lambda device: machine)
    monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda device: STAND_IN_CEILINGS["copy_gbps"])
    monkeypatch.setattr(timing, "matmul_tflops", lambda device: STAND_IN_CEILINGS["matmul_tflops"])


def command_line_flags(values: dict) -> list[str]:
    """horse.train's flags for a dict of field values: {"max_steps": 3, "resume": True} ->
    ["--max-steps", "3", "--resume"] (False leaves a flag out)."""
    flags = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        flags += ([flag] if value is True else []) if isinstance(value, bool) else [flag, str(value)]
    return flags


def all_pairs(*axes: list) -> list[tuple]:
    """Rows that hold every value of every axis and, for any two axes, every pair of their values
    (pairwise coverage), in far fewer rows than their product: 30 for LayerNorm's 2 x 3 x 2 x 10.
    Greedy: each row is one of the product that covers the most pairs not yet covered and, of those,
    the one whose pairs earlier rows hold least (no two axes stay correlated), the first such: the
    same rows on every run. The product of a test's few axes is small enough to scan."""
    if len(axes) < 2:
        return list(itertools.product(*axes))  # no pairs: each value of a lone axis once
    product = list(itertools.product(*(range(len(axis)) for axis in axes)))
    pairs_of = {row: {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(axes)), 2)}
                for row in product}  # fmt: skip
    uncovered = set().union(*pairs_of.values())
    rows, used = [], collections.Counter()  # how many rows hold each pair

    def score(row):  # new pairs first; then the row whose pairs are the least repeated
        return len(pairs_of[row] & uncovered), -sum(used[pair] for pair in pairs_of[row])

    while uncovered:
        rows.append(max(product, key=score))
        uncovered -= pairs_of[rows[-1]]
        used.update(pairs_of[rows[-1]])
    return [tuple(axis[i] for axis, i in zip(axes, row, strict=True)) for row in rows]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, from the OS: each test that starts a
    process group takes its own, so tests can run side by side (pytest-xdist)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_ranks(worker, world: int) -> None:
    """worker() on world spawned processes, each a rank of one gloo process group (on a port of its
    own, :func:`free_port`) with one torch thread, the group destroyed when the worker returns."""
    mp.spawn(_gloo_rank, args=(world, free_port(), worker), nprocs=world)


def _gloo_rank(rank: int, world: int, port: int, worker) -> None:
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1"}
    os.environ.update({k: str(v) for k, v in (env | {"MASTER_PORT": port}).items()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        worker()
    finally:
        dist.destroy_process_group()


def record_launches(monkeypatch, execute: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """(kernel name, grid) of every Triton launch from now on, in order, as ``runtime.launch`` sees
    them. With execute=False the grids are checked against CUDA's limits but no kernel runs (outputs
    stay as allocated): walks the launchers at sizes the interpreter is too slow for."""
    launches = []
    if execute:
        hook = lambda kernel, grid: launches.append((kernel.__name__, grid))  # noqa: E731
        monkeypatch.setattr(runtime, "launch_hooks", [*runtime.launch_hooks, hook])
    else:

        def check_only(kernel, grid, *args, **kwargs):
            launches.append((kernel.__name__, runtime.check_grid(grid, kernel.__name__)))

        monkeypatch.setattr(runtime, "launch", check_only)
    return launches


def record_gemms(monkeypatch) -> list[str]:
    """The names of the cuBLAS GEMMs (torch.matmul, torch.addmm) called from now on, in order: the
    kernels' dx and dW products."""
    gemms = []
    for name in ("matmul", "addmm"):
        gemm = getattr(torch, name)

        def recording(*args, _gemm=gemm, _name=name, **kwargs):
            gemms.append(_name)
            return _gemm(*args, **kwargs)

        monkeypatch.setattr(torch, name, recording)
    return gemms
