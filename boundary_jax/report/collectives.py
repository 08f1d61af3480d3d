"""The collectives a compiled program runs, read from its HLO text: by kind, by layer and with
their bytes.

The counts come from the compiled HLO text, after XLA's own passes, so they are what runs. A
collective belongs to the innermost `jax.named_scope` whose name matches `layer_<index>` in its op
metadata (the models wrap each decoder layer in one); the rest belong to no layer. A collective in
the body of a scanned run of layers (`boundary_jax.scan.StackedLayers`, scope
`layers_<start>_<stop>`) runs once per layer of the run, and is counted once for each of them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable

import jax

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_LAYER = re.compile(r"layer_(\d+)")
_RUN = re.compile(r"layers_(\d+)_(\d+)")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<mesh>[^\]]*)\]\s*\{(?P<axes>[^}]*)\}")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[0-9,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: One of `KINDS`.
      bytes: Size of the full buffer it operates on: an all-reduce's buffer, a reduce-scatter's
        input, an all-gather's output, an all-to-all's or collective-permute's buffer.
      group_size: Ranks per group.
      layer: The `layer_<index>` scope it was traced in; None outside every layer.
    """

    kind: str
    bytes: int
    group_size: int
    layer: int | None


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """The collectives of one compiled program."""

    collectives: tuple[Collective, ...]

    def counts(self, layer: int | None | str = "all") -> dict[str, int]:
        """Collectives by kind: of every layer (`"all"`), of one layer, or outside (None)."""
        chosen = self._select(layer)
        counter = collections.Counter(c.kind for c in chosen)
        return {kind: counter.get(kind, 0) for kind in KINDS}

    def bytes(self, layer: int | None | str = "all") -> int:
        return sum(c.bytes for c in self._select(layer))

    def sequence(self, layer: int | None | str = "all") -> tuple[str, ...]:
        """Kinds in program order."""
        return tuple(c.kind for c in self._select(layer))

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({c.layer for c in self.collectives if c.layer is not None}))

    def _select(self, layer):
        if layer == "all":
            return self.collectives
        return tuple(c for c in self.collectives if c.layer == layer)


def parse_hlo(text: str) -> CollectiveReport:
    """The collectives of compiled HLO text (`compiled.as_text()`), in program order."""
    found = []
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        kind = match["kind"]
        result_bytes = sum(
            _DTYPE_BYTES.get(a["dtype"], 4) * math.prod(int(d) for d in a["dims"].split(",") if d)
            for a in _ARRAY.finditer(match["shape"])
            if a["dtype"] != "token"
        )
        group = _group_size(line)
        size = result_bytes * group if kind == "reduce-scatter" else result_bytes
        if kind.endswith("-start") or "-start(" in line[: match.end()]:
            size = _start_bytes(kind, match["shape"], size)
        metadata = _metadata(line)
        if runs := _RUN.findall(metadata):
            start, stop = runs[-1]
            found.extend(Collective(kind, size, group, i) for i in range(int(start), int(stop)))
            continue
        layers = _LAYER.findall(metadata)
        found.append(Collective(kind, size, group, int(layers[-1]) if layers else None))
    return CollectiveReport(tuple(found))


def collective_report(fn: Callable, *args, **kwargs) -> CollectiveReport:
    """Compiles `jax.jit(fn)(*args, **kwargs)` and reports its collectives."""
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    return parse_hlo(compiled.as_text())


def _metadata(line: str) -> str:
    match = re.search(r'op_name="([^"]*)"', line)
    return match[1] if match else ""


def _group_size(line: str) -> int:
    if match := _MESH_GROUPS.search(line):
        sizes = {
            name.strip().strip("'"): int(size)
            for name, size in (item.split("=") for item in match["mesh"].split(",") if item)
        }
        axes = [a.strip().strip("'") for a in match["axes"].split(",") if a.strip()]
        return math.prod(sizes[a] for a in axes)
    if match := _IOTA_GROUPS.search(line):
        return int(match["size"])
    if match := _LIST_GROUPS.search(line):
        return len([d for d in match["first"].split(",") if d])
    return 1


def _start_bytes(kind: str, shape: str, size: int) -> int:
    """An async `-start` returns (operands..., results...); count the buffer once."""
    arrays = [
        _DTYPE_BYTES.get(a["dtype"], 4) * math.prod(int(d) for d in a["dims"].split(",") if d)
        for a in _ARRAY.finditer(shape)
    ]
    return max(arrays) if arrays else size


def describe_collectives(report: CollectiveReport, num_layers: int) -> dict[str, object]:
    """A compiled program's collectives in JSON-friendly form: each layer's in program order
    with their bytes, and those outside every layer."""
    return {
        "collectives_by_layer": [
            {"layer": layer, "sequence": list(report.sequence(layer)), "bytes": report.bytes(layer)}
            for layer in range(num_layers)
        ],
        "collectives_outside_layers": list(report.sequence(None)),
    }
