"""The drop-in norms of horse.layers against torch.nn.LayerNorm / torch.nn.RMSNorm."""

import inspect
import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional

from horse import kernels, layers
from horse.layers import FusedLayerNorm, FusedRMSNorm, replace_norms

PAIRS = [
    (lambda: nn.LayerNorm(96), lambda: FusedLayerNorm(96)),
    (
        lambda: nn.LayerNorm((6, 16), eps=1e-3, bias=False),
        lambda: FusedLayerNorm((6, 16), eps=1e-3, bias=False),
    ),
    (lambda: nn.RMSNorm(96), lambda: FusedRMSNorm(96)),
    (lambda: nn.RMSNorm([6, 16], eps=1e-4), lambda: FusedRMSNorm([6, 16], eps=1e-4)),
]


def _randomize(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


@pytest.mark.parametrize("make_torch,make_fused", PAIRS)
def test_state_dicts_load_both_ways_and_outputs_match(make_torch, make_fused, device):
    torch.manual_seed(0)
    ref = _randomize(make_torch()).to(device)
    fused = make_fused().to(device)
    fused.load_state_dict(ref.state_dict())
    assert fused.state_dict().keys() == ref.state_dict().keys()
    back = make_torch().to(device)
    back.load_state_dict(_randomize(fused).state_dict())  # and the other way round
    x = torch.randn(3, 7, *ref.normalized_shape, device=device)
    x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = back(x_ref), fused(x_fused)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    torch.testing.assert_close(x_fused.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for p, p_ref in zip(fused.parameters(), back.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-4)


def test_forward_residual_matches_add_then_norm(device):
    torch.manual_seed(0)
    ref = _randomize(nn.LayerNorm(64)).to(device)
    fused = FusedLayerNorm(64).to(device)
    fused.load_state_dict(ref.state_dict())
    x, r = torch.randn(2, 9, 64, device=device), torch.randn(2, 9, 64, device=device)
    y, h = fused.forward_residual(x, r)
    torch.testing.assert_close(h, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, ref(x + r), rtol=1e-5, atol=1e-5)


def test_subclasses_keep_isinstance_and_repr():
    assert isinstance(FusedLayerNorm(8), nn.LayerNorm) and isinstance(FusedRMSNorm(8), nn.RMSNorm)
    assert repr(FusedLayerNorm(8, bias=False)) == "Fused" + repr(nn.LayerNorm(8, bias=False))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(2))
        self.final = nn.RMSNorm(32, eps=1e-6)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.final(x))


def test_replace_norms_swaps_every_norm_and_keeps_parameters(device):
    torch.manual_seed(0)
    model = Tiny().to(device)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm | nn.RMSNorm):
            _randomize(m)
    model.blocks[1][0].eval()
    x = torch.randn(5, 16, device=device)
    expected = model(x)
    params_before = {name: p for name, p in model.named_parameters()}
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    assert replace_norms(model) is model
    assert [type(m) for m in model.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm)] == [
        FusedLayerNorm,
        FusedLayerNorm,
        FusedRMSNorm,
    ]
    assert model.final.eps == 1e-6 and not model.blocks[1][0].training and model.blocks[0][0].training
    for name, p in model.named_parameters():
        assert p is params_before[name], f"{name} is a new Parameter; an optimizer holding it would lose it"
    assert model.state_dict().keys() == state_before.keys()
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(replace_norms(nn.LayerNorm(4)), FusedLayerNorm)


class GPT2Attention(nn.Module):
    """nanoGPT's causal self-attention, the layout FusedSelfAttention loads directly."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, seqlen, d_model = x.shape
        q, k, v = self.c_attn(x).split(d_model, dim=2)
        q, k, v = (t.view(batch, seqlen, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seqlen, d_model))


def rope_reference(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as a complex rotation of the pairs (i, i + head_dim / 2) by position * freq."""
    seqlen, head_dim = x.shape[1], x.shape[-1]
    freqs = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rotation = torch.polar(
        torch.ones(seqlen, head_dim // 2, dtype=torch.float64), torch.outer(torch.arange(seqlen), freqs)
    )
    pairs = torch.complex(x[..., : head_dim // 2].double(), x[..., head_dim // 2 :].double())
    rotated = pairs * rotation[None, :, None, :]
    return torch.cat([rotated.real, rotated.imag], dim=-1)


class LlamaAttention(nn.Module):
    """Separate q/k/v/o projections, grouped-query heads and rotary embeddings, in float64; with a
    window, each position attends to itself and the ``window`` before it (Mistral's sliding window)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, window: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.window = window
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        batch, seqlen, d_model = x.shape
        q = rope_reference(self.q_proj(x).view(batch, seqlen, self.n_heads, self.head_dim))
        k = rope_reference(self.k_proj(x).view(batch, seqlen, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, seqlen, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
        if self.window is not None:
            mask = mask.triu(-self.window)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seqlen, d_model))


def _compare_attention(ref: nn.Module, fused: nn.Module, device, d_model: int):
    x = torch.randn(2, 37, d_model, device=device)
    x_ref = x.double().requires_grad_()
    x_fused = x.half().requires_grad_()
    y_ref, y = ref.double()(x_ref), fused(x_fused)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-2, atol=1e-2)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y.backward(dy.half())
    torch.testing.assert_close(x_fused.grad.double(), x_ref.grad, rtol=1e-2, atol=1e-2)


def test_fused_self_attention_loads_gpt2_layout(device):
    from horse.layers import FusedSelfAttention

    torch.manual_seed(0)
    ref = GPT2Attention(64, 4).to(device)
    fused = FusedSelfAttention(64, 4, device=device, dtype=torch.float16)
    fused.load_state_dict(ref.state_dict())
    _compare_attention(ref, fused, device, 64)


def test_fused_self_attention_loads_separate_projections_with_gqa_and_rotary(device):
    from horse.layers import FusedSelfAttention

    torch.manual_seed(0)
    ref = LlamaAttention(64, 4, 2).to(device)
    fused = FusedSelfAttention(
        64, 4, n_kv_heads=2, bias=False, rotary=True, device=device, dtype=torch.float16
    )
    fused.load_state_dict(ref.state_dict())
    assert set(fused.state_dict()) == {"c_attn.weight", "c_proj.weight"}
    _compare_attention(ref, fused, device, 64)


def test_fused_self_attention_sliding_window(device):
    from horse.layers import FusedSelfAttention

    torch.manual_seed(0)
    ref = LlamaAttention(64, 4, 2, window=8).to(device)
    fused = FusedSelfAttention(
        64, 4, n_kv_heads=2, bias=False, rotary=True, window_size=(8, -1), device=device, dtype=torch.float16
    )
    fused.load_state_dict(ref.state_dict())
    _compare_attention(ref, fused, device, 64)
    with pytest.raises(ValueError, match="window_size"):
        FusedSelfAttention(64, 4, window_size=(-3, 0))


def test_fused_self_attention_on_packed_documents_matches_each_alone(device):
    from horse.layers import FusedSelfAttention

    torch.manual_seed(0)
    # Rotary positions restart at each document: 76 tokens, none past the table's 48 positions.
    attn = FusedSelfAttention(
        64, 4, n_kv_heads=2, rotary=True, max_seqlen=48, device=device, dtype=torch.float16
    )
    lengths = [13, 1, 40, 22]
    x = torch.randn(sum(lengths), 64, device=device, dtype=torch.float16, requires_grad=True)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    packed = attn(x, cu_seqlens=cu, max_seqlen=max(lengths))
    alone = torch.cat([attn(doc[None])[0] for doc in x.split(lengths)])
    torch.testing.assert_close(packed, alone, rtol=2e-3, atol=2e-3)
    dy = torch.randn_like(packed)
    (dx_packed,) = torch.autograd.grad(packed, x, dy)
    (dx_alone,) = torch.autograd.grad(alone, x, dy)
    torch.testing.assert_close(dx_packed, dx_alone, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="x must be packed"):
        attn(x[None], cu_seqlens=cu, max_seqlen=40)


def test_rotary_offset_continues_the_positions():
    from horse.layers import RotaryEmbedding

    rotary = RotaryEmbedding(16, max_seqlen=32)
    x = torch.randn(2, 12, 3, 16)
    torch.testing.assert_close(rotary(x)[:, 5:], rotary(x[:, 5:], offset=5))
    torch.testing.assert_close(rotary(x).double(), rope_reference(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="past max_seqlen 32"):
        rotary(x, offset=25)


# The positional parameters of every public function of kernels and module of horse.layers, and
# the positional parameters of what each replaces: a positional argument must mean there what it
# means here. Every other argument is keyword-only.
POSITIONAL = {
    kernels.flash_attention: (["q", "k", "v"], None),  # flash_attn_func's fourth is dropout_p
    kernels.flash_attention_varlen: (
        ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
        None,
    ),  # flash_attn_varlen_func's eighth is dropout_p
    kernels.layer_norm: (None, functional.layer_norm),
    kernels.rms_norm: (None, functional.rms_norm),
    kernels.add_layer_norm: (["input", "residual", "normalized_shape", "weight", "bias", "eps"], None),
    kernels.add_rms_norm: (["input", "residual", "normalized_shape", "weight", "eps"], None),
    kernels.linear_act: (["x", "weight", "bias"], None),  # F.linear's (input, weight, bias)
    kernels.gated_linear: (["x", "w_gate", "w_up"], None),
    kernels.fused_mlp: (["x", "w_in", "b_in", "w_out", "b_out"], None),
    kernels.fused_gated_mlp: (["x", "w_gate", "w_up", "w_down"], None),
    kernels.flash_attention_with_kvcache: (["q", "k_cache", "v_cache"], None),  # flash-attn's fourth is k
    kernels.cross_entropy: (["logits", "target", "weight"], None),  # F.cross_entropy's; weight only None
    kernels.linear_cross_entropy: (["x", "weight", "target", "bias"], None),  # as Liger's (fifth: ce_weight)
    kernels.moe_mlp: (["x", "expert_ids", "expert_weights", "gate_up_proj", "down_proj"], None),
    layers.FusedLayerNorm: (None, nn.LayerNorm),
    layers.FusedRMSNorm: (None, nn.RMSNorm),
    layers.FusedSelfAttention: (["d_model", "n_heads"], nn.MultiheadAttention),  # then dropout
    layers.FusedMLP: (["d_model", "hidden"], None),
    layers.FusedMoE: (["hidden", "inter", "experts", "top_k"], None),
    layers.MoERouter: (["hidden", "experts", "top_k"], None),
    layers.MoEExperts: (["hidden", "inter", "experts"], None),
    layers.RotaryEmbedding: (["head_dim", "max_seqlen", "base", "device"], None),  # as HF's (dim, max, base)
}


def _positional(fn) -> list[str]:
    fn = fn.__init__ if isinstance(fn, type) else fn
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]
    return names[1:] if names[:1] == ["self"] else names


def test_every_public_function_and_module_is_audited():
    modules = {c for c in vars(layers).values() if isinstance(c, type) and issubclass(c, nn.Module)}
    modules = {c for c in modules if c.__module__ == "horse.layers"}
    assert set(POSITIONAL) == {getattr(kernels, name) for name in kernels.__all__} | modules


@pytest.mark.parametrize("fn", list(POSITIONAL), ids=lambda fn: fn.__name__)
def test_positional_arguments_mean_what_they_mean_in_what_they_replace(fn):
    expected, replaced = POSITIONAL[fn]
    ours = _positional(fn)
    if expected is None:  # all of them, exactly as the replaced function's
        expected = _positional(replaced)
    assert ours == expected
    if replaced is not None:  # as many as match the replaced function's, position by position
        assert len(_positional(replaced)) >= len(ours)


def test_a_positional_argument_past_those_raises():
    q = torch.zeros(1, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError):
        kernels.flash_attention(q, q, q, 0.1)  # flash-attn's dropout_p; was causal=True
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError):
        kernels.flash_attention_varlen(q[0], q[0], q[0], cu, cu, 4, 4, 0.1)
    with pytest.raises(TypeError):
        kernels.linear_act(q, q[0, 0], None, "relu")
    with pytest.raises(TypeError):
        kernels.cross_entropy(q[0, 0], torch.zeros(2, dtype=torch.long), None, False)  # F's size_average
    with pytest.raises(TypeError):
        layers.FusedSelfAttention(64, 4, 0.1)  # nn.MultiheadAttention's dropout
    with pytest.raises(TypeError):
        layers.FusedMLP(64, 256, True)
