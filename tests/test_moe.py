"""The mixture-of-experts kernels (horse.kernels.moe) against the float64 truth: the output and every
gradient (x, expert_weights, both weights, both biases), for top_k 1, 2 and 8, 1, 8 and 64 experts,
experts with no tokens, every token on one expert, dropped pairs, 1 token and a prime number of them,
both activations, gpt-oss's clamp, transformers' and gpt-oss's weight layouts.

The baseline of the accuracy rule is transformers' eager loop at the same precision
(``reference.moe_mlp(..., upcast=False)``: each product rounded to float16, the weighted rows added to
the output in float16). float16 through the kernels in the interpreter (its bf16 ``tl.dot`` is wrong);
float32 is the reference path's, off the Triton path, as for the MLP kernels.
"""

import copy
import functools
import zlib

import pytest
import torch
from helpers import assert_close, device_has_tma, record_tma_choices

from horse import kernels
from horse.kernels import reference, runtime
from horse.kernels.moe import configs, launch

# (tokens, hidden, inter, experts, top_k, routing): routing "random" (distinct experts a token, as
# top-k gives), "one_expert" (every token on expert 3), "dropped" (some ids = experts: no expert).
CASES = [
    (1, 24, 20, 1, 1, "random"),
    (13, 24, 20, 8, 2, "random"),
    (13, 16, 12, 64, 8, "random"),  # most of the 64 experts get no token
    (13, 24, 20, 8, 1, "one_expert"),
    (31, 16, 40, 8, 2, "dropped"),
]
# (activation, limit, gate_up_interleaved, gpt-oss's transposed storage, biases)
VARIANTS = [
    ("silu", None, False, False, False),
    ("gelu_tanh", None, False, False, True),
    ("silu", 1.0, True, True, True),  # gpt-oss, with a limit that clamps O(1) values
    ("silu", None, False, True, False),
    ("gelu_tanh", None, True, False, False),
]


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def make_case(tokens, hidden, inter, experts, top_k, routing, dtype, device, bias=False, seed=0) -> dict:
    """Inputs, weights and the output's gradient "dy": uniform with unit variance (weights 1/fan_in)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def uniform(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=gen) * 2 - 1) * 3**0.5 * scale).to(device=device, dtype=dtype)

    if routing == "one_expert":
        ids = torch.full((tokens, top_k), 3)
    else:
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
        if routing == "dropped":
            ids[::3, 0] = experts
    t = {
        "x": uniform(tokens, hidden),
        "expert_weights": torch.rand(tokens, top_k, generator=gen).to(device=device, dtype=dtype),
        "gate_up_proj": uniform(experts, 2 * inter, hidden, scale=hidden**-0.5),
        "down_proj": uniform(experts, hidden, inter, scale=inter**-0.5),
    }
    if bias:
        t["gate_up_bias"] = uniform(experts, 2 * inter, scale=0.5)
        t["down_bias"] = uniform(experts, hidden, scale=0.5)
    t["dy"] = uniform(tokens, hidden)
    return {"expert_ids": ids.to(device)} | t


def _call(fn, t: dict, activation: str, limit, interleaved: bool, transposed: bool, **options):
    """fn (kernels.moe_mlp or reference.moe_mlp) on t's leaves; transposed: the weights stored as
    gpt-oss stores them, (experts, hidden, 2 inter) and (experts, inter, hidden), passed as views."""
    gate_up, down = t["gate_up_proj"], t["down_proj"]
    if transposed:
        gate_up = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
        down = down.transpose(1, 2).contiguous().transpose(1, 2)
    return fn(
        t["x"],
        t["expert_ids"],
        t["expert_weights"],
        gate_up,
        down,
        activation=activation,
        gate_up_bias=t.get("gate_up_bias"),
        down_bias=t.get("down_bias"),
        limit=limit,
        gate_up_interleaved=interleaved,
        **options,
    )


def run(fn, t: dict, dtype=None) -> dict:
    """y = fn(leaves) and the gradient of every floating leaf for dy, by name ("y", "dx", ...)."""
    leaves = {
        name: (v.detach().to(dtype) if dtype else v.detach().clone()).requires_grad_()
        for name, v in t.items()
        if name not in ("dy", "expert_ids")
    }
    y = fn(leaves | {"expert_ids": t["expert_ids"]})
    grads = torch.autograd.grad(y, list(leaves.values()), t["dy"].to(y.dtype))
    return {"y": y.detach()} | {f"d{name}": g for name, g in zip(leaves, grads, strict=True)}


def check(t: dict, activation, limit, interleaved, transposed) -> None:
    call = functools.partial(
        _call, activation=activation, limit=limit, interleaved=interleaved, transposed=transposed
    )
    ours = run(lambda leaves: call(kernels.moe_mlp, leaves), t)
    truth = run(lambda leaves: call(reference.moe_mlp, leaves), t, torch.float64)
    baseline = run(lambda leaves: call(reference.moe_mlp, leaves, upcast=False), t)
    assert ours.keys() == truth.keys()
    for name in truth:
        assert_close(name, ours[name], truth[name], baseline[name].to(ours[name].dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_mlp_matches_reference(case, device):
    t = make_case(*case, torch.float16, device, seed=_seed(case))
    check(t, "silu", None, False, False)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_activations_clamp_biases_and_layouts(variant, device):
    activation, limit, interleaved, transposed, bias = variant
    t = make_case(13, 24, 20, 8, 2, "random", torch.float16, device, bias=bias, seed=_seed(variant))
    check(t, activation, limit, interleaved, transposed)


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("transposed", [False, True], ids=["transformers", "gpt-oss"])
@pytest.mark.parametrize("inter", [24, 20])
def test_down_and_dx_gemms_by_tma_and_by_pointers_match_reference(
    inter, transposed, use_tma, device, monkeypatch
):
    # TMA needs rows of 16-byte multiples: inter 24 takes it for the down GEMM (h's rows) and dx (dpre's,
    # 2 inter); inter 20 for dx alone, whose K (2 inter = 40) then ends inside a block of every
    # expert's weight. hidden 40 and the routing make the other edges: N past a tile, row tiles that end
    # inside an expert, dropped pairs. gpt-oss's transposed weights take the pointer path.
    monkeypatch.setattr(launch, "USE_TMA", use_tma)
    choices = record_tma_choices(monkeypatch, launch)
    case = (29, 40, inter, 8, 2, "dropped")
    t = make_case(*case, torch.float16, device, bias=True, seed=_seed(case, transposed))
    check(t, "silu", None, False, transposed)
    allowed = use_tma and configs.gemm_config("down", torch.device(device)).tma and device_has_tma(device)
    allowed = allowed and not transposed
    assert choices == [allowed and inter % 8 == 0, allowed]  # the down GEMM, dx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[2]], ids=["silu", "gpt-oss"])
def test_gpu_table_tiles_in_both_dtypes(variant, dtype):
    # The GPU's own table entries (128-row tiles: several a busy expert, partial ones, idle experts)
    # and bfloat16, which the interpreter cannot run through tl.dot.
    activation, limit, interleaved, transposed, bias = variant
    t = make_case(1000, 512, 384, 16, 4, "random", dtype, "cuda", bias=bias, seed=_seed(variant, dtype))
    check(t, activation, limit, interleaved, transposed)


def test_float32_runs_the_reference_off_the_triton_path(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    t = make_case(13, 24, 20, 8, 2, "dropped", torch.float32, "cpu", bias=True, seed=3)
    ours = run(lambda leaves: _call(kernels.moe_mlp, leaves, "silu", 1.0, True, True), t)
    truth = run(lambda leaves: _call(reference.moe_mlp, leaves, "silu", 1.0, True, True), t, torch.float64)
    for name in truth:
        assert_close(name, ours[name], truth[name], truth[name].float())


def test_backward_is_bit_identical_run_to_run(device):
    t = make_case(37, 24, 20, 8, 2, "random", torch.float16, device, bias=True, seed=5)
    runs = [
        run(lambda leaves: _call(kernels.moe_mlp, leaves, "silu", None, False, False), t) for _ in range(3)
    ]
    for again in runs[1:]:
        for name in runs[0]:
            assert torch.equal(runs[0][name], again[name]), f"{name} changed between identical runs"


def test_count_sort_is_stable_and_drops_ids_outside_the_experts(device):
    ids = torch.tensor([[2, 0], [5, 2], [0, 2], [1, 5], [2, 3]], device=device)  # 5: no expert of 5
    sorted_pairs, pair_rows, offsets = launch.count_sort(ids, experts=5)
    # Pairs by expert in pair order: 0: pairs 1, 4; 1: pair 6; 2: pairs 0, 3, 5, 8; 3: pair 9; 4: none.
    assert offsets.tolist() == [0, 2, 3, 7, 8, 8]
    assert sorted_pairs[:8].tolist() == [1, 4, 6, 0, 3, 5, 8, 9]
    assert pair_rows.tolist() == [3, 0, -1, 4, 1, 5, 2, -1, 6, 7]


def test_experts_without_tokens_get_no_row_tile(device):
    ids = torch.tensor([[6], [1], [6], [6], [1]], device=device)
    _, _, offsets = launch.count_sort(ids, experts=8)
    tile_expert, tile_row = launch.row_tiles(offsets, block_m=2, pairs=5)
    # Expert 1: rows 0-1 (one tile); expert 6: rows 2-4 (two tiles); the rest exit (id 8).
    assert tile_expert.cpu().tolist() == [1, 6, 6] + [8] * (len(tile_expert) - 3)
    assert tile_row.cpu().tolist()[:3] == [0, 2, 4]


def test_no_tokens(device):
    t = make_case(0, 16, 12, 4, 2, "random", torch.float16, device, bias=True)
    ours = run(lambda leaves: _call(kernels.moe_mlp, leaves, "silu", None, False, False), t)
    assert ours["y"].shape == (0, 16)
    for name in ("dgate_up_proj", "ddown_proj", "dgate_up_bias", "ddown_bias"):
        assert ours[name].abs().sum() == 0


def test_without_grad_nothing_is_saved_and_the_output_is_the_same(device, monkeypatch):
    saved = []  # the gate_up GEMM's Epilogue.store, launch by launch
    plan = launch.gate_up_plan
    monkeypatch.setattr(launch, "gate_up_plan", lambda *args: saved.append(args[-1].store) or plan(*args))
    t = make_case(13, 24, 20, 8, 2, "random", torch.float16, device)
    with torch.no_grad():
        y_inference = _call(kernels.moe_mlp, t, "silu", None, False, False)
    y_training = run(lambda leaves: _call(kernels.moe_mlp, leaves, "silu", None, False, False), t)["y"]
    assert saved == [False, True]
    assert torch.equal(y_training, y_inference)


def _bad(**changes):
    """A call of moe_mlp on a small valid case with the arguments in changes replaced (a function of t)."""

    def call(t):
        args = {name: t[name] for name in ("x", "expert_ids", "expert_weights", "gate_up_proj", "down_proj")}
        args |= {"activation": "silu"} | {name: change(t) for name, change in changes.items()}
        return kernels.moe_mlp(**args)

    return call


BAD_INPUTS = [
    (_bad(x=lambda t: t["x"].numpy()), TypeError, "x must be a torch.Tensor"),
    (_bad(x=lambda t: t["x"][None]), ValueError, r"x must be \(tokens, hidden\)"),
    (
        _bad(
            x=lambda t: t["x"].float(),
            gate_up_proj=lambda t: t["gate_up_proj"].float(),
            down_proj=lambda t: t["down_proj"].float(),
            expert_weights=lambda t: t["expert_weights"].float(),
        ),
        TypeError,
        "float16 or bfloat16 on the Triton path",
    ),
    (_bad(expert_ids=lambda t: t["expert_ids"].float()), TypeError, "expert_ids must be int32 or int64"),
    (
        _bad(expert_ids=lambda t: t["expert_ids"][:3]),
        ValueError,
        r"expert_ids must be \(tokens, top_k\) = \(5",
    ),
    (
        _bad(expert_weights=lambda t: t["expert_weights"][:, :1]),
        ValueError,
        r"expert_weights must have shape \[5, 2\]",
    ),
    (
        _bad(expert_weights=lambda t: t["expert_weights"].double()),
        TypeError,
        "expert_weights must be torch.float16 or float32",
    ),
    (
        _bad(gate_up_proj=lambda t: t["gate_up_proj"].transpose(1, 2)),
        ValueError,
        r"gate_up_proj must be \(experts, 2 \* inter, hidden\).*pass gate_up_proj.transpose\(1, 2\)",
    ),
    (_bad(gate_up_proj=lambda t: t["gate_up_proj"][0]), ValueError, "gate_up_proj must have 3 dimensions"),
    (
        _bad(down_proj=lambda t: t["down_proj"][:, :, :5]),
        ValueError,
        r"down_proj must have shape \[4, 16, 12\]",
    ),
    (_bad(down_proj=lambda t: t["down_proj"].bfloat16()), TypeError, "down_proj must be x's dtype"),
    (_bad(gate_up_bias=lambda t: t["down_bias"]), ValueError, r"gate_up_bias must have shape \[4, 24\]"),
    (_bad(down_bias=lambda t: t["down_bias"][0]), ValueError, r"down_bias must have shape \[4, 16\]"),
    (_bad(activation=lambda t: "gelu"), ValueError, "unknown activation 'gelu'"),
    (
        _bad(activation=lambda t: "gelu_tanh", limit=lambda t: 7.0),
        ValueError,
        "limit .* needs activation 'silu'",
    ),
    (_bad(x=lambda t: t["x"].to("meta")), ValueError, "expert_ids is on cpu but input is on meta"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_input_is_named(call, error, message):
    t = make_case(5, 16, 12, 4, 2, "random", torch.float16, "cpu", bias=True)
    with pytest.raises(error, match=message):
        call(t)


def test_backward_through_a_forward_that_saved_nothing_raises():
    # Every op's opcheck is tests/test_opcheck.py's.
    t = make_case(9, 16, 12, 4, 2, "random", torch.float16, "cpu")
    x = t["x"].clone().requires_grad_()
    args = (x, t["expert_ids"], t["expert_weights"], t["gate_up_proj"], t["down_proj"], None, None)
    y = torch.ops.horse.moe_mlp_fwd(*args, "silu", None, False, False)[0]  # saves nothing
    with pytest.raises(RuntimeError, match="save=False"):
        y.sum().backward()


@pytest.mark.interpreter
def test_torch_compile_fullgraph_runs_through_the_ops():
    t = make_case(13, 24, 20, 8, 2, "random", torch.float16, "cpu", bias=True, seed=11)
    call = functools.partial(_call, activation="silu", limit=None, interleaved=False, transposed=False)
    eager = run(lambda leaves: call(kernels.moe_mlp, leaves), t)
    torch._dynamo.reset()
    compiled_call = torch.compile(lambda leaves: call(kernels.moe_mlp, leaves), fullgraph=True)
    compiled = run(compiled_call, t)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=0, atol=0)


def _hf_block(model_type: str):
    """A tiny transformers sparse MoE block of model_type, its weights random, and the FusedMoE options
    that match its router."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    sizes = dict(hidden_size=24, num_experts_per_tok=2, hidden_act="silu")
    if model_type == "qwen3_moe":
        config = Qwen3MoeConfig(**sizes, moe_intermediate_size=20, num_experts=8, norm_topk_prob=True)
        block, normalize = Qwen3MoeSparseMoeBlock(config), True
    elif model_type == "mixtral":
        config = MixtralConfig(**sizes, intermediate_size=20, num_local_experts=8, router_jitter_noise=0.0)
        block, normalize = MixtralSparseMoeBlock(config), True
    else:
        config = OlmoeConfig(**sizes, intermediate_size=20, num_experts=8, norm_topk_prob=False)
        block, normalize = OlmoeSparseMoeBlock(config), False
    gen = torch.Generator().manual_seed(_seed(model_type))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block.eval(), dict(normalize=normalize)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_fused_moe_loads_transformers_blocks_and_matches_them(model_type, device):
    from horse.layers import FusedMoE

    block, options = _hf_block(model_type)
    ours = FusedMoE(24, 20, 8, 2, **options, dtype=torch.float16, device=device)
    ours.load_state_dict(block.state_dict())
    assert set(ours.state_dict()) == set(block.state_dict())
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 7, 24, generator=gen), torch.randn(2, 7, 24, generator=gen)

    def output_and_grads(module, dtype, device):
        module = copy.deepcopy(module).to(device, dtype)
        leaf = x.to(device, dtype).requires_grad_()
        y = module(leaf)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(dy.to(device, dtype))
        return {"y": y.detach(), "dx": leaf.grad} | {f"d{n}": p.grad for n, p in module.named_parameters()}

    got = output_and_grads(ours, torch.float16, device)
    truth = output_and_grads(block, torch.float64, "cpu")
    baseline = output_and_grads(block, torch.float16, "cpu")
    assert got.keys() == truth.keys()
    for name in truth:
        assert_close(name, got[name], truth[name].to(device), baseline[name].to(device))
    assert ours(x.to(device, torch.float16))[1].shape == (14, 8)  # the router logits, (tokens, experts)
    block.float().load_state_dict(ours.float().state_dict())  # and back


def test_load_balancing_loss_is_transformers(device):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from horse.layers import load_balancing_loss

    gen = torch.Generator().manual_seed(2)
    logits = tuple(
        torch.randn(2 * 9, 8, generator=gen).to(device) for _ in range(3)
    )  # 3 layers, 2 x 9 tokens
    mask = (torch.rand(2, 9, generator=gen) > 0.3).long().to(device)
    for attention_mask in (None, mask):
        expected = load_balancing_loss_func(logits, 8, 2, attention_mask)
        torch.testing.assert_close(load_balancing_loss(logits, 8, 2, attention_mask), expected)


def test_sigmoid_router_without_renormalisation():
    from horse.layers import FusedMoE

    moe = FusedMoE(16, 12, 6, 3, router="sigmoid", normalize=False, dtype=torch.float16)
    x = torch.randn(5, 16, dtype=torch.float16)
    logits, weights, ids = moe.gate(x)
    expected_weights, expected_ids = logits.float().sigmoid().topk(3, dim=-1)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    y, _ = moe(x)
    experts = moe.experts
    expected = reference.moe_mlp(x, ids, weights, experts.gate_up_proj, experts.down_proj, activation="silu")
    torch.testing.assert_close(y, expected.half(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"router": "softmax_topk"}, "unknown router 'softmax_topk'"),
        ({"activation": "gelu"}, "unknown activation"),
        ({"top_k": 9}, "top_k must be 1 to experts"),
    ],
)
def test_fused_moe_rejects_what_it_cannot_run(options, message):
    from horse.layers import FusedMoE

    with pytest.raises(ValueError, match=message):
        FusedMoE(16, 12, 8, **({"top_k": 2} | options))
