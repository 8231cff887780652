"""The package's import graph is one way: each module of horse/ imports only modules of its own layer
or of the layers below it, with no circle, and no ``import horse...`` inside a function except where
an optional dependency (transformers) makes the import optional.

Read from the source with ``ast`` (nothing is imported), so a new circle fails here before it fails
at import time. A module's ``if __name__ == "__main__":`` block is a script run by hand, not part of
importing the module: its imports are left out of the graph.

    python tests/test_import_graph.py [ROOT]     # the circles and function-level imports of ROOT/horse
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first: a module may import modules of its own layer or of a lower one. The most specific
# prefix decides a module's layer; every module of horse/ must have one.
LAYERS = {
    "horse.kernels": 0,
    "horse.device": 0,
    "horse.data": 0,
    "horse.run_log": 0,
    "horse.preemption": 0,
    "horse.layers": 1,
    "horse.demo": 1,
    "horse.hf.attention": 1,  # transformers' modules patched: they build on the kernels only
    "horse.hf.forwards": 1,
    "horse.hf.moe": 1,
    "horse.hf.patch": 1,
    "horse.model": 2,
    "horse.parallel": 3,
    "horse.checkpoint": 4,
    "horse.hf": 5,  # the package: checkpoints of Hugging Face's layout, and every loader of weights
    "horse.generate": 6,
    "horse.recipes": 6,
    "horse.optim": 6,
    "horse.loss_scale": 6,
    "horse.train": 6,
    "horse.cli": 7,
}

# Function-level imports that stay: the patching of transformers models needs transformers, an
# optional dependency, so ``import horse.hf`` imports it only when a patching name is asked for.
OPTIONAL = {("horse.hf", "horse.hf.patch")}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_main_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _imported(node: ast.Import | ast.ImportFrom, modules: set[str], importer: str) -> list[str]:
    """The horse modules an import statement in module ``importer`` loads: the named ones (a name
    after ``from X import`` when it is a submodule) and the packages above them, whose __init__ runs
    first (but not the importer's own packages: they are being imported already)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    loaded = set()
    for name in names:
        parts = name.split(".")
        loaded |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    own_packages = {importer.rsplit(".", i)[0] for i in range(1, importer.count(".") + 1)}
    return sorted(m for m in loaded if m in modules and m != importer and m not in own_packages)


def import_graph(
    root: Path = ROOT,
) -> tuple[dict[str, set[str]], list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """(module -> the horse modules it imports when imported, [(module, imported, line)] of the
    imports inside functions, the same of those in ``__main__`` blocks), for every module of
    root/horse."""
    files = {module_name(p, root): p for p in sorted((root / "horse").rglob("*.py"))}
    modules = set(files)
    graph, in_functions, in_main = {}, [], []
    for name, path in files.items():
        graph[name] = set()

        def walk(node: ast.AST, found: list | None, name=name) -> None:
            """found: where an import goes (None: the module's own imports, into the graph)."""
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _imported(child, modules, name):
                        if found is None:
                            graph[name].add(target)
                        else:
                            found.append((name, target, child.lineno))
                if _is_main_block(child):
                    walk(child, in_main)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and found is None:
                    walk(child, in_functions)
                else:
                    walk(child, found)

        walk(ast.parse(path.read_text()), None)
    return graph, in_functions, in_main


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    if not prefixes:
        raise KeyError(f"{module} has no layer: add it to LAYERS in {Path(__file__).name}")
    return LAYERS[max(prefixes, key=len)]


def test_no_circle_in_the_imports_of_horse():
    graph, in_functions, _ = import_graph()
    for module, target, _ in in_functions:  # a function may run while its module is imported
        graph[module].add(target)
    assert circles(graph) == []


def test_every_import_goes_down_the_layers():
    graph, _, _ = import_graph()
    upward = [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in graph.items()
        for t in sorted(targets)
        if layer(t) > layer(m)
    ]
    assert upward == []


def test_no_horse_import_inside_a_function():
    _, in_functions, _ = import_graph()
    assert [(m, t, line) for m, t, line in in_functions if (m, t) not in OPTIONAL] == []


def test_the_checks_see_a_circle_an_upward_import_and_a_function_level_import(tmp_path):
    package = tmp_path / "horse"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text("from horse import train\n")
    (package / "train.py").write_text(
        "import horse.model\n\ndef f():\n    from horse import model\n\n"
        "if __name__ == '__main__':\n    import horse.cli\n"
    )
    (package / "cli.py").write_text("")
    graph, in_functions, in_main = import_graph(tmp_path)
    assert graph == {
        "horse": set(),
        "horse.model": {"horse.train"},
        "horse.train": {"horse.model"},
        "horse.cli": set(),
    }
    assert circles(graph) == [["horse.model", "horse.train"]]
    assert layer("horse.model") < layer("horse.train")  # so model -> train goes up
    assert in_functions == [("horse.train", "horse.model", 4)]
    assert in_main == [("horse.train", "horse.cli", 7)]


if __name__ == "__main__":
    graph, in_functions, in_main = import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("circles of the modules' own imports:", circles(graph) or "none")
    for module, target, _ in in_functions + in_main:
        graph[module].add(target)
    print("circles counting the imports in functions and __main__ blocks:", circles(graph) or "none")
    print(f"horse imports inside functions: {len(in_functions)}")
    for module, target, line in in_functions:
        print(f"  {module}:{line} imports {target}")
