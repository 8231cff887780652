"""CPU tests of the attention tuner: its neighbourhood, its descent, its compile filter, its CLI."""

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import tune
from kernels.attention import AttnConfig

ROOT = Path(__file__).resolve().parents[1]


def test_neighbours_change_one_thing_within_range():
    cfg = AttnConfig(128, 128, 8, 3)
    got = set(tune.neighbours(cfg))
    assert got == {
        AttnConfig(64, 128, 8, 3), AttnConfig(256, 128, 8, 3), AttnConfig(128, 64, 8, 3),
        AttnConfig(128, 256, 8, 3), AttnConfig(128, 128, 4, 3), AttnConfig(128, 128, 8, 2),
        AttnConfig(128, 128, 8, 4), AttnConfig(128, 128, 8, 3, tma=False),
    }  # fmt: skip
    assert set(tune.neighbours(cfg, persistent=True)) == got | {AttnConfig(128, 128, 8, 3, programs_per_sm=1)}
    assert AttnConfig(128, 128, 8, 3, programs_per_sm=1) in tune.neighbours(
        AttnConfig(128, 128, 8, 3, programs_per_sm=2), persistent=True
    )
    edge = set(tune.neighbours(AttnConfig(16, 256, 4, 1, column_splits=2, tma=False)))
    assert AttnConfig(8, 256, 4, 1, 2, False) not in edge and AttnConfig(16, 512, 4, 1, 2, False) not in edge
    assert AttnConfig(16, 256, 4, 0, 2, False) not in edge
    assert all(c.tma is False for c in edge)  # no TMA variant of a split pass


def _synthetic(best: AttnConfig, broken=()):
    """A measure whose time grows with the distance from best; configs in broken do not compile."""
    calls = []

    def measure(cfg):
        calls.append(cfg)
        if cfg in broken:
            return tune.Measurement(dataclasses.asdict(cfg), compiled=False)
        distance = sum(
            getattr(cfg, f) != getattr(best, f) for f in ("block_m", "block_n", "num_warps", "tma")
        )
        distance += abs(cfg.num_stages - best.num_stages)
        ms = 1.0 + distance
        return tune.Measurement(dataclasses.asdict(cfg), True, True, {"full": ms}, {"full": 100 / ms})

    return measure, calls


def test_descent_reaches_the_fastest_and_measures_each_config_once():
    target = AttnConfig(64, 64, 4, 4, tma=False)
    measure, calls = _synthetic(target, broken={AttnConfig(128, 64, 8, 3)})
    best, measurements = tune.descend(AttnConfig(128, 128, 8, 3), measure, deadline=float("inf"))
    assert best == target
    assert len(calls) == len(set(calls)) == len(measurements)
    assert all(m.total_ms == float("inf") for m in measurements if not m.compiled)


def test_descent_keeps_the_table_entry_without_a_clear_gain():
    start = AttnConfig(128, 128, 8, 3)

    def measure(cfg):  # every neighbour 1 % faster: noise, not a gain
        return tune.Measurement(dataclasses.asdict(cfg), True, True, {"full": 1.0 if cfg == start else 0.99})

    best, measurements = tune.descend(start, measure, deadline=float("inf"))
    assert best == start and len(measurements) == 1 + len(tune.neighbours(start))


def test_descent_stops_at_the_deadline():
    ticks = itertools.count()
    measure, calls = _synthetic(AttnConfig(16, 16, 4, 1))
    tune.descend(AttnConfig(128, 128, 8, 3), measure, deadline=5, clock=lambda: next(ticks))
    assert 1 <= len(calls) <= 5


def test_wrong_results_never_win():
    start = AttnConfig(128, 128, 8, 3)

    def measure(cfg):
        wrong = cfg != start
        return tune.Measurement(dataclasses.asdict(cfg), True, not wrong, {"full": 0.1 if wrong else 1.0})

    assert tune.descend(start, measure, deadline=float("inf"))[0] == start


def test_compile_filter_passes_the_table_and_rejects_shared_memory_over_budget():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    script = (
        "from bench import tune; from kernels import attention; "
        "print(tune.compiles_clean('attn_fwd', attention.FWD_CONFIGS[64], 64)); "
        "print(tune.compiles_clean('attn_fwd', attention.AttnConfig(128, 256, 8, 4, tma=False), 128))"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    table_entry, too_big = run.stdout.splitlines()
    assert table_entry.startswith("(True, 'registers ")
    assert too_big.startswith("(False, ") and "shared memory" in too_big


def test_tune_reports_each_pass_as_strict_json(monkeypatch, capsys):
    from kernels import attention

    target = AttnConfig(64, 32, 4, 2, tma=False)
    monkeypatch.setattr(tune, "gpu_measure", lambda *args: _synthetic(target, broken={target})[0])
    before = dict(attention.BWD_DQ_CONFIGS)
    report = tune.tune(["fwd", "bwd_dq"], [64, 80], seqlen=4096, seconds=60)
    assert list(report["passes"]) == ["fwd d=64", "fwd d=80", "bwd_dq d=64", "bwd_dq d=80"]
    entry = report["passes"]["bwd_dq d=64"]
    assert entry["table"] == dataclasses.asdict(attention.BWD_DQ_CONFIGS[64])
    assert entry["best"] != dataclasses.asdict(target)  # it did not compile
    json.dumps(report, allow_nan=False)
    assert attention.BWD_DQ_CONFIGS == before  # the tables are never changed for good
    assert "== fwd d=64: table 128x64 w4 s3 tma, best " in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CLI would tune")
def test_cli_needs_a_gpu():
    with pytest.raises(SystemExit) as exit_info:
        tune.main(["--seconds", "1"])
    assert exit_info.value.code == 2
