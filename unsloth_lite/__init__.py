"""unsloth-lite: fast, memory-light QLoRA fine-tuning of Qwen models with fused Triton kernels.

The kernels import eagerly; the model and training layers (transformers, PEFT, bitsandbytes) on first use,
so that `unsloth_lite.recipes` can validate a recipe before anything heavy loads.
"""

import importlib

from unsloth_lite.kernels import (
    apply_rope,
    dequantize_nf4,
    fused_linear_cross_entropy,
    lora_mlp,
    lora_projections,
    qk_norm_rope,
    rms_norm,
    swiglu,
)

__version__ = "0.1.0"

_LAZY = {
    "Trainer": "unsloth_lite.training",
    "add_lora": "unsloth_lite.models",
    "load_model": "unsloth_lite.models",
    "offload_embeddings_to_host": "unsloth_lite.models",
    "patch_model": "unsloth_lite.models",
    "quantize_embeddings_nf4": "unsloth_lite.models",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unsloth_lite' has no attribute {name!r}")


__all__ = [
    "Trainer",
    "add_lora",
    "apply_rope",
    "dequantize_nf4",
    "fused_linear_cross_entropy",
    "load_model",
    "lora_mlp",
    "lora_projections",
    "offload_embeddings_to_host",
    "patch_model",
    "qk_norm_rope",
    "quantize_embeddings_nf4",
    "rms_norm",
    "swiglu",
]
