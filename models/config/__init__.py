"""Decoder configurations: the frozen config types, the Hugging Face `config.json` reader and
writer, and the named presets."""

from .deepseek import DeepseekRouting as DeepseekRouting
from .deepseek import ExpertScoring as ExpertScoring
from .deepseek import GroupScore as GroupScore
from .deepseek import MlaConfig as MlaConfig
from .hf import read_hf_config as read_hf_config
from .hf import write_hf_config as write_hf_config
from .hybrid import HybridConfig as HybridConfig
from .hybrid import HybridLayer as HybridLayer
from .hybrid import HybridMoeConfig as HybridMoeConfig
from .hybrid import Mamba2Spec as Mamba2Spec
from .hybrid import parse_pattern as parse_pattern
from .presets import PRESETS as PRESETS
from .rope_scaling import LinearRopeScaling as LinearRopeScaling
from .rope_scaling import Llama3RopeScaling as Llama3RopeScaling
from .rope_scaling import RopeScaling as RopeScaling
from .rope_scaling import YarnRopeScaling as YarnRopeScaling
from .rope_scaling import yarn_mscale as yarn_mscale
from .types import MLA_ARCHITECTURES as MLA_ARCHITECTURES
from .types import MOE_ARCHITECTURES as MOE_ARCHITECTURES
from .types import Activation as Activation
from .types import Architecture as Architecture
from .types import AttentionKind as AttentionKind
from .types import AttentionSpec as AttentionSpec
from .types import DecoderConfig as DecoderConfig
from .types import LayerAttention as LayerAttention
from .types import LayerBlock as LayerBlock
from .types import MoeConfig as MoeConfig
from .types import QkNorm as QkNorm
from .types import ResidualDesign as ResidualDesign
from .types import padded_vocab as padded_vocab
