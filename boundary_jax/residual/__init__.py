"""Residual designs, the per-forward stream and the helpers models call around their layers."""

from .add_norm import AddNormRead as AddNormRead
from .add_norm import PlainAdd as PlainAdd
from .batch import FinalizeRequest as FinalizeRequest
from .batch import add_to_output as add_to_output
from .batch import complete_output as complete_output
from .batch import final_norm as final_norm
from .batch import fold as fold
from .batch import set_written as set_written
from .batch import snapshot as snapshot
from .batch import start as start
from .batch import take_output as take_output
from .batch import to_pp as to_pp
from .mhc import MhcHead as MhcHead
from .mhc import MhcRead as MhcRead
from .mhc import MhcUpdate as MhcUpdate
from .norm import RMSNorm as RMSNorm
from .norm import add_rms_norm as add_rms_norm
from .norm import rms_norm as rms_norm
from .post_norm import PostNormUpdate as PostNormUpdate
from .protocols import DesignFacts as DesignFacts
from .protocols import ResidualReadout as ResidualReadout
from .protocols import ResidualUpdate as ResidualUpdate
from .stream import OwedOutput as OwedOutput
from .stream import ResidualStream as ResidualStream
from .stream import StreamState as StreamState
