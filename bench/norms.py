"""LayerNorm and RMSNorm in the bench suite: ours against torch eager and torch.compile.

    python -m bench --only norms        (or python -m bench.norms, the same)

Cases: fp16, rows 4K-64K, hidden 1K-16K, forward (one call under no_grad) and backward
(``torch.autograd.grad`` of y w.r.t. x, weight and bias on a graph built once). Ours is
``horse.kernels.layer_norm`` / ``horse.kernels.rms_norm`` with weight (and bias); eager is
``torch.nn.functional.layer_norm`` / ``rms_norm``, the op users call; compile is ``torch.compile``
of that function. Rates are GB/s of the bytes that must move (:func:`forward_bytes`,
:func:`backward_bytes`), and gates.toml holds ours to fractions of the measured copy bandwidth.
"""

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench import correctness, suite, timing

LAYER_NORM_EPS = 1e-5
RMS_NORM_EPS = 1e-6  # passed explicitly, so that every implementation uses the same eps
ROWS = (4096, 16384, 65536)
HIDDEN = (1024, 4096, 8192, 16384)
QUICK_SHAPES = ((16384, 4096),)  # where the gates apply
# A tile held in registers, and rows longer than 16,384: the chunked forward and backward.
INTERPRETER_SHAPES = ((64, 1000), (8, 20000))
DTYPE = torch.float16
# Largest normalized error (bench.correctness.normalized_error) allowed against the float32 reference.
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-3}


@dataclass(frozen=True)
class Norm:
    """One normalisation and its implementations, each called as fn(x, weight[, bias])."""

    name: str
    has_bias: bool
    ours: Callable[..., torch.Tensor]
    eager: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]  # float32, the truth ours is checked against


def _layer_norm(module):
    return lambda x, w, b: module.layer_norm(x, (x.shape[-1],), w, b, LAYER_NORM_EPS)


def _rms_norm(module):
    return lambda x, w: module.rms_norm(x, (x.shape[-1],), w, RMS_NORM_EPS)


def norms() -> tuple[Norm, ...]:
    from horse import kernels  # here, not at import: the CPU path sets TRITON_INTERPRET first
    from horse.kernels import reference

    functional = torch.nn.functional
    return (
        Norm("layer_norm", True, _layer_norm(kernels), _layer_norm(functional), _layer_norm(reference)),
        Norm("rms_norm", False, _rms_norm(kernels), _rms_norm(functional), _rms_norm(reference)),
    )


def forward_bytes(
    rows: int, hidden: int, element_bytes: int, weight_element_bytes: int, has_bias: bool
) -> int:
    """Bytes a norm's forward must move: read x and write y, read weight (and bias).

    2·rows·hidden·element_bytes + (2 if has_bias else 1)·hidden·weight_element_bytes. The per-row
    statistics the forward also writes for the backward are not counted: 4-8 bytes a row.
    """
    parameters = 2 if has_bias else 1
    return 2 * rows * hidden * element_bytes + parameters * hidden * weight_element_bytes


def backward_bytes(
    rows: int, hidden: int, element_bytes: int, weight_element_bytes: int, has_bias: bool
) -> int:
    """Bytes a norm's backward must move: read x and dy, write dx; read weight, write dweight (and dbias).

    3·rows·hidden·element_bytes + (3 if has_bias else 2)·hidden·weight_element_bytes.

    What ours moves from DRAM per element, derived from its loads and stores: 3·element_bytes (6 in
    fp16) at every width. Rows of up to 8,192 are one tile a program; longer ones are split into
    column blocks of 4,096 whose programs run side by side, each reading its own block and sweeping
    the others, which their owners read at the same moment (L2 hits: (2·blocks + 1)·element_bytes
    pass between the SMs and L2, 18 bytes at 16,384 fp16). Before, a coefficient pass
    read dy and x for every row first, then the main pass read them again, M·N·2·element_bytes
    later: 5·element_bytes (10 in fp16) from DRAM. The float32 partial sums add 8 bytes a column per
    slab (SMs / blocks slabs; was 4·SMs slabs of every column block), counted in neither figure.
    """
    parameter_vectors = 3 if has_bias else 2
    return 3 * rows * hidden * element_bytes + parameter_vectors * hidden * weight_element_bytes


def make_inputs(norm: Norm, rows: int, hidden: int, device, requires_grad=False) -> list[torch.Tensor]:
    """``[x, weight]`` or ``[x, weight, bias]``: x ~ N(0, 1), weight ~ 1 + 0.1·N(0, 1), bias ~ 0.1·N(0, 1)."""
    tensors = [
        torch.randn(rows, hidden, dtype=DTYPE, device=device),
        1 + 0.1 * torch.randn(hidden, dtype=DTYPE, device=device),
    ]
    if norm.has_bias:
        tensors.append(0.1 * torch.randn(hidden, dtype=DTYPE, device=device))
    return [t.requires_grad_(requires_grad) for t in tensors]


def check(norm: Norm, rows: int, hidden: int, device) -> tuple[dict, bool]:
    """Output and gradients of ours for a random dy against the float32 reference
    (:func:`bench.correctness.check`)."""
    torch.manual_seed(0)
    tensors = make_inputs(norm, rows, hidden, device, requires_grad=True)
    names = ("y", "dx", "dweight", "dbias")[: 1 + len(tensors)]
    return correctness.check(norm.ours, norm.reference, tensors, names, TOLERANCE[DTYPE])


def _setup(make_fn, norm: Norm, rows: int, hidden: int, direction: str):
    """forward reads x; backward x and dy (the parameters are small)."""
    make_copy = functools.partial(make_inputs, norm, rows, hidden, "cuda")
    read = (1 if direction == "forward" else 2) * rows * hidden * DTYPE.itemsize
    return timing.setup(make_fn, make_copy, direction, read)


def cases(quick: bool) -> list[suite.Case]:
    shapes = QUICK_SHAPES if quick else [(rows, hidden) for rows in ROWS for hidden in HIDDEN]
    out = []
    for norm in norms():
        implementations = {
            "ours": lambda n=norm: n.ours,
            "eager": lambda n=norm: n.eager,
            "compile": suite.compiled(norm.eager),
        }
        for rows, hidden in shapes:
            sizes = (rows, hidden, DTYPE.itemsize, DTYPE.itemsize, norm.has_bias)
            out += suite.family_cases(
                norm.name,
                {"rows": rows, "hidden": hidden},
                implementations,
                ("forward", "backward"),
                work=lambda d, s=sizes: (forward_bytes if d == "forward" else backward_bytes)(*s),
                unit="byte",
                setup=lambda name, make_fn, d, n=norm, r=rows, h=hidden: _setup(make_fn, n, r, h, d),
                check=functools.partial(check, norm, rows, hidden, "cuda"),
            )
    return out


def interpreter_checks() -> list[tuple[str, dict, bool]]:
    """The correctness check on small shapes, on the CPU (in Triton's interpreter when it is on)."""
    return [
        (f"{norm.name} rows={rows} hidden={hidden}", *check(norm, rows, hidden, "cpu"))
        for norm in norms()
        for rows, hidden in INTERPRETER_SHAPES
    ]


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["--only", "norms", *sys.argv[1:]]))
