"""Plans and compiled programs described, in one place: what each bound path runs, in words,
and the collectives a compiled program runs, by kind and by layer, with their bytes.

The collective counts come from the compiled HLO text, after XLA's own passes, so they are what
runs. A collective belongs to the innermost `jax.named_scope` whose name matches `layer_<index>`
in its op metadata (the models wrap each decoder layer in one); the rest belong to no layer. A
collective in the body of a scanned run of layers (`boundary_jax.scan.StackedLayers`, scope
`layers_<start>_<stop>`) runs once per layer of the run, and is counted once for each of them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable, Iterable

import jax

from . import ops
from .declare import EdgeKind
from .layout import BatchVariant, Topology
from .ops import AllGather, AllReduce, Finalize, ReduceScatter, Step, TakeBlock
from .plan import BranchFork, StagePath, StagePlan

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


def describe_steps(steps: tuple[Step, ...]) -> str:
    """`steps` in words, e.g. "reduce-scatter over attn_dp x attn_tp, all-gather over attn_tp"
    (each step's mesh axes: a token axis the expert-parallel size splits names both parts)."""

    def over(step):
        return " x ".join(step.topology.mesh_names(step.axes))

    words = {
        AllReduce: "all-reduce",
        ReduceScatter: "reduce-scatter",
        AllGather: "all-gather",
        TakeBlock: "local slice",
    }

    def word(step: Step) -> str:
        if isinstance(step, Finalize):
            return "finalize"
        return f"{words[type(step)]} over {over(step)}"

    return ", ".join(word(step) for step in steps) or "nothing"


def describe_path(path: StagePath, topology: Topology) -> dict[str, object]:
    """A JSON-friendly account of one bound path on `topology`: what each entry and exit
    option runs."""
    entries = []
    for entry in path.entries:
        if entry.initial:
            source = f"stack input ({entry.handoff})"
        elif entry.handoff is None:
            source = f"written residual on rows {entry.residual_from}"
        else:
            source = f"pending contribution ({entry.handoff})"
        completion = entry.residual_move + entry.complete
        entries.append(
            {
                "primary": entry.primary,
                "from": source,
                "completes": describe_steps(completion),
                "fused_with_add_norm": describe_steps(ops.all_reduce(entry.fused_sum, topology)),
                "reads_on_rows": str(path.residual_layout),
                "moves_input": describe_steps(entry.move_input),
            }
        )
    exits = [
        {
            "exit": option.kind.value,
            "runs": describe_steps(option.steps),
            "hands_on": str(option.handoff),
            **(
                {"then_folds_and_moves_residual_to": str(option.fold_to.layout)}
                if option.fold_to
                else {}
            ),
        }
        for option in path.exits
    ]
    described = {
        "variant": path.variant.value,
        "residual_rows": str(path.residual_layout),
        "compute_rows": str(path.compute_layout),
        "entries": entries,
        "exit_options": exits,
    }
    if path.fork is not None:
        described["fork"] = _describe_fork(path.fork)
    if path.merge is not None:
        described["merge"] = _describe_merge(path)
    return described


def _describe_fork(fork: BranchFork) -> dict[str, object]:
    """A branch's first stage: what `branch_input` moves from its source."""
    return {
        "edge": EdgeKind.BRANCH_FORK.value,
        "source_input_rows": str(fork.source_compute),
        "moves_input": describe_steps(fork.input_move),
        "source_residual_rows": str(fork.source_residual),
        "forks_residual": describe_steps(fork.residual_move),
    }


def _describe_merge(path: StagePath) -> dict[str, object]:
    """A branch's last stage: where the sum its output owes completes, per exit option, and how
    its residual joins its source's."""
    merge = path.merge
    completes = []
    for option in path.exits:
        steps = describe_steps(option.work.onto_residual)
        if option.handoff in merge.defers:
            where = (
                "added unsummed to the source's output at the merge, where the source hands on "
                "the same work: the source's consumer completes both (otherwise at merge_branch: "
                f"{steps})"
            )
        else:
            where = f"at branch_output: {steps}"
        completes.append({"exit": option.kind.value, "hands_on": str(option.handoff), "sum": where})
    return {
        "edge": EdgeKind.BRANCH_MERGE.value,
        "into_residual_rows": str(merge.into),
        "moves_residual": {
            str(rows): describe_steps(steps) for rows, steps in merge.residual_moves
        },
        "branch_sum_completes": completes,
    }


def describe_stages(
    stages: Iterable[tuple[int, str, StagePlan]], variant: BatchVariant
) -> list[dict[str, object]]:
    """`describe_path` of each `(layer, stage name, plan)` for `variant`, with its layer and
    name (and `input_format` where the stage reads quantized input): a model's whole bound
    stack in JSON-friendly form."""
    return [
        {
            "layer": layer,
            "stage": name,
            **_input_format(plan),
            **describe_path(plan.path(variant), plan.topology),
        }
        for layer, name, plan in stages
    ]


def _input_format(plan: StagePlan) -> dict[str, str]:
    """The stage's quantized input format, where its read declares one."""
    form = plan.declaration.read.input_format
    return {} if form is None else {"input_format": form.name}


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
