"""Adapters: layer entries and exits that a plain prepare -> compute -> finish cannot express,
running plans that binding made: branches (`branch`), two-batch overlap (`overlap`) and the
LoRA adapter's per-row values on a stage's compute rows (`lora`).
`stage.py` knows nothing of them."""

from .branch import branch_input as branch_input
from .branch import branch_output as branch_output
from .branch import merge_branch as merge_branch
from .lora import lora_rows as lora_rows
from .overlap import MicrobatchToken as MicrobatchToken
from .overlap import complete_now as complete_now
from .overlap import merge_streams as merge_streams
from .overlap import overlap_phases as overlap_phases
from .overlap import split_stream as split_stream
from .overlap import yield_point as yield_point
