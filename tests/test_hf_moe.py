"""horse.hf.apply on the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss) against
the same models unpatched, as tests/test_hf_apply.py does for the dense ones (its accuracy rule and
comparisons): loss, logits, every gradient (the experts' packed weights and gpt-oss's biases, the routers',
Qwen2-MoE's shared expert and its gate, gpt-oss's attention sinks), the load-balancing aux loss, and greedy
generation token for token. gpt-oss runs against eager attention: transformers refuses it sdpa."""

import copy

import pytest
import torch
from helpers import assert_close
from test_hf_apply import INIT, VOCAB, batch, compare, gpt_oss_config

transformers = pytest.importorskip("transformers")

import horse.hf  # noqa: E402
from horse.kernels import add_rms_norm  # noqa: E402

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
# transformers' attention each family runs unpatched: gpt-oss has no sdpa (its sinks)
ATTENTION = {"gpt_oss": "eager"}


def tiny_config(family: str):
    """A two-layer model of family, hidden 64, 4 query heads over 2 key-value heads, 8 experts of inter 32
    (Mixtral: 4 of inter 48) with top 2, the router logits and their aux loss on (coefficient 0.1, so that
    it counts in the loss); Qwen2-MoE with a shared expert of inter 48, its second layer dense
    (mlp_only_layers), Qwen3-MoE with the top-k weights renormalized; gpt-oss as test_hf_apply's (4 experts
    of inter 32, a window of 5 on its first layer) with swiglu_limit 2, where the clamp bites (its gate and
    up reach about ±6)."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.1,
    }
    experts = {"num_experts": 8, "moe_intermediate_size": 32, "intermediate_size": 96}
    configs = {
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=4, intermediate_size=48),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common, **experts, shared_expert_intermediate_size=48, mlp_only_layers=[1]
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, **experts, head_dim=16, norm_topk_prob=True
        ),
        "olmoe": lambda: transformers.OlmoeConfig(**common, num_experts=8, intermediate_size=32),
    }
    if family == "gpt_oss":
        config = gpt_oss_config()
        config.output_router_logits, config.router_aux_loss_coef, config.swiglu_limit = True, 0.1, 2.0
        return config
    config = configs[family]()
    config.initializer_range = INIT
    return config


def unpatched(family: str, config=None):
    """The model of family (config: tiny_config's unless given), float32, from one seed, in training mode,
    on sdpa (gpt-oss on eager) and transformers' default experts; gpt-oss's experts' biases drawn as the
    weights (transformers starts them at zero)."""
    torch.manual_seed(0)
    config = tiny_config(family) if config is None else config
    attention = ATTENTION.get(family, "sdpa")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model.train()
    for name, param in model.named_parameters():
        if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
            torch.nn.init.normal_(param, std=INIT)
    return model


def build(family: str):
    """(unpatched model, patched deep copy)."""
    model = unpatched(family)
    patched = copy.deepcopy(model)
    horse.hf.apply(patched)
    return model, patched


def run(model, **inputs):
    """(loss, logits, {parameter name: gradient}, aux loss) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, skip_logits=False) if getattr(model, "_horse_hf_patch", None) else model(**inputs)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.loss, out.logits, grads, out.aux_loss


def against_unpatched(family: str, dtype: torch.dtype, keep=None, **inputs):
    """Our patched model at dtype against the model at float64, with PyTorch's error (test_hf_apply.compare)
    the worse of the model's own runs at dtype: sdpa (gpt-oss: eager) with transformers' default experts
    (torch's grouped_mm), and eager attention with the experts' loop (eager: grouped_mm takes no float64);
    the aux loss too; keep selects the logits' positions that count (test_hf_apply.compare)."""
    model, patched = build(family)
    truth_model = copy.deepcopy(model).double()
    truth_model.set_experts_implementation("eager")
    truth = run(truth_model, **inputs)
    eager_model = copy.deepcopy(model).to(dtype)
    eager_model.set_attn_implementation("eager")
    eager_model.set_experts_implementation("eager")
    baselines = [run(model.to(dtype), **inputs), run(eager_model, **inputs)]
    actual = run(patched.to(dtype), **inputs)
    name = f"{family} {dtype}"
    compare(name, actual[:3], truth[:3], [b[:3] for b in baselines], inputs["labels"], keep)
    worse = max((b[3] for b in baselines), key=lambda aux: (aux.double() - truth[3]).abs().item())
    assert_close(f"{name} aux loss", actual[3], truth[3], worse)
    return patched


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_logits_aux_loss_and_every_gradient_match_unpatched_on_the_reference_path(
    family, reference_path
):
    ids, labels = batch()
    patched = against_unpatched(family, torch.float32, input_ids=ids, labels=labels)
    report = horse.hf.apply(patched)
    # Qwen2-MoE's second layer is dense (mlp_only_layers), its first one's shared expert a gated MLP
    moe_layers = 1 if family == "qwen2_moe" else 2
    assert report["moe_experts"] == [f"model.layers.{i}.mlp.experts" for i in range(moe_layers)]
    assert report["add_rms_norm"] == [f"model.layers.{i}" for i in range(2)]
    assert report["linear_cross_entropy"] == [""]
    dense = ["model.layers.0.mlp.shared_expert", "model.layers.1.mlp"] if family == "qwen2_moe" else None
    assert report.get("gated_mlp") == dense


@pytest.mark.interpreter
@pytest.mark.parametrize("family", FAMILIES)
def test_float16_triton_kernels_hold_flash_attns_accuracy_rule(family):
    ids, labels = batch(seqlen=8)
    against_unpatched(family, torch.float16, input_ids=ids, labels=labels)


def test_gpt_oss_right_padded_batch_matches_eager_where_tokens_are_real(reference_path):
    """Padding through the sinks' attention, the windowed layer, and the aux loss's mask (its padded tokens'
    router logits left out, as load_balancing_loss_func leaves them); on the right, as eager alone compares:
    at float64 a left pad's query sees no key there and turns to NaN."""
    ids, labels = batch(seqlen=12, rows=3)
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 3, 7)):
        mask[row, 12 - pads :] = 0
        labels[row, 12 - pads :] = -100
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    against_unpatched("gpt_oss", torch.float32, keep=mask.bool(), **inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_and_the_aux_loss_follow_output_router_logits(family, reference_path):
    """Off by the argument: no aux loss, the loss the cross-entropy alone. On (the config's): the router
    logits and the aux loss as the model's, in a tuple too."""
    model, patched = build(family)
    ids, labels = batch()
    ours = patched(input_ids=ids, labels=labels, output_router_logits=False, skip_logits=False)
    theirs = model(input_ids=ids, labels=labels, output_router_logits=False)
    assert ours.aux_loss is None and theirs.aux_loss is None and ours.router_logits is None
    torch.testing.assert_close(ours.loss, theirs.loss)
    ours, theirs = patched(input_ids=ids), model(input_ids=ids)
    assert len(ours.router_logits) == len(theirs.router_logits) == (1 if family == "qwen2_moe" else 2)
    for mine, their in zip(ours.router_logits, theirs.router_logits, strict=True):
        torch.testing.assert_close(mine, their)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss)
    as_tuple = patched(input_ids=ids, labels=labels, return_dict=False)
    torch.testing.assert_close(as_tuple[1], model(input_ids=ids, labels=labels).aux_loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_unpatched_token_for_token(family, reference_path):
    model, patched = build(family)
    model.eval(), patched.eval()
    # transformers' own generate fails with the aux loss on and a padding mask (the unpatched model too: its
    # load_balancing_loss_func pairs a decode step's router logits with the whole mask)
    model.config.output_router_logits = patched.config.output_router_logits = False
    ids = batch(seqlen=6, rows=2)[0]
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as generation pads
    options = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    for inputs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
        torch.testing.assert_close(
            patched.generate(**inputs, **options), model.generate(**inputs, **options), rtol=0, atol=0
        )


def refused(model, message: str) -> None:
    """apply refuses model with message, and leaves it as it was."""
    with pytest.raises(ValueError, match=message):
        horse.hf.apply(model)
    assert not hasattr(model, "_horse_hf_patch") and all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    "family, field, value, message",
    [
        ("qwen3_moe", "hidden_act", "tanh", r"mlp\.experts: activation Tanh, which moe_mlp lacks"),
        (
            "gpt_oss",
            "swiglu_alpha",
            1.5,
            r"mlp\.experts: swiglu_alpha 1\.5 \(moe_mlp's clamped SwiGLU has 1\.702\)",
        ),
    ],
)
def test_experts_the_kernel_cannot_run_are_refused(family, field, value, message):
    config = tiny_config(family)
    setattr(config, field, value)
    refused(unpatched(family, config), message)


def test_mxfp4_quantized_experts_are_refused_with_what_to_load_instead():
    """A checkpoint's quantization_config, and transformers' MXFP4 experts (packed uint8 blocks) where no
    quantization_config says so."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    model = unpatched("gpt_oss")
    model.config.quantization_config = {"quant_method": "mxfp4"}
    dequantize = r"Mxfp4Config\(dequantize=True\).*or a bfloat16 checkpoint"
    refused(model, rf"MXFP4-quantized experts \(quantization_config quant_method 'mxfp4'\).*{dequantize}")
    del model.config.quantization_config
    model.model.layers[1].mlp.experts = Mxfp4GptOssExperts(model.config)
    refused(model, rf"\(model\.layers\.1\.mlp\.experts\.gate_up_proj \(torch\.uint8\)\).*{dequantize}")


def test_gpt_oss_float32_norms_on_float16_activations_as_from_pretrained_keeps_them(
    monkeypatch, reference_path
):
    """from_pretrained keeps gpt-oss's norms' weights in float32 (_keep_in_fp32_modules) under 16-bit
    activations: its RMSNorm multiplies by the weight before the cast and gives float16, and the residual add
    before post_attention_layernorm is still fused (add_rms_norm), with the same results."""
    from horse.hf import forwards

    model, patched = build("gpt_oss")
    generator = torch.Generator().manual_seed(0)
    for m in (model, patched):
        m.half()
    for (name, theirs), ours in zip(model.named_parameters(), patched.parameters(), strict=True):
        if "norm" in name:
            weight = torch.randn(64, generator=generator)  # away from ones: the order of the casts shows
            theirs.data, ours.data = weight.clone(), weight.clone()
    fused = []
    monkeypatch.setattr(forwards, "add_rms_norm", lambda *a, **kw: fused.append(a) or add_rms_norm(*a, **kw))
    x, residual = (torch.randn(2, 5, 64, generator=generator).half() for _ in range(2))
    expected = model.model.norm(x)
    torch.testing.assert_close(patched.model.norm(x), expected)
    assert expected.dtype == torch.float16
    theirs, ours = model.model.layers[0], patched.model.layers[0]
    expected = (theirs.post_attention_layernorm(residual + x), residual + x)
    torch.testing.assert_close(forwards._add_rms_norm(ours.post_attention_layernorm, x, residual), expected)
    assert len(fused) == 1
