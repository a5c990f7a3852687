"""Qwen2 and Qwen2.5 (which share the `qwen2` model type): which Hugging Face modules take which fused forward."""

from unsloth_lite.models.causal_lm import causal_lm_forward, lm_head_is_plain_linear
from unsloth_lite.models.decode_loop import bind_generate
from unsloth_lite.models.decoder_layer import decoder_layer_forward
from unsloth_lite.models.layers import (
    mlp_uses_silu,
    rms_norm_forward,
    rope_attention_forward,
    swiglu_mlp_forward,
)
from unsloth_lite.models.patching import Rule, register
from unsloth_lite.models.qwen3 import ATTENTION_ATTRIBUTES, DECODER_LAYER_ATTRIBUTES, LINEAR4BIT_RULES

RULES = (
    Rule("Qwen2RMSNorm", rms_norm_forward, ("weight", "variance_epsilon")),
    Rule("Qwen2Attention", rope_attention_forward, ATTENTION_ATTRIBUTES),
    Rule("Qwen2MLP", swiglu_mlp_forward, ("gate_proj", "up_proj", "down_proj", "config"), check=mlp_uses_silu),
    Rule("Qwen2DecoderLayer", decoder_layer_forward, (*DECODER_LAYER_ATTRIBUTES, "self_attn")),
    Rule(
        "Qwen2ForCausalLM", causal_lm_forward, ("model", "lm_head"), check=lm_head_is_plain_linear,
        on_patch=bind_generate,
    ),
    *LINEAR4BIT_RULES,
)

register("qwen2", RULES)
