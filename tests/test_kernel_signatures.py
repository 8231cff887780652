"""Every @triton.jit function of horse/kernels takes at most MAX_PARAMETERS parameters: related
arguments go in as one tuple (a tensor's strides, the sequence lengths, the mask, the score
modifications), as the launchers' plans name them (horse.kernels.runtime.Plan.tuples).

Read from the source with ``ast`` (nothing is imported).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_PARAMETERS = 20


def jit_parameter_counts(root: Path = ROOT) -> dict[str, int]:
    """``"path:function"`` -> its parameter count, for every function of root/horse/kernels decorated
    with ``triton.jit`` (or ``jit``)."""
    counts = {}
    for path in sorted((root / "horse" / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
            if isinstance(node, ast.FunctionDef) and any(d in ("triton.jit", "jit") for d in decorators):
                arguments = node.args
                count = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
                counts[f"{path.relative_to(root).as_posix()}:{node.name}"] = count
    return counts


def over_the_limit(counts: dict[str, int]) -> dict[str, int]:
    return {name: count for name, count in counts.items() if count > MAX_PARAMETERS}


def test_every_jit_function_takes_at_most_20_parameters():
    assert over_the_limit(jit_parameter_counts()) == {}


def test_the_count_sees_every_parameter_of_a_jit_function(tmp_path):
    kernels = tmp_path / "horse" / "kernels"
    kernels.mkdir(parents=True)
    parameters = ", ".join(f"a{i}" for i in range(MAX_PARAMETERS))
    (kernels / "k.py").write_text(
        "import triton\nimport triton.language as tl\n\n"
        f"@triton.jit\ndef _wide({parameters}, B: tl.constexpr, c=None):\n    pass\n\n"
        f"@triton.jit\ndef _fits({parameters}):\n    pass\n\n"
        "def _host(a, b):\n    pass\n"
    )
    counts = jit_parameter_counts(tmp_path)
    wide, fits = "horse/kernels/k.py:_wide", "horse/kernels/k.py:_fits"
    assert counts == {wide: MAX_PARAMETERS + 2, fits: MAX_PARAMETERS}
    assert over_the_limit(counts) == {wide: MAX_PARAMETERS + 2}
