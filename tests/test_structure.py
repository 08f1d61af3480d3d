"""The repository's shape, read from the source with `ast`: `models/` imports down its folders, no
import cycle anywhere, no file over 600 lines, no private name imported across modules, and a
plain decoder family named only in its own file."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_PACKAGES = ("pallas_kernels", "boundary_jax", "models", "benchmarks")
"""The packages held to the file-size and private-name rules."""
ALL_PACKAGES = (*SOURCE_PACKAGES, "scripts", "tests")
MODEL_FLOORS = (
    ("precision", "distributed"),
    ("config",),
    ("inputs",),
    ("layers",),
    ("options",),
    ("decoder",),
    ("families",),
    ("weights",),
    ("build",),
    ("serving", "training"),
    ("pipeline",),
    ("cli",),
)
"""The units of `models` (a module or a subpackage), lowest first: a unit imports only from lower
floors and from itself. The package's `__init__` (its public API) sits above them all."""
MODEL_FLOOR = {unit: level for level, units in enumerate(MODEL_FLOORS) for unit in units}
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _files(packages=ALL_PACKAGES) -> list[pathlib.Path]:
    return [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]


MODULES = {_module_name(path)[0] for path in _files()}


def _imports(path: pathlib.Path):
    """(imported module, names imported from it, line, at module level) for each import."""
    module, is_package = _module_name(path)
    tree = ast.parse(path.read_text())
    top = set(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno, node in top
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            names = tuple(alias.name for alias in node.names)
            submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in MODULES]
            for submodule in submodules:
                yield submodule, (), node.lineno, node in top
            if len(submodules) < len(names):
                yield target, names, node.lineno, node in top


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "models" and len(parts) > 1 else None


def test_model_floors_cover_every_unit():
    """Every module and subpackage of models has a floor."""
    units = {_unit(_module_name(path)[0]) for path in _files(("models",))} - {None}
    assert units == set(MODEL_FLOOR), sorted(units ^ set(MODEL_FLOOR))


def test_models_import_down_their_floors():
    """Inside models, a unit imports only from lower floors, at module level."""
    bad = []
    for path in _files(("models",)):
        module, is_package = _module_name(path)
        source = _unit(module)
        for target, _, line, top in _imports(path):
            dest = _unit(target)
            if source is None or dest is None or dest == source:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            if not top:
                bad.append(f"{where}: a lazy import of {target}")
            if MODEL_FLOOR[dest] >= MODEL_FLOOR[source]:
                bad.append(
                    f"{where}: {source} (floor {MODEL_FLOOR[source]}) imports {dest} "
                    f"(floor {MODEL_FLOOR[dest]})"
                )
    assert not bad, "\n".join(bad)


def test_no_import_cycle_anywhere():
    """The module-level imports of every package, scripts and tests form no cycle."""
    graph: dict[str, set[str]] = {}
    for path in _files():
        module, _ = _module_name(path)
        graph[module] = {
            target for target, _, _, top in _imports(path) if top and target in MODULES
        } - {module}
    cycles = _cycles(graph)
    assert not cycles, cycles


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", SOURCE_PACKAGES)
def test_no_file_over_600_lines(package):
    """No source file of the library, the models, the kernels or the benchmarks is over 600
    lines."""
    long = {
        str(path.relative_to(ROOT)): lines
        for path in _files((package,))
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_no_private_name_is_imported_across_modules():
    """Outside tests, no module imports another module's private (`_x`) name."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name} from {target}"
        for path in _files((*SOURCE_PACKAGES, "scripts"))
        for target, names, line, _ in _imports(path)
        for name in names
        if name.startswith("_") and not name.startswith("__") and target in MODULES
    ]
    assert not bad, "\n".join(bad)


PLAIN_FAMILIES = {
    "qwen2": r"qwen[-_ ]?2(?![-_ .]?moe|\.5)",
    "qwen3": r"qwen[-_ ]?3(?![-_ .]?moe|[-_ ]?next|\.5)",
    "llama": r"llama(?![-_ ]?3)",
    "mistral": r"mistral",
    "mixtral": r"mixtral",
    "qwen2_moe": r"qwen[-_ ]?2[-_ ]?moe",
    "qwen3_moe": r"qwen[-_ ]?3[-_ ]?moe",
    "exaone4": r"exaone",
    "olmo2": r"olmo",
    "gemma3": r"gemma",
    "apertus": r"apertus",
    "arcee": r"arcee|\bafm\b",
}
"""The families that bring no new kind of layer, and how a file names them."""


@pytest.mark.parametrize("family", sorted(PLAIN_FAMILIES))
def test_a_plain_family_is_named_in_its_own_file_only(family):
    """Under models/ (outside the command line), a family that brings no new kind of layer is
    named only in its family file: what it needs from a layer is an option its file sets."""
    pattern = re.compile(PLAIN_FAMILIES[family], re.IGNORECASE)
    naming = sorted(
        str(path.relative_to(ROOT))
        for path in _files(("models",))
        if "cli" not in path.relative_to(ROOT).parts and pattern.search(path.read_text())
    )
    assert naming == [f"models/families/{family}.py"], naming
