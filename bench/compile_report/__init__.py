"""The compile report: every kernel config the package can select, compiled for the GPU family that
selects it, with no GPU (``python -m bench.compile_report``; its command line is ``__main__.py``).

Triton compiles for a ``GPUTarget("cuda", capability, 32)`` or ``GPUTarget("hip", "gfx942", 64)``
on the CPU; the ``cuobjdump`` and ``nvdisasm`` in Triton's wheel read a cubin, and an AMD kernel's
assembly (amdgcn) says its own registers, scratch and instructions. Each GPU family of
``horse.kernels.runtime.ARCHS`` (A100: sm_80; the 99-KiB Ampere, Ada and consumer Blackwell chips:
sm_86; H100/H200: sm_90; B200/GB300: sm_100; MI300X/MI325X: gfx942) has its own entry in every
config table, compiled for its target. One row per config: family, kernel, shape class, dtype,
block sizes, warps, stages, registers (AMD: VGPRs and AGPRs), spill bytes (stack + local; AMD:
scratch), shared memory (AMD: LDS), tensor-core instructions (HMMA on sm_80/86, HGMMA on sm_90,
UTCHMMA on sm_100, MFMA on gfx942), 128-bit global loads, TMA loads (UTMALDG) and the target
compiled for.

Pointers, strides, N and K are compiled as multiples of 16, the specialisation Triton picks on a
GPU for aligned tensors with hidden sizes that are multiples of 16 (the usual case); a stride of 1
is a constexpr there, so configs name their unit strides in their constexprs (an element of a
strides tuple as ``"x_strides[1]"``). A kernel's tuple arguments (``seqlens``, ``strides``...) are
typed element by element as the arguments they group would be (``KernelConfig.tuples`` names them).
The report must run without ``TRITON_INTERPRET=1``, which replaces the kernels by interpreted
functions.

Where each step lives, in the order a run takes them:

- ``norms.py``, ``attention.py``, ``mlp.py``, ``loss.py``, ``moe.py``: each kernel family's configs,
  built from the plans its launchers launch by (``config.plan_config``); a family adds its function
  to ``CONFIG_FAMILIES`` below.
- ``config.py``: :class:`~bench.compile_report.config.KernelConfig`, one compilation of a kernel.
- ``cache.py``: each config's row key, the rows already proven (bench/compile_report_cache.json),
  which configs to compile, and the check of a sample of the reused rows.
- ``compiler.py``: the compilation, in a pool of workers, and the row read from what was built;
  ``disassembly.py``: the readers of cubins, SASS, amdgcn and TTIR it calls.
- ``gate.py``: the table printed, and the failures that make the report exit 1.
"""

from bench.compile_report import attention, loss, mlp, moe, norms
from bench.compile_report.config import KernelConfig
from horse.kernels.runtime import ARCHS

CONFIG_FAMILIES = {
    "norms": norms.norm_configs,
    "attention": attention.attention_configs,
    "mlp": mlp.mlp_configs,
    "loss": loss.loss_configs,
    "moe": moe.moe_configs,
}


def all_configs(archs=tuple(ARCHS)) -> list[KernelConfig]:
    """Every family's configs for each GPU family named in archs (keys of horse.kernels.runtime.ARCHS)."""
    return [cfg for name in archs for family in CONFIG_FAMILIES.values() for cfg in family(ARCHS[name])]
