"""Decoder configurations: the frozen types every family builds, how a Hugging Face checkpoint
describes a model (the `config.json` readers' shared pieces in `hf`, tensor names in `tensors`),
and the registry that finds a config's family (`registry`)."""

from .hybrid import HybridConfig as HybridConfig
from .hybrid import HybridLayer as HybridLayer
from .hybrid import HybridMoeConfig as HybridMoeConfig
from .hybrid import Mamba2Spec as Mamba2Spec
from .hybrid import parse_pattern as parse_pattern
from .linear_attention import DeltaProjections as DeltaProjections
from .linear_attention import GatedDeltaNetSpec as GatedDeltaNetSpec
from .linear_attention import KimiDeltaSpec as KimiDeltaSpec
from .linear_attention import LinearAttentionLayers as LinearAttentionLayers
from .mla import MlaConfig as MlaConfig
from .registry import PRESETS as PRESETS
from .registry import family_of as family_of
from .registry import hf_name_map as hf_name_map
from .registry import read_hf_config as read_hf_config
from .registry import write_hf_config as write_hf_config
from .rope_scaling import DynamicNtkRopeScaling as DynamicNtkRopeScaling
from .rope_scaling import LinearRopeScaling as LinearRopeScaling
from .rope_scaling import Llama3RopeScaling as Llama3RopeScaling
from .rope_scaling import QueryScaling as QueryScaling
from .rope_scaling import RopeScaling as RopeScaling
from .rope_scaling import YarnRopeScaling as YarnRopeScaling
from .rope_scaling import yarn_mscale as yarn_mscale
from .routing import DeepseekRouting as DeepseekRouting
from .routing import ExpertScoring as ExpertScoring
from .routing import GroupScore as GroupScore
from .types import Activation as Activation
from .types import AttentionKind as AttentionKind
from .types import AttentionSpec as AttentionSpec
from .types import DecoderConfig as DecoderConfig
from .types import LayerAttention as LayerAttention
from .types import LayerBlock as LayerBlock
from .types import MoeConfig as MoeConfig
from .types import QkNorm as QkNorm
from .types import ResidualDesign as ResidualDesign
from .types import padded_vocab as padded_vocab
