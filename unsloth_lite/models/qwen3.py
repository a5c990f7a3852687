"""Qwen3 (dense): which Hugging Face modules take which fused forward."""

from unsloth_lite.models.layers import (
    causal_lm_forward,
    lm_head_is_plain_linear,
    mlp_uses_silu,
    qk_norm_rope_attention_forward,
    rms_norm_forward,
    swiglu_mlp_forward,
)
from unsloth_lite.models.patching import Rule, register

ATTENTION_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")

RULES = (
    Rule("Qwen3RMSNorm", rms_norm_forward, ("weight", "variance_epsilon")),
    Rule(
        "Qwen3Attention", qk_norm_rope_attention_forward,
        ATTENTION_ATTRIBUTES + ("q_norm.weight", "q_norm.variance_epsilon", "k_norm.weight"),
    ),
    Rule("Qwen3MLP", swiglu_mlp_forward, ("gate_proj", "up_proj", "down_proj", "config"), check=mlp_uses_silu),
    Rule("Qwen3ForCausalLM", causal_lm_forward, ("model", "lm_head"), check=lm_head_is_plain_linear),
)

register("qwen3", RULES)
