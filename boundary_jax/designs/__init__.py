"""Residual designs: how a producer's output joins the residual (`ResidualUpdate`) and how a
consumer reads it (`ResidualReadout`), one design per file.

Designs are leaves: they import arrays and each other, never the plans or the stream runtime.
"""

from .add_norm import AddNormRead as AddNormRead
from .add_norm import PlainAdd as PlainAdd
from .mhc import MhcHead as MhcHead
from .mhc import MhcRead as MhcRead
from .mhc import MhcUpdate as MhcUpdate
from .norm import RMSNorm as RMSNorm
from .norm import add_rms_norm as add_rms_norm
from .norm import rms_norm as rms_norm
from .post_norm import PostNormUpdate as PostNormUpdate
from .protocols import DesignFacts as DesignFacts
from .protocols import Norm as Norm
from .protocols import ResidualReadout as ResidualReadout
from .protocols import ResidualUpdate as ResidualUpdate
from .quantized import Fp8TokenGroups as Fp8TokenGroups
from .quantized import Quantized as Quantized
from .quantized import quantize_token_groups as quantize_token_groups
