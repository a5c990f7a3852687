"""Merging a trained adapter into its base: a 16-bit model that `AutoModelForCausalLM` loads without PEFT."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import torch

from unsloth_lite.recipes import Recipe, torch_dtype


def _save_atomically(write, target: pathlib.Path) -> None:
    """Write into a sibling temporary directory, then rename it into place."""
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    write(staging)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)


def _as_trained_in_nf4(model: torch.nn.Module, linears: bool = True, embeddings: bool = False) -> None:
    """Replaces each decoder linear weight (with `linears`) and the input embedding and lm_head (with
    `embeddings`) by its NF4 round trip (bitsandbytes' quantisation, double quant, block 64, then
    dequantisation): exactly the base the adapter was trained on with `load_in_4bit` / `quantize_embeddings`."""
    import bitsandbytes as bnb

    weights = [m.weight.data for name, m in model.named_modules()
               if linears and isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")]
    if embeddings:
        heads = [model.get_input_embeddings(), model.get_output_embeddings()]
        weights += [m.weight.data for m in heads if m is not None]
    for weight in {w.data_ptr(): w for w in weights}.values():  # a tied matrix once
        packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        weight.copy_(bnb.functional.dequantize_4bit(packed, state))


def merge_and_save(recipe: Recipe, base_path: str, adapter_dir: pathlib.Path, target: pathlib.Path) -> None:
    """A merged 16-bit model loadable by `AutoModelForCausalLM`: the base as it was trained (NF4-dequantised
    when trained in 4 bits) plus the adapter, in the recipe's dtype, or bfloat16 for a float32 recipe."""
    import transformers
    from peft import PeftModel

    dtype = torch_dtype(recipe.model.dtype)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype, device_map="cpu")
    if recipe.model.load_in_4bit or recipe.model.quantize_embeddings:
        _as_trained_in_nf4(base, linears=recipe.model.load_in_4bit, embeddings=recipe.model.quantize_embeddings)
    merged = PeftModel.from_pretrained(base.float(), adapter_dir).merge_and_unload()
    merged = merged.to(dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    _save_atomically(lambda d: merged.save_pretrained(d, safe_serialization=True), target)
