"""Bound plans described in words: what each entry and exit option of a stage's path runs, in
a JSON-friendly form for reports and the command line's `plan`."""

from __future__ import annotations

from collections.abc import Iterable

from .. import ops
from ..declare import EdgeKind
from ..layout import BatchVariant, Topology
from ..ops import AllGather, AllReduce, Finalize, ReduceScatter, Step, TakeBlock
from ..plan import BranchFork, StagePath, StagePlan


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
        if isinstance(step, AllGather) and step.custom is not None:
            return f"the stage's own gather over {over(step)} (else all-gather)"
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
    name (`input_format` where the stage reads quantized input, `replicated` where its output
    has parts counted once): a model's whole bound stack in JSON-friendly form."""
    return [
        {
            "layer": layer,
            "stage": name,
            **_input_format(plan),
            **_counted_once(plan),
            **describe_path(plan.path(variant), plan.topology),
        }
        for layer, name, plan in stages
    ]


def _counted_once(plan: StagePlan) -> dict[str, dict[str, str]]:
    """Where each replicated part of the stage's output is added, where it declares any."""
    if not plan.counted_once:
        return {}
    return {"replicated": {part.name: part.describe() for part in plan.counted_once}}


def _input_format(plan: StagePlan) -> dict[str, str]:
    """The stage's quantized input format, where its read declares one."""
    form = plan.declaration.read.input_format
    return {} if form is None else {"input_format": form.name}
