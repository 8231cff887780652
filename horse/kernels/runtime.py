"""Where the kernels run, and the small pieces every launcher shares.

The one switch: tensors on a CUDA device always run the Triton kernels. Tensors on the CPU run the
Triton kernels in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before ``triton`` was
first imported (the tests do this), and the float32 references of ``horse.kernels.reference`` otherwise.

Every config table of the kernels has an entry per GPU family of ``ARCHS`` (A100-class sm80, the
99-KiB sm86 chips, Hopper sm90, datacenter Blackwell sm100, AMD's MI300 series gfx942); a launch
takes its device's family, known by the compute capability or the AMD target (:func:`arch`), and
the compile report builds each family's entries for that family's own target.
"""

import contextlib
import contextvars
import functools
import json
import os
import pathlib
import re
from dataclasses import dataclass, field

import torch
import triton

# The oldest Triton the kernels run on (setup.py asks for the same; PyTorch 2.9 ships it). Before
# 3.4 there are no host-side tensor descriptors, the kernels' TMA operands; 3.4's compiler crashes
# on the Blackwell dk/dv pass, where 3.5 builds every config of the compile report.
MIN_TRITON = (3, 5)


def major_minor(version: str) -> tuple[int, int]:
    """(3, 10) of "3.10.0" or "3.10.0+git1a2b3c"."""
    return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())


def check_triton_version(version: str) -> None:
    """Raise a clear ImportError, not a missing module's, on a Triton older than MIN_TRITON."""
    if major_minor(version) < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        raise ImportError(
            f"Little Horse's kernels need triton>={need}; this environment has triton {version}. "
            f"PyTorch 2.9 and newer bring one: pip install 'torch>=2.9'."
        )


check_triton_version(triton.__version__)
TRITON_VERSION = major_minor(triton.__version__)

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Compile options of every launch (and of the compile report). FMA contraction is Triton's default
# up to 3.9, which warns that 3.10 turns it off; the kernels' tables and tolerances were set with it.
COMPILE_OPTIONS = {"enable_fp_fusion": True}

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
    if first is None or not torch.amp.is_autocast_available(first.device.type):  # meta: no autocast
        return tensors
    if not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


@dataclass(frozen=True)
class Arch:
    """A family of GPUs that shares one entry of every config table: the target the compile report
    builds that entry for (an NVIDIA compute capability, or an AMD gfx target), and the shared
    memory a block may have there."""

    name: str
    capability: int  # 80 for sm_80; 0 for an AMD family
    max_shared_bytes: int
    gpus: str  # the GPUs it covers, as the compile report names them
    hip_target: str = ""  # an AMD family's gfx target; "" for NVIDIA
    warp_size: int = 32  # threads a warp (AMD: a wavefront of 64)

    @property
    def tma(self) -> bool:
        """Whether the family moves tiles by TMA (tensor descriptors): NVIDIA sm_90 and newer."""
        return self.capability >= 90


SM80 = Arch("sm80", 80, 166912, "A100, A800, A30, Jetson Orin")  # 163 KiB a block
# Ampere's and Ada's other chips and consumer Blackwell: 99 KiB a block, mma.sync tensor cores.
SM86 = Arch("sm86", 86, 101376, "RTX 30, 40 and 50 series, A10, A40, L4, L40S, RTX 6000 Ada, GB10")
SM90 = Arch("sm90", 90, 232448, "H100, H200, H20, GH200")  # 227 KiB a block
SM100 = Arch("sm100", 100, 232448, "B200, B300, GB200, GB300")
# CDNA 3: 64 KiB of LDS a workgroup, MFMA matrix cores, 64-lane wavefronts.
GFX942 = Arch("gfx942", 0, 65536, "MI300X, MI300A, MI325X", hip_target="gfx942", warp_size=64)
ARCHS = {a.name: a for a in (SM80, SM86, SM90, SM100, GFX942)}
MAX_THREADS = 1024  # a block's (workgroup's), on every family


def arch_of_capability(major: int, minor: int, name: str = "this GPU") -> Arch:
    """The config family of an NVIDIA GPU of compute capability major.minor; an error below 8.0."""
    if major == 8:
        return SM80 if minor in (0, 7) else SM86
    if major == 9:
        return SM90
    if major == 10:
        return SM100
    if major == 12:
        return SM86
    raise RuntimeError(
        f"Little Horse's kernels have configs for NVIDIA compute capabilities 8.x, 9.0, 10.x and 12.x "
        f"(Ampere, Ada, Hopper, Blackwell); {name} is {major}.{minor}. Use the reference path "
        f"(CPU tensors, or the model's backend='reference') there."
    )


def arch_of_amd_target(gcn_arch_name: str, name: str = "this GPU") -> Arch:
    """The config family of an AMD GPU by its target as ROCm names it ("gfx942:sramecc+:xnack-")."""
    target = gcn_arch_name.split(":")[0]
    for family in ARCHS.values():
        if family.hip_target == target:
            return family
    amd = ", ".join(f"{a.hip_target} ({a.gpus})" for a in ARCHS.values() if a.hip_target)
    raise RuntimeError(
        f"Little Horse's kernels have configs for the AMD targets {amd}; {name} is {target}. Use the "
        f"reference path (CPU tensors, or the model's backend='reference') there."
    )


@functools.cache
def _cuda_arch(index: int) -> Arch:
    if torch.version.hip is not None:
        properties = torch.cuda.get_device_properties(index)
        return arch_of_amd_target(properties.gcnArchName, properties.name)
    major, minor = torch.cuda.get_device_capability(index)
    return arch_of_capability(major, minor, torch.cuda.get_device_name(index))


def arch(device: torch.device) -> Arch:
    """Which entry of the config tables a launch on device takes; the interpreter emulates sm_90."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return SM90


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small fixed count in the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def inline_ptx(t: torch.Tensor) -> bool:
    """Whether kernels on t's device may take inline PTX: an NVIDIA GPU, not the interpreter."""
    return not INTERPRET and not arch(t.device).hip_target


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether TMA (tensor descriptors) can address every tensor: an NVIDIA GPU of sm_90 or newer
    (the interpreter emulates one) and, per tensor, no zero size, a unit last stride, a 16-byte
    aligned start and other strides that are positive multiples of 16 bytes."""
    if not arch(tensors[0].device).tma:
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


# CUDA's grid limits: 2**31 - 1 programs on axis 0, 65,535 on axes 1 and 2 (AMD's are looser). The
# interpreter has none, so every launch checks them here and fails on the CPU where a GPU would.
MAX_GRID = (2**31 - 1, 65535, 65535)

# Called as hook(kernel, grid) before every launch: tests count launches through it.
launch_hooks: list = []


def check_grid(grid: tuple[int, ...], name: str = "kernel") -> tuple[int, ...]:
    """grid, checked against CUDA's limits (:data:`MAX_GRID`); a clear error naming the axis."""
    grid = tuple(int(n) for n in grid)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"{name}: a grid has 1 to 3 axes, got {grid}")
    for axis, (programs, limit) in enumerate(zip(grid, MAX_GRID[: len(grid)], strict=True)):
        if programs > limit:
            raise ValueError(
                f"{name}: grid {grid} has {programs:,} programs on axis {axis}, past CUDA's limit of "
                f"{limit:,} there; the input is too large for this kernel"
            )
    return grid


@dataclass(frozen=True)
class Plan:
    """How one launch of a kernel goes, decided from sizes alone: the kernel, its grid, its constexprs
    and launch options, its tuple arguments by their elements' names (in the order the launch packs
    them: :meth:`pack`), the arguments whose tiles host-built TMA descriptors load (their block
    shapes) and those written as float32 partials. Each family's plan functions make them; its
    launchers launch by them and the compile report (bench.compile_report) compiles the same plans,
    so neither re-derives the other."""

    kernel: object  # the @triton.jit function
    grid: tuple[int, ...]
    constexprs: dict  # an argument's, or a tuple element's, by its name
    num_warps: int
    num_stages: int
    tuples: dict = field(default_factory=dict)  # tuple argument or element -> its elements' names
    descriptors: dict = field(default_factory=dict)  # argument -> its TMA descriptor's block shape
    partials: tuple[str, ...] = ()

    def _elements(self) -> set[str]:
        """The names that are elements of a tuple."""
        return {element for elements in self.tuples.values() for element in elements}

    def pack(self, values: dict) -> dict:
        """The tuple arguments, each element taken by its name: a tuple packed in turn, a constexpr of
        the plan as triton.language.constexpr (Triton would take a tuple's plain value as a runtime
        argument) but None as it is (a constexpr to Triton, which the interpreted kernels test with
        ``is None``), any other from values."""

        def packed(name: str):
            if name in self.tuples:
                return tuple(packed(element) for element in self.tuples[name])
            if name in self.constexprs:
                value = self.constexprs[name]
                return value if value is None else triton.language.constexpr(value)
            return values[name]

        elements = self._elements()
        return {name: packed(name) for name in self.tuples if name not in elements}

    def operand(self, name: str, t: torch.Tensor):
        """Argument name: t, or the descriptor of it the plan loads by."""
        return tma_operand(t, self.descriptors.get(name), name in self.descriptors)

    def options(self) -> dict:
        """The constexprs that are arguments of their own (a tuple's go in by :meth:`pack`) and the
        launch options."""
        elements = self._elements()
        constexprs = {name: value for name, value in self.constexprs.items() if name not in elements}
        return dict(constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs):
    """kernel[grid](*args, **kwargs), the one way the package launches a Triton kernel: the grid is
    checked against CUDA's limits first, and :data:`launch_hooks` see every launch. In the
    interpreter the launch leaves triton.language as it found it (:func:`triton_language_kept`)."""
    grid = check_grid(grid, kernel.fn.__name__)
    for hook in launch_hooks:
        hook(kernel, grid)
    with triton_language_kept() if INTERPRET else contextlib.nullcontext():
        return kernel[grid](*args, **kwargs)


def _language_namespaces() -> tuple:
    """What Triton's interpreter patches while it runs a kernel: the language's modules and the
    classes whose methods it replaces (triton/runtime/interpreter.py, ``_patch_lang``)."""
    import triton.language as tl

    return (tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.core.tensor_descriptor_base)


@contextlib.contextmanager
def triton_language_kept():
    """Puts back every attribute of triton.language's modules and classes that changed inside.

    Triton's interpreter (3.6) patches the language for a launch and restores it afterwards, but it
    also patches it for every device-function call (any @triton.jit helper, triton.language's own
    ``tl.max`` and ``tl.sum`` among them) and never restores those. The interpreter's versions left
    behind then run inside a later compile for a GPU in the same process, which fails in Triton's
    code generator ("'block_argument' object has no attribute 'dtype'") wherever the kernel is not
    in Triton's on-disk cache yet: the tests' sm_90 compiles failed or passed by which interpreted
    tests their process had run before."""
    namespaces = _language_namespaces()
    saved = [dict(vars(namespace)) for namespace in namespaces]
    try:
        yield
    finally:
        for namespace, before in zip(namespaces, saved, strict=True):
            now = dict(vars(namespace))
            if isinstance(namespace, type):  # a method set on the class over its base's
                for name in now.keys() - before.keys():
                    delattr(namespace, name)
            for name, value in before.items():
                if now.get(name) is not value:
                    setattr(namespace, name, value)


def _descriptor_memory(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the tensor descriptors a kernel builds on the device, on the launch's device
    (the current one inside :func:`device_guard`); torch's allocator aligns to 512 bytes."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


def launch_building_descriptors(kernel, grid: tuple[int, ...], *args, **kwargs):
    """:func:`launch` for a kernel that builds tensor descriptors on the device
    (``tl.make_tensor_descriptor``): Triton asks its allocator (``triton.set_allocator``) for their
    memory at launch, and has none by default. Ours is set in a copy of the caller's context, so
    an allocator the caller set is left as it was."""

    def run():
        triton.set_allocator(_descriptor_memory)
        return launch(kernel, grid, *args, **kwargs)

    return contextvars.copy_context().run(run)


def check_tensor(fn: str, name: str, t, device: torch.device, dtypes: tuple, allowed: str) -> None:
    """Raise an error naming fn and the argument unless t is a tensor on device of one of dtypes
    (``allowed`` says them in words)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{fn}: {name} must be {allowed}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device} but input is on {device}")


def custom_op(name: str, fake, backward=None, setup_context=None, schema: str | None = None):
    """Decorator: the function as the PyTorch custom op ``horse::<name>`` (it mutates no input),
    with its fake (the outputs' shapes and dtypes, for torch.compile and meta tensors) and, given a
    backward, its autograd. Every kernel family registers its ops through this one helper. The op's
    schema is inferred from the function's annotations unless given (torch's schema language)."""

    def register(fn):
        op = torch.library.custom_op(f"horse::{name}", fn, mutates_args=(), schema=schema)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return register


def load_configs(path: pathlib.Path, config: type) -> dict:
    """The config tables of a kernel family's configs.json (path: the file beside its kernels, as
    horse/kernels/mlp/configs.json), in the file's order: ``{table: {family: ... {key:
    config(**fields)}}}``, keys that are numbers (head dims) as ints. ``bench.tune --compile-only
    --write`` writes entries found by compiling (not measured on their GPUs); the compile report's
    output, not a comment, records how each entry builds, and the family's TUNING.md why it was
    chosen."""

    def build(node: dict):
        if not all(isinstance(value, dict) for value in node.values()):  # an entry, not a table
            return config(**{k: build(v) if isinstance(v, dict) else v for k, v in node.items()})
        return {int(key) if key.isdigit() else key: build(value) for key, value in node.items()}

    return build(json.loads(path.read_text()))
