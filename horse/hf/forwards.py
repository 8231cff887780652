"""The forwards ``horse.hf.apply`` binds to a transformers model's modules, one per kind of module.

Each computes what the module's own forward computes, in the same dtypes, on ``horse.kernels``:

- RMSNorm (LLaMA's and the families like it, Qwen3's per-head q_norm and k_norm): transformers' cast order,
  ``weight * normalized.to(input dtype)``: ``rms_norm`` without a weight gives the normalized input in its
  own dtype, and the weight multiplies it as transformers does (a float32 weight on 16-bit activations
  gives float32, as there). OLMo-2's, Gemma 4's and gpt-oss's RMSNorm (their q_norm and k_norm too) multiply
  first and cast after, ``(weight * normalized).to(input dtype)``: ``rms_norm`` with the weight, whose kernel
  does just that (Gemma 4's norms without a weight: ``rms_norm`` without one; gpt-oss keeps its norms' weights
  in float32 on 16-bit activations: the output in theirs, as there).
  Gemma's RMSNorm scales by ``1 + weight``, added and multiplied in float32 before the cast: ``rms_norm``
  with ``weight_offset=1.0``.
- GPT-2's ``nn.LayerNorm``: ``layer_norm`` (in float32 under autocast, as autocast runs layer_norm).
- The gated MLP: ``fused_gated_mlp`` on gate_proj, up_proj and down_proj's weights; Phi-3's and GLM-4's
  fused ``gate_up_proj`` (gate rows first, up rows after) as the two row halves of its weight, views.
- GPT-2's MLP: ``fused_mlp`` on c_fc and c_proj. Conv1D stores its weight (in, out), so ``weight.t()`` is the
  (out, in) operand the kernel takes, a view (the kernels read any strides); dropout after it as before.
- The decoder layer: the residual add before the post-attention norm fused into it (``add_rms_norm`` /
  ``add_layer_norm``), which returns the sum rounded to the activations' dtype, as the unfused add, and the
  norm of that sum. Only where nothing can tell: the two addends of one dtype, no autocast around a
  LayerNorm, no hooks on the norm, and the norm running our forward; otherwise the layer adds as before.
  gpt-oss's MoE block returns (output, router scores): its layer takes the output.
  What a family does to the attention's output before that add stays as it was: Phi-3's residual dropout,
  Granite's residual_multiplier, GLM-4's post_self_attn_layernorm and Gemma 3's post_attention_layernorm
  (sandwich norms; Gemma 3's add goes into its pre_feedforward_layernorm). Gemma 4's layer is Gemma 3's, then
  its MoE block, its per-layer input's branch and layer_scalar, in the order of its own forward.
- The causal LM: its loss from the last hidden states by ``linear_cross_entropy`` (:func:`causal_lm_forward`),
  Granite's ``logits / logits_scaling`` folded into the hidden states, Gemma's final_logit_softcapping as
  the loss's ``softcap`` (the logits it returns softcapped as transformers does); Gemma 4's text model given
  logits_to_keep as indices of every row (:func:`_every_row`).

A projection these forwards read the weight of must be a plain ``nn.Linear`` (GPT-2: ``Conv1D``) without
hooks: a LoRA, quantized or hooked layer would be skipped, so its call raises instead, naming it.
"""

import functools
import inspect
import types

import torch
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_utils import slice_logits_to_keep
from transformers.pytorch_utils import Conv1D
from transformers.utils import ModelOutput, can_return_tuple

from horse.hf.attention import check_half_precision
from horse.kernels import (
    add_layer_norm,
    add_rms_norm,
    cross_entropy,
    fused_gated_mlp,
    fused_mlp,
    layer_norm,
    linear_cross_entropy,
    rms_norm,
)


def activation_of(act: nn.Module) -> str | None:
    """Our kernels' name for transformers' activation module act, or None if they have none."""
    from transformers import activations

    names = {
        activations.SiLUActivation: "silu",
        nn.SiLU: "silu",
        activations.GELUActivation: "gelu",  # erf, in torch or in Python
        activations.GELUTanh: "gelu_tanh",
        activations.NewGELUActivation: "gelu_tanh",
        activations.FastGELUActivation: "gelu_tanh",
        nn.ReLU: "relu",
        activations.ReLUSquaredActivation: "relu2",
    }
    return names.get(type(act))


def unfused_layers(module: nn.Module, names: tuple[str, ...], layer_type: type) -> list[str]:
    """Those of module's submodules names that a fused forward cannot stand in for: not exactly layer_type (a
    LoRA, quantized or otherwise wrapped layer), or with hooks that a fused forward would skip."""
    wrong = []
    for name in names:
        layer = getattr(module, name)
        if type(layer) is not layer_type:
            wrong.append(f"{name} ({type(layer).__module__}.{type(layer).__qualname__})")
        elif layer._forward_hooks or layer._forward_pre_hooks:
            wrong.append(f"{name} (has forward hooks)")
    return wrong


def _require_plain(module: nn.Module, names: tuple[str, ...], layer_type: type) -> None:
    if wrong := unfused_layers(module, names, layer_type):
        raise TypeError(
            f"horse.hf: {type(module).__name__}'s fused forward reads the weights of {', '.join(names)}, but "
            f"{'; '.join(wrong)} is not a plain {layer_type.__name__}, and would be skipped. Call "
            "horse.hf.unapply(model) before wrapping layers (PEFT adapters on these, quantization, hooks)."
        )


# ----------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm: ``weight * (x · rsqrt(mean(x²) + eps)).to(x.dtype)``."""
    normalized = rms_norm(hidden_states, hidden_states.shape[-1:], None, self.variance_epsilon)
    return self.weight * normalized


def olmo2_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """OLMo-2's, Gemma 4's and gpt-oss's RMSNorm: ``(weight * x · rsqrt(mean(x²) + eps)).to(x.dtype)``,
    weight times float32; Gemma 4's without a weight (``with_scale=False``: its v_norm, its router's norm)
    casts x̂."""
    weight = getattr(self, "weight", None)  # Gemma4RMSNorm(with_scale=False) has none
    return rms_norm(hidden_states, hidden_states.shape[-1:], weight, self.variance_epsilon)


def gemma_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm: ``(x · rsqrt(mean(x²) + eps) · (1 + weight.float())).to(x.dtype)``, all in float32."""
    return rms_norm(hidden_states, hidden_states.shape[-1:], self.weight, self.eps, weight_offset=1.0)


def layer_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``nn.LayerNorm``; under autocast in float32, as autocast runs layer_norm."""
    if torch.is_autocast_enabled(hidden_states.device.type):
        hidden_states = hidden_states.float()
    return layer_norm(hidden_states, self.normalized_shape, self.weight, self.bias, self.eps)


def _fusable(norm: nn.Module, forward, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``norm(residual + x)`` may run as one add-and-norm kernel with no output changed."""
    return (
        getattr(norm.forward, "__func__", None) is forward
        and x.dtype == residual.dtype
        and not (norm._forward_hooks or norm._forward_pre_hooks)
    )


def _add_rms_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """(norm(residual + x), residual + x)."""
    if _fusable(norm, rms_norm_forward, x, residual):
        normalized, hidden_states = add_rms_norm(x, residual, x.shape[-1:], None, norm.variance_epsilon)
        return norm.weight * normalized, hidden_states
    if _fusable(norm, gemma_rms_norm_forward, x, residual):
        return add_rms_norm(x, residual, x.shape[-1:], norm.weight, norm.eps, weight_offset=1.0)
    if _fusable(norm, olmo2_rms_norm_forward, x, residual):  # Gemma 4's, gpt-oss's (OLMo-2's layer: no add)
        return add_rms_norm(x, residual, x.shape[-1:], getattr(norm, "weight", None), norm.variance_epsilon)
    hidden_states = residual + x
    return norm(hidden_states), hidden_states


def _add_layer_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """(norm(x + residual), x + residual)."""
    if not _fusable(norm, layer_norm_forward, x, residual) or torch.is_autocast_enabled(x.device.type):
        hidden_states = x + residual
        return norm(hidden_states), hidden_states
    return add_layer_norm(x, residual, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


# ----------------------------------------------------------------------------------------------
# MLPs
# ----------------------------------------------------------------------------------------------


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` (LLaMA, Mistral, Qwen2, Qwen3), one fused call."""
    _require_plain(self, ("gate_proj", "up_proj", "down_proj"), nn.Linear)
    check_half_precision(x, type(self).__name__)
    weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
    return fused_gated_mlp(x, *weights, activation=activation_of(self.act_fn))


def gate_up_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Phi-3's and GLM-4's ``down_proj(up * act(gate))`` with ``gate, up = gate_up_proj(x).chunk(2, -1)``, one
    fused call on gate_up_proj's weight's two row halves (views: its gradient lands in the one weight)."""
    _require_plain(self, ("gate_up_proj", "down_proj"), nn.Linear)
    check_half_precision(x, type(self).__name__)
    gate, up = self.gate_up_proj.weight.chunk(2, dim=0)  # (intermediate, hidden) each
    return fused_gated_mlp(x, gate, up, self.down_proj.weight, activation=activation_of(self.activation_fn))


def gpt2_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``dropout(c_proj(act(c_fc(x))))``; Conv1D weights are (in, out): their transposes are views."""
    _require_plain(self, ("c_fc", "c_proj"), Conv1D)
    check_half_precision(x, type(self).__name__)
    fc, proj = self.c_fc, self.c_proj
    y = fused_mlp(x, fc.weight.t(), fc.bias, proj.weight.t(), proj.bias, activation=activation_of(self.act))
    return self.dropout(y)


# ----------------------------------------------------------------------------------------------
# Decoder layers: the residual add fused into the post-attention norm
# ----------------------------------------------------------------------------------------------


def checkpointed(forward):
    """forward as a transformers GradientCheckpointingLayer runs its own. The layer class checkpoints in a
    wrapper around its class's forward, which a forward bound to the instance bypasses: without this, a
    patched model under ``activation_checkpointing_enable()`` would keep every layer's activations. In
    training with gradients and the layer's gradient_checkpointing on: through its checkpoint function, the
    cache off as transformers turns it off there (``use_cache=False``; ``cache=None`` unless the layer keeps
    it)."""

    @functools.wraps(forward)
    def layer_forward(self, *args, **kwargs):
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return forward(self, *args, **kwargs)
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not self._can_checkpoint_with_cache and kwargs.get("cache") is not None:
            kwargs["cache"] = None
        return self._gradient_checkpointing_func(functools.partial(forward, self, **kwargs), *args)

    return layer_forward


@checkpointed
def decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """LLaMA's decoder layer (and those of the families built like it) with
    ``post_attention_layernorm(residual + attention)`` as one add_rms_norm. The layer's keyword arguments
    (attention_mask, position_ids, cache, use_cache, position_embeddings, ...) go on to self_attn, as the
    layer's own forward passes them."""
    attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    normalized, hidden_states = _add_rms_norm(self.post_attention_layernorm, attention_output, hidden_states)
    return hidden_states + self.mlp(normalized)


@checkpointed
def phi3_decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """Phi-3's decoder layer: LLaMA's with dropout on each branch's output (resid_pdrop) before its add."""
    attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    attention_output = self.resid_attn_dropout(attention_output)
    normalized, hidden_states = _add_rms_norm(self.post_attention_layernorm, attention_output, hidden_states)
    return hidden_states + self.resid_mlp_dropout(self.mlp(normalized))


@checkpointed
def granite_decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """Granite's decoder layer: LLaMA's with each branch's output times residual_multiplier before its add
    (the product rounded to the activations' dtype, as there, then the fused add and norm)."""
    attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    attention_output = attention_output * self.residual_multiplier
    normalized, hidden_states = _add_rms_norm(self.post_attention_layernorm, attention_output, hidden_states)
    return hidden_states + self.mlp(normalized) * self.residual_multiplier


@checkpointed
def glm4_decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """GLM-4's decoder layer: sandwich norms, each branch's output normalized (post_self_attn_layernorm,
    post_mlp_layernorm) before its add; the add into post_attention_layernorm fused as in LLaMA's."""
    attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    attention_output = self.post_self_attn_layernorm(attention_output)
    normalized, hidden_states = _add_rms_norm(self.post_attention_layernorm, attention_output, hidden_states)
    return hidden_states + self.post_mlp_layernorm(self.mlp(normalized))


@checkpointed
def gemma2_decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """Gemma 2's and Gemma 3's decoder layer: sandwich norms, the attention's output normalized
    (post_attention_layernorm) before its add, which is fused into pre_feedforward_layernorm; the MLP's output
    normalized (post_feedforward_layernorm) before its add."""
    attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    attention_output = self.post_attention_layernorm(attention_output)
    normalized, hidden_states = _add_rms_norm(self.pre_feedforward_layernorm, attention_output, hidden_states)
    return hidden_states + self.post_feedforward_layernorm(self.mlp(normalized))


@checkpointed
def gemma4_decoder_layer_forward(
    self, hidden_states: torch.Tensor, per_layer_input: torch.Tensor | None = None, **kwargs
) -> torch.Tensor:
    """Gemma 4's decoder layer: Gemma 3's, then the steps of its own as its forward takes them. With
    enable_moe_block, the MLP's output (post_feedforward_layernorm_1) plus the experts' (routed on the
    residual stream, from pre_feedforward_layernorm_2, then post_feedforward_layernorm_2) before
    post_feedforward_layernorm; with per-layer inputs, a gated branch added to the residual stream,
    ``post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h)) · per_layer_input))``
    (transformers' linears: no kernel fuses a gate with an input of its own); the sum times layer_scalar."""
    attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    attention_output = self.post_attention_layernorm(attention_output)
    normalized, hidden_states = _add_rms_norm(self.pre_feedforward_layernorm, attention_output, hidden_states)
    mlp_output = self.mlp(normalized)
    if self.enable_moe_block:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # (batch · seqlen, hidden)
        _, top_k_weights, top_k_index = self.router(tokens)
        experts_output = self.experts(self.pre_feedforward_layernorm_2(tokens), top_k_index, top_k_weights)
        experts_output = self.post_feedforward_layernorm_2(experts_output.reshape(hidden_states.shape))
        mlp_output = self.post_feedforward_layernorm_1(mlp_output) + experts_output
    hidden_states = hidden_states + self.post_feedforward_layernorm(mlp_output)
    if self.hidden_size_per_layer_input:
        gate = self.act_fn(self.per_layer_input_gate(hidden_states)) * per_layer_input
        hidden_states = hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gate))
    hidden_states *= self.layer_scalar  # in place, as there: the activations' dtype whatever the buffer's
    return hidden_states


@checkpointed
def gpt_oss_decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """gpt-oss's decoder layer: LLaMA's, its MoE block returning (output, router scores), the scores unused
    (the router's logits reach the output through transformers' recorder on the router)."""
    attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    normalized, hidden_states = _add_rms_norm(self.post_attention_layernorm, attention_output, hidden_states)
    mlp_output, _ = self.mlp(normalized)
    return hidden_states + mlp_output


@checkpointed
def gpt2_block_forward(
    self,
    hidden_states: torch.Tensor,
    cache=None,
    attention_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    use_cache: bool | None = False,
    **kwargs,
) -> torch.Tensor:
    """GPT-2's block with ``ln_2(attention + residual)`` as one add_layer_norm (cross-attention as before)."""
    if encoder_hidden_states is not None:
        return type(self).forward(
            self,
            hidden_states,
            cache,
            attention_mask,
            encoder_hidden_states,
            encoder_attention_mask,
            use_cache,
            **kwargs,
        )
    residual = hidden_states
    attention_output, _ = self.attn(
        self.ln_1(hidden_states), cache=cache, attention_mask=attention_mask, use_cache=use_cache, **kwargs
    )
    normalized, hidden_states = _add_layer_norm(self.ln_2, attention_output, residual)
    return hidden_states + self.mlp(normalized)


# ----------------------------------------------------------------------------------------------
# The causal LM: the loss without the logits
# ----------------------------------------------------------------------------------------------


def causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    logits: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss: token t predicts labels[t + 1] (or shift_labels[t]), ignore_index
    ignored, the mean over the tokens kept, or with num_items_in_batch (gradient accumulation) the sum
    divided by it. From the logits when given (``cross_entropy``), else from the hidden states and the head's
    weight (``linear_cross_entropy``: the logits never exist whole); the logits softcapped inside the loss by
    softcap unless None (``softcap · tanh(logits / softcap)``)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden_states.device)
    options = {"ignore_index": ignore_index, "reduction": "sum", "softcap": softcap}
    if logits is None:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        loss = linear_cross_entropy(rows, lm_head.weight, target, lm_head.bias, **options)
    else:
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), target, **options)
    if num_items_in_batch is None:
        # transformers' mean over the tokens kept: NaN (0/0) when every label is ignored, as there
        num_items_in_batch = (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def logits_divisor(config) -> float:
    """What the causal LM divides its logits by: Granite's ``logits_scaling``, 1 for the other families."""
    return config.logits_scaling if config.model_type == "granite" else 1


def final_logit_softcap(config) -> float | None:
    """The causal LM's final-logit softcap (Gemma 2's, Gemma 3's when set), None where it has none."""
    return getattr(config, "final_logit_softcapping", None)


def softcapped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap · tanh(logits / softcap)`` in the logits' dtype, the steps transformers' Gemmas take."""
    return torch.tanh(logits / softcap) * softcap


@can_return_tuple
def causal_lm_forward(self, *args, **kwargs):
    """The causal LM's forward with its loss by :func:`causal_lm_loss`. With labels in training the logits
    are skipped (``logits=None``); ``skip_logits=False`` asks for them (and True skips them in evaluation,
    as Trainer asks of Liger-Kernel). A loss function of the caller's own (``model.loss_function = ...``)
    runs the model's own forward."""
    skip_logits = kwargs.pop("skip_logits", None)
    if kwargs.get("output_attentions"):
        raise ValueError(
            "horse.hf: output_attentions=True: the fused attention never forms the attention weights. Run "
            "the model with attn_implementation='eager' (or horse.hf.unapply it) to get them."
        )
    original = type(self).forward
    signature = _signature(original)
    arguments = signature.bind(self, *args, **kwargs).arguments
    del arguments["self"]
    extra = arguments.pop("kwargs", {})
    labels = arguments.pop("labels", None)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    if labels is not None and self.loss_function is not ForCausalLMLoss:
        return original(self, *args, **kwargs)
    _require_plain(self, ("lm_head",), nn.Linear)
    if getattr(self.config, "num_kv_shared_layers", 0):
        arguments["logits_to_keep"] = _every_row(arguments)
    outputs = getattr(self, self.base_model_prefix)(**arguments, **extra)
    hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    if skip_logits is None:
        skip_logits = self.training and labels is not None
    if skip_logits and labels is None:
        raise ValueError("horse.hf: skip_logits=True needs labels: without them the logits are the output")
    logits = None if skip_logits else self.lm_head(hidden_states)
    if (divisor := logits_divisor(self.config)) != 1:
        hidden_states = hidden_states / divisor  # lm_head(h) / s as lm_head(h / s): Granite's has no bias
        logits = None if logits is None else logits / divisor  # what the model returns, as it divides
    loss = None
    softcap = final_logit_softcap(self.config)
    if labels is not None:
        # the loss softcaps the logits itself, in float32: from the head's logits, not the returned ones
        loss = causal_lm_loss(hidden_states, self.lm_head, labels, logits, softcap=softcap, **extra)
    if logits is not None and softcap is not None:
        logits = softcapped(logits, softcap)
    fields = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    return _output_class(signature)(loss=loss, logits=logits, **fields)


def _every_row(arguments: dict) -> torch.Tensor:
    """logits_to_keep for Gemma 4's text model that keeps every row: the indices of all. With an int it cuts
    the query rows of its KV-shared layers to the last logits_to_keep (all of them for the 0 it would get),
    and its masks with them as 4-D masks, where ours is 2-D (batch, seqlen); with indices it cuts nothing.
    This forward takes the rows of logits_to_keep from the last hidden states itself."""
    inputs = arguments.get("input_ids")
    inputs = arguments["inputs_embeds"] if inputs is None else inputs
    return torch.arange(inputs.shape[1], device=inputs.device)


@functools.cache
def causal_lm_forward_for(model_class: type):
    """:func:`causal_lm_forward` showing model_class's own forward's signature, for those who read it:
    Trainer keeps only the batch's columns it names, and passes num_items_in_batch for its **kwargs."""

    @functools.wraps(causal_lm_forward)
    def forward(self, *args, **kwargs):
        return causal_lm_forward(self, *args, **kwargs)

    forward.__signature__ = _signature(model_class.forward)
    return forward


@functools.cache
def _signature(forward) -> inspect.Signature:
    """A model class's forward's signature; its return annotation names the output class."""
    return inspect.signature(forward)


def _output_class(signature: inspect.Signature) -> type:
    """The output class a forward's return annotation names: itself, or the ModelOutput of a union
    (GLM-4's ``tuple | CausalLMOutputWithPast``)."""
    annotation = signature.return_annotation
    if isinstance(annotation, types.UnionType):
        (annotation,) = (member for member in annotation.__args__ if issubclass(member, ModelOutput))
    return annotation
