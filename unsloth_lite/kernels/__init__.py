"""Fused Triton kernels, each a `torch.autograd.Function` with a hand-written Triton backward."""

from unsloth_lite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from unsloth_lite.kernels.qk_norm_rope import qk_norm_rope
from unsloth_lite.kernels.rms_norm import rms_norm
from unsloth_lite.kernels.rope import apply_rope
from unsloth_lite.kernels.swiglu import swiglu

__all__ = ["apply_rope", "fused_linear_cross_entropy", "qk_norm_rope", "rms_norm", "swiglu"]
