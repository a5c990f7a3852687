"""Plain-PyTorch `nf4_matvec`: the decoding product's reference and its path off the kernels' devices."""

from __future__ import annotations

import torch

from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference


def nf4_matvec_reference(
    x: torch.Tensor,
    weight,
    bias: torch.Tensor | None = None,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 1.0,
    quant_state=None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch `nf4_matvec`: the weight dequantised by `dequantize_nf4_reference`, any number of rows, the
    product in x's dtype (the CPU path without the interpreter), the residual added after it."""
    qs = quant_state if quant_state is not None else weight.quant_state
    packed = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    dense = dequantize_nf4_reference(packed, qs).to(x.dtype)
    linear = torch.nn.functional.linear
    y = linear(x, dense, None if bias is None else bias.to(x.dtype))
    if lora_a is not None and lora_a.shape[0] > 0:
        y = y + scale * linear(linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype))
    return y if residual is None else residual.reshape(y.shape) + y
