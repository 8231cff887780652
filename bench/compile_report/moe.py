"""The mixture-of-experts kernels' configs (horse.kernels.moe): every GEMM table entry in each variant
a launcher takes it in, every block size of the sort's rule and the combine."""

import dataclasses

import torch

from bench.compile_report.config import KernelConfig, plan_config
from horse.kernels import runtime

# The unit strides the kernels are compiled with, as constexprs: x, dy and the sorted rows row-major,
# the weights as transformers 5.25 stores them (each launch's (expert, n, k) view of them: the down
# GEMM reads down_proj as stored, the dh GEMM down_proj and the dx GEMM gate_up_proj transposed).
UNIT_STRIDES = {
    "_gate_up_fwd_kernel": {"x_strides[1]": 1, "w_strides[2]": 1, "b_strides[1]": 1},
    "_expert_gemm_kernel": {"a_strides[1]": 1, "b_strides[1]": 1},  # and WEIGHT_UNIT_STRIDE's
    "_dh_bwd_kernel": {"dy_strides[1]": 1, "w_strides[1]": 1},
    "_weight_grad_kernel": {"a_strides[1]": 1, "b_strides[1]": 1, "dw_strides[2]": 1, "db_strides[1]": 1},
    "_count_kernel": {},
    "_place_kernel": {},
    "_combine_kernel": {},
}
# The plain grouped GEMM's weight by its use: the down GEMM reads down_proj as stored (unit stride
# along k), the dx GEMM gate_up_proj transposed (along n); Triton specialises either stride of 1.
WEIGHT_UNIT_STRIDE = {"down": {"w_strides[2]": 1}, "dx": {"w_strides[1]": 1}}
# Each epilogue the gated kernels take: (activation, limit, interleaved): the activations on
# transformers' layout, and gpt-oss's clamp (its limit, 7.0) on its interleaved one.
EPILOGUES = (("silu", None, False), ("gelu_tanh", None, False), ("silu", 7.0, True))


def moe_plan_config(
    plan, name: str, shape_class: str, dtype: torch.dtype, arch: str, **fields
) -> KernelConfig:
    """The KernelConfig of a launcher's plan, named moe_<name>, compiled with its unit strides."""
    strides = UNIT_STRIDES[plan.kernel.fn.__name__] | WEIGHT_UNIT_STRIDE.get(name, {})
    plan = dataclasses.replace(plan, constexprs=plan.constexprs | strides)
    return plan_config(plan, shape_class, dtype, arch, name=f"moe_{name}", **fields)


def moe_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every GEMM_CONFIGS entry of horse.kernels.moe for arch in the variants its launchers run it in,
    with the flags that keep the most values live (biases, the saved pre-activations), in both dtypes;
    the sort for every block size of its rule; the combine."""
    from horse.kernels.moe import configs, launch

    table = configs.GEMM_CONFIGS[arch.name]
    out = []
    for dtype in configs.SUPPORTED_DTYPES:
        for activation, limit, interleaved in EPILOGUES:
            shape = f"any/{activation}{'' if limit is None else '-clamped'}"
            epilogue = configs.Epilogue(activation, limit, interleaved, has_bias=True, store=True)
            plan = launch.gate_up_plan(table["gate_up"], 1, 1, epilogue)
            out.append(moe_plan_config(plan, "gate_up", shape, dtype, arch.name, matmul=True))
            plan = launch.dh_plan(table["dh"], 1, 1, epilogue._replace(has_bias=False, store=False))
            out.append(moe_plan_config(plan, "dh", shape, dtype, arch.name, matmul=True))
        for name, bias_and_scale in (("down", True), ("dx", False)):
            # Also by TMA where the entry takes it (pointer loads stay selectable: launch.tma_usable),
            # each weight as stored: down_proj (experts, N, K), gate_up_proj (experts, K, N)
            layouts = ("nk" if name == "down" else "kn",) if table["down"].tma and arch.tma else ()
            for tma in (None, *layouts):
                plan = launch.expert_gemm_plan(table["down"], 1, 1, bias_and_scale, bias_and_scale, tma)
                shape = "any tma" if tma else "any"
                out.append(moe_plan_config(plan, name, shape, dtype, arch.name, matmul=True))
        for name, gather_a in (("dw_gate_up", False), ("dw_down", True)):
            flags = dict(GATHER_A=gather_a, GATHER_B=not gather_a, SCALE_ROWS=gather_a, HAS_BIAS=True)
            plan = launch.weight_grad_plan(table["weight_grad"], 1, 1, 1, **flags)
            out.append(moe_plan_config(plan, name, "any", dtype, arch.name, matmul=True))
        out.append(moe_plan_config(launch.combine_plan(1, 1), "combine", "any", dtype, arch.name))
    for experts in (2**p for p in range(configs.MAX_EXPERTS.bit_length())):
        for name, plan in zip(("sort_count", "sort_place"), launch.sort_plans(1, experts), strict=True):
            out.append(moe_plan_config(plan, name, f"E<={experts}", torch.float16, arch.name))
    return out
