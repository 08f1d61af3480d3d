"""Training a decoder through its boundaries: the sharded loss, its gradients and optax steps."""

from .trainer import TrainConfig as TrainConfig
from .trainer import Trainer as Trainer
