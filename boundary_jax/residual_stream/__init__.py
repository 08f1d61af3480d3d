"""The per-forward residual stream and the helpers a model calls around its layers: the runtime
above the plans, the fusions and the residual designs.

One job per module: `stream` (the `ResidualStream` pytree and its `OwedOutput` handles), `begin`
(`start`, `set_written`, `next_pass`), `output` (reach into a pending layer output:
`complete_output`, `fold`, `snapshot`, `add_to_output`, `onto_residual_rows`), `leave` (the bound
way out, `take_output`), `final` (`final_norm`, `final_norm_captured`), `pipeline` (`to_pp`) and
`entry` (the entry path a stage's `prepare` and the final read share).
"""

from .begin import next_pass as next_pass
from .begin import set_written as set_written
from .begin import start as start
from .final import FinalizeRequest as FinalizeRequest
from .final import final_norm as final_norm
from .final import final_norm_captured as final_norm_captured
from .leave import take_output as take_output
from .output import add_to_output as add_to_output
from .output import complete_output as complete_output
from .output import fold as fold
from .output import onto_residual_rows as onto_residual_rows
from .output import snapshot as snapshot
from .pipeline import to_pp as to_pp
from .stream import OwedOutput as OwedOutput
from .stream import ResidualStream as ResidualStream
from .stream import StreamState as StreamState
