"""The compile report: every kernel config the package can select, compiled for the GPU that selects it.

    python -m bench.compile_report [--arch sm80 sm86 sm90 sm100 gfx942] [--filter TEXT] [--jobs N]
    python -m bench.compile_report --arch sm86 --capability 120   # an RTX 5090's build of sm86's

Prints a row per config (the package's docstring says what a row holds) and exits 1 if any config
spills, needs more shared memory than a block may have on its family or more than 1024 threads, or
is a matmul kernel without tensor-core instructions. ``--capability`` builds one NVIDIA family's
entries for another GPU that takes them (sm_89 or sm_120 for sm86).
"""

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from unittest import mock

import triton

from bench.compile_report import all_configs
from bench.compile_report.cache import (
    CACHE_FILE,
    VERIFY_AT_LEAST,
    attach_ir_keys,
    ir_keys,
    load_cache,
    prove,
    row_key,
    save_cache,
    updated_entries,
)
from bench.compile_report.compiler import compile_in_pool, in_pool
from bench.compile_report.config import check_capabilities
from bench.compile_report.gate import failures, format_table
from horse.kernels.runtime import ARCHS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compile_report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--arch", nargs="+", choices=list(ARCHS), default=list(ARCHS), help="GPU families (default: all)"
    )
    parser.add_argument("--filter", default="", help="only kernels whose name contains this text")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compilations")
    parser.add_argument(
        "--capability",
        type=int,
        help="build one --arch family's entries for another GPU that takes them: 87 (sm80), 89 or 120 "
        "(sm86), 103 (sm100)",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="rewrite --cache: this run's rows (only those whose key changed are compiled) over its rows "
        "of unchanged code; stale keys dropped",
    )
    parser.add_argument("--rebuild", action="store_true", help="compile every config, reusing no cached row")
    parser.add_argument(
        "--verify",
        type=int,
        default=VERIFY_AT_LEAST,
        metavar="N",
        help="compile N reused rows afresh, at least one per GPU family and kernel, and fail if one "
        f"differs (default {VERIFY_AT_LEAST}; 0: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="which reused rows --verify picks (default 0)")
    parser.add_argument("--cache", default=CACHE_FILE, help="the rows already proven (default: %(default)s)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    configs = [c for c in all_configs(args.arch) if args.filter in c.kernel]
    if not configs:
        parser.error(f"no kernel config matches --filter {args.filter!r}")
    if args.capability is not None:
        if len(args.arch) != 1:
            parser.error("--capability builds one family's entries: name it alone with --arch")
        check_capabilities(parser, [args.capability], args.arch[0])
        configs = [dataclasses.replace(c, capability=args.capability) for c in configs]
    keys = [row_key(c) for c in configs]
    cached = load_cache(args.cache)
    jobs = max(1, args.jobs)
    # An empty Triton cache: a row re-verified from Triton's on-disk cache would not be a fresh compile.
    # Patched for the run alone: a caller in this process (a test) keeps its own cache.
    with tempfile.TemporaryDirectory(prefix="compile-report-") as triton_cache:
        with mock.patch.dict(os.environ, TRITON_CACHE_DIR=triton_cache), ProcessPoolExecutor(jobs) as pool:
            reusable = {} if args.rebuild else cached
            build = functools.partial(compile_in_pool, pool, workers=jobs)
            find_ir_keys = functools.partial(in_pool, pool, ir_keys, workers=jobs)
            proof = prove(configs, keys, reusable, args.verify, args.seed, build, find_ir_keys)
            if args.update:
                entries = updated_entries(
                    cached, proof, current={row_key(c) for c in all_configs()} | set(keys)
                )
                attached = attach_ir_keys(entries, configs, keys, find_ir_keys)
    results = proof.results
    print(format_table(results) + "\n")
    bad = proof.differ + failures(results)
    built_for = {a: ARCHS[a].hip_target or f"sm_{args.capability or ARCHS[a].capability}" for a in args.arch}
    for name in args.arch:
        count = sum(r.config.arch == name for r in results)
        print(f"{name} ({ARCHS[name].gpus}): {count} configs for {built_for[name]}")
    targets, cache = ", ".join(built_for.values()), os.path.relpath(args.cache)
    cache = args.cache if cache.startswith("..") else cache
    print(
        f"{len(results)} configs for {targets} (triton {triton.__version__}): {proof.built} built (key new "
        f"or changed), {proof.reused} reused from {cache} ({proof.by_ir} found by their IR key), "
        f"{proof.verified} of them re-verified by a fresh compile; {len(bad)} failing"
    )
    if args.update:
        save_cache(args.cache, entries)
        dropped = len(cached.keys() - entries.keys())
        print(f"wrote {len(entries)} rows to {cache} ({dropped} dropped, {attached} given their IR key)")
    for line in bad:
        print(f"FAIL {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
