"""unsloth-lite: fast, memory-light QLoRA fine-tuning of Qwen models with fused Triton kernels."""

from unsloth_lite.kernels import apply_rope, fused_linear_cross_entropy, qk_norm_rope, rms_norm, swiglu

__version__ = "0.1.0"

__all__ = ["apply_rope", "fused_linear_cross_entropy", "qk_norm_rope", "rms_norm", "swiglu"]
