"""horse.hf.apply: our kernels inside transformers' own models, against the same models unpatched.

Tiny random models of each family built in code. Most tests run the float32 reference path (the kernels'
plain-PyTorch twins: ``runtime.INTERPRET`` off), where only the order of operations differs from eager; the
float16 tests run the Triton kernels in the interpreter. Both hold the suite's accuracy rule
(``helpers.assert_close``): our error against the model in float64 at most twice the unpatched model's own
error at the same precision (the worse of eager's and sdpa's, see :func:`compare`), plus a floor. Packed
batches are compared with their documents run apart (eager attends across documents when a mask is given).
"""

import copy
import json

import pytest
import torch
from helpers import assert_close

transformers = pytest.importorskip("transformers")

import horse.hf  # noqa: E402

VOCAB = 96
# Families with what the others lack (fused projections, multipliers, windows on some layers only, layers
# without rotary, post-norms): every test that runs per family runs each of them.
QUIRKY = ("phi3", "granite", "ministral", "smollm3", "olmo2", "glm4", "gemma", "gemma2", "gemma3_text")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", *QUIRKY)
# Weights 10x transformers' default spread: activations of order 1, where the activation functions differ
# (at the default 0.02, gelu and its tanh approximation agree to 1e-7 and a swap of them would pass).
INIT = 0.2


def tiny_config(family: str, **overrides):
    """A two-layer model of family: hidden 64, 4 query heads over 2 key-value heads (GQA) where the family
    has them, a sliding window of 5 (shorter than the tests' sequences) for Mistral, Qwen2 and Phi-3, and on
    the first layer only for Ministral, SmolLM3 and Gemma 3 (SmolLM3's second layer has no rotary, NoPE), and
    of 8 for Gemma 2 (eager alone compares it: a right pad's query still sees a real key); Granite's four
    multipliers away from 1; Gemma 2's caps where they bite (its scaled attention scores reach ±9 with
    query_pre_attn_scalar 16, a cap of 2; its logits ±10, a cap of 5)."""
    llama_like = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    configs = {
        "llama": lambda: transformers.LlamaConfig(**llama_like),
        "mistral": lambda: transformers.MistralConfig(**llama_like, sliding_window=5),
        "qwen2": lambda: transformers.Qwen2Config(
            **llama_like, use_sliding_window=True, sliding_window=5, max_window_layers=0
        ),
        "qwen3": lambda: transformers.Qwen3Config(**llama_like, head_dim=16),
        "phi3": lambda: transformers.Phi3Config(**llama_like, sliding_window=5),
        "granite": lambda: transformers.GraniteConfig(
            **llama_like,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            embedding_multiplier=3.0,
            logits_scaling=3.0,
        ),
        "ministral": lambda: transformers.MinistralConfig(
            **llama_like, head_dim=16, sliding_window=5, layer_types=["sliding_attention", "full_attention"]
        ),
        "smollm3": lambda: transformers.SmolLM3Config(
            **llama_like,
            use_sliding_window=True,
            sliding_window=5,
            no_rope_layers=[1, 0],
            layer_types=["sliding_attention", "full_attention"],
        ),
        "olmo2": lambda: transformers.Olmo2Config(**llama_like),
        "glm4": lambda: transformers.Glm4Config(**llama_like, head_dim=16),
        "gemma": lambda: transformers.GemmaConfig(**llama_like, head_dim=16),
        "gemma2": lambda: transformers.Gemma2Config(
            **llama_like,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(
            **llama_like, head_dim=16, sliding_window=5, layer_types=["sliding_attention", "full_attention"]
        ),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),  # fmt: skip
    }
    config = configs[family]()
    config.initializer_range = INIT
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def eager_model(family: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(family, **overrides)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def build(family: str, **overrides):
    """(eager model, patched deep copy), float32, from one seed, in training mode."""
    model = eager_model(family, **overrides)
    model.train()
    patched = copy.deepcopy(model)
    horse.hf.apply(patched)
    return model, patched


def batch(seqlen: int = 12, rows: int = 2, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seqlen), generator=generator)
    labels = ids.clone()
    labels[:, : seqlen // 4] = -100  # a prompt whose tokens are not predicted
    return ids, labels


def run(model, dtype=None, **inputs):
    """(loss, logits, {parameter name: gradient}) of one forward and backward with the logits asked for."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, skip_logits=False) if getattr(model, "_horse_hf_patch", None) else model(**inputs)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.loss, out.logits, grads


def token_losses(logits, labels):
    """The terms of transformers' causal LM loss, token by token, in float64 (0 where a label is ignored)."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    rows = logits.double().flatten(0, 1)
    return torch.nn.functional.cross_entropy(rows, shifted.flatten(), reduction="none")


def compare(name, actual, truth, baselines, labels, keep=None):
    """assert_close over (loss, logits, gradients); keep selects the logits' positions that count.

    PyTorch's error at the same precision is the worse of its runs in baselines (eager, sdpa): at these
    sizes one run's worst element is luck (GLM-4's float16 gate_up_proj gradient, batch seed 1: eager 8.9e-4
    off, sdpa 1.2e-3, ours 1.9e-3, ours with eager's attention 2.6e-3). The loss is a mean over tokens,
    where one model's errors may cancel by luck (llama's float16 loss, batch seed 2: ours 1.5e-3 off,
    eager's 1.2e-4), so PyTorch's error for it is the worst token's."""
    loss, logits, grads = actual
    loss_64, logits_64, grads_64 = truth

    def check(what, ours, exact, theirs):
        worse = max(theirs, key=lambda baseline: (baseline.double() - exact).abs().max())
        assert_close(f"{name} {what}", ours, exact, worse)

    tokens_64 = token_losses(logits_64, labels)
    worst_token = max((token_losses(b[1], labels) - tokens_64).abs().max() for b in baselines)
    assert_close(f"{name} loss", loss.float(), loss_64, (loss_64 + worst_token).float())
    keep = slice(None) if keep is None else keep
    check("logits", logits[keep], logits_64[keep], [b[1][keep] for b in baselines])
    assert grads.keys() == grads_64.keys(), sorted(grads.keys() ^ grads_64.keys())
    for param in grads:
        check(f"grad {param}", grads[param], grads_64[param], [b[2][param] for b in baselines])


# Families transformers runs on eager attention only (Gemma 2: "sdpa does not support softcapping").
EAGER_ONLY = ("gemma2",)


def against_eager(family: str, dtype: torch.dtype, keep=None, overrides=None, **inputs):
    """Our patched model against the model at float64 on the same inputs, with eager and sdpa at dtype as
    PyTorch's error; overrides: config fields for tiny_config. The float64 model runs sdpa: eager's softmax is
    float32 whatever the inputs, where float64's mask minimum becomes -inf and a padding query that sees no
    key turns to NaN. A family of EAGER_ONLY has eager alone, at float64 too (so padded on the right)."""
    model, patched = build(family, **(overrides or {}))
    eager_only = family in EAGER_ONLY
    truth_model = copy.deepcopy(model).double()
    if not eager_only:
        truth_model.set_attn_implementation("sdpa")
    truth = run(truth_model, **inputs)
    baselines = [run(copy.deepcopy(model).to(dtype), **inputs)]
    if not eager_only:
        sdpa_model = copy.deepcopy(model).to(dtype)
        sdpa_model.set_attn_implementation("sdpa")
        baselines.append(run(sdpa_model, **inputs))
    actual = run(patched.to(dtype), **inputs)
    compare(f"{family} {dtype}", actual, truth, baselines, inputs["labels"], keep)
    return patched


# ----------------------------------------------------------------------------------------------
# Against eager, family by family
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_every_gradient_match_eager_on_the_reference_path(family, reference_path):
    ids, labels = batch()
    patched = against_eager(family, torch.float32, input_ids=ids, labels=labels)
    report = horse.hf.apply(patched)  # applied already: the same report, nothing changed
    layers = [f"{'transformer.h' if family == 'gpt2' else 'model.layers'}.{i}" for i in range(2)]
    attention = "attn" if family == "gpt2" else "self_attn"
    assert report["attention"] == [f"{layer}.{attention}" for layer in layers]
    # OLMo-2's layer normalizes each branch before its add, and no norm follows the add: nothing to fuse.
    assert report.get("add_layer_norm" if family == "gpt2" else "add_rms_norm") == (
        None if family == "olmo2" else layers
    )
    assert report["linear_cross_entropy"] == [""]
    # two a layer and the final one; two more a layer: Qwen3's and OLMo-2's q/k norms, GLM-4's sandwich norms;
    # two more a layer for Gemma 2 (sandwich norms), four for Gemma 3 (q/k norms, sandwich norms)
    more = {"qwen3": 2, "olmo2": 2, "glm4": 2, "gemma2": 2, "gemma3_text": 4}.get(family, 0)
    norms = 2 * 2 + 1 + more * 2
    assert len(report["layer_norm" if family == "gpt2" else "rms_norm"]) == norms


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["llama", "gpt2", *QUIRKY])
def test_float16_triton_kernels_hold_flash_attns_accuracy_rule(family):
    ids, labels = batch(seqlen=8)
    against_eager(family, torch.float16, input_ids=ids, labels=labels)


@pytest.mark.interpreter
def test_head_dims_up_to_the_kernels_limit_run_on_the_kernels():
    # 512, the kernels' MAX_HEAD_DIM (Gemma 4's global layers), GQA, float16 through the kernels.
    ids, labels = batch(seqlen=8)
    overrides = {"head_dim": 512, "num_attention_heads": 2, "num_key_value_heads": 1}
    against_eager("llama", torch.float16, overrides=overrides, input_ids=ids, labels=labels)


# The tiny Gemma 3's logits reach about ±10 (median 1): a cap of 5 bends the large ones by half.
SOFTCAP = {"final_logit_softcapping": 5.0}


def test_final_logit_softcapping_matches_eager_on_the_reference_path(reference_path):
    """Gemma 3 with final_logit_softcapping: the logits returned softcapped, the loss softcapped inside the
    fused loss, from the logits (evaluation) and from the hidden states (training), every gradient."""
    ids, labels = batch()
    patched = against_eager("gemma3_text", torch.float32, overrides=SOFTCAP, input_ids=ids, labels=labels)
    uncapped = eager_model("gemma3_text")(input_ids=ids).logits
    assert uncapped.abs().max() > 1.5 * SOFTCAP["final_logit_softcapping"]  # the cap bites
    model = eager_model("gemma3_text", **SOFTCAP).train()
    expected = run(model, input_ids=ids, labels=labels)
    patched.zero_grad(set_to_none=True)
    fused = patched(input_ids=ids, labels=labels)
    assert fused.logits is None  # training: linear_cross_entropy with the softcap, no logits
    fused.loss.backward()
    torch.testing.assert_close(fused.loss, expected[0], rtol=1e-5, atol=1e-6)
    for name, p in patched.named_parameters():
        torch.testing.assert_close(p.grad, expected[2][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.interpreter
def test_final_logit_softcapping_in_float16_holds_flash_attns_accuracy_rule():
    ids, labels = batch(seqlen=8)
    against_eager("gemma3_text", torch.float16, overrides=SOFTCAP, input_ids=ids, labels=labels)


def test_gemma3_with_attn_logit_softcapping_runs_uncapped_as_transformers_runs_it(reference_path):
    """transformers' Gemma 3 (5.25) reads attn_logit_softcapping into its attention module but never passes it
    to the attention function (eager, sdpa or ours): set, it changes nothing there, and nothing here."""
    ids, labels = batch()
    overrides = {"attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 16}  # would bend every score
    patched = against_eager("gemma3_text", torch.float32, overrides=overrides, input_ids=ids, labels=labels)
    uncapped = eager_model("gemma3_text", query_pre_attn_scalar=16).eval()
    torch.testing.assert_close(patched.eval()(input_ids=ids).logits, uncapped(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma"])
def test_rms_norm_keeps_its_familys_cast_order(family, reference_path):
    """A float32 weight on float16 activations: LLaMA's RMSNorm multiplies after the cast to float16 and gives
    float32, OLMo-2's and Gemma's (1 + weight) multiply before it and give float16 (in one dtype the two
    orders differ by a rounding the accuracy rule cannot see)."""
    model, patched = build(family)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from Gemma's zeros: its 1 + weight must be added in float32
        weight = torch.randn(64, generator=generator)
        model.model.norm.weight.copy_(weight), patched.model.norm.weight.copy_(weight)
    x = torch.randn(3, 5, 64, generator=generator).half()
    expected, got = model.model.norm(x), patched.model.norm(x)
    assert got.dtype == expected.dtype == (torch.float32 if family == "llama" else torch.float16)
    torch.testing.assert_close(got, expected)


def test_the_training_loss_skips_the_logits_and_matches_the_loss_with_them(reference_path):
    model, patched = build("llama")
    ids, labels = batch()
    fused = patched(input_ids=ids, labels=labels)
    assert fused.logits is None  # training with labels: linear_cross_entropy, no logits
    fused.loss.backward()
    fused_grads = [p.grad.clone() for p in patched.parameters()]
    patched.zero_grad()
    with_logits = patched(input_ids=ids, labels=labels, skip_logits=False)
    with_logits.loss.backward()
    torch.testing.assert_close(fused.loss, with_logits.loss)
    for fused_grad, p in zip(fused_grads, patched.parameters(), strict=True):
        torch.testing.assert_close(fused_grad, p.grad)
    patched.eval()
    assert patched(input_ids=ids, labels=labels).logits is not None  # evaluation keeps them
    assert patched(input_ids=ids).loss is None


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["llama", *QUIRKY])
def test_padded_batches_match_eager_where_tokens_are_real(family, side, reference_path):
    if family in EAGER_ONLY and side == "left":
        pytest.skip("eager alone at float64: a left pad's query sees no key there and turns to NaN")
    ids, labels = batch(seqlen=12, rows=3)
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 3, 7)):
        where = slice(0, pads) if side == "left" else slice(12 - pads, 12)
        mask[row, where] = 0
        labels[row, where] = -100
    against_eager(family, torch.float32, keep=mask.bool(), input_ids=ids, attention_mask=mask, labels=labels)


def test_sliding_window_with_padding_matches_eager(reference_path):
    ids, labels = batch(seqlen=12, rows=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels[1, :4] = -100
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    against_eager("mistral", torch.float32, keep=mask.bool(), **inputs)


@pytest.mark.parametrize("how", ["position_ids", "flash_attn_kwargs"])
@pytest.mark.parametrize("family", ["qwen2", "gpt2", *QUIRKY])
def test_packed_documents_match_the_documents_run_apart(family, how, reference_path):
    _, patched = build(family)
    lengths = (5, 8, 3)
    documents = [batch(seqlen=n, rows=1, seed=i)[0] for i, n in enumerate(lengths)]
    labels = [d.clone() for d in documents]
    items = sum(n - 1 for n in lengths)  # tokens predicted: all but each document's first
    # DataCollatorWithFlattening's batch: one row, labels -100 at each document's first token.
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=how == "flash_attn_kwargs")
    pairs = list(zip(documents, labels, strict=True))
    packed = collate([{"input_ids": d[0].tolist(), "labels": y[0].tolist()} for d, y in pairs])
    loss, logits, grads = run(patched, **packed, num_items_in_batch=items)
    alone = [run(patched, input_ids=d, labels=y, num_items_in_batch=items) for d, y in pairs]
    torch.testing.assert_close(loss, sum(a[0] for a in alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, torch.cat([a[1] for a in alone], dim=1), rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, sum(a[2][name] for a in alone), rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["llama", "gpt2", "glm4"])
def test_gradient_checkpointing_recomputes_the_patched_layers(family, reference_path):
    """activation_checkpointing_enable() (gradient checkpointing) checkpoints the layers our forwards
    replace (each attention runs again in the backward), with the gradients of the run without it."""
    _, patched = build(family)
    ids, labels = batch()
    expected = run(patched, input_ids=ids, labels=labels)
    calls = []
    attention = patched.transformer.h[0].attn if family == "gpt2" else patched.model.layers[0].self_attn
    attention.register_forward_pre_hook(lambda *args: calls.append(args))
    patched.activation_checkpointing_enable()
    got = run(patched, input_ids=ids, labels=labels)
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gradient_accumulation_matches_one_full_batch(reference_path):
    """Two micro-batches with num_items_in_batch (Trainer's accumulation) sum to the full batch's mean loss
    and gradients, as eager's do."""
    model, patched = build("llama")
    ids, labels = batch(rows=4)
    labels[0, 5:] = -100  # uneven counts: a mean per micro-batch would weigh them wrong
    items = int((labels[:, 1:] != -100).sum())
    full_loss, _, full_grads = run(patched, input_ids=ids, labels=labels)
    for m in (patched, model):
        m.zero_grad()
        total = 0.0
        for half in (slice(0, 1), slice(1, 4)):
            out = m(input_ids=ids[half], labels=labels[half], num_items_in_batch=torch.tensor(items))
            out.loss.backward()
            total += out.loss.item()
        assert total == pytest.approx(full_loss.item(), rel=1e-5)
        for name, p in m.named_parameters():
            torch.testing.assert_close(p.grad, full_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_shift_labels_and_ignore_index_as_transformers_takes_them(reference_path):
    model, patched = build("qwen3")
    ids, labels = batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shifted[0, 3:6] = 7  # labels the shift alone would not give
    sevens = ids.clone()
    sevens[:, ::3] = 7  # ignored with ignore_index=7
    every_label_ignored = torch.full_like(labels, -100)  # transformers' mean over no tokens: NaN
    cases = (
        {"labels": labels, "shift_labels": shifted},
        {"labels": sevens, "ignore_index": 7},
        {"labels": every_label_ignored},
    )
    for kwargs in cases:
        expected = model(input_ids=ids, **kwargs).loss
        torch.testing.assert_close(patched(input_ids=ids, **kwargs).loss, expected, equal_nan=True)


@pytest.mark.parametrize("family", ["mistral", "gpt2", *QUIRKY])
def test_greedy_generation_matches_eager_token_for_token(family, reference_path):
    model, patched = build(family)
    model.eval(), patched.eval()
    ids = batch(seqlen=6, rows=2)[0]
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as generation pads
    options = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    for inputs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
        torch.testing.assert_close(patched.generate(**inputs, **options), model.generate(**inputs, **options),
                                   rtol=0, atol=0)  # fmt: skip


def test_decode_steps_use_the_kvcache_kernel(monkeypatch, reference_path):
    calls = []
    original = horse.hf.attention.flash_attention_with_kvcache
    monkeypatch.setattr(horse.hf.attention, "flash_attention_with_kvcache",
                        lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))  # fmt: skip
    _, patched = build("llama")
    patched.eval()
    patched.generate(batch(seqlen=5, rows=1)[0], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert calls == [torch.Size([1, 1, 4, 16])] * 2 * 2  # 2 decode steps after the prompt, 2 layers each


# ----------------------------------------------------------------------------------------------
# apply and unapply leave the model's parameters and files alone
# ----------------------------------------------------------------------------------------------


def test_apply_keeps_parameters_and_unapply_restores_the_forwards_bit_for_bit(tmp_path, reference_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    ids, labels = batch()
    before = model(input_ids=ids, labels=labels)
    params = {name: id(p) for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.save_pretrained(tmp_path / "before")

    report = horse.hf.apply(model)
    assert model.config._attn_implementation == "horse"
    assert {name: id(p) for name, p in model.named_parameters()} == params
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path / "after")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "before" / name).read_bytes() == (tmp_path / "after" / name).read_bytes(), name
    assert json.loads((tmp_path / "after" / "config.json").read_text()).get("attn_implementation") is None
    patched = {name: p.detach().clone() for name, p in model.named_parameters()}
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()  # the optimizer made before apply steps the model's own tensors
    assert all(not torch.equal(p, patched[name]) for name, p in model.named_parameters())
    assert horse.hf.apply(model) is report

    horse.hf.unapply(model)
    assert model.config._attn_implementation == "sdpa"
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not hasattr(model, "_horse_hf_patch")
    torch.manual_seed(0)
    fresh = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    fresh.load_state_dict(model.state_dict())
    got, expected = model(input_ids=ids, labels=labels), fresh(input_ids=ids, labels=labels)
    torch.testing.assert_close((got.loss, got.logits), (expected.loss, expected.logits), rtol=0, atol=0)
    horse.hf.unapply(model)  # not patched: nothing to do
    assert before.loss.isfinite()


def test_attn_implementation_horse_and_auto_horse_load_a_saved_model(tmp_path, reference_path):
    model, patched = build("qwen3")
    model.save_pretrained(tmp_path)
    horse.hf.register()
    by_name = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="horse")
    loaded = horse.hf.AutoHorseForCausalLM.from_pretrained(tmp_path)
    assert by_name.config._attn_implementation == loaded.config._attn_implementation == "horse"
    ids = batch()[0]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # the mask function registered with the attention: padding reaches it
    expected = patched.eval()(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    for m in (by_name, loaded):
        torch.testing.assert_close(m(input_ids=ids, attention_mask=mask).logits[mask.bool()], expected)


@pytest.mark.parametrize("family", ["llama", "granite", "gemma2"])
def test_trainer_runs_three_steps_with_the_unpatched_losses(family, tmp_path, reference_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(3, VOCAB, (12, 10), generator=generator)
    data = [{"input_ids": ids, "labels": ids} for ids in rows]
    losses = {}
    for patch in (False, True):
        model = eager_model(family)
        if patch:
            horse.hf.apply(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(patch)),
            max_steps=3,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert trainer.model_accepts_loss_kwargs  # num_items_in_batch reaches the fused loss
        losses[patch] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses[True]) == 3 and all(torch.isfinite(torch.tensor(losses[True])))
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def gpt_oss_config():
    """A two-layer gpt-oss: a sliding window of 5 on the first layer, biased projections, 4 experts."""
    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=INIT,
        pad_token_id=0,
    )


def test_gpt_oss_attention_with_its_sinks_matches_eager_on_the_reference_path(reference_path):
    """gpt-oss's attention (sinks as the kernels' sinks=, a window on one layer, GQA, biased projections) on
    "horse" alone, the rest as transformers runs it (apply on the whole model: tests/test_hf_moe.py): loss,
    logits, every gradient (the sinks' included) against eager, the sinks large enough to take a good part of
    each softmax; greedy generation token for token."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        gpt_oss_config(),
        attn_implementation="eager",
        experts_implementation="eager",  # float64 too
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, 4))
    ids, labels = batch()
    horse.hf.register()
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("horse")
    truth_model = copy.deepcopy(model).double()
    truth, baseline, actual = (run(m, input_ids=ids, labels=labels) for m in (truth_model, model, ours))
    assert "model.layers.0.self_attn.sinks" in actual[2]
    compare("gpt_oss float32", actual, truth, [baseline], labels)
    model.eval(), ours.eval()  # greedy generation: the decode steps' kernel with the sinks too
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    torch.testing.assert_close(
        ours.generate(ids[:1, :6], **options), model.generate(ids[:1, :6], **options), rtol=0, atol=0
    )


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------


def test_an_unsupported_model_type_is_refused_by_name():
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"'gpt_neox'.*llama, mistral, qwen2, qwen3, gpt2, phi3, granite"):
        horse.hf.apply(model)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        horse.hf.apply(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("llama", {"head_dim": 576, "num_attention_heads": 1, "num_key_value_heads": 1}, "head_dim 576"),
        ("llama", {"mlp_bias": True}, "MLP biases"),
        ("llama", {"hidden_act": "tanh"}, "activation Tanh"),
        ("gpt2", {"add_cross_attention": True}, "cross-attention"),
        ("phi3", {"hidden_act": "tanh"}, "activation Tanh"),
        ("granite", {"mlp_bias": True}, "MLP biases"),
        ("glm4", {"head_dim": 576, "num_attention_heads": 1, "num_key_value_heads": 1}, "head_dim 576"),
        ("gemma", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("gemma", {"hidden_act": "tanh"}, "activation Tanh"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
    ],
)  # fmt: skip
def test_configs_the_kernels_cannot_run_exactly_are_refused(family, overrides, message):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with pytest.raises(ValueError, match=message):
        horse.hf.apply(model)
    assert not hasattr(model, "_horse_hf_patch") and all("forward" not in m.__dict__ for m in model.modules())


def test_a_head_with_more_classes_than_the_loss_takes_is_refused(monkeypatch):
    monkeypatch.setattr("horse.hf.patch.MAX_VOCAB", VOCAB - 1)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gemma3_text"))
    with pytest.raises(ValueError, match=rf"a vocabulary of {VOCAB} \(the loss takes up to {VOCAB - 1}\)"):
        horse.hf.apply(model)


def test_gemma3s_vocabulary_goes_through_the_loss(reference_path):
    """A real Gemma 3's 262,208 classes, above the loss's limit before issue 49 raised it."""
    model, patched = build("gemma3_text", vocab_size=262_208)
    ids, labels = batch()
    fused = patched(input_ids=ids, labels=labels)
    assert fused.logits is None  # training: the fused loss, from the hidden states
    torch.testing.assert_close(fused.loss, model(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-5)


def test_quantized_and_wrapped_layers_are_refused_by_name(reference_path):
    class LoraLike(torch.nn.Linear):  # stands in for PEFT's and bitsandbytes' subclasses
        pass

    model = build("llama")[0]
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quantized"):
        horse.hf.apply(model)
    del model.config.quantization_config
    model.model.layers[1].mlp.up_proj.__class__ = LoraLike
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj \(.*LoraLike\)"):
        horse.hf.apply(model)
    model.model.layers[1].mlp.up_proj.__class__ = torch.nn.Linear
    horse.hf.apply(model)
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *args: None)  # after apply: at the call
    with pytest.raises(TypeError, match=r"down_proj \(has forward hooks\)"):
        model(input_ids=batch()[0])


def test_what_the_fused_attention_cannot_do_is_refused_at_the_call(reference_path):
    model, patched = build("gpt2", attn_pdrop=0.1)
    ids, labels = batch()
    with pytest.raises(ValueError, match=r"attention dropout 0\.1.*attn_pdrop=0\.0"):
        patched(input_ids=ids, labels=labels)
    patched.eval()  # no dropout in evaluation
    patched(input_ids=ids)
    with pytest.raises(ValueError, match="output_attentions"):
        patched(input_ids=ids, output_attentions=True)
    _, llama = build("llama")
    with pytest.raises(ValueError, match="output_attentions"):
        llama(input_ids=ids, output_attentions=True)
    with pytest.raises(ValueError, match="4-D attention mask"):
        llama(input_ids=ids, attention_mask=torch.zeros(2, 1, 12, 12))


@pytest.mark.interpreter
def test_float32_activations_on_the_triton_path_are_refused():
    _, patched = build("llama")
    with pytest.raises(TypeError, match=r"float32 activations.*torch_dtype=torch\.bfloat16"):
        patched(input_ids=batch()[0])
