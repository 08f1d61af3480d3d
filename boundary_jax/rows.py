"""Which rows each stage computes on and keeps the residual on, from the whole model's
declarations."""

from __future__ import annotations

from .declare import MoeDispatch, StageDeclaration, StageKind
from .layout import BatchVariant, Layout, SumGroup, TokenAxis, Topology
from .plan import StageRows


def own_rows(topology: Topology) -> Layout:
    """This rank's own rows: its attention-TP slice of the attention's rows (its attention-DP
    rank's tokens, or its attention-CP rank's share of them)."""
    return topology.layout(TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP)


def _runs_on_own_rows(declaration: StageDeclaration, topology: Topology) -> bool:
    if declaration.kind is not StageKind.FFN:
        return False
    if declaration.sparse:
        return declaration.moe_dispatch is MoeDispatch.ALL_TO_ALL
    size = declaration.dense_tp_size
    if size is None or size == topology.tp_size:
        return False
    if size == 1:
        return True
    if size == topology.attn_tp:
        return False
    raise ValueError(
        f"dense_tp_size must be 1, attention TP ({topology.attn_tp}) or TP "
        f"({topology.tp_size}); got {size=}. Pass None to use the mesh's TP size."
    )


def compute_layout(
    declaration: StageDeclaration, topology: Topology, variant: BatchVariant
) -> Layout:
    """The rows a stage computes on, from its declaration.

    Attention and mixers, and a dense FFN over attention TP, run on the attention's rows; an FFN
    over the full TP group on every DP rank's rows; an FFN on its own rows on this rank's slice,
    except in an unpadded batch, whose rows do not divide over attention TP.
    """
    if _runs_on_own_rows(declaration, topology):
        if variant is BatchVariant.UNPADDED:
            return topology.attention_rows()
        return own_rows(topology)
    if declaration.kind is StageKind.ATTN or declaration.dense_tp_size == topology.attn_tp:
        return topology.attention_rows()
    return topology.layout()


def compute_owed(declaration: StageDeclaration, topology: Topology) -> tuple[TokenAxis, ...]:
    """Token axes over which a stage's compute leaves its output unreduced."""
    if declaration.output_complete or _runs_on_own_rows(declaration, topology):
        return ()
    if declaration.kind is StageKind.FFN and declaration.dense_tp_size == topology.attn_tp:
        return topology.sum_axes(SumGroup.ATTN_TP)
    return topology.sum_axes(declaration.sum_group)


def supported_variants(
    declarations: tuple[StageDeclaration, ...], topology: Topology
) -> tuple[BatchVariant, ...]:
    """The batch variants a model whose stages are `declarations` can run on `topology`."""
    variants = [BatchVariant.ORDINARY]
    if topology.attn_tp > 1 and all(
        d.gathers_attn_tp_input for d in declarations if d.kind is StageKind.ATTN
    ):
        variants.append(BatchVariant.INPUT_SCATTERED)
    if topology.attn_tp > 1 and topology.attn_dp == 1:
        variants.append(BatchVariant.UNPADDED)
    return tuple(variants)


def stage_rows(
    declarations: tuple[StageDeclaration, ...], variant: BatchVariant, topology: Topology
) -> tuple[StageRows, ...]:
    """The rows of every stage of a model, in order.

    The residual starts on the attention's rows (each rank's slice of them for an
    input-scattered batch). It follows an FFN on its own rows onto that slice and stays there;
    a stage whose read declares `reads_after_attn_tp_gather`, the stack's leaving read or a
    pipeline send returns it to the attention's rows.

    Raises:
      NotImplementedError: An attention that cannot gather its input would read a residual on
        attention-TP slices.
    """
    attention = topology.attention_rows()
    current = own_rows(topology) if variant is BatchVariant.INPUT_SCATTERED else attention
    return _follow(declarations, current, variant, topology)


def branch_rows(
    source: StageRows,
    declarations: tuple[StageDeclaration, ...],
    variant: BatchVariant,
    topology: Topology,
) -> tuple[StageRows, ...]:
    """The rows of a branch's stages, in order: the residual forks on the rows the source keeps
    it on, then moves as in the stack (`stage_rows`).

    Raises:
      NotImplementedError: As `stage_rows`.
    """
    return _follow(declarations, source.residual, variant, topology)


def _follow(
    declarations: tuple[StageDeclaration, ...],
    current: Layout,
    variant: BatchVariant,
    topology: Topology,
) -> tuple[StageRows, ...]:
    attention = topology.attention_rows()
    rows = []
    for index, declaration in enumerate(declarations):
        compute = compute_layout(declaration, topology, variant)
        incoming = current
        if compute == own_rows(topology):
            current = compute
        if declaration.read.reads_after_attn_tp_gather:
            # The guide's reads_after_attn_tp_gather: what the producer left on this rank's
            # attention-TP slice returns to the attention's rows, and the read runs there.
            current = attention
        if (
            declaration.kind is StageKind.ATTN
            and current != attention
            and not declaration.gathers_attn_tp_input
        ):
            raise NotImplementedError(
                f"stage {index} is a mixer (or attention) that does not gather its input "
                "(gathers_attn_tp_input=False), but an FFN on its own rows before it leaves the "
                "residual on attention-TP slices; declare the FFN over attention TP or more"
            )
        rows.append(StageRows(incoming, current, compute))
    return tuple(rows)
