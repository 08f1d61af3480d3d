"""Layer stacks: `append_stages` records stages in order; the stack binds them when it closes.

A stack is a graph of stages joined by typed edges (`declare.Edge`): the stack entry, next-stage
edges, the stack exit into the final read, and, for a stack that holds layers [a, b) of a longer
model, a pipeline receive and a pipeline send whose far ends are the neighbouring layers'
declarations from the model's shared `stage_facts` function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping

from flax import nnx

from .bind import bind_stage
from .check import check_plan
from .declare import (
    Edge,
    EdgeKind,
    FinalRead,
    StackInput,
    StackPlace,
    StageDeclaration,
    StageKind,
)
from .designs.add_norm import AddNormRead
from .designs.protocols import Norm, ResidualReadout, read_facts
from .fusions import NO_FUSIONS, FusionProvider
from .layout import BatchVariant, SumGroup, Topology
from .ops import ReducingModule, RowGather
from .plan import StackFacts, StageRows
from .policy import ReductionPolicy, resolve_reduction_policy
from .rows import branch_rows, compute_layout, stage_rows, supported_variants
from .stage import Owned, StageBoundary

_STAGE_OPTIONS: dict[StageKind, frozenset[str]] = {
    StageKind.ATTN: frozenset({"fusions"}),
    StageKind.FFN: frozenset({"fusions"}),
}

StageFacts = Callable[[int], tuple[StageDeclaration, ...]]

BRANCH_ROWS = (
    "a stack with branches binds ordinary token rows only (branch transport does not support "
    "input-scattered or sequence-parallel rows)"
)


@dataclasses.dataclass
class Branch:
    """Stages appended with `prepared_from`: a side path that starts from `source`'s prepared
    input and merges back into its output; it neither extends the stack nor waits for a
    consumer.

    Attributes:
      source: The stage whose prepared input the branch starts from.
      stages: The branch's stages, in order.
    """

    source: StageBoundary
    stages: tuple[StageBoundary, ...]


@dataclasses.dataclass
class LayerStack:
    """An open layer stack: the stages appended so far and the facts they bind against.

    Attributes:
      topology: The parallel topology every stage binds on.
      policy: The resolved reduction policy.
      input_sum: The sum the stack input still owes when it reaches the first stage.
      fusions: The fusion provider of stages appended without their own.
      final_read: The read the stack leaves through (the last stage's consumer).
      final_gather: The final read's own gather over attention TP, or None.
      final_reads_slices: The final read reads this rank's attention-TP slice.
      stage_facts: The model's shared declaration function, or None.
      layers: The model layers this stack holds (with `stage_facts`), or None for all.
      num_layers: The model's layer count (with `stage_facts`).
      boundaries: The stages appended so far, in stack order.
      branches: The branches appended so far (their stages are not in `boundaries`).
    """

    topology: Topology
    policy: ReductionPolicy
    input_sum: SumGroup | None
    fusions: FusionProvider
    final_read: ResidualReadout
    stage_facts: StageFacts | None = None
    layers: range | None = None
    num_layers: int | None = None
    final_gather: RowGather | None = None
    final_reads_slices: bool = False
    boundaries: list[StageBoundary] = dataclasses.field(default_factory=list)
    branches: list[Branch] = dataclasses.field(default_factory=list)

    def source(self, prepared_from: StageBoundary | StageDeclaration) -> StageBoundary:
        """The appended stage `prepared_from` names (its boundary, or that boundary's
        declaration).

        Raises:
          ValueError: No stage appended to this stack so far is `prepared_from`.
        """
        stages = [*self.boundaries, *(b for branch in self.branches for b in branch.stages)]
        for boundary in stages:
            if boundary is prepared_from or boundary.declaration is prepared_from:
                return boundary
        raise ValueError(
            "prepared_from names the stage whose prepared input a branch starts from: a boundary "
            "appended earlier in this open layer stack, or its .declaration; got "
            f"{type(prepared_from).__name__}"
        )

    def model_stages(self) -> tuple[tuple[StageDeclaration, ...], int]:
        """The facts of every stage of the model, and the index of this stack's first stage.

        Raises:
          ValueError: The appended stages differ from what `stage_facts` declares for the
            layers this stack holds.
        """
        local = tuple(b.declaration for b in self.boundaries)
        if self.stage_facts is None:
            return local, 0
        per_layer = [tuple(d.facts() for d in self.stage_facts(i)) for i in range(self.num_layers)]
        before = sum(len(stages) for stages in per_layer[: self.layers.start])
        declared = tuple(d for i in self.layers for d in per_layer[i])
        if declared != local:
            at = next(
                (i for i, (a, b) in enumerate(zip(declared, local, strict=False)) if a != b),
                min(len(declared), len(local)),
            )
            raise ValueError(
                f"the layers {self.layers} appended {len(local)} stages, but stage_facts declares "
                f"{len(declared)} for them, differing first at stage {at}; each layer must declare "
                "its stages with the model's stage_facts function"
            )
        return tuple(d for stages in per_layer for d in stages), before

    def bind(self) -> None:
        """Binds every stage once the edges on both its sides are known."""
        stages, offset = self.model_stages()
        variants = supported_variants(stages, self.topology)
        rejected = ()
        if self.branches:
            if self.topology.attn_cp > 1:
                raise NotImplementedError(
                    f"branches under attention context parallelism are not supported (branch "
                    f"transport moves ordinary token rows only); got topology={self.topology!r}. "
                    "Build the model with attn_cp=1 (the branch appended at "
                    f"{self.branches[0].stages[0].call_site})"
                )
            scattered = BatchVariant.INPUT_SCATTERED
            rejected = ((scattered, BRANCH_ROWS),) if scattered in variants else ()
            variants = tuple(v for v in variants if v is not scattered)
        facts = StackFacts(
            self.topology, self.policy, variants, self.fusions, self.final_read, rejected
        )
        for boundary in self.boundaries:
            try:
                compute_layout(boundary.declaration, self.topology, BatchVariant.ORDINARY)
            except ValueError as error:
                error.add_note(f"while binding the stage appended at {boundary.call_site}")
                raise
        rows: dict[BatchVariant, tuple[StageRows, ...]] = {}
        for variant in facts.variants:
            try:
                rows[variant] = stage_rows(stages, variant, self.topology)
            except NotImplementedError as error:
                error.add_note(
                    "while binding the stack whose first stage is appended at "
                    f"{self.boundaries[0].call_site}"
                )
                raise
        final = FinalRead(read_facts(self.final_read), self.final_gather, self.final_reads_slices)
        bound_rows: dict[int, dict[BatchVariant, StageRows]] = {}
        last = len(self.boundaries) - 1
        for local, boundary in enumerate(self.boundaries):
            index = offset + local
            declaration = stages[index]
            if index == 0:
                incoming = Edge(EdgeKind.STACK_ENTRY, StackInput(self.input_sum), declaration)
            else:
                kind = EdgeKind.PIPELINE_RECEIVE if local == 0 else EdgeKind.NEXT_STAGE
                incoming = Edge(kind, stages[index - 1], declaration)
            if index == len(stages) - 1:
                outgoing = Edge(EdgeKind.STACK_EXIT, declaration, final)
            else:
                kind = EdgeKind.PIPELINE_SEND if local == last else EdgeKind.NEXT_STAGE
                outgoing = Edge(kind, declaration, stages[index + 1])
            stage_rows_of = {
                variant: (
                    rows[variant][index - 1] if index else None,
                    rows[variant][index],
                )
                for variant in facts.variants
            }
            producer = self.boundaries[local - 1].fusions if local else None
            bound_rows[id(boundary)] = {v: rows[v][index] for v in facts.variants}
            try:
                _check_next_sparse(declaration, stages[index + 1 :])
                plan = bind_stage(
                    dataclasses.replace(declaration, place=StackPlace(incoming, outgoing)),
                    incoming,
                    outgoing,
                    facts,
                    stage_rows_of,
                    boundary.fusions,
                    producer,
                    branch_source=any(branch.source is boundary for branch in self.branches),
                )
                check_plan(plan)
            except Exception as error:
                error.add_note(f"while binding the stage appended at {boundary.call_site}")
                raise
            boundary.bind(plan)
        for branch in self.branches:
            _bind_branch(branch, facts, bound_rows)


def _bind_branch(
    branch: Branch, facts: StackFacts, bound_rows: dict[int, dict[BatchVariant, StageRows]]
) -> None:
    """Binds a branch's stages: the first entered through a fork from its source's prepared
    input, the last leaving by a merge into its source's output (whose consumer it binds
    against)."""
    source = branch.source
    source_facts = source.declaration.facts()
    consumer = source.declaration.place.outgoing.consumer
    declarations = tuple(b.declaration for b in branch.stages)
    first = branch.stages[0]
    try:
        if declarations[0].read.input_format != source_facts.read.input_format:
            raise ValueError(
                f"a branch's first stage takes its source's prepared input as it is, so its read "
                f"must hand the same input format: the source's is "
                f"{source_facts.read.input_format}, the branch's "
                f"{declarations[0].read.input_format}"
            )
        rows = {
            variant: branch_rows(
                bound_rows[id(source)][variant], declarations, variant, facts.topology
            )
            for variant in facts.variants
        }
    except (ValueError, NotImplementedError) as error:
        error.add_note(f"while binding the branch appended at {first.call_site}")
        raise
    last = len(declarations) - 1
    for index, boundary in enumerate(branch.stages):
        declaration = declarations[index]
        if index == 0:
            incoming = Edge(EdgeKind.BRANCH_FORK, source_facts, declaration)
            producer, before = source.fusions, {v: bound_rows[id(source)][v] for v in rows}
        else:
            incoming = Edge(EdgeKind.NEXT_STAGE, declarations[index - 1], declaration)
            producer = branch.stages[index - 1].fusions
            before = {v: rows[v][index - 1] for v in rows}
        if index == last:
            outgoing = Edge(EdgeKind.BRANCH_MERGE, declaration, consumer)
        else:
            outgoing = Edge(EdgeKind.NEXT_STAGE, declaration, declarations[index + 1])
        try:
            compute_layout(declaration, facts.topology, BatchVariant.ORDINARY)
            plan = bind_stage(
                dataclasses.replace(declaration, place=StackPlace(incoming, outgoing)),
                incoming,
                outgoing,
                facts,
                {v: (before[v], rows[v][index]) for v in rows},
                boundary.fusions,
                producer,
                merge_into=source.plan if index == last else None,
            )
            check_plan(plan)
        except Exception as error:
            error.add_note(f"while binding the branch stage appended at {boundary.call_site}")
            raise
        boundary.bind(plan)
        bound_rows[id(boundary)] = {v: rows[v][index] for v in rows}


_open_stacks: contextvars.ContextVar[tuple[LayerStack, ...]] = contextvars.ContextVar(
    "boundary_jax_open_stacks", default=()
)


@contextlib.contextmanager
def layer_stack(
    topology: Topology,
    *,
    reduction: ReductionPolicy = ReductionPolicy.AUTO,
    architecture: str | None = None,
    input_sum: SumGroup | None = None,
    fusions: FusionProvider = NO_FUSIONS,
    final_read: ResidualReadout = AddNormRead(),
    stage_facts: StageFacts | None = None,
    num_layers: int | None = None,
    layers: range | None = None,
    final_attn_tp_gather: RowGather | None = None,
    final_reads_attn_tp_slices: bool = False,
) -> Iterator[LayerStack]:
    """Opens a layer stack; every `append_stages` inside it extends this stack.

    When the block ends without an error, every stage binds between the edge it is entered
    through and the edge it leaves by.

    Args:
      topology: The parallel topology (e.g. `Topology.from_mesh(mesh)`).
      reduction: The FFN output transport policy; AUTO resolves by `architecture`.
      architecture: Names the model for AUTO's per-architecture default.
      input_sum: The sum the stack input owes (a vocab-parallel embedding: `SumGroup.ATTN_TP`);
        the first stage's entry completes it.
      fusions: Fused candidates for stages appended without a `fusions` option. The default has
        none: the built-in all-reduce + XLA add + norm measured fastest end to end
        (benchmarks/RESULTS.md); `fusions.platform_fusions(topology)` opts into the Pallas
        kernels.
      final_read: The read the stack leaves through (`residual_stream.final_norm` applies it with
        the model's final norm); a frozen, stateless read. The default is add + RMSNorm.
      stage_facts: The model's shared declaration function: `stage_facts(i)` returns fresh
        declarations of the stages layer `i` appends, in order (an empty tuple for a layer that
        appends none). With it, each layer is checked against it and a stack holding part of the
        model binds its edge stages against the neighbouring layers' declarations.
      num_layers: The model's layer count (with `stage_facts`).
      layers: The layers this stack holds (with `stage_facts`; default all): a pipeline rank's
        share. Its first stage is entered through a pipeline receive unless it holds layer 0,
        and its last leaves by a pipeline send unless it holds the last layer.
      final_attn_tp_gather: The final read's own gather over attention TP (`ops.RowGather`)
        of the rows the last stage leaves on this rank's slice, tried before the built-in one.
      final_reads_attn_tp_slices: The final read reads this rank's attention-TP slice itself
        (then gathers what it read), so the last stage leaves its output there instead of
        folding it and gathering the residual at its exit.

    Raises:
      RuntimeError: Another layer stack is open.
      NotImplementedError: The topology uses attention context parallelism with pipeline
        parallelism, or pipeline parallelism without `stage_facts`.
      ValueError: `layers` or `num_layers` without `stage_facts`, or a `layers` range outside
        the model.
      TypeError: `final_read` is not a frozen (hashable) read.
    """
    if final_reads_attn_tp_slices and final_read.reads_after_attn_tp_gather:
        raise ValueError(
            f"the final read {type(final_read).__name__} declares reads_after_attn_tp_gather (it "
            "needs every row of the attention's), so it cannot read this rank's attention-TP "
            "slice; drop final_reads_attn_tp_slices"
        )
    if stage_facts is None:
        if layers is not None or num_layers is not None:
            raise ValueError(
                "a stack that holds part of a model's layers binds its edges from the model's "
                "declarations: pass stage_facts with num_layers and layers"
            )
        if topology.pp > 1:
            raise NotImplementedError(
                f"pipeline parallelism needs the model's stage_facts and the layers this rank "
                f"holds (layer_stack(stage_facts=..., num_layers=..., layers=...)); got {topology=}"
            )
    else:
        if num_layers is None or num_layers < 1:
            raise ValueError(f"stage_facts needs num_layers >= 1; got {num_layers=}")
        layers = range(num_layers) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= num_layers:
            raise ValueError(
                f"layers must be a non-empty range [a, b) within [0, {num_layers}); got {layers}"
            )
    if _open_stacks.get():
        raise RuntimeError(
            "layer_stack() inside an open layer stack: a stack holds one model's layers and "
            "binds when it closes; build a second stack (a draft model's, a multi-token "
            "predictor's) after the first one closes"
        )
    if topology.attn_cp > 1 and topology.pp > 1:
        raise NotImplementedError(
            f"attention context parallelism with pipeline parallelism is not supported yet; got "
            f"{topology=}. Use attn_cp with pp=1 (attention DP and TP may be any size)"
        )
    try:
        hash(final_read)
    except TypeError as error:
        raise TypeError(
            f"final_read must be a frozen, stateless read (it is static plan data); got "
            f"{type(final_read).__name__}. Put parameters in the norm passed to final_norm()."
        ) from error
    stack = LayerStack(
        topology,
        resolve_reduction_policy(reduction, architecture),
        input_sum,
        fusions,
        final_read,
        stage_facts,
        layers,
        num_layers,
        final_attn_tp_gather,
        final_reads_attn_tp_slices,
    )
    token = _open_stacks.set(_open_stacks.get() + (stack,))
    try:
        yield stack
    finally:
        _open_stacks.reset(token)
    if not stack.boundaries:
        raise ValueError("a layer stack closed without stages; append_stages() builds them")
    stack.bind()


def append_stages(
    *items: tuple[StageDeclaration, Norm | None]
    | tuple[StageDeclaration, Norm | None, Mapping[str, object]],
    owner: nnx.Module | None = None,
    prepared_from: StageBoundary | StageDeclaration | None = None,
) -> tuple[StageBoundary, ...]:
    """Appends stages to the innermost open layer stack, in order.

    Each item is `(declaration, norm)` or `(declaration, norm, options)`. The stage appended
    before the first item is its producer; the boundaries bind when the stack closes.

    With `prepared_from`, the items are a branch: a side path starting from the input the named
    stage (the source) has already prepared, merged back into the source's output by the model
    (`adapters.branch_input`, `branch_output`, `merge_branch`). A branch neither extends the
    stack nor waits for a consumer: the next append still follows the source, and the model's
    `stage_facts` does not list branch stages. The first item's norm is never applied (the
    source's read has run); pass the source's norm there.

    A norm, read, update or output transform that is an `nnx.Module` belongs to the layer, not
    to the boundary: assign it to an attribute of the layer first and pass the layer as
    `owner`, so its parameters are named by the layer's part (`layers.3.input_norm.weight`).

    Args:
      items: The stages, in order.
      owner: The layer appending them (`self` in its `__init__`); needed when a design is a
        module.
      prepared_from: The source of a branch: a boundary appended earlier to this stack, or its
        `.declaration`.

    Returns:
      One `StageBoundary` per item.

    Raises:
      RuntimeError: No layer stack is open.
      ValueError: A declaration already has its place in a stack, a module design is not an
        attribute of `owner`, or a module of `owner` sums its own result
        (`ops.ReducingModule`) and no stage appended with it declares `output_complete`.
      TypeError: A malformed item, an option the stage does not take, or a module design
        without an `owner`.
    """
    stacks = _open_stacks.get()
    if not stacks:
        raise RuntimeError(
            "append_stages needs an open layer stack; wrap the layers' construction in "
            "layer_stack()"
        )
    frame = sys._getframe(1)
    call_site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    boundaries = []
    for item in items:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise TypeError(
                f"append_stages takes (declaration, norm[, options]) items; got {item!r}"
            )
        declaration, norm, options = (*item, {}) if len(item) == 2 else item
        if not isinstance(declaration, StageDeclaration):
            raise TypeError(
                f"append_stages items start with a declare_attn()/declare_ffn() declaration; "
                f"got {type(declaration).__name__}"
            )
        if declaration.place is not None:
            raise ValueError(
                "a declaration taken from a bound boundary already has its place in a stack; "
                "pass a fresh declaration from declare_attn() / declare_ffn()"
            )
        taken = _STAGE_OPTIONS[declaration.kind]
        unknown = sorted(set(options) - taken)
        if unknown:
            raise TypeError(
                f"{declaration.kind.value} stages do not take the options {unknown}; "
                f"they take {sorted(taken) or 'none'}"
            )
        fusions = options.get("fusions")
        if fusions is not None and not isinstance(fusions, FusionProvider):
            raise TypeError(f"the fusions option takes a FusionProvider; got {fusions!r}")
        parts = (norm, declaration.read, declaration.update, declaration.output_transform)
        names = ("norm", "read", "update", "output_transform")
        designs = tuple(_owned(part, name, owner) for part, name in zip(parts, names, strict=True))
        uses_owner = any(isinstance(design, Owned) for design in designs)
        boundaries.append(
            StageBoundary(
                declaration.facts(), designs, call_site, fusions, owner if uses_owner else None
            )
        )
    _refuse_reducing_compute(owner, [boundary.declaration for boundary in boundaries], call_site)
    if prepared_from is None:
        stacks[-1].boundaries.extend(boundaries)
    elif boundaries:
        source = stacks[-1].source(prepared_from)
        if any(branch.source is source for branch in stacks[-1].branches):
            raise ValueError(
                f"the stage appended at {source.call_site} is already the source of a branch; a "
                "stage is the source of one branch (append the second's stages to the first, or "
                "fork it from one of the first branch's stages)"
            )
        stacks[-1].branches.append(Branch(source, tuple(boundaries)))
    else:
        raise ValueError(
            "a branch (append_stages(..., prepared_from=...)) needs at least one stage"
        )
    return tuple(boundaries)


def _refuse_reducing_compute(
    owner: nnx.Module | None, declarations: list[StageDeclaration], call_site: str
) -> None:
    """Compute under a boundary never sums its stage's output: a module of `owner` that does
    (`ops.ReducingModule.reduces_output`) is refused, unless a stage appended with it declares
    `output_complete` (compute completes that stage's sum, fused with a reduction it needs)."""
    if owner is None or any(d.output_complete for d in declarations):
        return
    for path, node in nnx.iter_graph(owner):
        if isinstance(node, ReducingModule) and node.reduces_output:
            where = ".".join(str(part) for part in path) or type(owner).__name__
            raise ValueError(
                f"the module at {where} ({type(node).__name__}) sums its own result under the "
                f"stage boundaries appended at {call_site}; build it with reduce_results=False "
                "and leave the sum to the boundary (or declare_ffn(output_complete=True) where "
                "compute must complete it)"
            )


def _owned(design: object, what: str, owner: nnx.Module | None) -> object:
    """`design` as the boundary holds it: a module of the layer becomes `Owned(attribute)`."""
    if not isinstance(design, nnx.Module):
        return design
    if owner is None:
        raise TypeError(
            f"the {what} passed to append_stages is a module ({type(design).__name__}); its "
            "parameters belong to the layer: assign it to an attribute of the layer and pass "
            "append_stages(..., owner=self)"
        )
    attribute = next((k for k, v in vars(owner).items() if v is design), None)
    if attribute is None:
        raise ValueError(
            f"the {what} passed to append_stages ({type(design).__name__}) is not an attribute "
            f"of its owner {type(owner).__name__}; assign it first (self.<name> = ...), then "
            "append the stage"
        )
    return Owned(attribute)


def _check_next_sparse(declaration: StageDeclaration, later: tuple[StageDeclaration, ...]) -> None:
    if declaration.next_sparse is None:
        return
    following = next((d for d in later if d.kind is declaration.kind), None)
    actual = following.sparse if following is not None else None
    if actual is not None and actual != declaration.next_sparse:
        raise ValueError(
            f"the stage declares next_sparse={declaration.next_sparse}, but the next FFN in the "
            f"stack is {'sparse' if actual else 'dense'}"
        )
