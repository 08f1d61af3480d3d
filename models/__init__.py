"""boundary-jax's decoders: Hugging Face families built only from layer boundaries, and what a
user runs them with.

```python
import boundary_jax as bj
import models

mesh = bj.make_mesh(bj.Topology(attn_tp=4))
model = models.load_model("CHECKPOINT_DIR", mesh)
runner = models.ShardedCausalLM(model, mesh)
codec = models.text_codec("CHECKPOINT_DIR", model.config.vocab_size)
print(models.generate_text(runner, codec, ["The capital of France is"], 32,
                           eos_ids=models.eos_token_ids("CHECKPOINT_DIR")))
```

The names below are resolved on first use, so `import models` (and the command line, which
takes interrupts before it imports JAX) stays light; the families register themselves when a
config is first read or built (`models.config.registry`).
"""

import importlib

_EXPORTS = {
    "BuildOptions": "models.options",
    "LoraSpec": "models.layers.lora",
    "Remat": "models.options",
    "build_model": "models.build",
    "load_model": "models.build",
    "DecoderConfig": "models.config",
    "PRESETS": "models.config",
    "read_hf_config": "models.config",
    "ShardedCausalLM": "models.serving.runtime",
    "Sampling": "models.serving.sampling",
    "GREEDY": "models.serving.sampling",
    "generate_ids": "models.serving.generation",
    "generate_text": "models.serving.generation",
    "text_codec": "models.serving.text",
    "eos_token_ids": "models.serving.text",
    "save_checkpoint": "models.weights",
    "Trainer": "models.training.trainer",
    "TrainConfig": "models.training.trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
