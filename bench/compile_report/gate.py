"""The report's verdict on its rows: the table it prints (:func:`format_table`) and the gate that fails
it (:func:`failures`).
"""

from bench import report
from bench.compile_report.cache import row_values
from bench.compile_report.compiler import CompileResult
from bench.compile_report.config import describe
from horse.kernels import runtime
from horse.kernels.runtime import ARCHS


def failures(results: list[CompileResult]) -> list[str]:
    """One line per config that Triton cannot compile, spills registers, exceeds its GPU family's
    shared-memory limit or threads a block, or is a matmul kernel without tensor-core instructions."""
    bad = []
    for r in results:
        c = r.config
        if r.error:  # nothing was built to count
            bad.append(f"{describe(c)}: does not compile: {r.error}")
            continue
        limit, threads = ARCHS[c.arch].max_shared_bytes, c.num_warps * ARCHS[c.arch].warp_size
        product, *more = r.narrow_stride_products or ("",)
        product += f" (and {len(more)} more)" if more else ""
        gates = (  # (failing, why)
            (r.spill_bytes > 0, f"spills {r.spill_bytes} bytes"),
            (r.shared_bytes > limit, f"needs {r.shared_bytes} bytes of shared memory (max {limit})"),
            (c.matmul and r.tensor_core_instructions == 0, "no tensor-core instructions"),
            (threads > runtime.MAX_THREADS, f"{threads} threads a block (max {runtime.MAX_THREADS})"),
            (product, f"a 32-bit stride product, which wraps past 2**31 elements: {product}"),
        )
        bad += [f"{describe(c)}: {why}" for failing, why in gates if failing]
    return bad


COLUMNS = (
    "arch",
    "kernel",
    "shape",
    "dtype",
    "blocks",
    "warps",
    "stages",
    "regs",
    "spill",
    "smem",
    "tc",
    "ldg128",
    "tma",
    "target",
)


def format_table(results: list[CompileResult]) -> str:
    def cells(r: CompileResult) -> tuple:
        c = r.config
        counts = row_values(r)[:-1]  # but the stride products, which a FAIL line names
        if r.error:  # nothing was built to count; the FAIL line below the table says why
            counts = ("-",) * (len(counts) - 1) + ("error",)
        return (c.arch, c.kernel, c.shape_class, c.dtype_name, c.blocks, c.num_warps, c.num_stages, *counts)

    return report.format_table([COLUMNS, *map(cells, results)], right=True)
