"""Our fused kernels inside a transformers model, in place: ``apply``, ``unapply``, ``AutoHorseForCausalLM``.

``apply(model)`` binds new forwards to the model's own module instances (the parameters, their names and
the state dict stay as they are, so an optimizer, PEFT and ``save_pretrained`` see the same model) and
switches its attention to "horse", our entry in transformers' attention interface (``horse.hf.attention``).
Per family, by ``config.model_type``:

    llama, mistral,   attention (GQA, Mistral's and Qwen2's sliding window), RMSNorm (Qwen3's q_norm and
    qwen2, qwen3      k_norm too), the gated MLP, the residual add into the post-attention RMSNorm, the loss
    ministral,        as LLaMA, with sliding windows on the layers whose layer_type says so (SmolLM3's
    smollm3           layers without rotary, NoPE, are the attention module's own affair: it sends q, k)
    phi3              as LLaMA, the MLP on gate_up_proj's two row halves (views), dropout as before
    granite           as LLaMA, with attention_multiplier as the softmax scale and residual_multiplier on
                      each branch before its add; logits / logits_scaling folded into the hidden states
    olmo2             attention, RMSNorm with the weight inside the cast (q_norm, k_norm and the post-norms
                      too), the gated MLP, the loss; no residual add is followed by a norm: none is fused
    glm4              as LLaMA with Phi-3's MLP and sandwich norms (each branch normalized before its add)
    gemma             as LLaMA with Gemma's RMSNorm (x̂ · (1 + weight) in float32, then the cast) and its
                      GeGLU MLP (tanh GELU); its embedding scaling stays in transformers' module
    gemma2            as gemma, with attn_logit_softcapping as the attention kernel's softcap, sliding
                      windows on the layers whose layer_type says so, query_pre_attn_scalar in the module's
                      scaling, sandwich norms (the add fused into pre_feedforward_layernorm), and
                      final_logit_softcapping as the loss's softcap
    gemma3_text       as gemma2, with its q_norm and k_norm (Gemma's RMSNorm over the head dim); the loss
                      over its 262,208 classes; either softcap when set
    gemma4_text       as gemma3_text with OLMo-2's RMSNorm (v_norm and the router's without a weight) and a
                      scale of 1; its layer's MoE block (the packed experts on moe_mlp, transformers' router),
                      per-layer inputs' gated branch (transformers' linears) and layer_scalar as its forward
                      takes them; keys as values and layers reusing others' keys and values are the
                      attention module's affair; global layers of head dim 512 run on the kernels
    mixtral, olmoe,   as LLaMA, with the packed experts (gate_up_proj, down_proj) as one moe_mlp call on
    qwen3_moe         the module's own parameters (horse.hf.moe); the router, its logits and the aux loss
                      (output_router_logits, router_aux_loss_coef) as the model computes them
    qwen2_moe         as qwen3_moe, with its shared expert (a gated MLP) patched as LLaMA's; its sigmoid gate
                      and the dense layers of mlp_only_layers as the others
    gpt_oss           as mixtral, with its experts' transposed, interleaved gate_up_proj, their biases and the
                      clamped SwiGLU (swiglu_limit) in the one moe_mlp call; its attention sinks as the
                      kernels' sinks, sliding windows on the layers whose layer_type says so, OLMo-2's RMSNorm
                      (the weight inside the cast); MXFP4-quantized experts refused (load them dequantized)
    gpt2              attention, LayerNorm, the MLP, the residual add into ln_2, the loss

Any other model type raises, naming the supported ones: a model is never left unpatched without a word.
Rotary embeddings, partial (Phi-3's partial_rotary_factor, GLM-4's interleaved half) or none, and Granite's
embedding_multiplier stay in transformers' own modules, which are not replaced. Refused at apply, naming
what: quantized models (MXFP4-quantized experts with what to load instead), cross-attention (GPT-2's
add_cross_attention), Gemma's use_bidirectional_attention, head dims above 512, a head with more classes
than the loss takes (cross_entropy.MAX_VOCAB), MLP biases on a gated MLP, activations the kernels lack,
wrapped layers (anything but a plain ``nn.Linear`` / ``Conv1D`` where a fused forward reads the weight, hooks
on them) and modules whose forward something else has replaced already. Refused at call: see
``horse.hf.attention`` and ``horse.hf.forwards``. Float32 activations on a GPU are refused rather than run on
the slow reference (``attention.check_half_precision``).
"""

import dataclasses
import importlib
import types
from collections.abc import Callable

import transformers
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.pytorch_utils import Conv1D

from horse.hf import attention, forwards, moe
from horse.kernels.attention.configs import MAX_HEAD_DIM
from horse.kernels.cross_entropy import MAX_VOCAB
from horse.kernels.runtime import major_minor

MIN_TRANSFORMERS = (5, 25)
if major_minor(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(
        f"horse.hf.apply needs transformers>={'.'.join(map(str, MIN_TRANSFORMERS))} (its attention and mask "
        f"interfaces, the `cache` argument); this environment has {transformers.__version__}"
    )

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "phi3",
    "granite",
    "ministral",
    "smollm3",
    "olmo2",
    "glm4",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma4_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
)
_PATCH = "_horse_hf_patch"  # the model's attribute holding what apply changed
# The families built like LLaMA: {model_type: the prefix of their modeling module's class names}
_LLAMA_LIKE = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "phi3": "Phi3",
    "granite": "Granite",
    "ministral": "Ministral",
    "smollm3": "SmolLM3",
    "olmo2": "Olmo2",
    "glm4": "Glm4",
    "gemma": "Gemma",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
    "olmoe": "Olmoe",
    "gpt_oss": "GptOss",
}
# Families whose modeling module is not named after their model type
_MODELING_MODULE = {"gemma3_text": "gemma3"}


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's module classes and what replaces each one's forward, with its kind in the report."""

    norm: type
    norm_kind: str
    norm_forward: types.FunctionType
    mlp: type | None  # None: the family has no dense MLP (Mixtral's layers are all experts)
    mlp_kind: str
    mlp_forward: types.FunctionType
    mlp_layers: tuple[str, ...]  # the projections whose weights the fused MLP reads
    mlp_layer_type: type
    mlp_activation: str  # the MLP's attribute holding its activation module
    layer: type | None  # None: the family's layer has no residual add followed by a norm
    layer_kind: str
    layer_forward: types.FunctionType
    attention: type
    causal_lm: type
    experts: type | None = None  # the MoE families' packed experts
    experts_forward: types.FunctionType = moe.experts_forward
    experts_refusals: types.FunctionType = moe.experts_refusals
    # the causal LM's forward: the loss alone, or with the router's aux loss (moe.causal_lm_forward_for)
    causal_lm_forward_for: Callable[[type], Callable] = forwards.causal_lm_forward_for


def family(model_type: str) -> Family:
    """The Family of a supported config.model_type."""
    if model_type == "gpt2":
        from transformers.models.gpt2 import modeling_gpt2 as gpt2

        return Family(
            norm=nn.LayerNorm,
            norm_kind="layer_norm",
            norm_forward=forwards.layer_norm_forward,
            mlp=gpt2.GPT2MLP,
            mlp_kind="mlp",
            mlp_forward=forwards.gpt2_mlp_forward,
            mlp_layers=("c_fc", "c_proj"),
            mlp_layer_type=Conv1D,
            mlp_activation="act",
            layer=gpt2.GPT2Block,
            layer_kind="add_layer_norm",
            layer_forward=forwards.gpt2_block_forward,
            attention=gpt2.GPT2Attention,
            causal_lm=gpt2.GPT2LMHeadModel,
        )
    if model_type == "gemma4_text":
        return _gemma4_text()
    name = _MODELING_MODULE.get(model_type, model_type)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    prefix = _LLAMA_LIKE[model_type]
    experts = getattr(module, f"{prefix}Experts", None)
    llama_like = Family(
        norm=getattr(module, f"{prefix}RMSNorm"),
        norm_kind="rms_norm",
        norm_forward=forwards.rms_norm_forward,
        mlp=getattr(module, f"{prefix}MLP", None),  # None: Mixtral (its layers' MLPs are all experts)
        mlp_kind="gated_mlp",
        mlp_forward=forwards.gated_mlp_forward,
        mlp_layers=("gate_proj", "up_proj", "down_proj"),
        mlp_layer_type=nn.Linear,
        mlp_activation="act_fn",
        layer=getattr(module, f"{prefix}DecoderLayer"),
        layer_kind="add_rms_norm",
        layer_forward=forwards.decoder_layer_forward,
        attention=getattr(module, f"{prefix}Attention"),
        causal_lm=getattr(module, f"{prefix}ForCausalLM"),
        experts=experts,
        # the MoE families' causal LMs add the router's aux loss to the loss
        causal_lm_forward_for=moe.causal_lm_forward_for if experts else forwards.causal_lm_forward_for,
    )
    return dataclasses.replace(llama_like, **_UNLIKE_LLAMA.get(model_type, {}))


def _gemma4_text() -> Family:
    """Gemma 4's text model: its class names are not one prefix's (Gemma4RMSNorm, Gemma4TextMLP), its norm is
    OLMo-2's (some without a weight), its experts have no aux loss in the causal LM."""
    from transformers.models.gemma4 import modeling_gemma4 as gemma4

    return Family(
        norm=gemma4.Gemma4RMSNorm,
        norm_kind="rms_norm",
        norm_forward=forwards.olmo2_rms_norm_forward,
        mlp=gemma4.Gemma4TextMLP,
        mlp_kind="gated_mlp",
        mlp_forward=forwards.gated_mlp_forward,
        mlp_layers=("gate_proj", "up_proj", "down_proj"),
        mlp_layer_type=nn.Linear,
        mlp_activation="act_fn",
        layer=gemma4.Gemma4TextDecoderLayer,
        layer_kind="add_rms_norm",
        layer_forward=forwards.gemma4_decoder_layer_forward,
        attention=gemma4.Gemma4TextAttention,
        causal_lm=gemma4.Gemma4ForCausalLM,
        experts=gemma4.Gemma4TextExperts,
    )


_GATE_UP_MLP = {
    "mlp_forward": forwards.gate_up_mlp_forward,
    "mlp_layers": ("gate_up_proj", "down_proj"),
    "mlp_activation": "activation_fn",
}
# Where a family built like LLaMA differs from it (the causal LM's logits_scaling: forwards.logits_divisor).
_UNLIKE_LLAMA = {
    "phi3": {**_GATE_UP_MLP, "layer_forward": forwards.phi3_decoder_layer_forward},
    "granite": {"layer_forward": forwards.granite_decoder_layer_forward},
    # post-norms: each branch is normalized before its add, and no norm follows the add within the layer
    "olmo2": {"norm_forward": forwards.olmo2_rms_norm_forward, "layer": None},
    "glm4": {**_GATE_UP_MLP, "layer_forward": forwards.glm4_decoder_layer_forward},
    "gemma": {"norm_forward": forwards.gemma_rms_norm_forward},
    "gemma2": {
        "norm_forward": forwards.gemma_rms_norm_forward,
        "layer_forward": forwards.gemma2_decoder_layer_forward,
    },
    "gemma3_text": {
        "norm_forward": forwards.gemma_rms_norm_forward,
        "layer_forward": forwards.gemma2_decoder_layer_forward,
    },
    # GptOssMLP is its MoE block (router and experts), not a gated MLP: only the experts are replaced
    "gpt_oss": {
        "norm_forward": forwards.olmo2_rms_norm_forward,
        "mlp": None,
        "layer_forward": forwards.gpt_oss_decoder_layer_forward,
        "experts_forward": moe.gpt_oss_experts_forward,
        "experts_refusals": moe.gpt_oss_experts_refusals,
    },
}


def register() -> None:
    """Make "horse" a name transformers knows: the attention function and, so that padding masks reach it,
    the mask function (``from_pretrained(..., attn_implementation="horse")`` works after this)."""
    AttentionInterface.register(attention.NAME, attention.attention)
    AttentionMaskInterface.register(attention.NAME, attention.padding_mask)


@dataclasses.dataclass
class _Patch:
    report: dict[str, list[str]]
    modules: list[nn.Module]  # those given a forward of ours
    attn_implementations: list[tuple[object, str | None]]  # (config, its attention before apply)


def _plan(model: PreTrainedModel, fam: Family) -> list[tuple[str, str, nn.Module, types.FunctionType]]:
    """(kind, name, module, forward) of every module apply replaces the forward of."""
    kinds = {fam.norm: (fam.norm_kind, fam.norm_forward)}
    if fam.mlp is not None:
        kinds[fam.mlp] = (fam.mlp_kind, fam.mlp_forward)
    if fam.layer is not None:
        kinds[fam.layer] = (fam.layer_kind, fam.layer_forward)
    if fam.experts is not None:
        kinds[fam.experts] = ("moe_experts", fam.experts_forward)
    if isinstance(model, fam.causal_lm):
        kinds[type(model)] = ("linear_cross_entropy", fam.causal_lm_forward_for(type(model)))
    plan = []
    for name, module in model.named_modules():
        if type(module) in kinds:
            kind, forward = kinds[type(module)]
            plan.append((kind, name, module, forward))
    return plan


def _refusals(model: PreTrainedModel, fam: Family, plan) -> list[str]:
    """What in model the fused forwards cannot run exactly, in words; empty when apply may go on."""
    config, problems = model.config, []
    if (mxfp4 := moe.mxfp4_refusal(model)) is not None:
        problems.append(mxfp4)
    elif getattr(model, "is_quantized", False) or getattr(config, "quantization_config", None) is not None:
        problems.append(f"the model is quantized ({getattr(config, 'quantization_config', None)!r})")
    if getattr(config, "add_cross_attention", False):
        problems.append("cross-attention (add_cross_attention=True)")
    # Gemma's own masks stay causal where its attention does not; Gemma 3's bidirectional masks are untested
    if bidirectional := getattr(config, "use_bidirectional_attention", False):
        problems.append(f"bidirectional attention (use_bidirectional_attention={bidirectional!r})")
    for name, module in model.named_modules():
        if isinstance(module, fam.attention) and module.head_dim > MAX_HEAD_DIM:
            problems.append(f"{name}: head_dim {module.head_dim} (the kernels take up to {MAX_HEAD_DIM})")
    for kind, name, module, _ in plan:
        if "forward" in module.__dict__:
            problems.append(
                f"{name or type(module).__name__}: its forward was replaced already (accelerate hooks, "
                "another kernel library?), and ours would bypass that"
            )
        if kind in ("mlp", "gated_mlp"):
            wrapped = forwards.unfused_layers(module, fam.mlp_layers, fam.mlp_layer_type)
            problems += [f"{name}.{layer}" for layer in wrapped]
            activation = getattr(module, fam.mlp_activation)
            if forwards.activation_of(activation) is None:
                problems.append(f"{name}: activation {type(activation).__name__}, which the fused MLP lacks")
            if kind == "gated_mlp" and any(getattr(module, p).bias is not None for p in fam.mlp_layers):
                problems.append(f"{name}: MLP biases (mlp_bias=True): the fused gated MLP has none")
        if kind == "moe_experts":
            problems += fam.experts_refusals(name, module)
        if kind == "linear_cross_entropy":
            problems += forwards.unfused_layers(module, ("lm_head",), nn.Linear)
            if (vocab := module.lm_head.out_features) > MAX_VOCAB:
                problems.append(f"a vocabulary of {vocab:,} (the loss takes up to {MAX_VOCAB:,})")
    return problems


def _configs(model: PreTrainedModel) -> list:
    configs = {id(model.config): model.config}
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            configs.setdefault(id(module.config), module.config)
    return list(configs.values())


def apply(model: PreTrainedModel) -> dict[str, list[str]]:
    """Run model (a transformers model of a supported family) on our fused kernels, in place.

    Returns {kind: [module names]} of what now runs them ("" names the model itself): "attention",
    "rms_norm" / "layer_norm", "gated_mlp" / "mlp", "moe_experts" (an MoE layer's packed experts),
    "add_rms_norm" / "add_layer_norm" (decoder layers whose post-attention residual add is fused into the
    norm), "linear_cross_entropy" (the causal LM's loss).
    Calling it again returns the same report and changes nothing. Raises ValueError for a model type not in
    SUPPORTED_MODEL_TYPES and for what it refuses (see the module docstring), before changing anything.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"horse.hf.apply takes a transformers PreTrainedModel, got {type(model).__name__} (a PEFT model: "
            "pass model.get_base_model())"
        )
    if (patch := model.__dict__.get(_PATCH)) is not None:
        return patch.report
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"horse.hf.apply: model type {model_type!r} ({type(model).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    fam = family(model_type)
    plan = _plan(model, fam)
    if problems := _refusals(model, fam, plan):
        raise ValueError(
            f"horse.hf.apply: {type(model).__name__} cannot run the fused kernels exactly: "
            + "; ".join(problems)
        )
    register()
    configs = _configs(model)
    before = [(config, config._attn_implementation_internal) for config in configs]
    model.set_attn_implementation(attention.NAME)
    report = {"attention": [name for name, m in model.named_modules() if isinstance(m, fam.attention)]}
    for kind, name, module, forward in plan:
        module.forward = types.MethodType(forward, module)
        report.setdefault(kind, []).append(name)
    setattr(model, _PATCH, _Patch(report, [module for _, _, module, _ in plan], before))
    return report


def unapply(model: PreTrainedModel) -> None:
    """Give model back the forwards and the attention implementation it had before :func:`apply` (a model
    not patched is left as it is)."""
    patch = model.__dict__.get(_PATCH)
    if patch is None:
        return
    for module in patch.modules:
        del module.forward  # the instance's attribute: the class's forward shows through again
    for config, implementation in patch.attn_implementations:
        config._attn_implementation_internal = implementation
    delattr(model, _PATCH)


class AutoHorseForCausalLM:
    """``AutoModelForCausalLM`` whose models come out with :func:`apply` done."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> PreTrainedModel:
        register()  # so that attn_implementation="horse" may be asked for too
        model = AutoModelForCausalLM.from_pretrained(*args, **kwargs)
        apply(model)
        return model

    @classmethod
    def from_config(cls, config, **kwargs) -> PreTrainedModel:
        register()
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        apply(model)
        return model
