"""Fusion providers: ordered candidates that complete a sum fused with the residual add + norm.

A candidate returns None, before touching anything, when it does not apply; the boundary then
tries the next candidate and finally its built-in path (an all-reduce, then the read's own
`update_and_read`).
"""

from .base import NO_FUSIONS as NO_FUSIONS
from .base import FusedReadout as FusedReadout
from .base import FusionProvider as FusionProvider
from .base import FusionRequest as FusionRequest
from .base import GatheringRead as GatheringRead
from .base import InputFusion as InputFusion
from .base import ReadoutFusion as ReadoutFusion
from .pallas import AddRmsNorm as AddRmsNorm
from .pallas import AddRmsNormQuantize as AddRmsNormQuantize
from .pallas import AllReduceAddRmsNorm as AllReduceAddRmsNorm
from .pallas import MoeFinalizeAddRmsNorm as MoeFinalizeAddRmsNorm
from .pallas import platform_fusions as platform_fusions
