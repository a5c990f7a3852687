"""The Gated DeltaNet's per-token, per-head gates (Qwen3.5): decay g and write strength β, one Triton pass each way.

Forward, for a and b of shape `[..., H]` and per-head parameters A_log, dt_bias `[H]` (math in fp32), σ the
logistic sigmoid and softplus as torch's (threshold 20):

    u = a + dt_bias        softplus(u) = log(1 + exp(u))  (u for u > 20)
    g = -exp(A_log) · softplus(u)        (fp32, as Hugging Face computes it from `a.float()`)
    β = σ(b)                             (in b's dtype)

Backward, with softplus'(u) = σ(u) (1 for u > 20) and σ' = σ (1 - σ):

    da       = dg · (-exp(A_log)) · softplus'(u)
    ddt_bias = Σ_rows da
    dA_log   = Σ_rows dg · g
    db       = dβ · β · (1 - β)

Saved: the inputs a and b; u, g and β are recomputed. Programs take tiles of rows × heads. When A_log or
dt_bias is trained, each backward program walks a run of row tiles and writes one fp32 partial row for each,
and `sum_partials` adds the partial rows (no atomics, deterministic).
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
    sum_partials,
)

SOFTPLUS_THRESHOLD = 20.0
# Elements a program's tile holds (rows × heads).
TILE_ELEMENTS = 1024


@triton.jit
def _log1p(v):
    """log(1 + v) for v >= 0, accurate for small v (the rounding error of 1 + v is divided out)."""
    w = 1.0 + v
    exact = w == 1.0
    return tl.where(exact, v, tl.log(w) * (v / tl.where(exact, 1.0, w - 1.0)))


@triton.jit
def _softplus_and_slope(u, THRESHOLD: tl.constexpr):
    """softplus(u) = max(u, 0) + log1p(exp(-|u|)) (u itself above the threshold), and its slope σ(u)."""
    e = tl.exp(-tl.abs(u))
    above = u > THRESHOLD
    softplus = tl.where(above, u, tl.maximum(u, 0.0) + _log1p(e))
    slope = tl.where(above, 1.0, tl.where(u >= 0, 1.0 / (1.0 + e), e / (1.0 + e)))
    return softplus, slope


@triton.jit
def _deltanet_gates_forward_kernel(
    a_ptr, a_row_stride, a_col_stride,
    b_ptr, b_row_stride, b_col_stride,
    a_log_ptr, dt_bias_ptr,
    g_ptr, beta_ptr,
    n_rows, n_heads,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, THRESHOLD: tl.constexpr, ACC: tl.constexpr,
):
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]
    heads = tl.arange(0, BLOCK_H)
    mask_heads = heads < n_heads
    mask = (rows < n_rows) & mask_heads[None, :]
    cols = heads[None, :]
    a = tl.load(a_ptr + rows * a_row_stride + cols * a_col_stride, mask=mask, other=0.0).to(ACC)
    b = tl.load(b_ptr + rows * b_row_stride + cols * b_col_stride, mask=mask, other=0.0).to(ACC)
    neg_rate = -tl.exp(tl.load(a_log_ptr + heads, mask=mask_heads, other=0.0).to(ACC))
    dt_bias = tl.load(dt_bias_ptr + heads, mask=mask_heads, other=0.0).to(ACC)
    softplus, _ = _softplus_and_slope(a + dt_bias[None, :], THRESHOLD)
    out = rows * n_heads + cols
    tl.store(g_ptr + out, (neg_rate[None, :] * softplus).to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(beta_ptr + out, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _deltanet_gates_backward_kernel(
    dg_ptr, dg_row_stride, dg_col_stride,
    dbeta_ptr, dbeta_row_stride, dbeta_col_stride,
    a_ptr, a_row_stride, a_col_stride,
    b_ptr, b_row_stride, b_col_stride,
    a_log_ptr, dt_bias_ptr,
    da_ptr, db_ptr,
    da_log_partial_ptr, ddt_bias_partial_ptr,
    n_rows, n_heads, tiles_per_program,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, THRESHOLD: tl.constexpr,
    COMPUTE_DA: tl.constexpr, COMPUTE_DB: tl.constexpr,
    COMPUTE_DA_LOG: tl.constexpr, COMPUTE_DDT_BIAS: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    mask_heads = heads < n_heads
    cols = heads[None, :]
    neg_rate = -tl.exp(tl.load(a_log_ptr + heads, mask=mask_heads, other=0.0).to(ACC))[None, :]
    dt_bias = tl.load(dt_bias_ptr + heads, mask=mask_heads, other=0.0).to(ACC)[None, :]
    da_log_acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=ACC)
    ddt_bias_acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=ACC)
    first_tile = pid.to(tl.int64) * tiles_per_program
    for tile in range(first_tile, first_tile + tiles_per_program):
        rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]
        mask = (rows < n_rows) & mask_heads[None, :]
        out = rows * n_heads + cols
        if COMPUTE_DA or COMPUTE_DA_LOG or COMPUTE_DDT_BIAS:
            dg = tl.load(dg_ptr + rows * dg_row_stride + cols * dg_col_stride, mask=mask, other=0.0).to(ACC)
            a = tl.load(a_ptr + rows * a_row_stride + cols * a_col_stride, mask=mask, other=0.0).to(ACC)
            softplus, slope = _softplus_and_slope(a + dt_bias, THRESHOLD)
            da = dg * neg_rate * slope
            if COMPUTE_DA:
                tl.store(da_ptr + out, da.to(da_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DDT_BIAS:
                ddt_bias_acc += da
            if COMPUTE_DA_LOG:
                da_log_acc += dg * neg_rate * softplus
        if COMPUTE_DB:
            dbeta = tl.load(
                dbeta_ptr + rows * dbeta_row_stride + cols * dbeta_col_stride, mask=mask, other=0.0
            ).to(ACC)
            beta = tl.sigmoid(tl.load(b_ptr + rows * b_row_stride + cols * b_col_stride, mask=mask, other=0.0).to(ACC))
            tl.store(db_ptr + out, (dbeta * beta * (1.0 - beta)).to(db_ptr.dtype.element_ty), mask=mask)
    if COMPUTE_DA_LOG:
        tl.store(da_log_partial_ptr + pid * n_heads + heads, tl.sum(da_log_acc, axis=0), mask=mask_heads)
    if COMPUTE_DDT_BIAS:
        tl.store(ddt_bias_partial_ptr + pid * n_heads + heads, tl.sum(ddt_bias_acc, axis=0), mask=mask_heads)


def _launch_config(n_heads: int) -> tuple[int, int]:
    block_h = triton.next_power_of_2(n_heads)
    return block_h, max(1, TILE_ELEMENTS // block_h)


def _g_dtype(a: torch.Tensor) -> torch.dtype:
    return torch.float64 if a.dtype == torch.float64 else torch.float32


def _deltanet_gates_forward(a2d, b2d, a_log, dt_bias):
    n_rows, n_heads = a2d.shape
    block_h, block_rows = _launch_config(n_heads)
    g = empty((n_rows, n_heads), _g_dtype(a2d), a2d.device)
    beta = empty((n_rows, n_heads), b2d.dtype, b2d.device)
    _deltanet_gates_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
        a2d, a2d.stride(0), a2d.stride(1),
        b2d, b2d.stride(0), b2d.stride(1),
        a_log, dt_bias,
        g, beta,
        n_rows, n_heads,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h, THRESHOLD=SOFTPLUS_THRESHOLD, ACC=accumulator_dtype(a2d.dtype),
        num_warps=4,
    )
    return g, beta


def _deltanet_gates_backward(dg2d, dbeta2d, a2d, b2d, a_log, dt_bias, needs):
    compute_da, compute_db, compute_da_log, compute_ddt_bias = needs
    n_rows, n_heads = a2d.shape
    block_h, block_rows = _launch_config(n_heads)
    n_tiles = triton.cdiv(n_rows, block_rows)
    acc = _g_dtype(a2d)
    da = empty((n_rows, n_heads), a2d.dtype, a2d.device) if compute_da else None
    db = empty((n_rows, n_heads), b2d.dtype, b2d.device) if compute_db else None
    if compute_da_log or compute_ddt_bias:
        n_programs = persistent_program_count(a2d.device, n_tiles)
        tiles_per_program = triton.cdiv(n_tiles, n_programs)
        n_programs = triton.cdiv(n_tiles, tiles_per_program)
    else:
        n_programs, tiles_per_program = n_tiles, 1
    da_log_partial = empty((n_programs, n_heads), acc, a2d.device) if compute_da_log else None
    ddt_bias_partial = empty((n_programs, n_heads), acc, a2d.device) if compute_ddt_bias else None
    unused = a2d  # pointer for outputs a flag compiles away
    _deltanet_gates_backward_kernel[(n_programs,)](
        dg2d, dg2d.stride(0), dg2d.stride(1),
        dbeta2d, dbeta2d.stride(0), dbeta2d.stride(1),
        a2d, a2d.stride(0), a2d.stride(1),
        b2d, b2d.stride(0), b2d.stride(1),
        a_log, dt_bias,
        da if compute_da else unused, db if compute_db else unused,
        da_log_partial if compute_da_log else unused, ddt_bias_partial if compute_ddt_bias else unused,
        n_rows, n_heads, tiles_per_program,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h, THRESHOLD=SOFTPLUS_THRESHOLD,
        COMPUTE_DA=compute_da, COMPUTE_DB=compute_db,
        COMPUTE_DA_LOG=compute_da_log, COMPUTE_DDT_BIAS=compute_ddt_bias, ACC=accumulator_dtype(a2d.dtype),
        num_warps=4,
    )
    da_log = sum_partials(da_log_partial, a_log.dtype) if compute_da_log else None
    ddt_bias = sum_partials(ddt_bias_partial, dt_bias.dtype) if compute_ddt_bias else None
    return da, db, da_log, ddt_bias


class DeltaNetGatesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_log, dt_bias):
        a2d, b2d = as_rows(a), as_rows(b)
        g, beta = _deltanet_gates_forward(a2d, b2d, a_log, dt_bias)
        ctx.save_for_backward(a2d, b2d, a_log, dt_bias)
        return g.view(a.shape), beta.view(b.shape)

    @staticmethod
    def backward(ctx, dg, dbeta):
        a2d, b2d, a_log, dt_bias = ctx.saved_tensors
        da, db, da_log, ddt_bias = _deltanet_gates_backward(
            as_rows(dg), as_rows(dbeta), a2d, b2d, a_log, dt_bias, tuple(ctx.needs_input_grad)
        )
        return (
            None if da is None else da.view(dg.shape),
            None if db is None else db.view(dbeta.shape),
            da_log,
            ddt_bias,
        )


def _check_args(a, b, a_log, dt_bias):
    for name, t in (("a", a), ("b", b), ("A_log", a_log), ("dt_bias", dt_bias)):
        check_float(name, t)
    if a.dim() == 0:
        raise ValueError("a must have at least one dimension (the heads), got a scalar")
    if b.shape != a.shape:
        raise ValueError(f"b has shape {tuple(b.shape)}; expected {tuple(a.shape)}, the shape of a")
    n_heads = a.shape[-1]
    if a_log.shape != (n_heads,):
        raise ValueError(f"A_log has shape {tuple(a_log.shape)}; expected ({n_heads},), the last dim of a")
    if dt_bias.shape != (n_heads,):
        raise ValueError(f"dt_bias has shape {tuple(dt_bias.shape)}; expected ({n_heads},), the last dim of a")
    check_same_device([("a", a), ("b", b), ("A_log", a_log), ("dt_bias", dt_bias)])
    check_kernel_device("a", a)


def deltanet_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):  # noqa: N803
    """`(g, beta)` with `g = -exp(A_log) * softplus(a + dt_bias)` in fp32 and `beta = sigmoid(b)` in b's dtype;
    a and b `[..., H]`, A_log and dt_bias `[H]`."""
    _check_args(a, b, A_log, dt_bias)
    if a.numel() == 0:
        return a.new_empty(a.shape, dtype=_g_dtype(a)), b.new_empty(b.shape)
    return DeltaNetGatesFunction.apply(a, b, A_log.contiguous(), dt_bias.contiguous())


def deltanet_gates_reference(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):  # noqa: N803
    """Plain PyTorch as Hugging Face's Qwen3.5 (fp32, or float64 for float64 a), for tests and CPU runs."""
    acc = _g_dtype(a)
    g = -A_log.to(acc).exp() * torch.nn.functional.softplus(a.to(acc) + dt_bias.to(acc))
    return g, b.sigmoid()
