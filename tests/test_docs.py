"""The docs name what exists: every file, module, function, class and attribute a README or
`docs/` page names in an inline code span is in the repository, read with `ast`."""

import ast
import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PACKAGES = ("boundary_jax", "models", "pallas_kernels", "benchmarks", "scripts", "tests")
TOP_LEVEL = {path.name for path in ROOT.iterdir() if not path.name.startswith(".")} | {".ci"}
SPAN = re.compile(r"`([^`\n]+)`")
FILE_SUFFIXES = (".py", ".md", ".ipynb", ".toml")
"""Files a page may name by their own name: one of that name must exist in the repository."""
DATA_SUFFIXES = (".json", ".safetensors", ".npz", ".npy", ".txt", ".jinja", ".model")
"""Files a page names generically (a checkpoint's), not checked."""
INSTANCE_WORDS = {"model", "layers", "layer", "config", "options", "stream", "batch", "rows"}
"""Heads of dotted names that are usually a value (`model.config`, `layers.3.mlp`), not the
module of that name."""
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+){2,}\b")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
DOTTED = re.compile(r"\b(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*")
CALL = re.compile(r"^([a-z_]\w*)\(")


@dataclasses.dataclass(frozen=True)
class Index:
    """What the code defines, and every file and folder name in the repository (`index`)."""

    modules: dict[str, set[str]]
    classes: dict[str, set[str]]
    bases: dict[str, set[str]]
    functions: set[str]
    dotted_modules: set[str]
    names: set[str]
    file_names: set[str]


@functools.cache
def index() -> Index:
    """The repository's names, read once per worker that runs a docs test (not at collection):
    per module basename its top-level names; per class name its members and bases; every
    function and method name; every module's dotted name; every file and folder name."""
    modules: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    functions: set[str] = set()
    dotted: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = parts[-2] if is_package else parts[-1]
            dotted.add(".".join(parts[:-1] if is_package else parts))
            tree = ast.parse(path.read_text())
            names = modules.setdefault(name, set())
            if is_package:
                names |= {p.stem for p in path.parent.glob("*.py")} | {
                    p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file()
                }
            for node in tree.body:
                names |= _bound(node)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    functions.add(node.name)
                elif isinstance(node, ast.ClassDef):
                    members = classes.setdefault(node.name, set())
                    bases.setdefault(node.name, set()).update(
                        base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                        for base in node.bases
                    )
                    for item in node.body:
                        members |= _bound(item)
                    for item in ast.walk(node):
                        if (
                            isinstance(item, ast.Attribute)
                            and isinstance(item.value, ast.Name)
                            and item.value.id in ("self", "cls")
                        ):
                            members.add(item.attr)
    names = set(functions) | set(classes) | {name for found in modules.values() for name in found}
    file_names = set()
    for _, subdirectories, files in os.walk(ROOT):
        # Hidden folders (.venv, .git) hold no file a page names; .ci does.
        subdirectories[:] = [d for d in subdirectories if d == ".ci" or not d.startswith(".")]
        file_names |= set(files) | set(subdirectories)
    return Index(modules, classes, bases, functions, dotted, names, file_names)


def _bound(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, ast.If | ast.For | ast.With | ast.Try):
        return {
            name
            for child in ast.iter_child_nodes(node)
            if isinstance(child, ast.stmt)
            for name in _bound(child)
        }
    return set()


def _members(cls: str, seen=()) -> set[str]:
    """A class's members, its project bases' included."""
    classes = index().classes
    members = set(classes.get(cls, ()))
    for base in index().bases.get(cls, ()):
        if base in classes and base not in seen:
            members |= _members(base, (*seen, cls))
    return members


def _spans(doc: pathlib.Path):
    text = FENCE.sub("", doc.read_text())
    for line_number, line in enumerate(text.splitlines(), 1):
        for span in SPAN.findall(line):
            yield line_number, span


def _problem(span: str) -> str | None:
    """Why a code span names something that does not exist, or None."""
    if any(mark in span for mark in "{<*"):
        return None
    if re.fullmatch(r"[\w.\-/]+/?", span) and "/" in span:
        first = span.split("/")[0]
        if first in TOP_LEVEL or first == "shared" or span.endswith(FILE_SUFFIXES):
            homes = (ROOT, *(ROOT / package for package in PACKAGES))
            return None if any((home / span).exists() for home in homes) else f"no file {span}"
        return None
    if re.fullmatch(r"[\w.\-]+", span) and span.endswith(FILE_SUFFIXES + DATA_SUFFIXES):
        if span.endswith(DATA_SUFFIXES) or span in index().file_names:
            return None
        return f"no file named {span}"
    for match in DOTTED.finditer(span):
        if match.group(0).endswith(FILE_SUFFIXES + DATA_SUFFIXES):
            continue
        problem = _dotted_problem(match.group(0))
        if problem:
            return problem
    call = CALL.match(span)
    if call and "_" in call.group(1) and call.group(1) not in index().functions | _builtins():
        return f"no function {call.group(1)}"
    return None


def _builtins() -> set[str]:
    return set(dir(__builtins__) if isinstance(__builtins__, dict) else dir(__builtins__))


def _dotted_problem(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] in PACKAGES:
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in index().dotted_modules:
                return _attribute_problem(parts[cut - 1], parts[cut:], name)
        return f"no module {name}"
    head, rest = parts[0], parts[1:]
    if any(part.isdigit() for part in parts) or head in INSTANCE_WORDS:
        return None
    if head in index().classes or head in index().modules:
        return _attribute_problem(head, rest, name)
    return None


def _attribute_problem(owner: str, rest: list[str], name: str) -> str | None:
    """`owner.rest[0]` exists (a module's top-level name or submodule, or a class's member);
    deeper attributes are not followed."""
    if not rest:
        return None
    attribute = rest[0]
    if attribute in index().modules.get(owner, set()) | _members(owner):
        return None
    if (
        attribute in index().classes or attribute in index().modules
    ):  # a name re-exported through a package
        return None
    return f"{name}: {owner} has no {attribute}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_docs_hold_no_placeholder(doc):
    """No page holds a placeholder for a number still to be measured (an ALL_CAPS token that
    names nothing in the code)."""
    text = SPAN.sub("", FENCE.sub("", doc.read_text()))
    placeholders = sorted(set(PLACEHOLDER.findall(text)) - index().names)
    assert not placeholders, placeholders


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_docs_name_what_exists(doc):
    """Every file, module, function, class or attribute the page names exists."""
    problems = [
        f"{doc.relative_to(ROOT)}:{line}: `{span}`: {problem}"
        for line, span in _spans(doc)
        if (problem := _problem(span))
    ]
    assert not problems, "\n".join(problems)


WORKED_FAMILY = r"""
import importlib.util
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
import numpy as np

import boundary_jax as bj
import models
from models.config import read_hf_config, write_hf_config

spec = importlib.util.spec_from_file_location("models.families.worked_example", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
hf = {
    "architectures": ["ReluSquaredForCausalLM"], "model_type": "relu_squared",
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 1e4, "max_position_embeddings": 64,
}
config = read_hf_config(hf)
assert read_hf_config(write_hf_config(config)) == config
prompts = [[1, 2, 3, 4, 5], [6, 7]]
logits = []
for topology in (bj.Topology(), bj.Topology(attn_tp=2)):
    mesh = bj.make_mesh(topology)
    model = models.build_model(config, topology, seed=3)
    logits.append(models.ShardedCausalLM(model, mesh).forward(prompts))
    assert "layers.0.mlp.up_proj.kernel" in models.config.hf_name_map(config)
np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)
assert np.abs(logits[0]).max() > 0
print("ok")
"""


def test_the_worked_family_example_builds_and_runs_sharded(tmp_path):
    """The "Adding a family" example of docs/architecture.md, as written, registers its family,
    reads and writes its config, and runs on two ranks as on one (in a process of its own, so
    the test registry stays as it is)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Adding a family", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    family = tmp_path / "worked_example.py"
    family.write_text(example)
    script = tmp_path / "run.py"
    script.write_text(WORKED_FAMILY)
    result = subprocess.run(
        [sys.executable, str(script), str(family)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "ok"
