"""CPU tests of the table tuner: its neighbourhood, its descent, its targets, its compile filter, its
measurement plumbing (timing faked) and its CLI."""

import copy
import dataclasses
import importlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import timing, tune
from horse.kernels import runtime
from horse.kernels.attention import configs as attention_configs
from horse.kernels.attention.configs import AttnConfig
from horse.kernels.mlp import configs as mlp_configs
from horse.kernels.mlp.configs import GemmConfig

ROOT = Path(__file__).resolve().parents[1]


def test_attention_neighbours_change_one_thing_within_range():
    cfg = AttnConfig(128, 128, 8, 3)
    got = set(tune.neighbours(cfg))
    assert got == {
        AttnConfig(64, 128, 8, 3), AttnConfig(256, 128, 8, 3), AttnConfig(128, 64, 8, 3),
        AttnConfig(128, 256, 8, 3), AttnConfig(128, 128, 4, 3), AttnConfig(128, 128, 8, 2),
        AttnConfig(128, 128, 8, 4), AttnConfig(128, 128, 8, 3, tma=False),
    }  # fmt: skip
    edge = set(tune.neighbours(AttnConfig(16, 256, 4, 1, column_splits=2, tma=False)))
    assert AttnConfig(8, 256, 4, 1, 2, False) not in edge and AttnConfig(16, 512, 4, 1, 2, False) not in edge
    assert AttnConfig(16, 256, 4, 0, 2, False) not in edge
    assert all(c.tma is False for c in edge)  # no TMA variant of a split pass
    assert got - set(tune.neighbours(cfg, tma=False)) == {AttnConfig(128, 128, 8, 3, tma=False)}  # no TMA


def test_gemm_neighbours_vary_block_k_and_the_epilogue_split():
    cfg = GemmConfig(128, 256, 64, 8, 8, 3, epilogue_split=4)
    got = set(tune.neighbours(cfg))
    assert GemmConfig(128, 256, 32, 8, 8, 3, epilogue_split=4) in got
    assert GemmConfig(128, 256, 128, 8, 8, 3, epilogue_split=4) in got
    assert GemmConfig(128, 256, 64, 8, 8, 3, epilogue_split=2) in got
    assert GemmConfig(128, 256, 64, 8, 8, 3, epilogue_split=4, tma=False) in got
    assert not any(c.epilogue_split == 8 or c.group_m != 8 for c in got)
    assert len(got) == 10  # m, n (256 doubles past the range), k twice, warps, stages twice, tma, split


def _synthetic(best, broken=()):
    """A measure whose time grows with the distance from best; configs in broken do not compile."""
    calls = []

    def measure(cfg):
        calls.append(cfg)
        if cfg in broken:
            return tune.Measurement(dataclasses.asdict(cfg), compiled=False)
        here, there = dataclasses.asdict(cfg), dataclasses.asdict(best)
        distance = sum(here[f] != there[f] for f in here if f != "num_stages")
        ms = 1.0 + distance + abs(cfg.num_stages - best.num_stages)
        return tune.Measurement(here, True, True, {"full": ms}, {"full": 100 / ms})

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


def test_targets_start_from_the_entries_and_shapes_of_their_class():
    from horse.kernels import mlp

    fwd, packed, dq = tune.attention_targets(["fwd", "bwd_dq"], [64], seqlen=4096)
    assert fwd.entry == attention_configs.FWD_CONFIGS["sm90"][64] and fwd.tma
    # Packed batches load by TMA through per-sequence descriptors.
    assert packed.entry == attention_configs.PACKED_FWD_CONFIGS["sm90"][64] and packed.tma
    assert dq.entry == attention_configs.BWD_DQ_CONFIGS["sm90"][64]
    targets = tune.mlp_targets(["fwd", "gated_fwd", "dh_bwd", "gated_dh_bwd"], ["large", "medium"])
    assert len(targets) == 8  # each (gemm, class) shape checked to fall in its class
    assert targets[0].entry == mlp.configs.GEMM_CONFIGS["sm90"]["fwd"]["large"]
    a100, a100_packed = tune.attention_targets(["fwd"], [128], seqlen=4096, arch=runtime.SM80)
    assert a100.entry == attention_configs.FWD_CONFIGS["sm80"][128] and not a100.tma  # no TMA before sm_90
    assert a100_packed.entry == attention_configs.PACKED_FWD_CONFIGS["sm80"][128]


def _fake_target(entry, check, calls=lambda cfg: {"full": (lambda: None, 2e12)}):
    return tune.Target("fake", entry, lambda cfg: [], check, calls)


def test_measure_passes_the_candidate_to_the_check_and_the_calls(monkeypatch):
    monkeypatch.setattr(
        timing, "time_gpu", lambda fn, inputs, **kw: (fn(inputs[0]), timing.Timing(4.0, 3, 5, 30))[1]
    )
    entry, candidate = AttnConfig(128, 64, 4, 3), AttnConfig(64, 64, 4, 3)
    checked, timed = [], []

    def calls(cfg):
        return {"full": (lambda: timed.append(cfg), 2e12)}

    measure = tune.gpu_measure(_fake_target(entry, lambda cfg: checked.append(cfg) or True, calls))
    result = measure(candidate)
    assert checked == timed == [candidate]
    assert result.correct and result.ms == {"full": 4.0} and result.tflops == {"full": 500.0}

    def launch_fails(cfg):
        raise RuntimeError("out of resource: shared memory")

    result = tune.gpu_measure(_fake_target(entry, launch_fails))(candidate)
    assert result.correct is False and "shared memory" in result.note


@pytest.fixture
def tiny_targets_on_the_cpu(monkeypatch):
    """The real targets on shapes small enough for the interpreter, timing faked (one real call)."""
    from bench import attention as bench_attention
    from bench import mlp as bench_mlp

    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setattr(tune, "CHECK_SEQLEN", 21)
    monkeypatch.setattr(
        bench_attention, "benchmark_shape", lambda seqlen, d: bench_attention.Shape(1, 40, 2, d)
    )
    monkeypatch.setattr(bench_attention, "PACKED_LENGTHS", (17, 1, 30))
    tiny = (bench_mlp.Model("tiny", 48, 80, gated=False), bench_mlp.Model("tiny-gated", 40, 96, gated=True))
    monkeypatch.setattr(bench_mlp, "MODELS", tiny)
    shapes = {(g, "medium"): ("tiny-gated" if "gated" in g else "tiny", 100) for g, _ in tune.MLP_SHAPES}
    monkeypatch.setattr(tune, "MLP_SHAPES", shapes)
    monkeypatch.setattr(
        timing, "time_gpu", lambda fn, inputs, **kw: (fn(inputs[0]), timing.Timing(1.0, 1, 1, 2))[1]
    )


def _tables() -> dict:
    """Every attention and GEMM table, copied."""
    names = ("FWD_CONFIGS", "PACKED_FWD_CONFIGS", "BWD_DKDV_CONFIGS", "BWD_DQ_CONFIGS", "DECODE_CONFIGS")
    tables = {name: getattr(attention_configs, name) for name in names}
    return copy.deepcopy(tables | {"GEMM_CONFIGS": mlp_configs.GEMM_CONFIGS})


# The plan function that launches each target's kernel: (family, pass or GEMM) -> (module, function).
TARGET_PLANS = {
    ("attention", "fwd"): ("horse.kernels.attention.launch", "fwd_plan"),
    ("attention", "bwd_dkdv"): ("horse.kernels.attention.launch", "dkdv_plans"),
    ("attention", "bwd_dq"): ("horse.kernels.attention.launch", "dq_plan"),
    ("mlp", "fwd"): ("horse.kernels.mlp.launch", "fwd_plan"),
    ("mlp", "gated_fwd"): ("horse.kernels.mlp.launch", "fwd_plan"),
    ("mlp", "dh_bwd"): ("horse.kernels.mlp.launch", "dh_plan"),
    ("mlp", "gated_dh_bwd"): ("horse.kernels.mlp.launch", "dh_plan"),
}


@pytest.fixture
def plans_seen(monkeypatch) -> list:
    """Every call of a plan function of TARGET_PLANS, recorded as (module, function, its entry, whether
    every table was as before at the call)."""
    before, seen = _tables(), []

    def recording(plan, where):
        def record(entry, *args, **kwargs):
            seen.append((*where, entry, _tables() == before))
            return plan(entry, *args, **kwargs)

        return record

    for module_name, name in set(TARGET_PLANS.values()):
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, recording(getattr(module, name), (module_name, name)))
    return seen


@pytest.mark.interpreter
def test_every_target_checks_and_times_a_candidate_with_the_tables_untouched(
    tiny_targets_on_the_cpu, plans_seen
):
    # The launchers run the candidate given, its tiles too (the table's entries get the interpreter's).
    targets = tune.attention_targets(list(tune.ATTENTION_PASSES), [64], seqlen=4096)
    assert [t.title for t in targets if "fwd" in t.title] == [
        "attention fwd d=64 (sm90)",
        "attention fwd packed d=64 (sm90)",
    ]
    targets += tune.mlp_targets(["fwd", "gated_fwd", "dh_bwd", "gated_dh_bwd"], ["medium"])
    for target in targets:
        target.compile_configs = lambda cfg: []  # the sm_90 compile needs TRITON_INTERPRET unset
        plan = TARGET_PLANS[tuple(target.title.split()[:2])]
        for candidate in (target.entry, *tune.neighbours(target.entry)[-2:]):
            plans_seen.clear()
            result = tune.gpu_measure(target)(candidate)
            assert result.correct, (target.title, candidate, result.note)
            modes = {"causal"} if "packed" in target.title else {"full", "causal"}
            assert set(result.ms) == ({"gemm"} if target.title.startswith("mlp") else modes)
            # The target's kernel planned with the candidate at every launch, checked and timed ...
            entries = [entry for *where, entry, _ in plans_seen if tuple(where) == plan]
            assert len(entries) >= 2 and set(entries) == {candidate}, (target.title, entries)
            # ... and every table as it was while it ran.
            assert all(unchanged for *_, unchanged in plans_seen), target.title


@pytest.mark.interpreter
def test_a_candidate_that_computes_wrong_fails_its_check(tiny_targets_on_the_cpu, monkeypatch):
    from horse.kernels.mlp import launch as mlp_launch

    [dkdv] = tune.attention_targets(["bwd_dkdv"], [64], seqlen=4096)
    [dh] = tune.mlp_targets(["gated_dh_bwd"], ["medium"])
    assert dkdv.check(dkdv.entry) and dh.check(dh.entry)
    attention_bwd, dh_act_bwd = tune.attention_bwd, mlp_launch._dh_act_bwd

    def dk_off(*args, **kwargs):
        dq, dk, dv, dsinks = attention_bwd(*args, **kwargs)
        return dq, 1.05 * dk, dv, dsinks

    def dpre_off(*args, **kwargs):
        dpre, h, db = dh_act_bwd(*args, **kwargs)
        return 1.05 * dpre, h, db

    monkeypatch.setattr(tune, "attention_bwd", dk_off)
    monkeypatch.setattr(mlp_launch, "_dh_act_bwd", dpre_off)
    assert not dkdv.check(dkdv.entry) and not dh.check(dh.entry)


def test_compile_filter_passes_the_tables_and_rejects_shared_memory_over_budget():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    script = (
        "from bench import tune; from horse.kernels.attention import configs; "
        "from horse.kernels.mlp.configs import GEMM_CONFIGS; "
        "[fwd, packed] = tune.attention_targets(['fwd'], [128], 4096); "
        "[gemm] = tune.mlp_targets(['fwd'], ['medium']); "
        "print(tune.compiles_clean(fwd.compile_configs(configs.FWD_CONFIGS['sm90'][128]))); "
        "print(tune.compiles_clean(fwd.compile_configs(configs.AttnConfig(128, 256, 8, 4, tma=False)))); "
        "print(tune.compiles_clean(gemm.compile_configs(GEMM_CONFIGS['sm90']['fwd']['medium']))); "
        "variants = packed.compile_configs(configs.PACKED_FWD_CONFIGS['sm90'][128]); "
        "print(tune.compiles_clean(variants)); print(sorted(c.shape_class for c in variants))"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    attention_entry, too_big, gemm_entry, packed_entry, packed_variants = run.stdout.splitlines()
    for entry in (attention_entry, gemm_entry, packed_entry):
        assert entry.startswith("(True, 'registers "), entry
    assert packed_variants == str(["d=128 causal tma varlen", "d=128 local tma varlen", "d=128 tma varlen"])
    assert too_big.startswith("(False, ") and "shared memory" in too_big


def test_tune_reports_each_target_as_strict_json(capsys):
    best = GemmConfig(64, 64, 32, 8, 4, 2)
    table = {"large": GemmConfig(128, 128, 64, 8, 8, 4), "medium": GemmConfig(64, 128, 64, 8, 4, 4)}
    targets = [_fake_target(entry, lambda cfg: True) for entry in table.values()]
    for target, key in zip(targets, table, strict=True):
        target.title = f"fake {key}"
    report = tune.tune(targets, seconds=60, make_measure=lambda t: _synthetic(best, broken={best})[0])
    assert list(report) == ["fake large", "fake medium"]
    assert report["fake medium"]["table"] == dataclasses.asdict(table["medium"])
    assert report["fake medium"]["best"] != dataclasses.asdict(best)  # it did not compile
    json.dumps(report, allow_nan=False)
    assert "== fake large: table 128x128x64 w8 s4 tma, best " in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CLI would tune")
@pytest.mark.parametrize("family", ["attention", "mlp"])
def test_cli_needs_a_gpu(family):
    with pytest.raises(SystemExit) as exit_info:
        tune.main([family, "--seconds", "1"])
    assert exit_info.value.code == 2


def test_attention_candidates_start_from_the_entry_and_never_grow_the_tile():
    start = AttnConfig(128, 64, 8, 3)
    got = tune.attention_candidates("attn_fwd", start, 128, tma=True)
    assert got[0] == start and len(got) == len(set(got))
    assert all(c.block_n <= c.block_m and c.block_m * c.block_n <= 128 * 64 for c in got)
    assert all(c.column_splits == 1 for c in got)
    areas = [c.block_m * c.block_n for c in got[1:]]
    assert areas == sorted(areas, reverse=True) and got[-1].block_m * got[-1].block_n == 16 * 16
    # start's tile and warps first: TMA before pointers, then fewer stages
    assert got[1:3] == [dataclasses.replace(start, tma=False), dataclasses.replace(start, num_stages=2)]
    assert {c.tma for c in got} == {True, False}
    dkdv = tune.attention_candidates("attn_bwd_dkdv", AttnConfig(64, 128, 8, 2, tma=False), 256, tma=False)
    assert all(c.block_m <= c.block_n and not c.tma for c in dkdv)
    assert {c.column_splits for c in dkdv} == {1, 2}
    assert {c.column_splits for c in tune.attention_candidates("attn_bwd_dkdv", dkdv[0], 128, False)} == {1}
    split_outputs = AttnConfig(64, 128, 8, 1, split_outputs=True)  # its kernel takes whole head-dim rows
    descent = tune.attention_candidates("attn_bwd_dkdv", split_outputs, 256, tma=True)
    assert {c.column_splits for c in descent} == {1}


def test_gemm_candidates_keep_32_columns_an_epilogue_subtile():
    start = GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=4, tma=False)
    got = tune.gemm_candidates(start, tma=False)
    assert got[0] == start and len(got) == len(set(got))
    assert all(c.block_m * c.block_n <= 128 * 128 and c.block_n // c.epilogue_split >= 32 for c in got)
    assert all(not c.tma and c.group_m == 8 for c in got)
    # among the tiles of start's size, start's shape (not 64x256) comes first, deepest pipeline first
    assert got[1] == GemmConfig(128, 128, 64, 8, 8, 4, epilogue_split=1, tma=False)
    assert GemmConfig(64, 256, 64, 8, 8, 4, tma=False) in got
    assert got.index(GemmConfig(64, 256, 64, 8, 8, 4, tma=False)) > got.index(
        GemmConfig(128, 128, 32, 8, 4, 2, tma=False)
    )


def _clean_below(max_area, calls):
    """A compile_batch whose configs spill when their tile holds more than max_area scores."""
    from bench.compile_report.compiler import CompileResult

    def compile_batch(configs):
        calls.append(len(configs))
        area = [c.constexprs["BLOCK_M"] * c.constexprs["BLOCK_N"] for c in configs]
        return [
            CompileResult(c, 128, 8 * (a > max_area), 1024, 16, 0, 0)
            for c, a in zip(configs, area, strict=True)
        ]

    return compile_batch


def test_search_keeps_the_first_clean_candidate_and_says_why_each_before_failed(capsys):

    [search] = tune.attention_searches(["bwd_dq"], [96], runtime.SM86, start_from=runtime.SM90)
    assert search.table_entry == attention_configs.BWD_DQ_CONFIGS["sm86"][128]
    assert search.candidates[0] == dataclasses.replace(
        attention_configs.BWD_DQ_CONFIGS["sm90"][128], tma=False
    )
    calls = []
    report = tune.search_entries([search], _clean_below(64 * 64, calls), batch=2)
    result = report[search.title]
    assert search.title == "attention bwd_dq d=128 (sm86)"
    clean = AttnConfig(**result["clean"])
    assert clean.block_m * clean.block_n == 64 * 64 and clean == search.candidates[len(result["rejected"])]
    assert all(r["config"]["block_m"] * r["config"]["block_n"] > 64 * 64 for r in result["rejected"])
    assert all("spills 8 bytes" in r["reason"] for r in result["rejected"])
    # a failing candidate costs one batch; the clean one compiles every variant (padded and packed)
    variants = len(search.variants(clean))
    assert variants == 3 * 2 * 2 * 2 and sum(calls) == 2 * len(result["rejected"]) + variants
    json.dumps(report, allow_nan=False)
    out = capsys.readouterr().out
    assert out.startswith("== attention bwd_dq d=128 (sm86): from 128x64 w8 s2, first clean 128x32 w8 s3")


def test_search_reports_none_when_nothing_is_clean_and_stops_at_the_deadline():
    searches = tune.mlp_searches(["fwd", "dh_bwd"], ["small"], runtime.SM80)
    assert [s.title for s in searches] == ["mlp fwd small (sm80)", "mlp dh_bwd small (sm80)"]
    report = tune.search_entries(searches[:1], _clean_below(0, []), batch=4)
    assert report["mlp fwd small (sm80)"]["clean"] is None
    assert len(report["mlp fwd small (sm80)"]["rejected"]) == len(searches[0].candidates)
    ticks = itertools.count()
    report = tune.search_entries(searches, _clean_below(0, []), seconds=3, clock=lambda: next(ticks))
    assert sum(len(r["rejected"]) for r in report.values()) <= 3


def test_a_compile_error_is_a_reason_not_a_crash():
    def broken(configs):
        raise RuntimeError("PassManager::run failed\n  in tritongpu")

    [search] = tune.mlp_searches(["fwd"], ["small"], runtime.SM80)
    search.candidates = search.candidates[:2]
    report = tune.search_entries([search], broken)
    reasons = [r["reason"] for r in report[search.title]["rejected"]]
    assert reasons == ["does not compile: PassManager::run failed in tritongpu"] * 2


def test_a_search_built_for_several_gpus_needs_every_variant_clean_on_each():
    from bench.compile_report.compiler import CompileResult

    [search] = tune.attention_searches(["bwd_dq"], [16], runtime.SM86)
    several = tune.built_for(search, [86, 89, 120])
    assert several.title == "attention bwd_dq d=16 (sm86 as sm_86/sm_89/sm_120)"
    assert several.candidates == search.candidates and several.table_entry == search.table_entry
    start = search.candidates[0]
    one = search.variants(start)
    built = several.variants(start)
    assert len(built) == 3 * len(one)
    first = [(v.target_capability, v.shape_class) for v in built[:3]]
    assert first == [(c, one[0].shape_class) for c in (86, 89, 120)]  # each variant on every GPU in turn
    assert [dataclasses.replace(v, capability=0) for v in built[::3]] == one

    def spills_on_120_above(area):  # a stand-in compiler: the GPU of 12.0 spills the larger tiles
        def compile_batch(configs):
            return [
                CompileResult(c, 128, 8 * (c.target_capability == 120 and c.constexprs["BLOCK_M"]
                                           * c.constexprs["BLOCK_N"] > area), 1024, 16, 0, 0)
                for c in configs
            ]  # fmt: skip

        return compile_batch

    area = start.block_m * start.block_n // 2
    own = tune.search_entries([search], spills_on_120_above(area))[search.title]
    assert own["clean"] == dataclasses.asdict(start) and own["rejected"] == []
    result = tune.search_entries([several], spills_on_120_above(area))[several.title]
    clean = AttnConfig(**result["clean"])
    assert clean.block_m * clean.block_n == area and result["rejected"]
    assert all(r["reason"].startswith("sm86 as sm_120 attn_bwd_dq ") for r in result["rejected"])
    assert all(r["reason"].endswith("spills 8 bytes") for r in result["rejected"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["attention", "--compile-only", "--arch", "sm86", "--capability", "86", "90"], "takes sm90's"),
        (["mlp", "--compile-only", "--arch", "sm80", "--capability", "75"], "takes no family's entries"),
        (["attention", "--capability", "120"], "go with --compile-only"),
        (["mlp", "--compile-only"], "--arch"),
        (["mlp", "--compile-only", "--arch", "sm80"], "TRITON_INTERPRET"),
        (["attention", "--arch", "sm80"], "go with --compile-only"),
        (["attention", "--compile-only", "--arch", "sm80", "--head-dims", "513"], "--head-dims"),
    ],
)
def test_compile_only_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_compile_only_cli_finds_a_real_entry_clean(tmp_path):
    from horse.kernels import mlp

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    out = tmp_path / "search.json"
    argv = ["mlp", "--compile-only", "--arch", "sm80", "--gemms", "fwd", "--shape-classes", "small"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.tune", *argv, "--jobs", "2", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    [result] = json.loads(out.read_text()).values()
    entry = mlp.configs.GEMM_CONFIGS["sm80"]["fwd"]["small"]
    assert result["clean"] == result["table"] == dataclasses.asdict(entry)
    assert result["rejected"] == [] and "first clean 64x64x64 w4 s4 (the table's)" in run.stdout


@pytest.fixture
def config_copies(tmp_path, monkeypatch):
    """The config files copied to tmp_path, where --write writes (attention/configs.json, mlp/configs.json);
    the compile step a stand-in that spills above 64x64 tiles, run in this process (no
    TRITON_INTERPRET check to trip)."""
    from bench.compile_report import compiler

    for family, family_configs in (("attention", attention_configs), ("mlp", mlp_configs)):
        (tmp_path / family).mkdir()
        config_file = tmp_path / family / "configs.json"
        config_file.write_text(family_configs.CONFIG_FILE.read_text())
        monkeypatch.setattr(family_configs, "CONFIG_FILE", config_file)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fake = _clean_below(64 * 64, [])
    monkeypatch.setattr(compiler, "compile_in_pool", lambda pool, configs, jobs: fake(configs))
    return tmp_path


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_compile_only_write_puts_the_entries_found_into_the_config_file(arch, config_copies, capsys):
    # The MLP's file holds every family's entries, sm90's among them.
    mlp_file = config_copies / "mlp" / "configs.json"
    before = mlp_file.read_text()
    argv = ["mlp", "--compile-only", "--arch", arch, "--gemms", "gated_fwd", "--jobs", "1", "--write"]
    assert tune.main(argv) == 0
    after = mlp_file.read_text()
    tables = runtime.load_configs(mlp_file, GemmConfig)["GEMM_CONFIGS"]
    assert list(tables) == list(mlp_configs.GEMM_CONFIGS)
    moved = 0
    for family, gemms in tables.items():
        for gemm, classes in gemms.items():
            for shape_class, got in classes.items():
                entry = mlp_configs.GEMM_CONFIGS[family][gemm][shape_class]
                if (family, gemm) != (arch, "gated_fwd") or entry.block_m * entry.block_n <= 64 * 64:
                    assert got == entry
                else:  # the first candidate clean in the stand-in: TMA where the family has it
                    assert got.block_m * got.block_n == 64 * 64 and got.tma is runtime.ARCHS[arch].tma
                    moved += 1
    assert moved == 2  # large and medium; small's 64x64 entry was clean
    changed = [b for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert len(changed) == moved and all('"block_m": 64, "block_n": 64' in line for line in changed)
    assert f"wrote 3 entries to {mlp_file}" in capsys.readouterr().out


def attention_tables(config_copies) -> dict:
    """The attention tables as the copy of their config file holds them."""
    return runtime.load_configs(config_copies / "attention" / "configs.json", AttnConfig)


def test_compile_only_write_keeps_one_forward_entry_for_padded_and_packed(config_copies):
    padded, packed = tune.attention_searches(["fwd"], [64], runtime.SM86)
    [joint] = tune.one_per_entry([padded, packed])
    start = joint.candidates[0]
    assert joint.variants(start) == padded.variants(start) + packed.variants(start)
    argv = ["attention", "--compile-only", "--arch", "sm86", "--passes", "fwd", "--head-dims", "64"]
    assert tune.main([*argv, "--jobs", "1", "--write"]) == 0
    tables = attention_tables(config_copies)
    got = tables["FWD_CONFIGS"]["sm86"][64]
    assert got.block_m * got.block_n == 64 * 64 and got != attention_configs.FWD_CONFIGS["sm86"][64]
    assert tables["BWD_DQ_CONFIGS"] == attention_configs.BWD_DQ_CONFIGS


def test_compile_only_writes_sm90s_entries_too_and_refuses_a_family_the_file_lacks(config_copies):
    argv = ["attention", "--compile-only", "--arch", "sm90", "--passes", "bwd_dq", "--head-dims", "64"]
    assert tune.main([*argv, "--jobs", "1", "--write"]) == 0
    tables = attention_tables(config_copies)
    got = tables["BWD_DQ_CONFIGS"]["sm90"][64]
    assert got.block_m * got.block_n == 64 * 64 and got != attention_configs.BWD_DQ_CONFIGS["sm90"][64]
    assert tables["FWD_CONFIGS"] == attention_configs.FWD_CONFIGS  # the rest as it was
    without_gfx942 = json.loads(attention_configs.CONFIG_FILE.read_text())
    for table in without_gfx942.values():
        del table["gfx942"]
    attention_configs.CONFIG_FILE.write_text(json.dumps(without_gfx942))
    with pytest.raises(SystemExit) as exit_info:
        tune.main(["attention", "--compile-only", "--arch", "gfx942", "--write"])
    assert exit_info.value.code == 2


def test_an_entry_with_its_own_pointer_tile_is_written_and_read_back(config_copies):
    # sm100 started from sm90's head-dim-128 forward carries its pointer tile (AttnConfig.pointer).
    entry = AttnConfig(128, 128, 8, 3, pointer=AttnConfig(128, 64, 8, 3))
    tune.write_entries(attention_configs.CONFIG_FILE, {("FWD_CONFIGS", "sm100", "128"): entry})
    tables = attention_tables(config_copies)
    assert tables["FWD_CONFIGS"]["sm100"][128] == entry
    assert tables["FWD_CONFIGS"]["sm100"][64] == AttnConfig(128, 128, 8, 3)  # the rest as it was
