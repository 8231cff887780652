"""horse.hf.apply on the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against the same
models unpatched, as tests/test_hf_apply.py does for the dense ones (its accuracy rule and comparisons):
loss, logits, every gradient (the experts' packed weights, the routers', Qwen2-MoE's shared expert and its
gate), the load-balancing aux loss, and greedy generation token for token."""

import copy

import pytest
import torch
from helpers import assert_close
from test_hf_apply import INIT, VOCAB, batch, compare

transformers = pytest.importorskip("transformers")

import horse.hf  # noqa: E402
from horse.kernels import runtime  # noqa: E402

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def tiny_config(family: str):
    """A two-layer model of family, hidden 64, 4 query heads over 2 key-value heads, 8 experts of inter 32
    (Mixtral: 4 of inter 48) with top 2, the router logits and their aux loss on (coefficient 0.1, so that
    it counts in the loss); Qwen2-MoE with a shared expert of inter 48, its second layer dense
    (mlp_only_layers), Qwen3-MoE with the top-k weights renormalized."""
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
    config = configs[family]()
    config.initializer_range = INIT
    return config


def build(family: str):
    """(sdpa model, patched deep copy), float32, from one seed, in training mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")
    model.train()
    patched = copy.deepcopy(model)
    horse.hf.apply(patched)
    return model, patched


@pytest.fixture
def reference_path(monkeypatch):
    """CPU tensors take the kernels' float32 references, as they do without TRITON_INTERPRET."""
    monkeypatch.setattr(runtime, "INTERPRET", False)


def run(model, **inputs):
    """(loss, logits, {parameter name: gradient}, aux loss) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, skip_logits=False) if getattr(model, "_horse_hf_patch", None) else model(**inputs)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.loss, out.logits, grads, out.aux_loss


def against_sdpa(family: str, dtype: torch.dtype, **inputs):
    """Our patched model at dtype against the model at float64, with PyTorch's error (test_hf_apply.compare)
    the worse of the model's own runs at dtype: sdpa with transformers' default experts (torch's grouped_mm),
    and eager attention with the experts' loop (eager: grouped_mm takes no float64); the aux loss too."""
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
    compare(name, actual[:3], truth[:3], [b[:3] for b in baselines], inputs["labels"])
    worse = max((b[3] for b in baselines), key=lambda aux: (aux.double() - truth[3]).abs().item())
    assert_close(f"{name} aux loss", actual[3], truth[3], worse)
    return patched


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_logits_aux_loss_and_every_gradient_match_sdpa_on_the_reference_path(family, reference_path):
    ids, labels = batch()
    patched = against_sdpa(family, torch.float32, input_ids=ids, labels=labels)
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
    against_sdpa(family, torch.float16, input_ids=ids, labels=labels)


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
def test_greedy_generation_matches_sdpa_token_for_token(family, reference_path):
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


def test_experts_the_kernel_cannot_run_are_refused():
    torch.manual_seed(0)
    config = tiny_config("qwen3_moe")
    config.hidden_act = "tanh"
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"mlp\.experts: activation Tanh, which moe_mlp lacks"):
        horse.hf.apply(model)
    assert not hasattr(model, "_horse_hf_patch") and all("forward" not in m.__dict__ for m in model.modules())
