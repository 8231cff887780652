"""Test set-up. Without a CUDA device the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must
be set before triton is first imported, which is why this happens here, at collection's start."""

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

from kernels import runtime  # noqa: E402

check_descriptor_strides_in_bytes()


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


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every output buffer a launcher allocates starts as NaN, so an unwritten element fails."""
    with runtime.poison_outputs():
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
