"""Argument checks of `nf4_matvec` (and of the launches that share its arguments: `nf4_gated_matvec`,
`nf4_grouped_matvec`): one-line errors naming the argument, before any launch."""

from __future__ import annotations

import torch

from unsloth_lite.kernels.lora_down import MAX_ROWS
from unsloth_lite.kernels.utils import check_float, check_kernel_device


def _check_args(x, weight, bias, lora_a, lora_b, lora_t, n_out, n_in):
    check_float("x", x)
    if x.dtype == torch.float64:
        raise ValueError("nf4_matvec computes in fp32; x has dtype float64 (use nf4_matvec_reference)")
    if x.shape[-1] != n_in:
        raise ValueError(f"x has {x.shape[-1]} features but the weight takes {n_in}")
    rows = x.numel() // max(n_in, 1)
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"nf4_matvec takes 1 to {MAX_ROWS} rows of x, got {rows}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, lora_a, lora_b, lora_t)):
        raise ValueError("nf4_matvec is inference only (no autograd); run it under torch.no_grad()")
    check_kernel_device("x", x)
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n_out},)")
    if lora_t is not None:
        if lora_a is not None or lora_b is None:
            raise ValueError("lora_t replaces lora_a: give it with lora_b alone")
        if (lora_t.dtype != torch.float32 or lora_t.dim() not in (2, 3) or lora_t.shape[-2] != rows
                or lora_t.stride(-1) != 1 or lora_t.shape[0] == 0):
            raise ValueError(f"lora_t must be fp32 [{rows}, r] or [parts, {rows}, r] with unit column stride; got "
                             f"{lora_t.dtype} {tuple(lora_t.shape)} strides {lora_t.stride()}")
        if tuple(lora_b.shape) != (n_out, lora_t.shape[-1]):
            raise ValueError(f"lora_b has shape {tuple(lora_b.shape)}; expected {(n_out, lora_t.shape[-1])}")
        return
    if (lora_a is None) != (lora_b is None):
        raise ValueError("lora_a and lora_b go together")
    if lora_a is not None:
        rank = lora_a.shape[0]
        if tuple(lora_a.shape) != (rank, n_in) or tuple(lora_b.shape) != (n_out, rank):
            raise ValueError(
                f"adapter shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit a weight [{n_out}, {n_in}]"
            )
