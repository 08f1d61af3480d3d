"""Handing a stream to the next pipeline rank (`to_pp`); the receiving stage rebuilds it with
`StageBoundary.from_pp`."""

from __future__ import annotations

import jax

from .. import ops
from ..declare import EdgeKind
from .leave import way_out
from .stream import OwedOutput, ResidualStream, require_output_of


def to_pp(output: OwedOutput, stream: ResidualStream) -> dict[str, jax.Array]:
    """Hands the stream to the next pipeline rank as a plain pytree, every owed item complete.

    Completes the pending contribution's finalize and sums on this rank (a partial sum must
    never travel: the transport reassembles a tensor from one slice per attention-TP rank). When
    the residual is on the attention's rows and the update is plain, sends
    `{"hidden_states": completed output, "residual": residual}` for the receiver's fused update
    + read; otherwise folds the output into the residual here and sends
    `{"hidden_states": residual}` alone. Both are on the attention's rows.

    Raises:
      RuntimeError: The stream has not passed the stage before this rank's pipeline send.
    """
    stream = require_output_of(output, stream)
    leave = way_out(stream, EdgeKind.PIPELINE_SEND, "to_pp()")
    residual, pending = stream.residual, stream.pending
    if pending is not None:
        value = pending.completed_on_residual_rows()
        if not leave.sends_written:
            return {"hidden_states": value, "residual": residual}
        residual = pending.apply(residual, value)
    return {"hidden_states": ops.run(leave.entry(None).move_input, residual)}
