"""Training: the Trainer drop-in, data pipeline, and the embedded tiny default."""

from unsloth_lite.training.trainer import Trainer

__all__ = ["Trainer"]
