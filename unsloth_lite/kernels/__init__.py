"""Fused Triton kernels. Each differentiable op is a `torch.autograd.Function` with a hand-written backward;
`dequantize_nf4` (frozen weights) has none."""

from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4
from unsloth_lite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from unsloth_lite.kernels.gated_delta_rule import chunk_gated_delta_rule
from unsloth_lite.kernels.lora import lora_mlp, lora_projections
from unsloth_lite.kernels.qk_norm_rope import qk_norm_rope
from unsloth_lite.kernels.rms_norm import rms_norm
from unsloth_lite.kernels.rope import apply_rope
from unsloth_lite.kernels.swiglu import swiglu

__all__ = [
    "apply_rope",
    "chunk_gated_delta_rule",
    "dequantize_nf4",
    "fused_linear_cross_entropy",
    "lora_mlp",
    "lora_projections",
    "qk_norm_rope",
    "rms_norm",
    "swiglu",
]
