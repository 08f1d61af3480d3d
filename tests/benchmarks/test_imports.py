"""The benchmark modules import each other without a cycle and by public names only."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _imports(path: pathlib.Path) -> list[tuple[str, str | None, int]]:
    """(benchmarks module, imported name or None for the module itself, line) per import of a
    sibling benchmark module in `path`, at any depth (a lazy import closes a cycle too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("benchmarks."):
                    found.append((alias.name.split(".")[1], None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module
            elif node.level == 0 and (node.module or "").startswith("benchmarks"):
                base = node.module.removeprefix("benchmarks").removeprefix(".") or None
            else:
                continue
            for alias in node.names:
                if base is None:  # `from . import bench_x`
                    found.append((alias.name, None, node.lineno))
                else:
                    found.append((base.split(".")[0], alias.name, node.lineno))
    return found


def _graph() -> dict[str, list[tuple[str, str | None, int]]]:
    return {path.stem: _imports(path) for path in sorted(BENCHMARKS.glob("*.py"))}


def test_no_private_name_is_imported_across_modules():
    """A benchmark imports another module's public names only (shared helpers live public in
    `common` or `gspmd_baseline`)."""
    bad = [
        f"benchmarks/{module}.py:{line} imports {name} from {target}"
        for module, imports in _graph().items()
        for target, name, line in imports
        if name is not None and name.startswith("_")
    ]
    assert not bad, "\n".join(bad)


def test_benchmark_imports_form_no_cycle():
    """No benchmark module imports, directly or through others, a module that imports it."""
    edges = {
        module: {target for target, _, _ in imports if (BENCHMARKS / f"{target}.py").exists()}
        for module, imports in _graph().items()
    }
    cycles = []

    def visit(module, path):
        for target in sorted(edges[module]):
            if target in path:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            else:
                visit(target, [*path, target])

    for module in edges:
        visit(module, [module])
    assert not cycles, "\n".join(sorted(set(cycles)))
