"""The GPT with a mixture of experts in place of each MLP (GPTConfig.moe_experts): its config refuses bad
values by name; its training loss adds the load-balancing loss as transformers computes it; on the
triton backend in float16 its experts run horse.kernels.moe_mlp within the suite's accuracy rule; the
tiny MoE preset learns the built-in corpus on the CPU; activation checkpointing recomputes the experts
alike; split over 2 gloo ranks by tensor parallelism or by FSDP2 it takes the steps of one process, step
for step (and DDP too); state dicts and checkpoints cut by the plan gather back and reshard between tp 1
and tp 2; the Hugging Face export refuses it by name."""

import contextlib
import dataclasses
import functools
import math

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close, run_gloo_ranks

from horse import checkpoint, hf, kernels, optim, recipes, train
from horse.cli import parse_args
from horse.loss_scale import LossScaler
from horse.model import GPT, PRESETS, GPTConfig, num_active_params, num_params, preset
from horse.parallel import (
    Parallel,
    apply,
    gather_state_dicts,
    init_from_env,
    parallelize,
    shard_state_dict,
)

# Under pytest-xdist in one worker with the other multi-process tests: one group of ranks at a time.
pytestmark = pytest.mark.xdist_group("multiprocess")
# tiny-moe, smaller: 4 experts of width 32 (16 a rank at tp 2), 2 a token, over 2 blocks.
SMALL = {"n_layer": 2, "d_model": 64, "n_head": 4, "block_size": 32, "moe_experts": 4, "moe_inter": 32}
CONFIG = dataclasses.replace(preset("tiny-moe"), **SMALL)


def test_the_moe_fields_refuse_bad_values_by_name():
    for fields, message in [
        ({"moe_experts": -1}, "moe_experts must be at least 0"),
        ({"moe_experts": 4, "moe_top_k": 0}, r"moe_top_k must be between 1 and moe_experts \(4\), got 0"),
        ({"moe_experts": 4, "moe_top_k": 5}, r"moe_top_k must be between 1 and moe_experts \(4\), got 5"),
        ({"moe_experts": 4, "moe_inter": 0}, "moe_inter must be at least 1"),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef must be at least 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            GPTConfig(**fields)
    assert GPTConfig(moe_top_k=0).moe_experts == 0  # the dense MLP: the experts' fields unused


def test_presets_state_their_total_and_active_parameters():
    # The counts their docstrings give (python -m horse.model prints them).
    counts = {
        name: (num_params(preset(name)), num_active_params(preset(name)))
        for name in ("tiny-moe", "moe-124m", "moe-1b-7b")
    }
    assert [round(total / 1e6, 1) for total, _ in counts.values()] == [7.4, 293.5, 6816.1]
    assert [round(active / 1e6, 1) for _, active in counts.values()] == [2.7, 123.7, 1178.9]
    dense = num_params(preset("gpt2-124m"))
    assert num_active_params(preset("gpt2-124m")) == dense


def test_the_moe_presets_are_selectable_with_their_recipes_and_the_model_flags():
    assert set(recipes.RECIPES) == set(PRESETS)  # every preset, the moe ones too, carries its recipe
    flags = ["--preset", "moe-1b-7b", "--moe-top-k", "4", "--router-aux-loss-coef", "0.01"]
    cfg, overrides = parse_args(flags)
    assert (cfg.lr, cfg.warmup_steps, cfg.batch_tokens) == (2e-4, 358, 2**20)  # GPT-3 XL's
    assert overrides == {"moe_top_k": 4, "router_aux_loss_coef": 0.01}
    assert parse_args(["--preset", "moe-124m"])[0].lr == 6e-4  # GPT-3 Small's
    assert parse_args(["--preset", "tiny-moe"])[0].lr == 2e-3  # tiny's
    with pytest.raises(ValueError, match="--preset moe-124m trains on text tokenised with a BPE tokenizer"):
        recipes.check_data(parse_args(["--preset", "moe-124m"])[0])


def test_the_training_loss_adds_transformers_load_balancing_loss():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    model = GPT(CONFIG)
    inputs = []  # each block's MoE input (B, T, C), from which the router logits are recomputed here
    for block in model.blocks:
        block.moe.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
    routers = [block.moe.gate.weight for block in model.blocks]
    idx, targets = torch.randint(0, CONFIG.vocab_size, (2, 3, 17), generator=torch.Generator().manual_seed(1))

    def reference(weights: list[torch.Tensor]) -> torch.Tensor:
        logits = tuple(x.flatten(0, 1) @ w.T for x, w in zip(inputs, weights, strict=True))
        return load_balancing_loss_func(logits, CONFIG.moe_experts, CONFIG.moe_top_k)

    gradients = []  # of the routers' weights, without the load-balancing loss and with it at 1
    for coef in (0.0, 1.0):
        inputs.clear()
        model.config = dataclasses.replace(CONFIG, router_aux_loss_coef=coef)
        model.zero_grad()
        loss = model.loss(idx, targets)
        loss.backward()
        gradients.append([w.grad.clone() for w in routers])
    expected = reference(routers)
    torch.testing.assert_close(model.router_aux_loss, expected.detach(), rtol=1e-6, atol=0)
    # The load-balancing loss trains the routers: its gradient in the last router's weight is the
    # reference's (the earlier routers' gradients also reach them through the later blocks' inputs).
    weights = [w.detach().requires_grad_() for w in routers]
    reference(weights).backward()
    model.eval()  # the cross-entropy alone: the validation loss
    torch.testing.assert_close(loss, model.loss(idx, targets) + expected, rtol=1e-6, atol=0)
    with_aux, without = gradients[1][-1], gradients[0][-1]
    torch.testing.assert_close(with_aux - without, weights[-1].grad, rtol=1e-4, atol=1e-7)


def test_the_triton_backend_in_float16_runs_the_experts_on_the_kernels(monkeypatch):
    """Loss and every gradient within the suite's accuracy rule (a float64 truth, the reference
    backend under the same autocast as the baseline), the experts on horse.kernels.moe_mlp (Triton's
    interpreter without a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    moe_mlp = kernels.moe_mlp
    monkeypatch.setattr(
        kernels, "moe_mlp", lambda *args, **kwargs: calls.append(1) or moe_mlp(*args, **kwargs)
    )
    config = dataclasses.replace(CONFIG, n_layer=1)
    torch.manual_seed(0)
    model, baseline, truth = GPT(config, backend="triton"), GPT(config), GPT(config).double()
    for other in (baseline, truth):
        other.load_state_dict(model.state_dict())
    idx = torch.randint(0, config.vocab_size, (1, 13), device=device)

    def loss_and_grads(m: GPT, dtype: torch.dtype | None) -> list[torch.Tensor]:
        m.to(device)
        with torch.autocast(device, dtype) if dtype else contextlib.nullcontext():
            loss = m.loss(idx, idx)
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters()]

    results = [loss_and_grads(model, torch.float16), loss_and_grads(truth, None)]
    assert len(calls) == 1  # the reference backend and float64 loop over the experts in plain torch
    results.append(loss_and_grads(baseline, torch.float16))
    names = ["loss"] + [name for name, _ in model.named_parameters()]
    for name, actual, want, base in zip(names, *results, strict=True):
        assert_close(name, actual, want, base)


def test_tiny_moe_learns_the_built_in_corpus(tmp_path, capsys):
    quick = dict(
        batch_size=8, max_steps=40, warmup_steps=2, eval_interval=40, eval_tokens=512, sample_tokens=0
    )
    cfg = train.TrainConfig(preset="tiny-moe", out_dir=str(tmp_path / "run"), device="cpu", **quick)
    records = train.train(cfg, {k: v for k, v in SMALL.items() if not k.startswith("moe")})
    losses = [r["loss"] for r in records]
    assert losses[0] == pytest.approx(math.log(256) + 0.001 * 2, abs=0.3)  # uniform, plus coef x ~top_k
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert records[-1]["val_loss"] < losses[0] - 1.5
    assert all(math.isfinite(r["router_aux_loss"]) for r in records)  # logged, before its coefficient
    out = capsys.readouterr().out  # the preset's experts, on SMALL's shape
    assert "0.84M parameters (0.25M active: 2 of 8 experts of width 256 a token)" in out
    assert "| aux loss " in out


def test_state_dicts_cut_by_the_plan_gather_back_and_the_export_refuses_by_name():
    whole = GPT(CONFIG).state_dict()
    # GPT-2's initialisation: the experts' down projections, which write into the stream, scaled down.
    assert whole["blocks.0.moe.experts.gate_up_proj"].std().item() == pytest.approx(0.02, rel=0.05)
    down_std = 0.02 / math.sqrt(2 * CONFIG.n_layer)
    assert whole["blocks.0.moe.experts.down_proj"].std().item() == pytest.approx(down_std, rel=0.05)
    shards = [shard_state_dict(whole, CONFIG, rank, 2) for rank in range(2)]
    assert shards[0]["blocks.0.moe.experts.gate_up_proj"].shape == (4, 32, 64)  # half of gate, half of up
    assert shards[0]["blocks.0.moe.experts.down_proj"].shape == (4, 64, 16)
    assert shards[0]["blocks.0.moe.gate.weight"].shape == (4, 64)  # the router: whole on every rank
    gate, up = whole["blocks.0.moe.experts.gate_up_proj"].split(32, dim=1)
    torch.testing.assert_close(
        shards[1]["blocks.0.moe.experts.gate_up_proj"], torch.cat([gate[:, 16:], up[:, 16:]], 1)
    )
    gathered = gather_state_dicts(shards, CONFIG)
    assert all(torch.equal(gathered[name], whole[name]) for name in whole)
    with pytest.raises(
        ValueError, match=r"a mixture of experts \(moe_experts 4\) has no Hugging Face export"
    ):
        hf.hf_architecture(CONFIG)
    with pytest.raises(ValueError, match="tensor parallel size 3 must divide .*moe_inter 32"):
        shard_state_dict(whole, dataclasses.replace(CONFIG, n_head=3, d_model=48, vocab_size=255), 0, 3)


def test_activation_checkpointing_recomputes_the_experts_with_the_same_loss_and_gradients():
    torch.manual_seed(0)
    plain, checkpointed = GPT(CONFIG), GPT(CONFIG)
    checkpointed.load_state_dict(plain.state_dict())
    apply.checkpoint_blocks(checkpointed)  # the blocks' router logits come out of the checkpoint
    idx = torch.randint(0, CONFIG.vocab_size, (2, 32))
    losses = [model.loss(idx, idx) for model in (plain, checkpointed)]
    for loss in losses:
        loss.backward()
    assert torch.equal(*losses) and torch.equal(plain.router_aux_loss, checkpointed.router_aux_loss)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_tp1_checkpoint_loads_into_tp2_shards(tmp_path):
    # Each tp rank reads its slice of the experts from the whole tensors: gate_up_proj's gate and up
    # rows (dim 1), down_proj's columns (dim 2); the reverse, tp 2 -> tp 1, runs in the ranks below.
    torch.manual_seed(0)
    whole = GPT(CONFIG)
    optimizer = optim.make_optimizer(whole, train.TrainConfig(), "cpu")
    ckpt = checkpoint.save(tmp_path, 1, whole, optimizer, {"step": 1}, "bytes")
    for rank in range(2):
        with torch.device("meta"):
            shard = parallelize(GPT(CONFIG), Parallel(tp_rank=rank, tp_size=2))
        shard.to_empty(device="cpu")
        checkpoint.load_weights(ckpt, shard, Parallel(tp_rank=rank, tp_size=2))
        expected = shard_state_dict(whole.state_dict(), CONFIG, rank, 2)
        assert all(torch.equal(t, expected[name]) for name, t in shard.state_dict().items())


# ----------------------------------------------------------------------------------------------
# Two gloo ranks: tp 2 and dp_shard 2 against one process
# ----------------------------------------------------------------------------------------------

STEPS = 3
BATCH = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))


def _steps(parallel: Parallel, micro_batches: list[torch.Tensor]) -> tuple[list[tuple], GPT, object]:
    """(loss, load-balancing loss, gradient norm) of STEPS training steps of the trainer's model in
    parallel's layout (built from the seed by train.make_model), each on micro_batches; the model and
    its optimizer after them."""
    cfg = train.TrainConfig(grad_accum=len(micro_batches), warmup_steps=1)
    model, loss_fn = train.make_model(cfg, CONFIG, "reference", parallel, "cpu", pretrained=False)
    optimizer = optim.make_optimizer(model, cfg, "cpu")
    batches = iter(micro_batches * STEPS)

    def next_batch():
        rows = next(batches)
        return rows[:, :-1], rows[:, 1:]

    results = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = optim.lr_at(step, STEPS, cfg)
        loss, aux, norm, skipped = train.train_step(
            loss_fn, next_batch, model, optimizer, LossScaler(enabled=False), cfg, parallel
        )
        assert not skipped
        results.append((loss.item(), aux.item(), norm))
    return results, model, optimizer


def _tp2_and_dp_shard2_take_one_process_steps(tmp: str) -> None:
    rank = dist.get_rank()
    one_process = Parallel()
    # Tensor parallelism: both ranks on the whole batch, each holding half of every expert.
    expected, _, _ = _steps(one_process, [BATCH])
    tp2 = init_from_env(tp=2, device_type="cpu")
    actual, model, optimizer = _steps(tp2, [BATCH])
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=0, msg="tp 2")
    # Its checkpoint loads at tp 1 (reading across the two shards): cut by the plan again, the whole
    # model holds this rank's shard, bit for bit.
    ckpt = checkpoint.save(tmp, STEPS, model, optimizer, {"step": STEPS}, "bytes", parallel=tp2)
    gathered = GPT(CONFIG)
    checkpoint.load_weights(ckpt, gathered)
    cut = shard_state_dict(gathered.state_dict(), CONFIG, rank, 2)
    assert all(torch.equal(t, cut[name]) for name, t in model.state_dict().items())
    # FSDP2: each rank its half of the batch; one process takes both halves as two micro-batches.
    halves = [BATCH[0::2], BATCH[1::2]]
    expected, _, _ = _steps(one_process, halves)
    actual, _, _ = _steps(init_from_env(device_type="cpu", dp_shard=2), [halves[rank]])
    torch.testing.assert_close(
        torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=0, msg="dp_shard 2"
    )
    # DDP likewise, on the same halves: every expert's weights take part in the graph.
    actual, _, _ = _steps(init_from_env(device_type="cpu"), [halves[rank]])
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=0, msg="DDP")
    # Sequence parallelism would route each rank's chunk of the tokens alone: refused by name.
    sequence_parallel = init_from_env(tp=2, sequence_parallel=True, device_type="cpu")
    with pytest.raises(ValueError, match="sequence parallelism does not take a mixture of experts"):
        parallelize(GPT(CONFIG), sequence_parallel)


def test_tp2_and_dp_shard2_take_the_steps_of_one_process(tmp_path):
    worker = functools.partial(_tp2_and_dp_shard2_take_one_process_steps, str(tmp_path))
    run_gloo_ranks(worker, 2)
