"""horse.model: the two backends agree, the KV cache matches the full forward, and the helpers count right."""

import dataclasses
import math

import pytest
import torch

from horse import kernels
from horse.layers import FusedLayerNorm, FusedRMSNorm
from horse.model import GPT, GPTConfig, KVCache, causal_attention, num_params, preset

# Tiny shapes: the Triton backend runs in the interpreter here.
SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
VARIANTS = {
    "gpt2": SMALL,
    "llama-like": dataclasses.replace(
        SMALL, norm="rmsnorm", mlp="swiglu", positions="rotary", n_kv_heads=2, bias=False
    ),
    "sliding-window": dataclasses.replace(SMALL, positions="rotary", n_kv_heads=2, attn_window=4),
}


def _pair(config: GPTConfig, device: str) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    reference = GPT(config, "reference").to(device)
    with torch.no_grad():  # move the norms off their ones/zeros init, so that their weights matter
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    triton = GPT(config, "triton").to(device)
    triton.load_state_dict(reference.state_dict())
    return reference, triton


def _count_calls(monkeypatch, names: list[str]) -> dict[str, int]:
    """Count the calls of these kernels functions (the model looks them up at call time)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(kernels, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_backends_agree_forward_and_gradients(variant, precision, device, monkeypatch):
    config = VARIANTS[variant]
    reference, triton = _pair(config, device)
    mlp_kernel = "fused_gated_mlp" if config.mlp == "swiglu" else "fused_mlp"
    calls = _count_calls(monkeypatch, ["flash_attention", mlp_kernel])
    assert any(isinstance(m, (FusedLayerNorm, FusedRMSNorm)) for m in triton.modules())
    assert not any(isinstance(m, (FusedLayerNorm, FusedRMSNorm)) for m in reference.modules())
    idx = torch.randint(0, config.vocab_size, (2, 11), device=device)
    targets = torch.randint(0, config.vocab_size, (2, 11), device=device)
    tol = {"fp32": 1e-5, "fp16": 1e-2}[precision]
    results = []
    for model in (reference, triton):
        with torch.autocast(device, torch.float16, enabled=precision == "fp16"):
            logits = model(idx)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        results.append((logits.float(), {n: p.grad for n, p in model.named_parameters()}))
    (logits_ref, grads_ref), (logits, grads) = results
    # fp16 runs every block's attention and MLP on the kernels; fp32 keeps them on torch.
    expected = config.n_layer if precision == "fp16" else 0
    assert calls == {"flash_attention": expected, mlp_kernel: expected}
    torch.testing.assert_close(logits, logits_ref, rtol=tol, atol=tol)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        scale = max(1.0, grads_ref[name].abs().max().item())
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=tol, atol=tol * scale, msg=name)


def test_state_dicts_are_the_same_on_both_backends():
    for config in VARIANTS.values():
        reference, triton = GPT(config, "reference"), GPT(config, "triton")
        assert {k: v.shape for k, v in reference.state_dict().items()} == {
            k: v.shape for k, v in triton.state_dict().items()
        }
        reference.load_state_dict(triton.state_dict())


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_cache_matches_the_full_forward(variant):
    config = VARIANTS[variant]
    torch.manual_seed(0)
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(config)
        # A prefill, a chunk of several new tokens (the bottom-right mask), then one at a time.
        parts = [model(idx[:, :5], cache), model(idx[:, 5:9], cache)]
        parts += [model(idx[:, i : i + 1], cache) for i in range(9, 12)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_cache_on_the_kernels_decodes_in_place_like_the_full_forward(variant, device, monkeypatch):
    # fp16 on the triton backend: the cached steps run flash_attention_with_kvcache, whose in-place
    # appends must leave the cache as the full forward's keys, and whose outputs match it.
    config = VARIANTS[variant]
    _, model = _pair(config, device)
    model.eval()
    with torch.no_grad():  # scores far from 0, so that attention depends on which keys are cached
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(30)
    calls = _count_calls(monkeypatch, ["flash_attention", "flash_attention_with_kvcache"])
    idx = torch.randint(0, config.vocab_size, (2, 12), device=device)
    with torch.no_grad(), torch.autocast(device, torch.float16):
        full = model(idx)
        cache = KVCache(config)
        parts = [model(idx[:, :5], cache), model(idx[:, 5:9], cache)]
        parts += [model(idx[:, i : i + 1], cache) for i in range(9, 12)]
    assert calls == {"flash_attention": config.n_layer, "flash_attention_with_kvcache": 5 * config.n_layer}
    error = (torch.cat(parts, dim=1).float() - full.float()).abs().max() / full.float().abs().max()
    assert error < 1e-2, f"cached steps differ from the full forward by {error:.3g} of its largest logit"


def test_causal_attention_matches_an_explicit_mask_with_gqa():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 8)  # the last 3 of 7 positions
    k, v = torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    k_full, v_full = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_full) / math.sqrt(8)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(4)
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v_full)
    torch.testing.assert_close(causal_attention(q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_what_each_position_sees(device):
    # n_layer windows of 4 reach 8 positions back: changing token 0 changes positions 0..8, no more.
    config = VARIANTS["sliding-window"]
    reference, triton = _pair(config, device)
    idx = torch.randint(0, config.vocab_size, (1, 16), device=device)
    changed = idx.clone()
    changed[0, 0] = (idx[0, 0] + 1) % config.vocab_size
    reach = config.n_layer * config.attn_window
    for model in (reference, triton):
        with torch.no_grad(), torch.autocast(device, torch.float16):
            differs = (model(idx) - model(changed)).abs().amax(dim=-1)[0]
        assert (differs[: reach + 1] > 0).all() and (differs[reach + 1 :] == 0).all(), differs


def test_weights_tied_and_gpt2_initialisation():
    config = dataclasses.replace(SMALL, d_model=256, n_head=4, vocab_size=512)
    torch.manual_seed(0)
    model = GPT(config)
    assert "lm_head.weight" not in model.state_dict()  # the head is wte itself
    block = model.blocks[0]
    for scaled in (block.attn.c_proj, block.mlp.c_proj):
        assert scaled.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.05)
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(block.attn.c_attn.bias == 0)
    assert torch.all(model.norm_f.weight == 1)


def test_parameter_count_and_flops():
    assert num_params(preset("gpt2-124m")) == 124_475_904  # nanoGPT's GPT-2 small with its 50,304 vocabulary
    assert 1e6 < num_params(preset("tiny")) < 1e7
    config = preset("tiny")
    model = GPT(config)
    n = model.num_params() - config.block_size * config.d_model  # without the position table
    assert model.flops_per_token(64) == 6 * n + 12 * config.n_layer * config.d_model * 64
    rotary = GPT(dataclasses.replace(config, positions="rotary"))
    assert rotary.flops_per_token(64) == 6 * rotary.num_params() + 12 * config.n_layer * config.d_model * 64
    windowed = GPT(dataclasses.replace(config, positions="rotary", attn_window=15))
    assert windowed.flops_per_token(64) == 6 * rotary.num_params() + 12 * config.n_layer * config.d_model * 16


def test_bad_configs_and_inputs_name_the_problem():
    with pytest.raises(ValueError, match="d_model .* multiple of n_head"):
        GPTConfig(d_model=100, n_head=12)
    with pytest.raises(ValueError, match="n_kv_heads"):
        GPTConfig(n_head=12, n_kv_heads=5)
    with pytest.raises(ValueError, match="attn_window must be at least 0"):
        GPTConfig(attn_window=-1)
    with pytest.raises(ValueError, match="norm must be one of"):
        GPTConfig(norm="batchnorm")
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        preset("gpt5")
    with pytest.raises(ValueError, match="backend"):
        GPT(SMALL, "cuda")
    with pytest.raises(ValueError, match="exceed block_size 16"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.gpu
def test_backends_agree_on_the_gpu_in_fp16():
    config = dataclasses.replace(preset("gpt2-124m"), n_layer=2, vocab_size=1024)
    reference, triton = _pair(config, "cuda")
    idx = torch.randint(0, config.vocab_size, (4, 512), device="cuda")
    losses = []
    for model in (reference, triton):
        with torch.autocast("cuda", torch.float16):
            loss = model.loss(idx, idx)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    for (name, p), p_ref in zip(triton.named_parameters(), reference.parameters(), strict=True):
        scale = max(1e-3, p_ref.grad.abs().max().item())
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=2e-2, atol=2e-2 * scale, msg=name)
