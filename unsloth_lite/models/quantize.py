"""NF4 quantisation of a model already in memory, layer by layer: what `load_model(load_in_4bit=True)` gives
from a checkpoint, for a model built from its config (a random-weight model of a large shape, built directly on
the GPU, never written to disk)."""

from __future__ import annotations

import torch


def quantize_linears_nf4(
    model: torch.nn.Module, compute_dtype: torch.dtype, skip: tuple[str, ...] = ("lm_head",),
    quant_storage: torch.dtype = torch.uint8,
):
    """Replaces, in place, every `nn.Linear` of `model` whose name does not end in one of `skip` by a
    bitsandbytes NF4 `Linear4bit` (double quantisation, block 64, computing in `compute_dtype`), quantised on
    the device its weight is on; each dense weight is freed as soon as its layer is quantised, so the peak is
    the model plus one layer. `quant_storage` is the dtype the packed bytes are stored as (a sharded model's
    all-gathers take them in the compute dtype: `unsloth_lite.training.distributed`). Returns `model`."""
    import bitsandbytes as bnb

    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and not name.endswith(skip)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = module.weight.detach()
        quantized = bnb.nn.Linear4bit(
            module.in_features, module.out_features, bias=module.bias is not None, compute_dtype=compute_dtype,
            quant_type="nf4", compress_statistics=True, quant_storage=quant_storage, device="meta",
        )
        quantized.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, quant_type="nf4", compress_statistics=True, quant_storage=quant_storage,
            module=quantized,
        ).to(weight.device)
        if module.bias is not None:
            quantized.bias = torch.nn.Parameter(module.bias.detach().to(compute_dtype), requires_grad=False)
        setattr(parent, child, quantized)
        del module, weight
    return model
