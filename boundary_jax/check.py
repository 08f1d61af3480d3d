"""Simulates every bound step of a plan: each owed item completes once, in order, on the rows
that read it.

Every step states its effect on a `Placement` (`ops.Step.after`); a path is checked by composing
those effects from where its value starts and comparing where it lands with where the stage, the
residual helper or the stack's leaving read reads it. A binding bug fails here, when the stack
closes, never on the device.
"""

from __future__ import annotations

from . import ops
from .ops import PlanError, Step, TakeBlock
from .placement import Placement
from .plan import EntryPath, ExitOption, OwedWork, ResidualRows, StagePath, StagePlan


def check_plan(plan: StagePlan) -> None:
    """Simulates every path of `plan`.

    Raises:
      PlanError: A bound path does not land where it is read (a binding bug); the message names
        the path, the step sequence and where it landed.
    """
    for path in plan.paths:
        _Checker(path, plan).run()


class _Checker:
    def __init__(self, path: StagePath, plan: StagePlan):
        self.path = path
        self.topology = plan.topology
        self.residual = Placement(path.residual_layout)
        self.attention = Placement(plan.topology.attention_rows())

    def expect(self, steps: tuple[Step, ...], start: Placement, want: Placement, what: str):
        landed = ops.simulate(steps, start)
        if landed != want:
            raise PlanError(
                f"{what} of the {self.path.variant.value} path lands on {landed}, but is read "
                f"on {want}; this is a binding bug: report it with the stack's declarations"
            )

    def run(self) -> None:
        path = self.path
        self.rows(path.residual_rows, "the residual's rows")
        for entry in path.entries:
            self.entry(entry, self.residual, "the entry", compute=Placement(path.compute_layout))
        for option in path.exits:
            self.exit(option)
        if path.fork is not None:
            self.fork(path)
        if path.merge is not None:
            self.merge(path)

    def fork(self, path: StagePath) -> None:
        fork = path.fork
        self.expect(
            fork.residual_move,
            Placement(fork.source_residual),
            self.residual,
            "the residual's fork at branch_input",
        )
        self.expect(
            fork.input_move,
            Placement(fork.source_compute),
            Placement(path.compute_layout),
            "the move of the source's prepared input at branch_input",
        )

    def merge(self, path: StagePath) -> None:
        merge = path.merge
        into = Placement(merge.into)
        for rows, steps in merge.residual_moves:
            self.expect(steps, Placement(rows), into, "the branch residual's move at the merge")
        handoffs = {option.handoff for option in path.exits}
        for placement in merge.defers:
            if placement.finalize or placement not in handoffs:
                raise PlanError(
                    f"the merge defers a branch output {placement}, which the branch's exit "
                    "does not hand on unfinalized"
                )

    def rows(self, rows: ResidualRows, what: str) -> None:
        want = Placement(rows.layout)
        self.expect(rows.from_attention, self.attention, want, f"the move onto {what}")
        if not all(isinstance(step, TakeBlock) for step in rows.from_attention):
            raise PlanError(
                f"a value moves onto {what} by local slices only; the "
                f"{self.path.variant.value} path binds {rows.from_attention}"
            )

    def entry(self, entry: EntryPath, residual: Placement, what: str, *, compute: Placement):
        if not entry.initial:
            self.expect(
                entry.residual_move,
                Placement(entry.residual_from),
                residual,
                f"the residual move of {what} from {entry.residual_from}",
            )
        if entry.handoff is not None:
            self.expect(
                entry.complete + ops.all_reduce(entry.fused_sum, self.topology),
                entry.handoff,
                residual,
                f"the completion of {entry.handoff} at {what}",
            )
        self.expect(entry.move_input, residual, compute, f"the input move of {what}")
        self.expect(entry.capture_move, residual, self.attention, f"the capture move of {what}")

    def exit(self, option: ExitOption) -> None:
        name = f"the {option.kind.name} exit"
        start = Placement(self.path.compute_layout, self.path.owed, option.defers_finalize)
        if option.output != start:
            raise PlanError(f"{name} starts from {option.output}; compute returns {start}")
        self.expect(option.steps, option.output, option.handoff, name)
        self.work(option.work, option.handoff, name)
        rows = self.residual
        if option.fold_to is not None:
            if option.handoff != self.residual:
                raise PlanError(
                    f"a folding exit must hand on a complete value on {self.residual}; got "
                    f"{option.handoff}"
                )
            rows = Placement(option.fold_to.layout)
            self.expect(option.fold_steps, self.residual, rows, f"the fold of {name}")
            self.rows(option.fold_to, f"the rows {name} folds onto")
        self.leave(option, rows, name)

    def work(self, work: OwedWork, handoff: Placement, what: str) -> None:
        if work.placement != handoff:
            raise PlanError(f"{what} records {work.placement} for a handoff on {handoff}")
        while True:
            placement = work.placement
            self.expect(work.in_place, placement, placement.completed(), f"{what}'s completion")
            self.expect(work.onto_residual, placement, self.residual, f"{what}'s fold")
            if work.then is None:
                if not placement.complete:
                    raise PlanError(f"{what} records no completed form of {placement}")
                return
            if work.then.placement != placement.completed():
                raise PlanError(f"{what}'s completed record is on {work.then.placement}")
            work = work.then

    def leave(self, option: ExitOption, rows: Placement, what: str) -> None:
        leave = option.leave
        forms = {entry.handoff for entry in leave.entries}
        wanted = {None, Placement(rows.layout)}
        if option.fold_to is None:
            wanted |= {option.handoff, option.handoff.completed()}
        if forms != wanted:
            raise PlanError(
                f"{what} binds leaving paths for {sorted(map(str, forms))}; the stream may "
                f"leave as {sorted(map(str, wanted))}"
            )
        for entry in leave.entries:
            if entry.residual_from != rows.layout:
                raise PlanError(f"{what} leaves from {entry.residual_from}, not {rows.layout}")
            self.entry(entry, rows, f"the leaving read of {what}", compute=self.attention)
