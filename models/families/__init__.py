"""The decoder families, one file per Hugging Face model class, and the registry that picks a
config's class.

`decoder.CausalLM` is the pre-norm dense decoder every family builds on; `moe.MoeCausalLM` adds
sparse FFNs, `norm_designs.NormDesignCausalLM` the post-norm and sandwich-norm residual designs,
`deepseek.DeepseekCausalLM` latent attention and DeepSeek's MoE,
`longcat.LongcatFlashForCausalLM` LongCat-Flash's layers with a branch of the MoE's input;
`nemotron_h.NemotronHForCausalLM` builds hybrid stacks of single-stage layers on `MoeCausalLM`.
"""

from ..config import Architecture, DecoderConfig
from ..decoder.model import CausalLM as CausalLM
from ..decoder.model import DecoderLayer as DecoderLayer
from ..decoder.model import Remat as Remat
from ..decoder.moe import MoeCausalLM as MoeCausalLM
from .deepseek import DeepseekCausalLM as DeepseekCausalLM
from .deepseek import DeepseekV2ForCausalLM as DeepseekV2ForCausalLM
from .deepseek import DeepseekV3ForCausalLM as DeepseekV3ForCausalLM
from .exaone4 import Exaone4ForCausalLM as Exaone4ForCausalLM
from .gemma3 import Gemma3ForCausalLM as Gemma3ForCausalLM
from .llama import LlamaForCausalLM as LlamaForCausalLM
from .longcat import LongcatFlashForCausalLM as LongcatFlashForCausalLM
from .mixtral import MixtralForCausalLM as MixtralForCausalLM
from .nemotron_h import NemotronHForCausalLM as NemotronHForCausalLM
from .olmo2 import Olmo2ForCausalLM as Olmo2ForCausalLM
from .qwen2 import Qwen2ForCausalLM as Qwen2ForCausalLM
from .qwen2_moe import Qwen2MoeForCausalLM as Qwen2MoeForCausalLM
from .qwen3 import Qwen3ForCausalLM as Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM as Qwen3MoeForCausalLM

FAMILIES: tuple[type[CausalLM], ...] = (
    Qwen3ForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3MoeForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Exaone4ForCausalLM,
    Olmo2ForCausalLM,
    Gemma3ForCausalLM,
    NemotronHForCausalLM,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    LongcatFlashForCausalLM,
)
"""Every decoder class; each names the `Architecture`s it builds."""


def model_class(config: DecoderConfig) -> type[CausalLM]:
    """The decoder class for a config's architecture (every `Architecture` has one)."""
    return _BY_ARCHITECTURE[config.architecture]


_BY_ARCHITECTURE: dict[Architecture, type[CausalLM]] = {
    architecture: family for family in FAMILIES for architecture in family.architectures
}
