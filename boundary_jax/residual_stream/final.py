"""The stack's final read: complete what the last stage owes, apply its update and read the
residual into the stack output (`final_norm`), optionally also returning the updated residual
(`final_norm_captured`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.compat import zeros_varying_like

from .. import ops
from ..declare import EdgeKind
from ..designs.protocols import Norm
from ..finalize import DeferredFinalize
from ..layout import TokenAxis, Topology
from .entry import run_entry
from .leave import way_out
from .stream import OwedOutput, ResidualStream, require_output_of


@dataclasses.dataclass(frozen=True)
class FinalizeRequest:
    """What a fused finalize norm is asked to do: `norm(residual + sum(finalize(handoff)))`.

    Attributes:
      handoff: The sparse FFN's `DeferredFinalize`, on the residual's rows.
      residual: The residual on the same rows.
      norm: The final norm.
      sum_axes: Token axes the finalized value still owes a sum over.
      topology: The topology the stack is bound on: it names the mesh axes of `sum_axes`.
    """

    handoff: DeferredFinalize
    residual: jax.Array
    norm: Norm | None
    sum_axes: tuple[TokenAxis, ...]
    topology: Topology

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Mesh axis names of `sum_axes`, for a kernel's collective."""
        return self.topology.mesh_names(self.sum_axes)


def final_norm(
    output: OwedOutput,
    stream: ResidualStream,
    norm: Norm | None,
    *,
    skip_empty: bool = False,
    finalize_norm: Callable[[FinalizeRequest], jax.Array] | None = None,
) -> jax.Array:
    """Leaves the stack through its final read: completes what is owed, applies the update, and
    reads (by default add + RMSNorm with `norm`).

    Returns the stack output on the attention's rows; rows past a DP rank's token count are zero.
    With `skip_empty`, a rank without tokens still runs every collective (the other ranks join
    them) and skips only the read. A MoE finalize handed to the final read goes to
    `finalize_norm` (a fused finalize + sum + add + norm) when given, else to the stack's
    fusion provider's `final_input` candidates; where none takes it, it completes unfused.
    """
    return _final_read(output, stream, norm, skip_empty, finalize_norm, capture=False)[0]


def final_norm_captured(
    output: OwedOutput, stream: ResidualStream, norm: Norm | None, *, skip_empty: bool = False
) -> tuple[jax.Array, jax.Array]:
    """`final_norm`, also returning the updated residual it normalizes (the last auxiliary
    hidden state), on the attention's rows.

    The owed sum completes unfused first, and a finalize handoff completes unfused (there is no
    fused finalize norm when the residual is captured).
    """
    return _final_read(output, stream, norm, skip_empty, None, capture=True)


def _final_read(output, stream, norm, skip_empty, finalize_norm, *, capture: bool):
    stream = require_output_of(output, stream)
    leave = way_out(stream, EdgeKind.STACK_EXIT, "final_norm()")
    pending = stream.pending
    entry = leave.entry(None if pending is None else pending.placement)

    def read():
        fused = pending is not None and pending.placement.finalize and finalize_norm is not None
        if fused and not entry.move_input:
            request = FinalizeRequest(
                pending.value,
                stream.residual,
                norm,
                pending.placement.owed,
                stream.batch.topology,
            )
            return finalize_norm(request), None
        normed, residual, _ = run_entry(
            entry,
            stream.residual,
            pending,
            leave.final_read,
            norm,
            candidates=() if capture else leave.final_fusions,
            topology=stream.batch.topology,
            fuse_sum=not capture,
        )
        return normed, ops.run(entry.move_input, residual) if capture else None

    if skip_empty and stream.batch.token_counts is not None:
        result = jax.eval_shape(read)
        normed, residual = lax.cond(
            stream.batch.has_tokens(),
            read,
            lambda: jax.tree.map(zeros_varying_like, result),
        )
    else:
        normed, residual = read()
    mask = stream.batch.valid_rows(normed.shape[0])
    if mask is not None:
        normed = jnp.where(mask[:, None], normed, jnp.zeros((), normed.dtype))
    return normed, residual
