"""Training: the Trainer drop-in, data pipeline (padding and packing), and the embedded tiny default."""

from unsloth_lite.training.packing import PackingCollator, pack_dataset
from unsloth_lite.training.trainer import Trainer

__all__ = ["PackingCollator", "Trainer", "pack_dataset"]
