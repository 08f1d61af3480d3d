"""The packages' imports run one way, read from the source with `ast`.

Packages: benchmarks -> models -> boundary_jax -> pallas_kernels. Inside `boundary_jax` and
`models` the floors of `FLOORS` (lowest first): a module imports only from lower floors and from
its own unit (a subpackage's modules import each other), never lazily from another unit, and
nothing in `boundary_jax` imports lazily at all (inside a function or a TYPE_CHECKING block).
"""

import pytest

from .source_tree import ROOT, SOURCE_PACKAGES, files, imports, module_name

FLOORS = {
    "boundary_jax": (
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
    ),
    "models": (
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
    ),
}
"""Each layered package's units (a module or a subpackage), lowest first. A package's `__init__`
(its public API) sits above them all."""
NO_LAZY_IMPORTS = ("boundary_jax",)
"""Packages that import nothing lazily, not even from outside."""


def _unit(package: str, module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == package and len(parts) > 1 else None


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_floors_cover_every_unit(package):
    """Every module and subpackage of a layered package has a floor."""
    floor = {unit for units in FLOORS[package] for unit in units}
    units = {_unit(package, module_name(path)[0]) for path in files((package,))} - {None}
    assert units == floor, sorted(units ^ floor)


@pytest.mark.parametrize("package", SOURCE_PACKAGES)
def test_packages_import_downwards(package):
    """No package imports a package above it."""
    above = SOURCE_PACKAGES[SOURCE_PACKAGES.index(package) + 1 :]
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in files((package,))
        for target, _, line, _ in imports(path)
        if target.split(".")[0] in above
    ]
    assert not bad, bad


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_units_import_down_their_floors(package):
    """Inside a layered package, a unit imports only from lower floors, at module level."""
    floor = {unit: level for level, units in enumerate(FLOORS[package]) for unit in units}
    bad = []
    for path in files((package,)):
        source = _unit(package, module_name(path)[0])
        for target, _, line, top in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            dest = _unit(package, target)
            crosses = None not in (source, dest) and dest != source
            if not top and (crosses or package in NO_LAZY_IMPORTS):
                bad.append(f"{where}: a lazy import of {target}")
            if not crosses:
                continue
            if floor[dest] >= floor[source]:
                bad.append(
                    f"{where}: {source} (floor {floor[source]}) imports {dest} "
                    f"(floor {floor[dest]})"
                )
    assert not bad, "\n".join(bad)
