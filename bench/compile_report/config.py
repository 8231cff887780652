"""A kernel config (:class:`KernelConfig`: one compilation of a kernel for a GPU family), and what
the kernel families' modules build theirs with (:func:`plan_config` of a launcher's plan, on
:func:`kernel_config`; :func:`row_sizes`).
"""

import argparse
import dataclasses
import importlib

import torch
from triton.backends.compiler import GPUTarget

from horse.kernels import runtime
from horse.kernels.runtime import ARCHS

TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compilation: a kernel with its pointer dtypes, constexprs and launch options."""

    kernel: str
    shape_class: str
    dtype: torch.dtype
    fn_path: str  # "module.function" of the @triton.jit kernel; a path, since JIT functions don't pickle
    pointer_types: dict = dataclasses.field(repr=False)  # argument name -> triton type of the pointee
    constexprs: dict = dataclasses.field(repr=False)
    num_warps: int = 4
    num_stages: int = 1
    # argument name -> block shape of a TMA descriptor argument (its dtype from pointer_types)
    descriptors: dict = dataclasses.field(default_factory=dict, repr=False)
    arch: str = "sm90"  # the horse.kernels.runtime.ARCHS family whose table holds this config
    # tuple argument name -> its length, for a strides tuple (``x.stride()``: i32 multiples of 16), or
    # the names of its elements, each typed as an argument of that name (a tuple itself when named here)
    tuples: dict = dataclasses.field(default_factory=dict, repr=False)
    matmul: bool = False  # its tl.dot must lower to tensor-core instructions
    capability: int = 0  # the target compiled for; 0: its family's own (another with --capability)

    @property
    def fn(self):
        module, name = self.fn_path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    @property
    def target_capability(self) -> int:
        return self.capability or ARCHS[self.arch].capability

    @property
    def gpu_target(self) -> GPUTarget:
        """What Triton compiles this config for."""
        arch = ARCHS[self.arch]
        backend, target = ("hip", arch.hip_target) if arch.hip_target else ("cuda", self.target_capability)
        return GPUTarget(backend, target, arch.warp_size)

    @property
    def blocks(self) -> str:
        return "x".join(str(v) for k, v in self.constexprs.items() if k.startswith("BLOCK_"))

    @property
    def dtype_name(self) -> str:
        return TRITON_TYPES[self.dtype]


def describe(c: KernelConfig) -> str:
    """A config in words: "sm90 attn_fwd d=128 causal fp16 blocks 128x64x128 warps 8" (not unique)."""
    family = f"{c.arch} as sm_{c.capability}" if c.capability else c.arch
    return f"{family} {c.kernel} {c.shape_class} {c.dtype_name} blocks {c.blocks} warps {c.num_warps}"


def check_capabilities(parser: argparse.ArgumentParser, capabilities: list[int], family: str) -> None:
    """Refuse (parser.error) a build of family's entries for a compute capability (86 for 8.6) whose
    GPU takes another family's entries, or none: the --capability check of this CLI and bench.tune's."""
    for capability in capabilities:
        try:
            takes = runtime.arch_of_capability(capability // 10, capability % 10).name
        except RuntimeError:
            takes = None
        if takes != family:
            parser.error(
                f"--capability {capability}: a GPU of compute capability {capability / 10:.1f} "
                f"takes {takes or 'no family'}'s entries, not {family}'s"
            )


def row_sizes(limit: int) -> list[int]:
    """The row sizes that reach every config of a row-wise rule: each power of two up to limit (the
    largest held in registers), and one past it."""
    return [2**p for p in range(limit.bit_length())] + [2 * limit]


# Each kernel module's (or family package's) pointer arguments, over all its kernels: in the input's
# dtype, in float32, and of other types. A padded attention batch passes a float32 placeholder for
# cu_seqlens (a packed one, i32).
KERNEL_POINTERS = {
    "layernorm": (
        ("X", "RESIDUAL", "W", "B", "Y", "RESIDUAL_OUT", "DY", "DRESIDUAL_OUT", "DX"),
        ("MEAN", "RSTD", "DW_PARTIAL", "DB_PARTIAL"),
        {},
    ),
    "attention": (
        ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"),
        ("LSE", "LSE_LOG2", "DLSE", "DELTA", "O_SPLIT", "LSE_SPLIT", "CU_SEQLENS_Q", "CU_SEQLENS_K", "SINKS"),
        {"SEQLENS_K": "i32", "FIRST_KEYS": "i32", "LAST_QUERIES": "i32"},
    ),
    "mlp": (
        ("X", "W", "B", "Y", "PRE", "WU", "UP", "DY", "DH", "DPRE", "DUP", "H"),
        ("DB_PARTIAL", "PARTIAL"),
        {},
    ),
    "cross_entropy": (("LOGITS", "DLOGITS"), ("DLOSS", "LOSS", "LSE", "STATS", "SCALE"), {"TARGET": "i64"}),
    # The routing weights (SCALE) as a router's softmax gives them, float32; the ids as torch.topk's.
    "moe": (
        ("X", "W", "B", "H", "GATE", "UP", "A", "OUT", "DY", "DPRE", "DW", "DB", "ROWS"),
        ("SCALE", "DSCALE_PARTIAL"),
        dict.fromkeys(
            ("SORTED_PAIRS", "TILE_EXPERT", "TILE_ROW", "OFFSETS", "PAIR_ROWS", "COUNTS", "BLOCK_ROWS"), "i32"
        )
        | {"EXPERT_IDS": "i64"},
    ),
}
# The strides tuples of three elements, (expert, row, column), of the stacked expert weights.
EXPERT_STRIDES = ("w_strides", "dw_strides")


def kernel_config(
    kernel: str,
    shape_class: str,
    dtype: torch.dtype,
    constexprs: dict,
    warps: int,
    arch: str,
    stages: int = 1,
    name: str = "",
    pointers: dict | None = None,
    tuples: dict | None = None,
    **fields,
) -> KernelConfig:
    """The KernelConfig of horse.kernels.<kernel> (``"module._<name>_kernel"``, or in a family's package
    ``"family.module._<name>_kernel"``), named <name> unless name is given. Its pointer types come from
    KERNEL_POINTERS (pointers: overrides); its other tuple arguments from tuples (name -> its elements'
    names, as KernelConfig.tuples), and its strides tuples from the ``<tensor>_strides`` arguments and
    elements, as the launchers pass them (an attention tile's (batch, seqlen, heads), lse's (batch,
    heads), an MLP matrix's ``x.stride()``); INLINE_PTX, where the kernel takes it, as
    runtime.inline_ptx sets it (on NVIDIA); with VARLEN (a packed batch), i32 cu_seqlens and lse
    (heads, total_q) read by first row, as flash_attention_varlen passes them. fields: descriptors,
    matmul."""
    module, function = kernel.rsplit(".", 1)
    kernels_module = module.split(".")[0]  # the module, or the family's package, in horse.kernels
    typed, fp32, others = KERNEL_POINTERS[kernels_module]
    types = dict.fromkeys(typed, TRITON_TYPES[dtype]) | dict.fromkeys(fp32, "fp32") | others
    arg_names = getattr(importlib.import_module(f"horse.kernels.{module}"), function).arg_names
    tuples = dict(tuples or {})
    names = [*arg_names, *(element for elements in tuples.values() for element in elements)]
    strides = [a for a in names if a.endswith("_strides")]
    if kernels_module == "moe":
        tuples |= {a: 3 if a in EXPERT_STRIDES else 2 for a in strides}
    else:
        tuples |= {a: 2 if kernels_module == "mlp" or a == "lse_strides" else 3 for a in strides}
    if "INLINE_PTX" in names:
        constexprs = constexprs | {"INLINE_PTX": not ARCHS[arch].hip_target}
    if constexprs.get("VARLEN"):
        constexprs = constexprs | {"lse_strides[0]": 1}
        types |= dict.fromkeys(("CU_SEQLENS_Q", "CU_SEQLENS_K"), "i32")
    name = name or function[1:].removesuffix("_kernel")
    fn_path = f"horse.kernels.{kernel}"
    return KernelConfig(
        name,
        shape_class,
        dtype,
        fn_path,
        types | (pointers or {}),
        constexprs,
        warps,
        stages,
        arch=arch,
        tuples=tuples,
        **fields,
    )


def plan_config(plan, shape_class: str, dtype: torch.dtype, arch: str, **fields) -> KernelConfig:
    """The KernelConfig of a launcher's plan (horse.kernels.runtime.Plan, made by the kernel family's plan
    functions): its kernel, constexprs, launch options, tuple arguments, descriptors and float32
    partials, as launched; fields: name, matmul."""
    kernel = f"{plan.kernel.fn.__module__.removeprefix('horse.kernels.')}.{plan.kernel.fn.__name__}"
    return kernel_config(
        kernel,
        shape_class,
        dtype,
        plan.constexprs,
        plan.num_warps,
        arch,
        plan.num_stages,
        pointers=dict.fromkeys(plan.partials, "fp32"),
        tuples=plan.tuples,
        descriptors=plan.descriptors,
        **fields,
    )
