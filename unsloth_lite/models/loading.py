"""Loading a Qwen checkpoint patched onto the fused kernels, and adding LoRA adapters (standard PEFT format)."""

from __future__ import annotations

import os
import warnings

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from unsloth_lite.models.host_embeddings import offload_embeddings_to_host
from unsloth_lite.models.patching import patch_model
from unsloth_lite.models.quantized_embeddings import quantize_embeddings_nf4

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _has_tokenizer(name_or_path) -> bool:
    """A local checkpoint must ship tokenizer files (recent transformers would otherwise build an empty
    tokenizer without a word); a hub name is left to `AutoTokenizer`."""
    if not os.path.isdir(name_or_path):
        return True
    return any(os.path.exists(os.path.join(name_or_path, name)) for name in TOKENIZER_FILES)


def _default_device_map():
    return {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"


def load_model(
    name_or_path: str | os.PathLike,
    load_in_4bit: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    max_seq_length: int | None = None,
    quantize_embeddings: bool = False,
    offload_embeddings: bool = False,
    quant_storage: torch.dtype = torch.uint8,
    **kwargs,
):
    """Returns `(model, tokenizer)`, the model patched. With `load_in_4bit` the decoder's linear layers are
    stored in bitsandbytes NF4 with double quantisation and compute in `dtype`; embeddings and lm_head stay in
    `dtype` unless `quantize_embeddings`, which stores them in NF4 too, frozen (`quantize_embeddings_nf4`).
    `offload_embeddings` keeps the input embedding in host memory, frozen, in `dtype` (`offload_embeddings_to_host`;
    with `quantize_embeddings` only the lm_head is then quantised).
    `quant_storage` is the dtype the packed NF4 bytes are stored as: the compute dtype for FSDP sharding
    (`unsloth_lite.training.distributed`), bytes otherwise. `max_seq_length` caps the tokenizer's
    `model_max_length` (and must fit the model's positions).
    Other keyword arguments go to `AutoModelForCausalLM.from_pretrained` (`trust_remote_code` is off unless
    given). The tokenizer is None when the checkpoint ships none."""
    quantization_config = None
    if load_in_4bit:
        quantization_config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=quant_storage,
        )
    kwargs.setdefault("device_map", _default_device_map())
    kwargs.setdefault("attn_implementation", "sdpa")
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype, quantization_config=quantization_config, **kwargs
    )
    positions = getattr(model.config, "max_position_embeddings", None)
    if max_seq_length is not None and positions is not None and max_seq_length > positions:
        raise ValueError(f"max_seq_length={max_seq_length} exceeds the model's max_position_embeddings={positions}")
    tokenizer = None
    if _has_tokenizer(name_or_path):
        trust_remote_code = kwargs.get("trust_remote_code", False)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    else:
        warnings.warn(f"{name_or_path} has no tokenizer files; load_model returns None for the tokenizer", stacklevel=2)
    if tokenizer is not None and max_seq_length is not None:
        tokenizer.model_max_length = max_seq_length
    model.max_seq_length = max_seq_length or positions
    if offload_embeddings:
        offload_embeddings_to_host(model)
    if quantize_embeddings:
        quantize_embeddings_nf4(model)
    return patch_model(model), tokenizer


def add_lora(
    model: torch.nn.Module,
    r: int = 16,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    **kwargs,
):
    """Wraps `model` in a `peft.PeftModel` with LoRA adapters (standard PEFT format: `save_pretrained` /
    `PeftModel.from_pretrained`), patched. Dropout 0 (the default) keeps every adapter on the fused path."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules, bias="none",
        task_type="CAUSAL_LM", **kwargs,
    )
    return patch_model(get_peft_model(model, config))
