"""The repository's Python source read with `ast`, for the tests of its shape: which modules
exist and what each imports."""

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_PACKAGES = ("pallas_kernels", "boundary_jax", "models", "benchmarks")
"""The packages, lowest first: a package imports only from packages before it."""
ALL_PACKAGES = (*SOURCE_PACKAGES, "scripts", "tests")


def module_name(path: pathlib.Path) -> tuple[str, bool]:
    """The dotted module name of `path` and whether it is a package's `__init__`."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def files(packages: tuple[str, ...] = ALL_PACKAGES) -> list[pathlib.Path]:
    """Every `.py` file under `packages`, sorted."""
    return [path for package in packages for path in sorted((ROOT / package).rglob("*.py"))]


MODULES = {module_name(path)[0] for path in files()}


def imports(path: pathlib.Path) -> Iterator[tuple[str, tuple[str, ...], int, bool]]:
    """(imported module, names imported from it, line, at module level) for each import in
    `path`; `from package import submodule` counts as an import of the submodule."""
    module, is_package = module_name(path)
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
