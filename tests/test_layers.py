"""The drop-in norms of horse.layers against torch.nn.LayerNorm / torch.nn.RMSNorm."""

import pytest
import torch
from torch import nn

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
