"""Test set-up. Without a CUDA device the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must
be set before triton is first imported, which is why this happens here, at collection's start."""

import collections
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"

from helpers import check_descriptor_strides_in_bytes  # noqa: E402

from horse.kernels import runtime  # noqa: E402

check_descriptor_strides_in_bytes()
# A pytest-xdist worker takes its share of the cores, not all of them: two workers with two threads
# each on two cores spend their time switching.
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def reference_path(monkeypatch):
    """CPU tensors take the kernels' float32 references, as they do without TRITON_INTERPRET."""
    monkeypatch.setattr(runtime, "INTERPRET", False)


def pytest_collection_modifyitems(config, items):
    # One process runs the kernels either compiled for its GPU or in the interpreter, never both.
    if HAS_CUDA:
        marker, reason = "interpreter", "needs Triton's interpreter: CUDA_VISIBLE_DEVICES= runs it"
    else:
        marker, reason = "gpu", "needs a CUDA GPU; this machine runs the kernels in Triton's interpreter"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # pytest-xdist's --dist loadgroup sends a test to its xdist_group's worker by the "@group" it
    # appends to the test's id; where that append has no effect (pytest 9.2 with xdist 3.8) a group's
    # tests run on every worker side by side, each building the module's fixtures again: say so.
    grouped = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group")]
    lost = [nodeid for nodeid in grouped if "@" not in nodeid]
    if session.config.getoption("loadgroup", False) and lost:
        session.config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"--dist loadgroup lost the xdist_group of {len(lost)} tests ({lost[0]}), which now run side by "
            f"side: pytest {pytest.__version__} with this pytest-xdist (pytest-dev/pytest-xdist#1386); "
            "install 'pytest<9.2'"), stacklevel=1)  # fmt: skip


def pytest_terminal_summary(terminalreporter):
    # A clean run's summary is its counts: the skips are one line a reason here, not one a test
    # function (-rs lists those), so a real failure or warning is not lost among them.
    reasons = collections.Counter(
        report.longrepr[2].removeprefix("Skipped: ")
        for report in terminalreporter.stats.get("skipped", [])
        if isinstance(report.longrepr, tuple)
    )
    if reasons:
        terminalreporter.section("skipped, by reason", sep="-")
        for reason, count in reasons.most_common():
            terminalreporter.line(f"{count:5d}  {reason}")


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every output buffer a launcher allocates starts as NaN, so an unwritten element fails."""
    with runtime.poison_outputs():
        yield


@pytest.fixture(autouse=True)
def triton_language_kept():
    """Each test leaves triton.language as it found it. runtime.launch does this for our launches;
    kernels launched otherwise (bench.revision's, of an earlier day, through their own runtime) would
    leave the interpreter's patches for the sm_90 compiles of a later test in this process."""
    with runtime.triton_language_kept():
        yield


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """What a test cached goes back to the driver: the GPU tests share one GPU among several
    processes (pytest-xdist in bench/device_check.sh), and a caching allocator keeps its peak."""
    yield
    if HAS_CUDA:
        torch.cuda.empty_cache()


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
