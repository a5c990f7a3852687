"""Qwen3.5 (the hybrid of Gated DeltaNet and gated full attention): which Hugging Face modules take which fused
forward. Every module of the text model runs fused: the zero-centred norms, the MLP, the loss, the gated
attention and the Gated DeltaNet layers (`qwen3_5_layers.py`)."""

from unsloth_lite.models.causal_lm import causal_lm_forward, lm_head_is_plain_linear
from unsloth_lite.models.decode_loop import bind_generate
from unsloth_lite.models.decoder_layer import decoder_layer_forward
from unsloth_lite.models.layers import (
    mlp_uses_silu,
    swiglu_mlp_forward,
    zero_centred_rms_norm_forward,
)
from unsloth_lite.models.patching import Rule, register
from unsloth_lite.models.qwen3 import DECODER_LAYER_ATTRIBUTES, LINEAR4BIT_RULES
from unsloth_lite.models.qwen3_5_layers import (
    DELTANET_PROJECTIONS,
    deltanet_checks,
    gated_attention_forward,
    gated_deltanet_forward,
)

RULES = (
    Rule("Qwen3_5RMSNorm", zero_centred_rms_norm_forward, ("weight", "eps")),
    Rule(
        "Qwen3_5Attention", gated_attention_forward,
        ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config", "q_norm.weight",
         "q_norm.eps", "k_norm.weight"),
    ),
    Rule(
        "Qwen3_5GatedDeltaNet", gated_deltanet_forward,
        (*DELTANET_PROJECTIONS, "out_proj", "conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "norm.weight",
         "norm.variance_epsilon", "activation", "key_dim", "value_dim", "num_k_heads", "num_v_heads", "head_k_dim",
         "head_v_dim"),
        check=deltanet_checks,
    ),
    Rule("Qwen3_5MLP", swiglu_mlp_forward, ("gate_proj", "up_proj", "down_proj", "config"), check=mlp_uses_silu),
    Rule("Qwen3_5DecoderLayer", decoder_layer_forward, (*DECODER_LAYER_ATTRIBUTES, "block_type")),
    Rule(
        "Qwen3_5ForCausalLM", causal_lm_forward, ("model", "lm_head"), check=lm_head_is_plain_linear,
        on_patch=bind_generate,
    ),
    *LINEAR4BIT_RULES,
)

register("qwen3_5_text", RULES)
register("qwen3_5", RULES)
