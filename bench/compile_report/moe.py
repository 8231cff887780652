"""The mixture-of-experts kernels' configs (horse.kernels.moe): every GEMM table entry in each variant
a launcher takes it in, every block size of the sort's rule and the combine."""

import dataclasses

import torch

from bench.compile_report.config import KernelConfig, plan_config
from horse.kernels import runtime

# The unit strides the kernels are compiled with, as constexprs: x, dy, the sorted rows and the biases
# row-major; the weights' by layout, below (WEIGHT_UNIT_STRIDE).
UNIT_STRIDES = {
    "_gate_up_fwd_kernel": {"x_strides[1]": 1, "b_strides[1]": 1},
    "_expert_gemm_kernel": {"a_strides[1]": 1, "b_strides[1]": 1},
    "_dh_bwd_kernel": {"dy_strides[1]": 1},
    "_weight_grad_kernel": {"a_strides[1]": 1, "b_strides[1]": 1, "db_strides[1]": 1},
    "_count_kernel": {},
    "_place_kernel": {},
    "_combine_kernel": {},
}
# The weights' stride of 1 in each launch's (expert, n, k) view of them (the weight gradients' dW:
# (expert, N1, N2), strided as its weight), by layout; Triton specialises either stride of 1 at launch.
# transformers 5.25 stores gate_up_proj (experts, 2 inter, hidden) and down_proj (experts, hidden, inter):
# gate_up and down read them as stored (unit stride along k), dh reads down_proj and dx gate_up_proj
# transposed (along n). gpt-oss stores both transposed, (experts, hidden, 2 inter) and (experts, inter,
# hidden); horse.hf.moe.gpt_oss_experts_forward passes them as transposed views, so every launch's
# unit stride is the other one.
WEIGHT_UNIT_STRIDE = {
    "transformers": {
        "gate_up": {"w_strides[2]": 1},
        "down": {"w_strides[2]": 1},
        "dh": {"w_strides[1]": 1},
        "dx": {"w_strides[1]": 1},
        "dw_gate_up": {"dw_strides[2]": 1},
        "dw_down": {"dw_strides[2]": 1},
    },
    "gpt-oss": {
        "gate_up": {"w_strides[1]": 1},
        "down": {"w_strides[1]": 1},
        "dh": {"w_strides[2]": 1},
        "dx": {"w_strides[2]": 1},
        "dw_gate_up": {"dw_strides[1]": 1},
        "dw_down": {"dw_strides[1]": 1},
    },
}
# gpt-oss's epilogue, (activation, limit, interleaved): its clamped SwiGLU at its limit (7.0, as its
# modules' `limit` reaches the kernels) on its interleaved gate and up rows.
GPT_OSS_EPILOGUE = ("silu", 7.0, True)
# The epilogues each layout runs with: on transformers' the activations and gpt-oss's epilogue (moe_mlp
# takes any of them on it); on gpt-oss's its own. Both with the biases (gpt-oss has them).
EPILOGUES = {
    "transformers": (("silu", None, False), ("gelu_tanh", None, False), GPT_OSS_EPILOGUE),
    "gpt-oss": (GPT_OSS_EPILOGUE,),
}


def moe_plan_config(
    plan, name: str, shape_class: str, dtype: torch.dtype, arch: str, layout: str = "transformers", **fields
) -> KernelConfig:
    """The KernelConfig of a launcher's plan, named moe_<name>, compiled with its unit strides in the
    weight layout (a key of WEIGHT_UNIT_STRIDE; the shape class names gpt-oss's)."""
    strides = UNIT_STRIDES[plan.kernel.fn.__name__] | WEIGHT_UNIT_STRIDE[layout].get(name, {})
    plan = dataclasses.replace(plan, constexprs=plan.constexprs | strides)
    shape_class += " gpt-oss" if layout == "gpt-oss" else ""
    return plan_config(plan, shape_class, dtype, arch, name=f"moe_{name}", **fields)


def moe_configs(arch: runtime.Arch) -> list[KernelConfig]:
    """Every GEMM_CONFIGS entry of horse.kernels.moe for arch in the variants its launchers run it in,
    in both weight layouts (transformers' and gpt-oss's) with the flags that keep the most values live
    (biases, the saved pre-activations), in both dtypes; the sort for every block size of its rule;
    the combine."""
    from horse.kernels.moe import configs, launch

    table = configs.GEMM_CONFIGS[arch.name]
    out = []
    for dtype in configs.SUPPORTED_DTYPES:
        for layout, epilogues in EPILOGUES.items():
            for activation, limit, interleaved in epilogues:
                shape = f"any/{activation}{'' if limit is None else '-clamped'}"
                epilogue = configs.Epilogue(activation, limit, interleaved, has_bias=True, store=True)
                plan = launch.gate_up_plan(table["gate_up"], 1, 1, epilogue)
                out.append(moe_plan_config(plan, "gate_up", shape, dtype, arch.name, layout, matmul=True))
                plan = launch.dh_plan(table["dh"], 1, 1, epilogue._replace(has_bias=False, store=False))
                out.append(moe_plan_config(plan, "dh", shape, dtype, arch.name, layout, matmul=True))
            for name, bias_and_scale in (("down", True), ("dx", False)):
                # Also by TMA where the entry takes it (pointer loads stay selectable: launch.tma_usable),
                # each weight as stored: down_proj (experts, N, K), gate_up_proj (experts, K, N); not
                # gpt-oss's weights, whose last stride is not their unit one (runtime.tma_compatible).
                tma_usable = table["down"].tma and arch.tma and layout == "transformers"
                tma_layouts = ("nk" if name == "down" else "kn",) if tma_usable else ()
                for tma in (None, *tma_layouts):
                    plan = launch.expert_gemm_plan(table["down"], 1, 1, bias_and_scale, bias_and_scale, tma)
                    shape = "any tma" if tma else "any"
                    out.append(moe_plan_config(plan, name, shape, dtype, arch.name, layout, matmul=True))
            for name, gather_a in (("dw_gate_up", False), ("dw_down", True)):
                flags = dict(GATHER_A=gather_a, GATHER_B=not gather_a, SCALE_ROWS=gather_a, HAS_BIAS=True)
                plan = launch.weight_grad_plan(table["weight_grad"], 1, 1, 1, **flags)
                out.append(moe_plan_config(plan, name, "any", dtype, arch.name, layout, matmul=True))
        out.append(moe_plan_config(launch.combine_plan(1, 1), "combine", "any", dtype, arch.name))
    for experts in (2**p for p in range(configs.MAX_EXPERTS.bit_length())):
        for name, plan in zip(("sort_count", "sort_place"), launch.sort_plans(1, experts), strict=True):
            out.append(moe_plan_config(plan, name, f"E<={experts}", torch.float16, arch.name))
    return out
