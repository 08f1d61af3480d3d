"""Layer stacks: `append_stages` records stages in order; the stack binds them when it closes."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Iterator, Mapping

from .bind import StackFacts, bind_stage, supported_variants
from .contracts import ReductionPolicy, StageKind, resolve_reduction_policy
from .declare import StackPlace, StageDeclaration
from .fusions import NO_FUSIONS, FusionProvider
from .layout import SumGroup, Topology
from .residual.protocols import Norm
from .stage import StageBoundary

_STAGE_OPTIONS: dict[StageKind, frozenset[str]] = {
    StageKind.ATTN: frozenset({"fusions"}),
    StageKind.FFN: frozenset({"fusions"}),
}


@dataclasses.dataclass
class LayerStack:
    """An open layer stack: the stages appended so far and the facts they bind against.

    Attributes:
      topology: The parallel topology every stage binds on.
      policy: The resolved reduction policy.
      input_sum: The sum the stack input still owes when it reaches the first stage.
      fusions: The fusion provider of stages appended without their own.
      boundaries: The stages appended so far, in stack order.
    """

    topology: Topology
    policy: ReductionPolicy
    input_sum: SumGroup | None
    fusions: FusionProvider
    boundaries: list[StageBoundary] = dataclasses.field(default_factory=list)

    def bind(self) -> None:
        """Binds every stage once its producer and consumer are known."""
        declarations = tuple(b.declaration for b in self.boundaries)
        facts = StackFacts(
            self.topology,
            self.policy,
            () if self.input_sum is None else self.topology.sum_axes(self.input_sum),
            supported_variants(declarations, self.topology),
        )
        for index, boundary in enumerate(self.boundaries):
            producer = declarations[index - 1] if index else None
            consumer = declarations[index + 1] if index + 1 < len(declarations) else None
            try:
                _check_next_sparse(boundary.declaration, declarations[index + 1 :])
                plan = bind_stage(
                    _placed(boundary.declaration, producer, consumer is None),
                    producer,
                    consumer,
                    facts,
                    boundary.fusions or self.fusions,
                )
            except Exception as error:
                error.add_note(f"while binding the stage appended at {boundary.call_site}")
                raise
            boundary.bind(plan)


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
) -> Iterator[LayerStack]:
    """Opens a layer stack; every `append_stages` inside it extends this stack.

    When the block ends without an error, every stage binds: each knows the stage before it
    (its producer) and after it (its consumer); the last one is terminal.

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

    Raises:
      NotImplementedError: The topology uses pipeline or attention context parallelism.
    """
    if topology.pp > 1:
        raise NotImplementedError(f"pipeline parallelism is not supported yet; got {topology=}")
    if topology.attn_cp > 1:
        raise NotImplementedError(
            f"attention context parallelism is not supported yet; got {topology=}"
        )
    stack = LayerStack(
        topology, resolve_reduction_policy(reduction, architecture), input_sum, fusions
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
) -> tuple[StageBoundary, ...]:
    """Appends stages to the innermost open layer stack, in order.

    Each item is `(declaration, norm)` or `(declaration, norm, options)`. The stage appended
    before the first item is its producer; the boundaries bind when the stack closes.

    Returns:
      One `StageBoundary` per item.

    Raises:
      RuntimeError: No layer stack is open.
      ValueError: A declaration already has its place in a stack.
      TypeError: A malformed item or an option the stage does not take.
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
        boundaries.append(
            StageBoundary(
                declaration.facts(), norm, declaration.output_transform, call_site, fusions
            )
        )
    stacks[-1].boundaries.extend(boundaries)
    return tuple(boundaries)


def _placed(
    declaration: StageDeclaration, producer: StageDeclaration | None, terminal: bool
) -> StageDeclaration:
    return dataclasses.replace(declaration, place=StackPlace(producer, terminal))


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
