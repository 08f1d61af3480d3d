"""The packages' imports run one way, read from the source with `ast`.

Packages: benchmarks -> models -> boundary_jax -> pallas_kernels. Inside `boundary_jax` the floors
of `FLOORS` (lowest first): a module imports only from lower floors and from its own unit (a
subpackage's modules import each other), and never lazily, inside a function or a TYPE_CHECKING
block.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "boundary_jax", "models", "benchmarks")
"""Lowest first: a package imports only from packages before it."""
FLOORS = (
    ("layout", "initializers"),
    ("placement", "policy", "batch"),
    ("designs",),
    ("finalize",),
    ("ops",),
    ("fusions",),
    ("declare",),
    ("plan",),
    ("rows",),
    ("bind", "check"),
    ("residual_stream",),
    ("stage",),
    ("adapters",),
    ("stack",),
    ("scan", "sharding", "report", "residual"),
)
"""The floors of `boundary_jax`, lowest first; a unit is a module or a subpackage."""
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield path, name, parts[-1] == "__init__"


def _imports(tree: ast.Module, module: str, is_package: bool):
    """(absolute imported module, node, at module level) for every import in `tree`."""
    top = set(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node, node in top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    for alias in node.names:
                        yield f"{name}.{alias.name}", node, node in top
                    continue
            else:
                name = node.module
            yield name, node, node in top


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "boundary_jax" and len(parts) > 1 else None


def test_floors_cover_every_unit():
    """Every module and subpackage of boundary_jax has a floor."""
    units = {_unit(name) for _, name, _ in _modules("boundary_jax")} - {None}
    assert units == set(FLOOR), sorted(units ^ set(FLOOR))


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_downwards(package):
    """No package imports a package above it."""
    above = PACKAGES[PACKAGES.index(package) + 1 :]
    bad = [
        f"{path.relative_to(ROOT)}:{node.lineno} imports {target}"
        for path, name, is_package in _modules(package)
        for target, node, _ in _imports(ast.parse(path.read_text()), name, is_package)
        if target.split(".")[0] in above
    ]
    assert not bad, bad


def test_boundary_jax_imports_down_its_floors_and_never_lazily():
    """Inside boundary_jax, imports run down the floors, at module level only."""
    bad = []
    for path, name, is_package in _modules("boundary_jax"):
        source = _unit(name)
        for target, node, top in _imports(ast.parse(path.read_text()), name, is_package):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if not top:
                bad.append(f"{where}: a lazy import of {target}")
            dest = _unit(target)
            if source is None or dest is None or dest == source:
                continue
            if FLOOR[dest] >= FLOOR[source]:
                bad.append(
                    f"{where}: {source} (floor {FLOOR[source]}) imports {dest} "
                    f"(floor {FLOOR[dest]})"
                )
    assert not bad, "\n".join(bad)
