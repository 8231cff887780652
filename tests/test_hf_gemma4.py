"""horse.hf.apply on Gemma 4's text model (gemma4_text) against the same model unpatched on sdpa, as
tests/test_hf_apply.py does for the dense families (its accuracy rule and comparisons): loss, logits, every
gradient, padding on either side, greedy generation token for token. Two tiny models built from their configs:
a plain one, and one with everything Gemma 4 adds (the MoE block beside the MLP, per-layer inputs, layers
reusing earlier layers' keys and values, keys as values on the global layers); global_head_dim 32, and once
512 as in the released models (the kernels' limit)."""

import copy

import pytest
import torch
from test_hf_apply import INIT, VOCAB, batch, compare, run

transformers = pytest.importorskip("transformers")

import horse.hf  # noqa: E402

VARIANTS = ("plain", "moe_per_layer_shared_kv")


def tiny_config(variant: str, **overrides):
    """Hidden 64, 4 query heads over 2 key-value heads of 16 on the sliding layers (a window of 5, shorter
    than the tests' sequences), of 32 on the global ones, a final-logit softcap of 5 (the logits reach 8 to
    10).
    "plain": two layers (sliding, global), nothing else. "moe_per_layer_shared_kv": four layers, the last two
    reusing the first two's keys and values (num_kv_shared_layers), 4 experts of inter 32 with top 2 beside
    each MLP, per-layer inputs of 16, and the global layers' values their keys (attention_k_eq_v) over one
    key-value head."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "sliding_window": 5,
        "max_position_embeddings": 64,
        "final_logit_softcapping": 5.0,
        "initializer_range": INIT,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    variants = {
        "plain": {
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "hidden_size_per_layer_input": 0,
        },
        "moe_per_layer_shared_kv": {
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": VOCAB,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
        },
    }
    return transformers.Gemma4TextConfig(**(common | variants[variant] | overrides))


# What Gemma 4 initializes to ones, where a forward that dropped it would pass, by module class.
ONES = {
    "Gemma4RMSNorm": ("weight",),  # v_norm and the router's norm have none
    "Gemma4TextDecoderLayer": ("layer_scalar",),
    "Gemma4TextRouter": ("scale", "per_expert_scale"),
}


def build(variant: str, **overrides):
    """(sdpa model, patched deep copy), float32, from one seed, in training mode; what Gemma 4 initializes to
    ones (ONES) drawn from [0.5, 1.5) instead."""
    torch.manual_seed(0)
    config = tiny_config(variant, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for module in model.modules():
            for name in ONES.get(type(module).__name__, ()):
                if (tensor := getattr(module, name, None)) is not None:
                    tensor.uniform_(0.5, 1.5)
    model.train()
    patched = copy.deepcopy(model)
    horse.hf.apply(patched)
    return model, patched


def against_sdpa(variant: str, dtype: torch.dtype, keep=None, overrides=None, **inputs):
    """Our patched model at dtype against the model at float64 on sdpa, with PyTorch's error the worse of the
    model's own runs at dtype on sdpa and on eager (with the experts' loop: grouped_mm takes no float64);
    overrides: config fields for tiny_config."""
    model, patched = build(variant, **(overrides or {}))
    truth_model = copy.deepcopy(model).double()
    truth_model.set_experts_implementation("eager")
    truth = run(truth_model, **inputs)
    eager_model = copy.deepcopy(model).to(dtype)
    eager_model.set_attn_implementation("eager")
    eager_model.set_experts_implementation("eager")
    baselines = [run(copy.deepcopy(model).to(dtype), **inputs), run(eager_model, **inputs)]
    actual = run(patched.to(dtype), **inputs)
    compare(f"gemma4_text {variant} {dtype}", actual, truth, baselines, inputs["labels"], keep)
    return patched


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_loss_and_every_gradient_match_sdpa_on_the_reference_path(variant, reference_path):
    ids, labels = batch()
    patched = against_sdpa(variant, torch.float32, input_ids=ids, labels=labels)
    report = horse.hf.apply(patched)
    layers = [f"model.layers.{i}" for i in range(patched.config.num_hidden_layers)]
    assert report["attention"] == [f"{layer}.self_attn" for layer in layers]
    assert report["add_rms_norm"] == layers
    assert report["gated_mlp"] == [f"{layer}.mlp" for layer in layers]
    assert report["linear_cross_entropy"] == [""]
    # Per layer: the four sandwich norms and q_norm; k_norm and v_norm where the layer computes its own keys
    # and values; with the MoE block three more and the router's, with per-layer inputs one more (and the
    # model's per_layer_projection_norm); the final norm.
    if variant == "plain":
        assert report.get("moe_experts") is None
        assert len(report["rms_norm"]) == 2 * (4 + 1 + 2) + 1
    else:
        assert report["moe_experts"] == [f"{layer}.experts" for layer in layers]
        assert len(report["rms_norm"]) == 4 * (4 + 1 + 4 + 1) + 2 * 2 + 1 + 1


@pytest.mark.interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_float16_triton_kernels_hold_flash_attns_accuracy_rule(variant):
    ids, labels = batch(seqlen=8)
    against_sdpa(variant, torch.float16, input_ids=ids, labels=labels)


@pytest.mark.interpreter
def test_the_released_global_head_dim_runs_on_the_kernels():
    # 512, the released models' global_head_dim and the kernels' MAX_HEAD_DIM, float16 through the kernels.
    ids, labels = batch(seqlen=8)
    against_sdpa("plain", torch.float16, overrides={"global_head_dim": 512}, input_ids=ids, labels=labels)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_batches_match_sdpa_where_tokens_are_real(variant, side, reference_path):
    """The layers reusing keys and values take a 2-D padding mask too (the text model's cut of their rows,
    which slices 4-D masks, kept off by horse.hf.forwards)."""
    ids, labels = batch(seqlen=12, rows=3)
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 3, 7)):
        where = slice(0, pads) if side == "left" else slice(12 - pads, 12)
        mask[row, where] = 0
        labels[row, where] = -100
    against_sdpa(variant, torch.float32, keep=mask.bool(), input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_matches_sdpa_token_for_token(variant, reference_path):
    model, patched = build(variant)
    model.eval(), patched.eval()
    ids = batch(seqlen=6, rows=2)[0]
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as generation pads
    options = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    for inputs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
        torch.testing.assert_close(
            patched.generate(**inputs, **options), model.generate(**inputs, **options), rtol=0, atol=0
        )


@pytest.mark.parametrize("how", ["position_ids", "flash_attn_kwargs"])
def test_packed_documents_match_the_documents_run_apart(how, reference_path):
    _, patched = build("moe_per_layer_shared_kv")
    lengths = (5, 8, 3)
    documents = [batch(seqlen=n, rows=1, seed=i)[0] for i, n in enumerate(lengths)]
    items = sum(n - 1 for n in lengths)  # tokens predicted: all but each document's first
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=how == "flash_attn_kwargs")
    packed = collate([{"input_ids": d[0].tolist(), "labels": d[0].tolist()} for d in documents])
    loss, logits, grads = run(patched, **packed, num_items_in_batch=items)
    alone = [run(patched, input_ids=d, labels=d, num_items_in_batch=items) for d in documents]
    torch.testing.assert_close(loss, sum(a[0] for a in alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, torch.cat([a[1] for a in alone], dim=1), rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, sum(a[2][name] for a in alone), rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_recomputes_the_patched_layers(reference_path):
    """Each layer's per-layer input reaches the recomputation as the forward's (a positional argument)."""
    _, patched = build("moe_per_layer_shared_kv")
    ids, labels = batch()
    expected = run(patched, input_ids=ids, labels=labels)
    calls = []
    patched.model.layers[3].self_attn.register_forward_pre_hook(lambda *args: calls.append(args))
    patched.activation_checkpointing_enable()
    got = run(patched, input_ids=ids, labels=labels)
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gemma4s_rms_norm_multiplies_before_the_cast_and_some_have_no_weight(reference_path):
    """A float32 weight on float16 activations: Gemma 4's RMSNorm multiplies in float32 before the cast to
    float16 (as OLMo-2's, without Gemma's 1 + weight); v_norm and the router's norm have no weight."""
    model, patched = build("moe_per_layer_shared_kv")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight = torch.randn(64, generator=generator)
        model.model.norm.weight.copy_(weight), patched.model.norm.weight.copy_(weight)
    x = torch.randn(3, 5, 64, generator=generator).half()
    expected, got = model.model.norm(x), patched.model.norm(x)
    assert got.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(got, expected)
    for name in ("model.layers.0.self_attn.v_norm", "model.layers.0.router.norm"):
        theirs, ours = model.get_submodule(name), patched.get_submodule(name)
        assert not hasattr(ours, "weight") and "forward" in ours.__dict__
        torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"use_bidirectional_attention": "all"}, "bidirectional attention"),
        ({"hidden_activation": "tanh"}, r"mlp: activation Tanh"),
        ({"hidden_activation": "gelu"}, r"experts: activation GELUActivation, which moe_mlp lacks"),
    ],
)
def test_configs_the_kernels_cannot_run_exactly_are_refused(overrides, message):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("moe_per_layer_shared_kv", **overrides))
    with pytest.raises(ValueError, match=message):
        horse.hf.apply(model)
    assert not hasattr(model, "_horse_hf_patch") and all("forward" not in m.__dict__ for m in model.modules())


def test_global_layers_above_the_kernels_head_dim_are_refused_by_name(monkeypatch):
    """Gemma 4's global layers have a head dim of their own (global_head_dim, 512 in the released models):
    refused by layer when it is above what the kernels take (here 16 stands in for the kernels' limit)."""
    monkeypatch.setattr("horse.hf.patch.MAX_HEAD_DIM", 16)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("plain"))
    refusal = r"model\.layers\.1\.self_attn: head_dim 32 \(the kernels take up to 16\)"
    with pytest.raises(ValueError, match=refusal):
        horse.hf.apply(model)
