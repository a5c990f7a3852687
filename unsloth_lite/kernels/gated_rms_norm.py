"""Gated RMSNorm (Qwen3.5's `Qwen3_5RMSNormGated`, after the Gated DeltaNet): one Triton pass each way.

Forward, for each row x of length H with its gate row z (math in fp32, result in x's dtype), σ the logistic
sigmoid:

    r = 1 / sqrt(mean(x²) + eps)        x̂ = x · r        s = silu(z) = z · σ(z)        y = x̂ · w · s

Hugging Face rounds x̂ to the input dtype before multiplying by w; here everything stays in fp32 and y is
rounded once, which differs from it by less than one rounding of the input dtype.

Backward. With g = dy · w · s (the gradient reaching x̂) and ∂r/∂x_j = -r³ x_j / H, as for RMSNorm:

    dx_j = r · (g_j - x̂_j · mean(g · x̂))
    dz   = dy · w · x̂ · σ(z) · (1 + z · (1 - σ(z)))
    dw   = Σ_rows dy · x̂ · s

Saved for the backward: x, z and r (4 bytes per row); x̂, σ(z) and s are recomputed on chip. Programs take
tiles of rows (several short rows, such as Qwen3.5's 128-wide heads, per program). When the weight is frozen
(LoRA) the backward skips dw: it reads x, z, dy and writes dx, dz. When it is trained, each program walks a
run of row tiles and writes one fp32 partial dw row, and `sum_partials` adds the partial rows.
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

# Elements a program's row tile holds at least (several rows when rows are short).
TILE_ELEMENTS = 2048
MAX_TILE_ROWS = 16


@triton.jit
def _gated_rms_norm_forward_kernel(
    x_ptr, x_row_stride, x_col_stride,
    z_ptr, z_row_stride, z_col_stride,
    w_ptr,
    y_ptr, y_row_stride,
    rstd_ptr,
    n_rows, n_cols, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK)
    mask_rows = rows < n_rows
    mask = mask_rows[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask, other=0.0).to(ACC)
    z = tl.load(z_ptr + rows[:, None] * z_row_stride + cols[None, :] * z_col_stride, mask=mask, other=0.0).to(ACC)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(ACC)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=mask_rows)


@triton.jit
def _gated_rms_norm_backward_kernel(
    dy_ptr, dy_row_stride, dy_col_stride,
    x_ptr, x_row_stride, x_col_stride,
    z_ptr, z_row_stride, z_col_stride,
    w_ptr, rstd_ptr,
    dx_ptr, dx_row_stride,
    dz_ptr, dz_row_stride,
    dw_partial_ptr,
    n_rows, n_cols, tiles_per_program,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr, COMPUTE_DW: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask_cols = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask_cols, other=0.0).to(ACC)
    dw_acc = tl.zeros([BLOCK_ROWS, BLOCK], dtype=ACC)
    first_tile = pid.to(tl.int64) * tiles_per_program
    for tile in range(first_tile, first_tile + tiles_per_program):
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask_rows = rows < n_rows
        mask = mask_rows[:, None] & mask_cols[None, :]
        r2 = rows[:, None]
        c2 = cols[None, :]
        dy = tl.load(dy_ptr + r2 * dy_row_stride + c2 * dy_col_stride, mask=mask, other=0.0).to(ACC)
        x = tl.load(x_ptr + r2 * x_row_stride + c2 * x_col_stride, mask=mask, other=0.0).to(ACC)
        z = tl.load(z_ptr + r2 * z_row_stride + c2 * z_col_stride, mask=mask, other=0.0).to(ACC)
        rstd = tl.load(rstd_ptr + rows, mask=mask_rows, other=0.0)
        x_hat = x * rstd[:, None]
        sig = tl.sigmoid(z)
        dyw = dy * w[None, :]
        g = dyw * (z * sig)
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
        dz = dyw * x_hat * sig * (1.0 + z * (1.0 - sig))
        tl.store(dx_ptr + r2 * dx_row_stride + c2, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptr + r2 * dz_row_stride + c2, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += dy * x_hat * (z * sig)
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=mask_cols)


def _launch_config(n_cols: int) -> tuple[int, int, int]:
    """(columns block, rows a tile, warps)."""
    block, num_warps = row_launch_config(n_cols)
    block_rows = max(1, min(MAX_TILE_ROWS, TILE_ELEMENTS // block))
    return block, block_rows, num_warps


def _gated_rms_norm_forward(x2d, z2d, weight, eps: float):
    n_rows, n_cols = x2d.shape
    block, block_rows, num_warps = _launch_config(n_cols)
    y = empty((n_rows, n_cols), x2d.dtype, x2d.device)
    rstd = empty((n_rows,), torch.float64 if x2d.dtype == torch.float64 else torch.float32, x2d.device)
    _gated_rms_norm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
        x2d, x2d.stride(0), x2d.stride(1),
        z2d, z2d.stride(0), z2d.stride(1),
        weight,
        y, y.stride(0),
        rstd,
        n_rows, n_cols, eps,
        BLOCK_ROWS=block_rows, BLOCK=block, ACC=accumulator_dtype(x2d.dtype), num_warps=num_warps,
    )
    return y, rstd


def _gated_rms_norm_backward(dy2d, x2d, z2d, weight, rstd, compute_dw: bool):
    n_rows, n_cols = x2d.shape
    block, block_rows, num_warps = _launch_config(n_cols)
    n_tiles = triton.cdiv(n_rows, block_rows)
    dx = empty((n_rows, n_cols), x2d.dtype, x2d.device)
    dz = empty((n_rows, n_cols), z2d.dtype, z2d.device)
    if compute_dw:
        n_programs = persistent_program_count(x2d.device, n_tiles)
        tiles_per_program = triton.cdiv(n_tiles, n_programs)
        n_programs = triton.cdiv(n_tiles, tiles_per_program)
        dw_partial = empty((n_programs, n_cols), rstd.dtype, x2d.device)
    else:
        n_programs, tiles_per_program = n_tiles, 1
        dw_partial = rstd  # never written: COMPUTE_DW compiles the store away
    _gated_rms_norm_backward_kernel[(n_programs,)](
        dy2d, dy2d.stride(0), dy2d.stride(1),
        x2d, x2d.stride(0), x2d.stride(1),
        z2d, z2d.stride(0), z2d.stride(1),
        weight, rstd,
        dx, dx.stride(0),
        dz, dz.stride(0),
        dw_partial,
        n_rows, n_cols, tiles_per_program,
        BLOCK_ROWS=block_rows, BLOCK=block, COMPUTE_DW=compute_dw, ACC=accumulator_dtype(x2d.dtype),
        num_warps=num_warps,
    )
    dw = sum_partials(dw_partial, weight.dtype) if compute_dw else None
    return dx, dz, dw


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        x2d, z2d = as_rows(x), as_rows(gate)
        y, rstd = _gated_rms_norm_forward(x2d, z2d, weight, eps)
        ctx.save_for_backward(x2d, z2d, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, z2d, weight, rstd = ctx.saved_tensors
        dx, dz, dw = _gated_rms_norm_backward(
            as_rows(dy), x2d, z2d, weight, rstd, compute_dw=ctx.needs_input_grad[1]
        )
        return dx.view(dy.shape), dw, dz.view(dy.shape), None


def _check_args(x, weight, gate):
    check_float("x", x)
    check_float("weight", weight)
    check_float("gate", gate)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},), the last dim of x")
    if gate.shape != x.shape:
        raise ValueError(f"gate has shape {tuple(gate.shape)}; expected {tuple(x.shape)}, the shape of x")
    check_same_device([("x", x), ("weight", weight), ("gate", gate)])
    check_kernel_device("x", x)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(mean(x², -1) + eps) * weight * silu(gate)` over the last dim of `x`, any leading shape; `gate`
    is shaped like `x`. Result in x's dtype."""
    _check_args(x, weight, gate)
    if x.numel() == 0:
        return x.new_empty(x.shape)
    return GatedRMSNormFunction.apply(x, weight.contiguous(), gate, float(eps))


def gated_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float = 1e-6):
    """Plain PyTorch, in fp32 (or the input's float64), for tests and for CPU runs outside the interpreter."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    zf = gate.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc) * torch.nn.functional.silu(zf)
    return y.to(x.dtype)
