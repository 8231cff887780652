"""The mixture-of-experts forwards ``horse.hf.apply`` binds (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss;
Gemma 4's experts, whose causal LM has no aux loss and keeps ``forwards.causal_lm_forward``).

- The experts (``<Family>Experts``: ``gate_up_proj`` (experts, 2 · inter, hidden), gate rows first, and
  ``down_proj`` (experts, hidden, inter), as transformers packs them): one ``moe_mlp`` call on the module's
  own parameters, read in place (no copy: their gradients land in them). It takes the router's top-k ids
  and weights as the module's own forward does, so the router, its logits (``output_router_logits``) and
  the sparse block around the experts stay transformers' own; so do Qwen2-MoE's shared expert gate (its
  shared expert is a gated MLP, patched as LLaMA's).
- gpt-oss's experts (``GptOssExperts``): its transposed storage, ``gate_up_proj`` (experts, hidden, 2 · inter)
  with gate and up interleaved column by column and ``down_proj`` (experts, inter, hidden), passed to
  ``moe_mlp`` as ``.transpose(1, 2)`` views with ``gate_up_interleaved=True``, its two biases, and its
  clamped SwiGLU by the module's ``limit`` (``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)``,
  ``g = min(gate, limit)``; the kernels' alpha is 1.702, the config's default and every released
  checkpoint's: another swiglu_alpha is refused). Its router (top-k of the biased logits, then a softmax
  over those k) stays transformers' own, as the others'. Only bfloat16 / float16 weights: an
  MXFP4-quantized checkpoint is refused (:func:`mxfp4_refusal`).
- The causal LM: the loss of ``forwards.causal_lm_forward``, plus the load-balancing loss as the model's
  own forward adds it: the modeling module's ``load_balancing_loss_func`` over the router logits, times
  ``router_aux_loss_coef``, when ``output_router_logits`` (the argument, else the config's) is on.
"""

import dataclasses
import functools
import inspect

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.utils import can_return_tuple

from horse.hf import forwards
from horse.hf.attention import check_half_precision
from horse.kernels import moe_mlp
from horse.kernels.moe import ACTIVATIONS
from horse.kernels.reference import GPT_OSS_SWIGLU_ALPHA


def experts_refusals(name: str, module: nn.Module) -> list[str]:
    """What in an experts module the fused forward cannot run exactly, in words."""
    problems = []
    activation = forwards.activation_of(module.act_fn)
    if activation not in ACTIVATIONS:
        problems.append(f"{name}: activation {type(module.act_fn).__name__}, which moe_mlp lacks")
    for weight in ("gate_up_proj", "down_proj"):
        if type(getattr(module, weight, None)) is not nn.Parameter:
            problems.append(f"{name}.{weight}: not a plain nn.Parameter (quantized or wrapped experts?)")
    return problems


def experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The packed experts' ``Σ_k top_k_weights[t, k] · expert_{top_k_index[t, k]}(hidden_states[t])``, with
    ``expert_e(x) = down_proj[e] (act(gate) ⊙ up)`` and ``gate, up = gate_up_proj[e] x`` split in halves:
    one ``moe_mlp`` call. hidden_states (tokens, hidden); top_k_index, top_k_weights (tokens, top_k)."""
    check_half_precision(hidden_states, type(self).__name__)
    return moe_mlp(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        activation=forwards.activation_of(self.act_fn),
    )


def gpt_oss_experts_refusals(name: str, module: nn.Module) -> list[str]:
    """What in gpt-oss's experts the fused forward cannot run exactly, in words."""
    problems = []
    if module.alpha != GPT_OSS_SWIGLU_ALPHA:
        problems.append(
            f"{name}: swiglu_alpha {module.alpha} (moe_mlp's clamped SwiGLU has {GPT_OSS_SWIGLU_ALPHA})"
        )
    for weight in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        if type(getattr(module, weight, None)) is not nn.Parameter:
            problems.append(f"{name}.{weight}: not a plain nn.Parameter (quantized or wrapped experts?)")
    return problems


def gpt_oss_experts_forward(
    self, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor
) -> torch.Tensor:
    """gpt-oss's experts, ``Σ_k routing_weights[t, k] · expert_{router_indices[t, k]}(hidden_states[t])`` with
    ``expert_e(x) = (x gate_up_proj[e] + gate_up_proj_bias[e] → clamped SwiGLU) down_proj[e] +
    down_proj_bias[e]``: one ``moe_mlp`` call on the module's own parameters, the transposed weights as views.
    hidden_states (tokens, hidden); router_indices, routing_weights (tokens, top_k)."""
    check_half_precision(hidden_states, type(self).__name__)
    return moe_mlp(
        hidden_states,
        router_indices,
        routing_weights,
        self.gate_up_proj.transpose(1, 2),  # (experts, 2 · inter, hidden), gate j in row 2j, up j in 2j + 1
        self.down_proj.transpose(1, 2),  # (experts, hidden, inter)
        activation="silu",
        gate_up_bias=self.gate_up_proj_bias,
        down_bias=self.down_proj_bias,
        limit=self.limit,
        gate_up_interleaved=True,
    )


def mxfp4_refusal(model: nn.Module) -> str | None:
    """Why model's experts are MXFP4-quantized (gpt-oss's released checkpoints), with what to load instead;
    None when they are not: the config's quantization_config names mxfp4, or an experts module's parameter
    holds packed blocks or their scales (named so, or of an integer dtype: transformers'
    Mxfp4GptOssExperts)."""
    quantization = getattr(model.config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    method = getattr(quantization, "quant_method", method)
    packed = [
        f"{name} ({param.dtype})"
        for name, param in model.named_parameters()
        if ".experts." in name and (name.endswith(("_blocks", "_scales")) or not param.is_floating_point())
    ]
    if method != "mxfp4" and not packed:
        return None
    what = "quantization_config quant_method 'mxfp4'" if method == "mxfp4" else packed[0]
    return (
        f"MXFP4-quantized experts ({what}), which moe_mlp does not take: it runs bfloat16 or float16 "
        "weights. Load the checkpoint dequantized, from_pretrained(..., "
        "quantization_config=Mxfp4Config(dequantize=True), torch_dtype=torch.bfloat16), or a bfloat16 "
        "checkpoint of the model"
    )


@can_return_tuple
def causal_lm_forward(self, *args, **kwargs):
    """The MoE causal LM's forward: ``forwards.causal_lm_forward``'s loss and logits, with the aux loss and
    its share of the loss as the model's own forward computes them."""
    original = type(self).forward
    arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
    del arguments["self"]
    extra = arguments.pop("kwargs", {})
    if arguments.get("labels") is not None and self.loss_function is not ForCausalLMLoss:
        return original(self, *args, **kwargs)  # a loss function of the caller's own: the model's forward
    if arguments.get("output_router_logits") is None:
        arguments["output_router_logits"] = self.config.output_router_logits
    outputs = forwards.causal_lm_forward(self, **arguments, **extra, return_dict=True)
    if not arguments["output_router_logits"]:
        return outputs
    load_balancing_loss = inspect.getmodule(type(self)).load_balancing_loss_func
    aux_loss = load_balancing_loss(
        outputs.router_logits, self.num_experts, self.num_experts_per_tok, arguments.get("attention_mask")
    )
    loss = outputs.loss
    if loss is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    fields = {field.name: getattr(outputs, field.name) for field in dataclasses.fields(outputs)}
    return type(outputs)(**(fields | {"loss": loss, "aux_loss": aux_loss}))


@functools.cache
def causal_lm_forward_for(model_class: type):
    """:func:`causal_lm_forward` showing model_class's own forward's signature (see
    ``forwards.causal_lm_forward_for``)."""

    @functools.wraps(causal_lm_forward)
    def forward(self, *args, **kwargs):
        return causal_lm_forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(model_class.forward)
    return forward
