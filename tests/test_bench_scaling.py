"""The tensor-parallel step model of bench/scaling.py: byte counts, ring factors, step arithmetic, the
table's n/a rows and its ESTIMATED label. No timing is asserted; everything runs on the CPU."""

import json

import pytest
import torch

from bench import scaling
from horse.model import GPTConfig, num_params, preset

# B·T = 16 tokens of width 32: one (B·T, d_model) float16 activation is 16·32·2 = 1024 bytes, the
# cross entropy's (B·T,) float32 row max 64 bytes and its (2, B·T) sums 128.
SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
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


@pytest.mark.parametrize("tp, expected", [(2, 10440), (4, 15660)])
def test_comm_bytes_by_hand(tp, expected):
    # 4 all-reduces per layer × 2 layers + embedding (forward) + LM head input (backward) = 10 of
    # 1024 bytes, the loss's 64 + 128 bytes, 2 scalars of 4 bytes; a ring all-reduce sends
    # 2·(tp-1)/tp of each: tp 2: 1.0 · (10·1024 + 192 + 8) = 10440; tp 4: 1.5 · 10440 = 15660.
    assert scaling.comm_bytes_per_gpu(SMALL, tp, BATCH, SEQ, sequence_parallel=False) == expected


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_moves_the_same_activation_bytes_in_twice_the_calls(tp):
    plain = scaling.collectives(SMALL, tp, BATCH, SEQ, sequence_parallel=False)
    sequence = scaling.collectives(SMALL, tp, BATCH, SEQ, sequence_parallel=True)
    assert sum(c.count for c in plain) == 14  # 10 activation all-reduces, 2 for the loss, 2 scalars
    # 10 all-gathers, 10 reduce-scatters, the same 4 all-reduces, 1 of the replicated gradients
    assert sum(c.count for c in sequence) == 25
    # the replicated gradients: 2 layers × (2 LayerNorms of 64 + 2 biases of 32) + the final 64 =
    # 448 float32 parameters, 1792 bytes
    assert scaling.replicated_grad_params(SMALL) == 448
    extra = scaling.ring_factor("all_reduce", tp) * 1792
    assert scaling.comm_bytes_per_gpu(SMALL, tp, BATCH, SEQ, True) == pytest.approx(
        scaling.comm_bytes_per_gpu(SMALL, tp, BATCH, SEQ, False) + extra
    )


def test_comm_ms_is_bytes_over_bandwidth_plus_latency():
    # tp 2: 10440 bytes at 1 GB/s = 10.44 µs, plus 14 collectives × 2 µs.
    got = scaling.comm_ms(SMALL, 2, BATCH, SEQ, False, nvlink_gbps=1.0, latency_us=2.0)
    assert got == pytest.approx((10440 / 1e9 + 14 * 2e-6) * 1e3)


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m"])
def test_local_params_at_tp_1_count_the_whole_model(name):
    config = preset(name)
    assert scaling.local_params(config, 1) == num_params(config)


def test_local_params_shard_everything_but_the_replicated_parts():
    d, v, hidden, layers = SMALL.d_model, SMALL.vocab_size, SMALL.hidden, SMALL.n_layer
    # replicated: norms (weight + bias) twice per block and once at the end, c_proj's and the MLP
    # output's biases, the position table
    replicated = layers * (2 * 2 * d + 2 * d) + 2 * d + SMALL.block_size * d
    sharded = num_params(SMALL) - replicated
    assert scaling.local_params(SMALL, 2) == replicated + sharded // 2
    assert sharded == layers * (3 * d * d + 3 * d + d * d + 2 * d * hidden + hidden) + v * d


def test_step_and_throughput_arithmetic():
    row = scaling.Row("x", 2, compute_ms=6.0, comm_ms=2.0, comm_bytes_per_gpu=0.0)
    assert row.step_ms == 8.0
    per_gpu, per_node = scaling.tokens_per_s(8192, row.step_ms, tp=2)
    assert per_gpu == pytest.approx(8192 / 8e-3 / 2)
    assert per_node == pytest.approx(8192 / 8e-3 * 4)
    entries = scaling.row_dicts([scaling.Row("x", 1, 10.0, 0.0, 0.0), row], 8192)
    assert entries[1]["efficiency"] == pytest.approx(10.0 / (2 * 8.0))
    assert entries[1]["comm_fraction"] == pytest.approx(0.25)


def test_flops_halve_with_tp():
    config = preset("gpt2-350m")
    assert scaling.flops_per_rank(config, 2, 8, 1024) == pytest.approx(
        scaling.flops_per_rank(config, 1, 8, 1024) / 2
    )


def test_no_gpu_table_is_labelled_estimated_with_n_a_rows(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_json = tmp_path / "scaling.json"
    scaling.main(["--presets", "gpt2-124m", "gpt2-1.5b", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "ESTIMATED (no GPU: roofline at 50% of 989 TFLOP/s peak), not measured" in out
    assert "gpt2-124m   8 n/a: tensor parallel size 8 must divide n_head 12" in out
    assert "gpt2-1.5b   2 n/a: tensor parallel size 2 must divide n_head 25" in out
    assert "of the reference 2.15M tokens/s" in out
    saved = json.loads(out_json.read_text())
    assert saved["settings"]["measured"] is False
    rows = {(r["preset"], r["tp"]): r for r in saved["rows"]}
    assert rows[("gpt2-124m", 8)]["step_ms"] is None and rows[("gpt2-124m", 8)]["reason"]
    assert rows[("gpt2-124m", 1)]["comm_ms"] == 0 and rows[("gpt2-124m", 1)]["efficiency"] == 1
    assert rows[("gpt2-124m", 4)]["comm_bytes_per_gpu"] > rows[("gpt2-124m", 2)]["comm_bytes_per_gpu"]


def test_bad_flags_fail_before_any_work():
    with pytest.raises(ValueError, match="unknown preset"):
        scaling.parse_args(["--presets", "gpt9"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--tp", "3"])
