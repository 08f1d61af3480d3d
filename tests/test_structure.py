"""The repository's shape, read from the source with `ast`: no import cycle anywhere, no file over
600 lines, no private name imported across modules, and a plain decoder family named only in its
own file. The imports' direction is `test_layering.py`'s."""

import re

import pytest

from .source_tree import MODULES, ROOT, SOURCE_PACKAGES, files, imports, module_name

MAX_LINES = 600


def test_no_import_cycle_anywhere():
    """The module-level imports of every package, scripts and tests form no cycle."""
    graph: dict[str, set[str]] = {}
    for path in files():
        module, _ = module_name(path)
        graph[module] = {
            target for target, _, _, top in imports(path) if top and target in MODULES
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
        for path in files((package,))
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_no_private_name_is_imported_across_modules():
    """Outside tests, no module imports another module's private (`_x`) name."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name} from {target}"
        for path in files((*SOURCE_PACKAGES, "scripts"))
        for target, names, line, _ in imports(path)
        for name in names
        if name.startswith("_") and not name.startswith("__") and target in MODULES
    ]
    assert not bad, "\n".join(bad)


PLAIN_FAMILIES = {
    "qwen2": r"qwen[-_ ]?2(?![-_ .]?moe|\.5)",
    "qwen3": r"qwen[-_ ]?3(?![-_ .]?moe|[-_ ]?next|[-._]5)",
    "llama": r"llama(?![-_ ]?[34])",
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
        for path in files(("models",))
        if "cli" not in path.relative_to(ROOT).parts and pattern.search(path.read_text())
    )
    assert naming == [f"models/families/{family}.py"], naming
