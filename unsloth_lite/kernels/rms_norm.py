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

`add_rms_norm` is the residual stream's form, s = x + δ (rounded to s's dtype, as a separate add would
round it), y = RMSNorm(s), returning both. Where s also flows on (the residual stream), its backward receives
ds besides dy, and

    dx = dδ = ds + r · (g - ŝ · mean(g · ŝ))

in the one pass: the add of the two gradients that autograd would launch is folded into the norm's backward.
Without δ, s is x itself: the form for a norm whose input also flows on (a decoder layer's first norm).
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
    delta_ptr, delta_row_stride, delta_col_stride,
    sum_ptr, sum_row_stride,
    w_ptr,
    y_ptr, y_row_stride,
    rstd_ptr,
    n_cols, eps, offset,
    BLOCK: tl.constexpr, ACC: tl.constexpr, ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask_cols = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask_cols, other=0.0).to(ACC)
    if ADD:  # x + delta, rounded to the sum's dtype before the norm reads it
        delta = tl.load(delta_ptr + row * delta_row_stride + cols * delta_col_stride, mask=mask_cols, other=0.0)
        total = (x + delta.to(ACC)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_row_stride + cols, total, mask=mask_cols)
        x = total.to(ACC)
    w = tl.load(w_ptr + cols, mask=mask_cols, other=0.0).to(ACC) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * y_row_stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask_cols)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, dy_row_stride, dy_col_stride,
    x_ptr, x_row_stride, x_col_stride,
    w_ptr, rstd_ptr,
    ds_ptr, ds_row_stride, ds_col_stride,
    dx_ptr, dx_row_stride,
    dw_partial_ptr,
    n_rows, n_cols, offset, rows_per_program,
    BLOCK: tl.constexpr, COMPUTE_DW: tl.constexpr, ACC: tl.constexpr, ADD_DS: tl.constexpr,
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
        if ADD_DS:  # the gradient the input receives along the residual stream
            dx += tl.load(ds_ptr + row * ds_row_stride + cols * ds_col_stride, mask=mask_cols, other=0.0).to(ACC)
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask_cols)
        if COMPUTE_DW:
            dw_acc += dy * x_hat
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask_cols)


def _rms_norm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, delta2d=None, sum_out=None):
    """(y, rstd, s): the norm of x2d, or with `delta2d` of s = x2d + delta2d (written into `sum_out` where given;
    s is x2d without delta2d)."""
    n_rows, n_cols = x2d.shape
    block, num_warps = row_launch_config(n_cols)
    total = x2d
    if delta2d is not None:
        total = sum_out if sum_out is not None else empty((n_rows, n_cols), x2d.dtype, x2d.device)
    y = empty((n_rows, n_cols), total.dtype, x2d.device)
    rstd = empty((n_rows,), torch.float64 if total.dtype == torch.float64 else torch.float32, x2d.device)
    added = delta2d if delta2d is not None else x2d  # never read without the add
    _rms_norm_forward_kernel[(n_rows,)](
        x2d, x2d.stride(0), x2d.stride(1),
        added, added.stride(0), added.stride(1),
        total, total.stride(0),
        weight,
        y, y.stride(0),
        rstd,
        n_cols, eps, offset,
        BLOCK=block, ACC=accumulator_dtype(total.dtype), ADD=delta2d is not None, num_warps=num_warps,
    )
    return y, rstd, total


def _rms_norm_backward(dy2d, x2d, weight, rstd, offset: float, compute_dw: bool, ds2d=None):
    """(dx, dw or None) of the norm of x2d; `ds2d`, a gradient x2d receives besides the norm's, is added in."""
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
    added = ds2d if ds2d is not None else dy2d  # never read without ds
    _rms_norm_backward_kernel[(n_programs,)](
        dy2d, dy2d.stride(0), dy2d.stride(1),
        x2d, x2d.stride(0), x2d.stride(1),
        weight, rstd,
        added, added.stride(0), added.stride(1),
        dx, dx.stride(0),
        dw_partial,
        n_rows, n_cols, offset, rows_per_program,
        BLOCK=block, COMPUTE_DW=compute_dw, ACC=accumulator_dtype(x2d.dtype), ADD_DS=ds2d is not None,
        num_warps=num_warps,
    )
    dw = sum_partials(dw_partial[:n_programs], weight.dtype) if compute_dw else None
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2d = as_rows(x)
        y, rstd, _ = _rms_norm_forward(x2d, weight, eps, offset)
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


class AddRMSNormFunction(torch.autograd.Function):
    """(s, RMSNorm(s)) with s = x + delta, or the kept `total` equal to it, or x itself without delta."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps, offset, total, sum_into):
        ctx.set_materialize_grads(False)
        if total is not None:
            y, rstd, s2d = _rms_norm_forward(as_rows(total), weight, eps, offset)
        else:
            into = None if sum_into is None else as_rows(sum_into)
            delta2d = None if delta is None else as_rows(delta)
            y, rstd, s2d = _rms_norm_forward(as_rows(x), weight, eps, offset, delta2d, into)
        ctx.save_for_backward(s2d, weight, rstd)
        ctx.offset, ctx.has_delta = offset, delta is not None
        s = total if total is not None else x if delta is None else s2d.view(x.shape)
        return s, y.view(x.shape)

    @staticmethod
    def backward(ctx, ds, dy):
        s2d, weight, rstd = ctx.saved_tensors
        if dy is None:
            dx, dw = ds, None
        else:
            dx, dw = _rms_norm_backward(
                as_rows(dy), s2d, weight, rstd, ctx.offset, compute_dw=ctx.needs_input_grad[2],
                ds2d=None if ds is None else as_rows(ds),
            )
            dx = dx.view(dy.shape)
        return dx, dx if ctx.has_delta else None, dw, None, None, None, None


def _check_norm_arguments(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},), the last dim of x")
    check_same_device([("x", x), ("weight", weight)])
    check_kernel_device("x", x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """`x * rsqrt(mean(x², -1) + eps) * (offset + weight)` over the last dim of `x`, any leading shape."""
    _check_norm_arguments(x, weight)
    if x.numel() == 0:
        return x.new_empty(x.shape)
    return RMSNormFunction.apply(x, weight.contiguous(), float(eps), float(offset))


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
    kept_sum: torch.Tensor | None = None, sum_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, `rms_norm(s, weight, eps, offset)`) with s = x + delta, the residual stream's add and norm in one pass
    each way (module docstring); without `delta`, s is x itself. `kept_sum`: a tensor equal to x + delta kept
    from an earlier forward, taken as s instead of adding (gradients still reach x and delta); `sum_into`: a
    buffer shaped like x, of x's dtype, that s is written into."""
    _check_norm_arguments(x, weight)
    for name, t in (("delta", delta), ("kept_sum", kept_sum), ("sum_into", sum_into)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(x.shape)}, the shape of x")
    if delta is not None and delta.dtype != x.dtype:
        raise ValueError(f"delta has dtype {delta.dtype}; expected {x.dtype}, the dtype of x")
    if sum_into is not None and (sum_into.dtype != x.dtype or not sum_into.is_contiguous()):
        raise ValueError(f"sum_into must be a contiguous {x.dtype} tensor")
    if x.numel() == 0:
        return (x if delta is None else x + delta), x.new_empty(x.shape)
    return AddRMSNormFunction.apply(x, delta, weight.contiguous(), float(eps), float(offset), kept_sum, sum_into)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0):
    """Plain PyTorch, in fp32 (or the input's float64), for tests and for CPU runs outside the interpreter."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.to(acc))
    return y.to(x.dtype)
