"""Adapters for layer exits and entries a plain sequential `prepare` / `finish` cannot express:
two-batch overlap (`overlap`). They wrap bound plans; `stage.py` knows nothing of them."""

from .overlap import MicrobatchToken as MicrobatchToken
from .overlap import complete_now as complete_now
from .overlap import merge_streams as merge_streams
from .overlap import overlap_phases as overlap_phases
from .overlap import split_stream as split_stream
from .overlap import yield_point as yield_point
