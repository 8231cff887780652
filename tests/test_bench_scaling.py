"""The tensor-parallel step model of bench/scaling.py: byte counts, ring factors, step arithmetic, the
table's n/a rows and its ESTIMATED label, and the rank's step that a GPU would time (run once here,
in Triton's interpreter). No timing is asserted; everything runs on the CPU."""

import dataclasses
import json
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

from bench import scaling
from horse.model import GPT, GPTConfig, num_params, preset
from horse.parallel import Parallel, collectives, init_from_env, parallelize

# B·T = 16 tokens of width 32: one (B·T, d_model) float16 activation is 16·32·2 = 1024 bytes, the
# cross entropy's (B·T,) float32 row max 64 bytes and its (3, B·T) sums 192.
SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
LLAMA_LIKE = dataclasses.replace(
    SMALL, norm="rmsnorm", mlp="swiglu", positions="rotary", n_kv_heads=2, bias=False
)
BATCH, SEQ = 2, 8


def test_ring_factors():
    assert scaling.ring_factor("all_reduce", 1) == 0
    assert scaling.ring_factor("all_reduce", 2) == 1
    assert scaling.ring_factor("all_reduce", 4) == 1.5
    assert scaling.ring_factor("all_reduce", 8) == 1.75
    assert scaling.ring_factor("all_gather", 4) == 0.75
    assert scaling.ring_factor("reduce_scatter", 8) == 0.875
    with pytest.raises(ValueError, match="unknown collective"):
        scaling.ring_factor("broadcast", 2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_no_communication_at_tp_1(sequence_parallel):
    assert scaling.collectives(SMALL, 1, BATCH, SEQ, sequence_parallel) == []
    assert scaling.comm_bytes_per_gpu(SMALL, 1, BATCH, SEQ, sequence_parallel) == 0
    assert scaling.comm_ms(SMALL, 1, BATCH, SEQ, sequence_parallel, 450.0, 10.0) == 0


@pytest.mark.parametrize("tp, expected", [(2, 10504), (4, 15756)])
def test_comm_bytes_by_hand(tp, expected):
    # 4 all-reduces per layer × 2 layers + embedding (forward) + LM head input (backward) = 10 of
    # 1024 bytes, the loss's 64 + 192 bytes, 2 scalars of 4 bytes; a ring all-reduce sends
    # 2·(tp-1)/tp of each: tp 2: 1.0 · (10·1024 + 256 + 8) = 10504; tp 4: 1.5 · 10504 = 15756.
    assert scaling.comm_bytes_per_gpu(SMALL, tp, BATCH, SEQ, sequence_parallel=False) == expected


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_calls_and_bytes_by_hand(tp):
    plain = scaling.collectives(SMALL, tp, BATCH, SEQ, sequence_parallel=False)
    sequence = scaling.collectives(SMALL, tp, BATCH, SEQ, sequence_parallel=True)
    assert sum(c.count for c in plain) == 14  # 10 activation all-reduces, 2 for the loss, 2 scalars
    # the embedding's all-reduce; 9 all-gathers and 9 reduce-scatters (blocks, LM head); the
    # embedding gradient's all-gather; the loss's 2 and the 2 scalars; the replicated gradients
    assert sum(c.count for c in sequence) == 1 + 18 + 1 + 4 + 1
    # the replicated gradients: 2 layers × (2 LayerNorms of 64 + 2 biases of 32) + the final 64 =
    # 448 float32 parameters, 1792 bytes
    assert scaling.replicated_grad_params(SMALL) == 448
    # all-gather + reduce-scatter moves what an all-reduce does; on top: the embedding gradient's
    # all-gather and the replicated gradients' all-reduce
    extra = scaling.ring_factor("all_gather", tp) * 1024 + scaling.ring_factor("all_reduce", tp) * 1792
    assert scaling.comm_bytes_per_gpu(SMALL, tp, BATCH, SEQ, True) == pytest.approx(
        scaling.comm_bytes_per_gpu(SMALL, tp, BATCH, SEQ, False) + extra
    )


def _count_collectives(rank: int, port: int) -> None:
    """On one of 2 gloo ranks: the collectives of a tp=2 training step's forward and backward, counted
    as the code runs them, against the ones bench.scaling derives from the plan."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    parallel = init_from_env(tp=2, device_type="cpu")
    seen = Counter()

    def counted(kind: str, run, whole: int):  # whole: the argument that is the whole tensor
        def collective(*args, **kwargs):
            seen[kind, args[whole].numel()] += 1
            return run(*args, **kwargs)

        return collective

    collectives.dist.all_reduce = counted("all_reduce", dist.all_reduce, 0)
    collectives._all_gather_tensor = counted("all_gather", collectives._all_gather_tensor, 0)
    collectives._reduce_scatter_tensor = counted("reduce_scatter", collectives._reduce_scatter_tensor, 1)
    tokens = BATCH * SEQ
    for config in (SMALL, LLAMA_LIKE):
        for sequence_parallel in (False, True):
            seen.clear()
            p = dataclasses.replace(parallel, sequence_parallel=sequence_parallel)
            torch.manual_seed(0)
            model = parallelize(GPT(config), p)
            idx = torch.randint(
                0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
            )
            model.loss(idx, idx).backward()
            numel = {"activation": tokens * config.d_model, "row_max": tokens, "sums": 3 * tokens}
            expected = Counter()
            for (_, kind, tensor), count in scaling.plan_collectives(config, sequence_parallel).items():
                expected[kind, numel[tensor]] += count
            case = f"{config.mlp} sequence_parallel={sequence_parallel}"
            assert seen == expected, f"{case}: the step ran {dict(seen)}, the plan says {dict(expected)}"
    dist.destroy_process_group()


@pytest.mark.xdist_group("multiprocess")
def test_the_derived_collectives_are_the_ones_a_tp2_step_runs():
    mp.spawn(_count_collectives, args=(free_port(),), nprocs=2)


def test_comm_ms_is_bytes_over_bandwidth_plus_latency():
    # tp 2: 10504 bytes at 1 GB/s = 10.504 µs, plus 14 collectives × 2 µs.
    got = scaling.comm_ms(SMALL, 2, BATCH, SEQ, False, nvlink_gbps=1.0, latency_us=2.0)
    assert got == pytest.approx((10504 / 1e9 + 14 * 2e-6) * 1e3)


def test_dp_allreduce_by_hand():
    config = preset("gpt2-124m")
    assert scaling.dp_allreduce_ms(config, 8, 450.0, 10.0) == 0  # one replica per node
    # tp 2: 4 replicas; float32 gradients of the rank's parameters in 25 MiB buckets
    size = 4 * scaling.local_params(config, 2)
    buckets = -(-size // (25 * 2**20))
    expected = (1.5 * size / 1e9 + buckets * 2e-6) * 1e3
    assert scaling.dp_allreduce_ms(config, 2, nvlink_gbps=1.0, latency_us=2.0) == pytest.approx(expected)
    assert scaling.exposed_dp_ms(dp_ms=10.0, compute_ms=12.0) == pytest.approx(2.0)  # 10 - 2/3 · 12
    assert scaling.exposed_dp_ms(dp_ms=1.0, compute_ms=12.0) == 0


UNTIED = dataclasses.replace(LLAMA_LIKE, tie_embeddings=False)  # LLaMA's own LM head


@pytest.mark.parametrize(
    "config, tp",
    [
        (SMALL, 1),
        (SMALL, 2),
        (SMALL, 4),
        (LLAMA_LIKE, 1),
        (LLAMA_LIKE, 2),
        (UNTIED, 2),
        (preset("gpt2-350m"), 4),
    ],
)
def test_local_params_count_what_a_rank_holds(config, tp):
    with torch.device("meta"):
        rank = parallelize(GPT(config, "reference"), Parallel(tp_size=tp))
    assert scaling.local_params(config, tp) == rank.num_params()
    block = sum(p.numel() for p in rank.blocks[0].parameters())
    assert scaling.block_params(config, tp) == block
    assert scaling.root_params(config, tp) == rank.num_params() - config.n_layer * block
    if tp == 1:
        assert scaling.local_params(config, 1) == num_params(config)


def test_the_llama_shapes_are_llama_3s_sizes():
    assert num_params(scaling.LLAMA_SHAPES["llama-8b"]) == 8_030_261_248
    assert num_params(scaling.LLAMA_SHAPES["llama-70b"]) == 70_553_706_496


def _dp_bytes(config, layout) -> float:
    """Bytes a GPU sends in one step's data-parallel collectives (ring), by the model's list."""
    calls = scaling.data_parallel_collectives(config, layout)
    size = {"dp_shard": layout.dp_shard, "dp_replicate": layout.dp_replicate}
    return sum(c.count * scaling.ring_factor(c.kind, size[c.group]) * c.size_bytes for c in calls)


def test_fsdp_and_hsdp_collectives_and_state_by_hand():
    config, n = SMALL, SMALL.n_layer
    block, root = scaling.block_params(config, 1), scaling.root_params(config, 1)
    local = n * block + root
    fsdp = scaling.Layout(tp=1, dp_shard=4, dp_replicate=1)
    # float16 gathers: every block and the root before the forward, every block but the last again
    # before the backward; float32 reduce-scatters of every gradient; a ring moves 3/4 of each.
    gathered = 2 * (local + (n - 1) * block)
    assert _dp_bytes(config, fsdp) == pytest.approx(0.75 * (gathered + 4 * local))
    calls = {c.name: c.count for c in scaling.data_parallel_collectives(config, fsdp)}
    assert calls == {
        "root_gather": 1,
        "block_gather": n,
        "block_regather": n - 1,
        "block_grads": n,
        "root_grads": 1,
    }
    # HSDP: then each quarter of the float32 gradients all-reduced over the 2 replicas.
    hsdp = scaling.Layout(tp=1, dp_shard=4, dp_replicate=2)
    assert _dp_bytes(config, hsdp) == pytest.approx(_dp_bytes(config, fsdp) + 1.0 * 4 * local / 4)
    ddp = scaling.Layout(tp=1, dp_shard=1, dp_replicate=8)
    assert _dp_bytes(config, ddp) == pytest.approx(1.75 * 4 * local)
    # State: 16 bytes a parameter (+4 of DDP's buckets), or a quarter of 16 and the float16 root
    # and two blocks gathered.
    assert scaling.state_bytes_per_gpu(config, ddp) == 20 * local
    assert scaling.state_bytes_per_gpu(config, fsdp) == 16 * local / 4 + 2 * (root + 2 * block)


def test_what_the_compute_hides_and_which_links_carry_it():
    config = preset("gpt2-350m")
    fsdp = scaling.Layout(tp=2, dp_shard=4, dp_replicate=2)  # shards inside a node, replicas across
    total, exposed = scaling.data_parallel_ms(config, fsdp, 1e9, 450.0, 50.0, 0.0)
    # Behind ample compute, only what nothing can overlap: the first gathers (the root's, block 0's)
    # and the last reduce-scatters (block 0's, the root's) with their all-reduces over the replicas.
    one = {
        c.name: scaling.collective_ms(c, fsdp, 450.0, 50.0, 0.0)
        for c in scaling.data_parallel_collectives(config, fsdp)
    }
    first_and_last = (
        "root_gather",
        "block_gather",
        "block_grads",
        "root_grads",
        "block_replicas",
        "root_replicas",
    )
    assert exposed == pytest.approx(sum(one[name] for name in first_and_last))
    assert scaling.data_parallel_ms(config, fsdp, 0.0, 450.0, 50.0, 0.0) == pytest.approx((total, total))
    ddp = scaling.Layout(tp=2, dp_shard=1, dp_replicate=8)
    ddp_total, _ = scaling.data_parallel_ms(config, ddp, 0.0, 450.0, 50.0, 0.0)
    assert scaling.data_parallel_ms(config, ddp, 3.0, 450.0, 50.0, 0.0)[1] == pytest.approx(ddp_total - 2.0)
    # A shard group inside a node rides NVLink; one that spans nodes the links between them.
    gather = scaling.data_parallel_collectives(config, fsdp)[0]
    inside = scaling.collective_ms(gather, fsdp, 450.0, 50.0, 0.0)
    across = scaling.collective_ms(gather, scaling.Layout(2, 8, 1), 450.0, 50.0, 0.0)
    assert inside == pytest.approx(0.75 * gather.size_bytes / 450e9 * 1e3)
    assert across == pytest.approx(0.875 * gather.size_bytes / 50e9 * 1e3)


def test_memory_bound_work_of_the_stream_shrinks_with_tp_only_under_sequence_parallelism():
    config = preset("gpt2-350m")

    def norms(tp, sequence_parallel):  # what is left with the loss and the optimizer taken out
        total = scaling.memory_bytes_per_rank(config, tp, 8, 1024, sequence_parallel)
        per_logit = scaling.LOSS_BYTES_PER_LOGIT if tp == 1 else scaling.VOCAB_PARALLEL_LOSS_BYTES_PER_LOGIT
        loss = 8 * 1024 * config.vocab_size / tp * per_logit
        return total - loss - scaling.OPTIMIZER_BYTES_PER_PARAM * scaling.local_params(config, tp)

    stream = 8 * 1024 * config.d_model
    assert norms(1, False) == pytest.approx(49 * scaling.NORM_BYTES * stream)  # 2 · 24 layers + 1
    row_biases = 24 * 2 * scaling.ROW_BIAS_BYTES * stream
    assert norms(4, False) == pytest.approx(norms(1, False) + row_biases)
    assert norms(4, True) == pytest.approx((norms(1, False) + row_biases) / 4)


def test_flops_halve_with_tp():
    config = preset("gpt2-350m")
    assert scaling.flops_per_rank(config, 2, 8, 1024) == pytest.approx(
        scaling.flops_per_rank(config, 1, 8, 1024) / 2
    )


def test_step_and_throughput_arithmetic():
    row = scaling.Row("x", 2, compute_ms=6.0, comm_ms=2.0, dp_ms=5.0, comm_bytes_per_gpu=0.0)
    assert row.dp_exposed_ms == pytest.approx(1.0)  # 5 - 2/3 · 6
    assert row.step_ms == pytest.approx(9.0)
    per_gpu, per_group, per_node = scaling.tokens_per_s(8192, 8.0, tp=2)
    assert per_group == pytest.approx(8192 / 8e-3)
    assert per_gpu == pytest.approx(per_group / 2)
    assert per_node == pytest.approx(per_group * 4)
    entries = scaling.row_dicts([scaling.Row("x", 1, 10.0, 0.0, 0.0, 0.0), row], 8192)
    assert entries[1]["efficiency"] == pytest.approx(10.0 / (2 * 9.0))
    assert entries[1]["comm_fraction"] == pytest.approx(3.0 / 9.0)
    assert entries[0]["comm_fraction"] == 0


def test_no_gpu_table_is_labelled_estimated_with_n_a_rows(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_json = tmp_path / "scaling.json"
    scaling.main(["--presets", "gpt2-124m", "gpt2-1.5b", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "ESTIMATED (no GPU: roofline at 50% of 989 TFLOP/s peak, 4300 GB/s HBM), not measured" in out
    assert "gpt2-124m   8 n/a: tensor parallel size 8 must divide n_head 12" in out
    assert "gpt2-1.5b   2 n/a: tensor parallel size 2 must divide n_head 25" in out
    assert "of the reference 2.15M tokens/s" in out
    saved = json.loads(out_json.read_text())
    assert saved["settings"]["measured"] is False
    rows = {(r["preset"], r["tp"]): r for r in saved["rows"]}
    assert rows[("gpt2-124m", 8)]["step_ms"] is None and rows[("gpt2-124m", 8)]["reason"]
    assert rows[("gpt2-124m", 1)]["comm_ms"] == 0 and rows[("gpt2-124m", 1)]["efficiency"] == 1
    assert rows[("gpt2-124m", 4)]["comm_bytes_per_gpu"] > rows[("gpt2-124m", 2)]["comm_bytes_per_gpu"]
    assert rows[("gpt2-124m", 4)]["efficiency"] < 1


@pytest.mark.parametrize("config", [SMALL, LLAMA_LIKE], ids=["gpt2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_rank_step_a_gpu_would_time_runs_and_trains(config, tp):
    step, model = scaling.rank_step(config, tp, BATCH, SEQ, "cpu")
    assert model.num_params() == scaling.local_params(config, tp)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):  # the loss scaler may skip the first fp16 steps while its scale settles (hysteresis 2)
        step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_the_data_parallel_table_is_estimated_and_picks_a_layout_that_fits(capsys, tmp_path):
    out_json = tmp_path / "scaling.json"
    scaling.main(["--presets", "gpt2-124m", "--models", "gpt2-350m", "llama-70b", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "Data parallelism over 2 node(s) of 8 GPUs: DDP, FSDP2 and HSDP, ESTIMATED" in out
    rows = {(r["model"], r["layout"]): r for r in json.loads(out_json.read_text())["data_parallel_rows"]}
    assert rows[("llama-70b", "tp 8 x DDP 2")]["fits"] is False  # 70.6B x 20 bytes / 8 = 176 GB a GPU
    assert rows[("llama-70b", "tp 8 x dp_shard 2 x dp_replicate 1")]["fits"] is True
    picked = [line for line in out.splitlines() if line.startswith("llama-70b on 2 node(s): ")]
    assert len(picked) == 1 and "dp_shard" in picked[0]


def test_bad_flags_fail_before_any_work():
    with pytest.raises(ValueError, match="unknown preset"):
        scaling.parse_args(["--presets", "gpt9"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--tp", "3"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--sequence-parallel", "--seq-len", "1022"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--models", "llama-9b"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--nodes", "0"])
