"""Checkpoint state that is not trained: a parameter the optimizer leaves alone."""

from __future__ import annotations

from flax import nnx


class Buffer(nnx.Param):
    """A model tensor loaded and saved with the parameters (and split like them) that training
    leaves as it is: no update and no weight decay (Hugging Face keeps such tensors as
    buffers, e.g. DeepSeek-V3's `e_score_correction_bias`, which only picks experts).

    A subclass of `nnx.Param`, so every filter of parameters (checkpoints, sharding) holds it;
    `models.training.Trainer` freezes it.
    """
