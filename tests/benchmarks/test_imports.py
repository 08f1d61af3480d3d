"""The benchmark modules import each other without a cycle and by public names only."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _siblings(path: pathlib.Path) -> set[str]:
    """The benchmark modules `path` imports, at any depth (a lazy import closes a cycle too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module.split(".")[0] != "benchmarks":
                continue
            if node.level == 0:
                module = module.removeprefix("benchmarks").removeprefix(".")
            if module:  # `from .common import x`
                found.add(module.split(".")[0])
            else:  # `from . import bench_x`
                found |= {alias.name for alias in node.names}
    return {name for name in found if (BENCHMARKS / f"{name}.py").exists()}


def test_no_private_name_is_imported_across_modules():
    """A benchmark imports public names only, from a sibling (shared helpers live public in
    `common` or `gspmd_baseline`) or from any other package."""
    bad = [
        f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {node.module or '.'}"
        for path in sorted(BENCHMARKS.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not bad, "\n".join(bad)


def test_benchmark_imports_form_no_cycle():
    """No benchmark module imports, directly or through others, a module that imports it."""
    edges = {path.stem: _siblings(path) for path in sorted(BENCHMARKS.glob("*.py"))}
    cycles = set()

    def visit(module, path):
        for target in sorted(edges[module]):
            if target in path:
                cycles.add(" -> ".join([*path[path.index(target) :], target]))
            else:
                visit(target, [*path, target])

    for module in edges:
        visit(module, [module])
    assert not cycles, "\n".join(sorted(cycles))
