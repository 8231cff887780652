"""``python -m bench``: every kernel, and the whole training step, against its baselines on this
machine's GPU, gated.

    python -m bench [--quick] [--gate] [--only norms attention ...] [--out DIR] [--compare PREVIOUS.json]
                    [pytest options: --durations N, -k ..., --benchmark-save NAME, ...]

Measures the device's ceilings (copy bandwidth, a large float16 matmul), then times every case of
the families below under pytest-benchmark with CUDA events (norms, attention, MLP, the MoE experts
against transformers' own, the fused loss, the end-to-end training step of bench/train.py, and a
transformers model's training step with horse.hf.apply against its own attention implementations in
bench/hf.py), ours checked against the float32 reference first where a family has a check. Prints a
table, writes results.json (with the machine) and a PNG per kernel to --out (default
bench/results/<date>-<gpu>/), and with --gate exits 1 naming each kernel and shape below its
threshold in bench/gates.toml (a gated case of ours without a result fails as "not measured").
``--quick`` times only what the gates need: ours on the gated shapes and directions, and the
baselines those gates name. ``--compare PREVIOUS.json`` prints each case's time over an earlier
run's and exits 1 where ours is more than 5 % slower. Options it does not know (``--durations 20``:
where the time went, compilation included; ``--benchmark-save NAME``, ``-k``) go to pytest.

Without a GPU it runs each family's correctness check on small shapes in Triton's interpreter and
the compile report for sm_90 (the GPU the suite times; ``python -m bench.compile_report`` builds
every GPU family's), says that timing needs a GPU, and exits 0 if both pass.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# bench/<name>.py, each with cases(quick) -> list[suite.Case] and interpreter_checks() -> list of
# (label, errors, passed).
FAMILIES = ("norms", "attention", "mlp", "moe", "loss", "train", "hf")
BENCH_DIR = Path(__file__).resolve().parent


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shape or two per kernel, where gates apply")
    parser.add_argument(
        "--gate", action="store_true", help="exit 1 if a kernel misses a gates.toml threshold"
    )
    parser.add_argument("--only", nargs="+", choices=FAMILIES, help="these families only")
    parser.add_argument("--out", type=Path, help="directory for results.json and the plots")
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="PREVIOUS.json",
        help="an earlier run's results.json: print each case's time ratio, exit 1 if ours regressed > 5 %%",
    )
    return parser.parse_known_args(argv)


def _families(names):
    return [importlib.import_module(f"bench.{name}") for name in names]


def cpu_main(args) -> int:
    print("No CUDA device: timing needs a GPU. Checking correctness in Triton's interpreter instead,")
    print("then compiling every kernel config for sm_90.\n")
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels (and so triton) are first imported
    passed = True
    for family in _families(args.only or FAMILIES):
        for label, errors, ok in family.interpreter_checks():
            detail = "  ".join(f"{name} {error:.1e}" for name, error in errors.items())
            print(f"  {'ok  ' if ok else 'FAIL'} {label}  {detail}")
            passed &= ok
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "bench.compile_report", "--arch", "sm90"]
    passed &= subprocess.run(command, env=env, cwd=BENCH_DIR.parent).returncode == 0
    print("\ncorrectness and sm_90 compile report: " + ("ok" if passed else "FAIL"))
    if args.compare:
        print(f"--compare {args.compare}: nothing was timed here to compare")
    return 0 if passed else 1


def gpu_main(args, pytest_args) -> int:
    import pytest

    from bench import suite, timing

    start = time.perf_counter()
    device, machine = timing.announce_machine()
    copy, matmul = timing.copy_bandwidth_gbps(device), timing.matmul_tflops(device)
    ceilings = {"copy_gbps": copy, "matmul_tflops": matmul}
    seconds = time.perf_counter() - start
    print(
        f"ceilings: copy {copy:.0f} GB/s, float16 matmul {matmul:.0f} TFLOP/s (measured in {seconds:.0f} s)"
    )
    gates = suite.load_gates()
    previous = json.loads(args.compare.read_text()) if args.compare else None  # a bad file fails first
    cases = [case for family in _families(args.only or FAMILIES) for case in family.cases(args.quick)]
    if args.quick:
        cases = suite.gated_cases(cases, gates)
    plugin = suite.SuitePlugin(cases)
    collect_bench = ["-o", "python_files=bench_*.py", "-o", "python_functions=bench_*"]  # not test_*
    # -q for pytest's own lines, -ra for why a baseline was unavailable (a skip) or a case failed
    report = ["-p", "no:cacheprovider", "-q", "-ra", "--benchmark-columns=median,iqr,rounds"]
    pytest_argv = [str(BENCH_DIR / "bench_kernels.py"), *collect_bench, *report, *pytest_args]
    pytest_code = pytest.main(pytest_argv, plugins=[plugin])
    failed = suite.save_and_gate(
        args.out, "results.json", machine, ceilings, plugin.results, gates, cases, plots=True
    )
    regressed = []
    if previous is not None:
        lines, regressed = suite.compare(plugin.results, previous, cases)
        print(f"\nagainst {args.compare}: {len(regressed)} regressions of ours beyond 5 %")
        print("\n".join("  " + line for line in lines))
    if pytest_code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        return int(pytest_code)
    return 1 if (args.gate and failed) or regressed else 0


def main(argv=None) -> int:
    args, pytest_args = _parse(argv)
    return gpu_main(args, pytest_args) if torch.cuda.is_available() else cpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
