"""Where the kernels run, and the small pieces every launcher shares.

The one switch: tensors on a CUDA device always run the Triton kernels. Tensors on the CPU run the
Triton kernels in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before ``triton`` was
first imported (the tests do this), and the float32 references of ``kernels.reference`` otherwise.
"""

import contextlib
import os

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Tests turn this on so that an output element a kernel forgot to write reads as NaN, never as
# whatever the allocator left there.
_poison_outputs = False


def runs_triton(x: torch.Tensor) -> bool:
    """True when ``x`` is handled by the Triton kernels (CUDA, or the CPU interpreter)."""
    return x.is_cuda or (INTERPRET and x.device.type == "cpu")


def device_guard(x: torch.Tensor):
    """Launch on x's GPU, not on the current one (the classic multi-GPU bug)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new output buffer; NaN-filled while :func:`poison_outputs` is active."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _poison_outputs:
        out.fill_(float("nan"))
    return out


@contextlib.contextmanager
def poison_outputs():
    """Fill every output buffer the launchers allocate with NaN while the context is open."""
    global _poison_outputs
    previous, _poison_outputs = _poison_outputs, True
    try:
        yield
    finally:
        _poison_outputs = previous


def autocast(*tensors):
    """The tensors as torch.autocast would hand them to a matmul: floating tensors cast to the
    autocast dtype when autocast is on for their device, unchanged otherwise (None stays None).

    Custom ops are invisible to autocast, so the kernels' public functions call this first: a
    float32 weight under ``torch.autocast("cuda", torch.float16)`` then runs in float16, as it would
    in nn.Linear, and the cast is differentiable, so the float32 master weight gets its gradient.
    """
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small fixed count in the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether TMA (tensor descriptors) can address every tensor: an NVIDIA GPU of sm_90 or newer
    (the interpreter emulates one) and, per tensor, no zero size, a unit last stride, a 16-byte
    aligned start and other strides that are positive multiples of 16 bytes."""
    first = tensors[0]
    if first.is_cuda and (
        torch.version.hip is not None or torch.cuda.get_device_capability(first.device)[0] < 9
    ):
        return False
    return all(
        t.numel() > 0
        and t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )


def tma_operand(t: torch.Tensor, block_shape: tuple[int, ...], tma: bool):
    """A kernel's operand: with tma, a descriptor of the whole of t whose loads are block_shape tiles
    (out-of-bounds elements read as zeros, stores drop them); otherwise t itself."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape)) if tma else t
