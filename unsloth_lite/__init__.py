"""unsloth-lite: fast, memory-light QLoRA fine-tuning of Qwen models with fused Triton kernels."""

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
from unsloth_lite.models import add_lora, load_model, patch_model

__version__ = "0.1.0"

__all__ = [
    "add_lora",
    "apply_rope",
    "dequantize_nf4",
    "fused_linear_cross_entropy",
    "load_model",
    "lora_mlp",
    "lora_projections",
    "patch_model",
    "qk_norm_rope",
    "rms_norm",
    "swiglu",
]
