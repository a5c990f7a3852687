"""The models of the decoding benchmarks (W3): their shapes and configs, the random-weight NF4 model a worker
builds, and the bytes a decoding step reads at least (the bandwidth bound of `bench_generate.py`; the per-call
bytes of `bench_nf4_matvec.py` and `bench_dequantize.py`).

Shapes: `qwen3_8b` (W1's config, `bench_train_setup.W1`) and `qwen3_5_27b` (W2's, `bench_train_27b.W2`).
"""

from __future__ import annotations

import torch
from bench_train_27b import ATTENTION_MLP, model_config, with_special_tokens
from bench_train_setup import TINY as TINY_QWEN3
from bench_train_setup import W1
from random_checkpoint import weightless_model

SHAPES = ("qwen3_8b", "qwen3_5_27b")
LORA_R = 16  # the adapter rank of the LoRA variants (on the attention and MLP projections)


def shape_config(shape: str, tiny: bool) -> dict:
    """The shape's config; the 27B's with the special tokens W1 has (the stand-in tokenizer needs them)."""
    if shape == "qwen3_8b":
        return dict(TINY_QWEN3 if tiny else W1)
    return with_special_tokens(model_config(tiny, None))


def nf4_bytes(n: int) -> float:
    """Packed weights, uint8 absmax per 64-weight block, float32 second-level absmax per 256 blocks."""
    return n / 2 + n / 64 + n / 64 / 256 * 4


def bytes_per_token(shape: str, c: dict, context: float, lora: bool = False) -> dict:
    """Bytes a decoding step reads at least (`bench_generate.py`'s docstring), by part, and their total."""
    model = weightless_model(shape, c)
    skip = ("lm_head", "embed_tokens")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith(skip)}
    linear_params = sum(m.weight.numel() for m in linears.values())
    dense = sum(p.numel() for n, p in model.named_parameters()) - linear_params
    dense -= 2 * c["vocab_size"] * c["hidden_size"]  # lm_head and the input embedding, counted below
    parts = dict(
        nf4_linears=nf4_bytes(linear_params), other_weights=2 * dense, lm_head=2 * c["vocab_size"] * c["hidden_size"],
        embedding_row=2 * c["hidden_size"],
    )
    layer_types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    full, linear = layer_types.count("full_attention"), layer_types.count("linear_attention")
    parts["kv_cache"] = full * 2 * c["num_key_value_heads"] * c["head_dim"] * 2 * context
    if linear:
        state = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
        channels = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
        channels += c["linear_num_value_heads"] * c["linear_value_head_dim"]
        conv = channels * (c["linear_conv_kernel_dim"] - 1) * 2
        parts["deltanet_state"] = linear * 2 * (state + conv)
    if lora:
        adapted = [m for n, m in linears.items() if n.rsplit(".", 1)[-1] in ATTENTION_MLP]
        parts["lora"] = 2 * LORA_R * sum(m.in_features + m.out_features for m in adapted)
    parts["total"] = sum(parts.values())
    return parts


def build_model(shape: str, c: dict, device: torch.device, dtype: torch.dtype):
    """The random-weight model of `c` built on `device` in `dtype` (seed 0), decoder linears quantised to NF4."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    from unsloth_lite.models.quantize import quantize_linears_nf4

    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if shape == "qwen3_8b":
                model = Qwen3ForCausalLM(Qwen3Config(**c, attn_implementation="sdpa"))
            else:
                model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**c, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(default_dtype)
    model = quantize_linears_nf4(model, dtype)
    # In eval mode on a CPU, bitsandbytes repacks 4-bit weights into a layout that needs every output size to
    # be a multiple of its block (the tiny Qwen3.5's DeltaNet gates are not); its training-mode path does not.
    return model.eval() if device.type == "cuda" else model
