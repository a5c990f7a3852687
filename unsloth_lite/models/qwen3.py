"""Qwen3 (dense): which Hugging Face modules take which fused forward."""

from unsloth_lite.models.causal_lm import causal_lm_forward, lm_head_is_plain_linear
from unsloth_lite.models.decode_loop import bind_generate
from unsloth_lite.models.decoder_layer import decoder_layer_forward
from unsloth_lite.models.layers import (
    disable_cpu_repacking,
    is_nf4_linear4bit,
    linear4bit_forward,
    mlp_uses_silu,
    qk_norm_rope_attention_forward,
    rms_norm_forward,
    swiglu_mlp_forward,
)
from unsloth_lite.models.patching import Rule, register

ATTENTION_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")
# What `decoder_layer_forward`'s decoding step reads of a decoder layer (besides its token mixer).
DECODER_LAYER_ATTRIBUTES = ("input_layernorm", "post_attention_layernorm", "mlp")

# Every architecture's 4-bit layers (bitsandbytes' Linear4bit and its NF4 subclass): dequantised by our code.
LINEAR4BIT_RULES = tuple(
    Rule(name, linear4bit_forward, ("weight", "bias"), check=is_nf4_linear4bit, on_patch=disable_cpu_repacking)
    for name in ("Linear4bit", "LinearNF4")
)

RULES = (
    Rule("Qwen3RMSNorm", rms_norm_forward, ("weight", "variance_epsilon")),
    Rule(
        "Qwen3Attention", qk_norm_rope_attention_forward,
        ATTENTION_ATTRIBUTES + ("q_norm.weight", "q_norm.variance_epsilon", "k_norm.weight"),
    ),
    Rule("Qwen3MLP", swiglu_mlp_forward, ("gate_proj", "up_proj", "down_proj", "config"), check=mlp_uses_silu),
    Rule("Qwen3DecoderLayer", decoder_layer_forward, (*DECODER_LAYER_ATTRIBUTES, "self_attn")),
    Rule(
        "Qwen3ForCausalLM", causal_lm_forward, ("model", "lm_head"), check=lm_head_is_plain_linear,
        on_patch=bind_generate,
    ),
    *LINEAR4BIT_RULES,
)

register("qwen3", RULES)
