"""RMSNorm: one Triton pass forward, one Triton pass backward.

Forward, for each row x of length H (math in fp32, result in x's dtype), with w' = offset + w:

    r = 1 / sqrt(mean(x²) + eps)        x̂ = x · r        y = x̂ · w'

`offset = 1.0` is the zero-centred form of Qwen3.5, whose weights are stored around 0.

Backward. With g = dy · w', and ∂r/∂x_j = -r³ x_j / H:

    dx_j = r g_j - (r³ x_j / H) Σ_i g_i x_i = r · (g_j - x̂_j · mean(g · x̂))
    dw   = Σ_rows dy · x̂

Saved for the backward: x (the caller holds it anyway) and r, 4 bytes per row; x̂ is recomputed on chip.
When the weight is frozen (LoRA) the backward skips dw entirely: one read of x and dy, one write of dx.
When it is trained, each program owns a run of rows and writes one fp32 partial dw row; the partial rows
are then added by `sum_partials`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.utils import (
    accumulator_dtype,
    as_rows,
    check_float,
    check_kernel_device,
    check_same_device,
    empty,
    persistent_program_count,
    row_launch_config,
    sum_partials,
)


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, x_row_stride, x_col_stride,
    w_ptr,
    y_ptr, y_row_stride,
    rstd_ptr,
    n_cols, eps, offset,
    BLOCK: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask_cols = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask_cols, other=0.0).to(ACC)
    w = tl.load(w_ptr + cols, mask=mask_cols, other=0.0).to(ACC) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * y_row_stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask_cols)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, dy_row_stride, dy_col_stride,
    x_ptr, x_row_stride, x_col_stride,
    w_ptr, rstd_ptr,
    dx_ptr, dx_row_stride,
    dw_partial_ptr,
    n_rows, n_cols, offset, rows_per_program,
    BLOCK: tl.constexpr, COMPUTE_DW: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask_cols = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask_cols, other=0.0).to(ACC) + offset
    dw_acc = tl.zeros([BLOCK], dtype=ACC)
    first_row = pid.to(tl.int64) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    for row in range(first_row, last_row):
        dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask_cols, other=0.0).to(ACC)
        x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask_cols, other=0.0).to(ACC)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dy * w
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask_cols)
        if COMPUTE_DW:
            dw_acc += dy * x_hat
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask_cols)


def _rms_norm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    n_rows, n_cols = x2d.shape
    block, num_warps = row_launch_config(n_cols)
    y = empty((n_rows, n_cols), x2d.dtype, x2d.device)
    rstd = empty((n_rows,), torch.float64 if x2d.dtype == torch.float64 else torch.float32, x2d.device)
    _rms_norm_forward_kernel[(n_rows,)](
        x2d, x2d.stride(0), x2d.stride(1),
        weight,
        y, y.stride(0),
        rstd,
        n_cols, eps, offset,
        BLOCK=block, ACC=accumulator_dtype(x2d.dtype), num_warps=num_warps,
    )
    return y, rstd


def _rms_norm_backward(dy2d, x2d, weight, rstd, offset: float, compute_dw: bool):
    n_rows, n_cols = x2d.shape
    block, num_warps = row_launch_config(n_cols)
    dx = empty((n_rows, n_cols), x2d.dtype, x2d.device)
    if compute_dw:
        n_programs = persistent_program_count(x2d.device, n_rows)
        dw_partial = empty((n_programs, n_cols), rstd.dtype, x2d.device)
    else:
        n_programs = n_rows
        dw_partial = rstd  # never written: COMPUTE_DW compiles the store away
    rows_per_program = triton.cdiv(n_rows, n_programs)
    n_programs = triton.cdiv(n_rows, rows_per_program)
    _rms_norm_backward_kernel[(n_programs,)](
        dy2d, dy2d.stride(0), dy2d.stride(1),
        x2d, x2d.stride(0), x2d.stride(1),
        weight, rstd,
        dx, dx.stride(0),
        dw_partial,
        n_rows, n_cols, offset, rows_per_program,
        BLOCK=block, COMPUTE_DW=compute_dw, ACC=accumulator_dtype(x2d.dtype), num_warps=num_warps,
    )
    dw = sum_partials(dw_partial[:n_programs], weight.dtype) if compute_dw else None
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2d = as_rows(x)
        y, rstd = _rms_norm_forward(x2d, weight, eps, offset)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset = offset
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_backward(
            as_rows(dy), x2d, weight, rstd, ctx.offset, compute_dw=ctx.needs_input_grad[1]
        )
        return dx.view(dy.shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """`x * rsqrt(mean(x², -1) + eps) * (offset + weight)` over the last dim of `x`, any leading shape."""
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},), the last dim of x")
    check_same_device([("x", x), ("weight", weight)])
    check_kernel_device("x", x)
    if x.numel() == 0:
        return x.new_empty(x.shape)
    return RMSNormFunction.apply(x, weight.contiguous(), float(eps), float(offset))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0):
    """Plain PyTorch, in fp32 (or the input's float64), for tests and for CPU runs outside the interpreter."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.to(acc))
    return y.to(x.dtype)
