"""The per-forward residual stream and the helpers a model calls around its layers (`start`,
`final_norm`, `to_pp`, `fold`, `snapshot`, ...): the runtime above the plans, the fusions and the
residual designs."""

from .helpers import FinalizeRequest as FinalizeRequest
from .helpers import add_to_output as add_to_output
from .helpers import complete_output as complete_output
from .helpers import final_norm as final_norm
from .helpers import final_norm_captured as final_norm_captured
from .helpers import fold as fold
from .helpers import next_pass as next_pass
from .helpers import onto_residual_rows as onto_residual_rows
from .helpers import set_written as set_written
from .helpers import snapshot as snapshot
from .helpers import start as start
from .helpers import take_output as take_output
from .helpers import to_pp as to_pp
from .stream import OwedOutput as OwedOutput
from .stream import ResidualStream as ResidualStream
from .stream import StreamState as StreamState
