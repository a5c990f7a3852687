"""Qwen3.5 (the hybrid of Gated DeltaNet and gated full attention): the modules shared with the dense models
run fused; the attention and DeltaNet layers keep Hugging Face's forwards (their q/k norms, zero-centred
RMSNorms, do run fused)."""

from unsloth_lite.models.layers import (
    causal_lm_forward,
    lm_head_is_plain_linear,
    mlp_uses_silu,
    swiglu_mlp_forward,
    zero_centred_rms_norm_forward,
)
from unsloth_lite.models.patching import Rule, register
from unsloth_lite.models.qwen3 import LINEAR4BIT_RULES

RULES = (
    Rule("Qwen3_5RMSNorm", zero_centred_rms_norm_forward, ("weight", "eps")),
    Rule("Qwen3_5MLP", swiglu_mlp_forward, ("gate_proj", "up_proj", "down_proj", "config"), check=mlp_uses_silu),
    Rule("Qwen3_5ForCausalLM", causal_lm_forward, ("model", "lm_head"), check=lm_head_is_plain_linear),
    *LINEAR4BIT_RULES,
)

register("qwen3_5_text", RULES)
register("qwen3_5", RULES)
