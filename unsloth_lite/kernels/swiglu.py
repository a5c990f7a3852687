"""SwiGLU, the gated activation of Qwen's MLP, and the sigmoid output gate of Qwen3.5's attention: one Triton
pass forward, one backward, the gate's function a compile-time flag.

Forward, elementwise with σ the logistic sigmoid (math in fp32):

    swiglu:        h = silu(g) · u = g · σ(g) · u
    sigmoid gate:  h = σ(g) · u

Backward, using σ'(g) = σ(g)(1 - σ(g)):

    swiglu:        du = dh · g · σ(g)      dg = dh · u · σ(g) · (1 + g · (1 - σ(g)))
    sigmoid gate:  du = dh · σ(g)          dg = dh · u · σ(g) · (1 - σ(g))

Saved for the backward: g and u, the inputs. σ(g) is recomputed, so the backward moves the fewest bytes
possible: read dh, g, u; write dg, du. Where a caller also needs h in the backward (the LoRA MLP's down
projection's adapter gradients, `lora.py`), the backward writes it too (`h_out`, which may be dh itself: each
element is read before it is overwritten), so h costs one write instead of a forward pass's reads of g and u.

Gate and up may be views into one fused projection output (`gate_up.chunk(2, -1)`, or Qwen3.5's q_proj output
holding each head's query and gate side by side): each tensor is read as rows with its own row stride, so
such views are never copied.
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
)

BLOCK_COLS = 1024


@triton.jit
def _swiglu_forward_kernel(
    g_ptr, g_row_stride, g_col_stride,
    u_ptr, u_row_stride, u_col_stride,
    h_ptr,
    n_cols, n_col_blocks,
    BLOCK: tl.constexpr, ACC: tl.constexpr, SIGMOID: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask_cols = cols < n_cols
    g = tl.load(g_ptr + row * g_row_stride + cols * g_col_stride, mask=mask_cols, other=0.0).to(ACC)
    u = tl.load(u_ptr + row * u_row_stride + cols * u_col_stride, mask=mask_cols, other=0.0).to(ACC)
    if SIGMOID:
        h = tl.sigmoid(g) * u
    else:
        h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + row * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=mask_cols)


@triton.jit
def _swiglu_backward_kernel(
    dh_ptr, dh_row_stride, dh_col_stride,
    g_ptr, g_row_stride, g_col_stride,
    u_ptr, u_row_stride, u_col_stride,
    dg_ptr, du_ptr, h_ptr,
    n_cols, n_col_blocks,
    BLOCK: tl.constexpr, ACC: tl.constexpr, SIGMOID: tl.constexpr, H_OUT: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask_cols = cols < n_cols
    dh = tl.load(dh_ptr + row * dh_row_stride + cols * dh_col_stride, mask=mask_cols, other=0.0).to(ACC)
    g = tl.load(g_ptr + row * g_row_stride + cols * g_col_stride, mask=mask_cols, other=0.0).to(ACC)
    u = tl.load(u_ptr + row * u_row_stride + cols * u_col_stride, mask=mask_cols, other=0.0).to(ACC)
    sig = tl.sigmoid(g)
    if SIGMOID:
        du = dh * sig
        dg = dh * u * sig * (1.0 - sig)
    else:
        du = dh * g * sig
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    out = row * n_cols + cols
    tl.store(dg_ptr + out, dg.to(dg_ptr.dtype.element_ty), mask=mask_cols)
    tl.store(du_ptr + out, du.to(du_ptr.dtype.element_ty), mask=mask_cols)
    if H_OUT:
        h = sig * u if SIGMOID else g * sig * u
        tl.store(h_ptr + out, h.to(h_ptr.dtype.element_ty), mask=mask_cols)


def _grid(n_rows: int, n_cols: int):
    block = min(BLOCK_COLS, triton.next_power_of_2(n_cols))
    n_col_blocks = triton.cdiv(n_cols, block)
    return block, n_col_blocks, (n_rows * n_col_blocks,)


def _swiglu_forward(g2d: torch.Tensor, u2d: torch.Tensor, sigmoid: bool = False) -> torch.Tensor:
    n_rows, n_cols = g2d.shape
    block, n_col_blocks, grid = _grid(n_rows, n_cols)
    h = empty((n_rows, n_cols), g2d.dtype, g2d.device)
    _swiglu_forward_kernel[grid](
        g2d, g2d.stride(0), g2d.stride(1),
        u2d, u2d.stride(0), u2d.stride(1),
        h,
        n_cols, n_col_blocks,
        BLOCK=block, ACC=accumulator_dtype(g2d.dtype), SIGMOID=sigmoid, num_warps=4,
    )
    return h


def _swiglu_backward(dh2d, g2d, u2d, out=None, sigmoid: bool = False, h_out=None):
    """(dg, du); `out` = two contiguous `[rows, cols]` tensors to write them into, which may be g and u
    themselves: each element is read before it is overwritten, by the same program. `h_out`: a contiguous
    `[rows, cols]` tensor (dh itself, if contiguous, as well) that the forward's h is written into."""
    n_rows, n_cols = g2d.shape
    block, n_col_blocks, grid = _grid(n_rows, n_cols)
    if out is None:
        dg = empty((n_rows, n_cols), g2d.dtype, g2d.device)
        du = empty((n_rows, n_cols), u2d.dtype, u2d.device)
    else:
        dg, du = out
    _swiglu_backward_kernel[grid](
        dh2d, dh2d.stride(0), dh2d.stride(1),
        g2d, g2d.stride(0), g2d.stride(1),
        u2d, u2d.stride(0), u2d.stride(1),
        dg, du, dg if h_out is None else h_out,
        n_cols, n_col_blocks,
        BLOCK=block, ACC=accumulator_dtype(g2d.dtype), SIGMOID=sigmoid, H_OUT=h_out is not None, num_warps=4,
    )
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, sigmoid):
        g2d, u2d = as_rows(gate), as_rows(up)
        ctx.save_for_backward(g2d, u2d)
        ctx.sigmoid = sigmoid
        return _swiglu_forward(g2d, u2d, sigmoid).view(gate.shape)

    @staticmethod
    def backward(ctx, dh):
        g2d, u2d = ctx.saved_tensors
        dg, du = _swiglu_backward(as_rows(dh), g2d, u2d, sigmoid=ctx.sigmoid)
        return dg.view(dh.shape), du.view(dh.shape), None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, elementwise; gate and up of one shape and dtype."""
    _check_gate_args(gate, up)
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return SwiGLUFunction.apply(gate, up, False)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(gate)`, elementwise (Qwen3.5's attention output gate); x and gate of one shape and dtype."""
    _check_gate_args(gate, x, ("gate", "x"))
    if gate.numel() == 0:
        return x.new_empty(x.shape)
    return SwiGLUFunction.apply(gate, x, True)


def _check_gate_args(gate, up, names=("gate", "up")) -> None:
    gate_name, up_name = names
    check_float(gate_name, gate)
    check_float(up_name, up)
    if gate.shape != up.shape:
        raise ValueError(
            f"{gate_name} has shape {tuple(gate.shape)} but {up_name} has shape {tuple(up.shape)}; they must match"
        )
    if gate.dtype != up.dtype:
        raise ValueError(f"{gate_name} has dtype {gate.dtype} but {up_name} has dtype {up.dtype}; they must match")
    if gate.dim() == 0:
        raise ValueError(f"{gate_name} and {up_name} must have at least one dimension, got scalars")
    check_same_device([(gate_name, gate), (up_name, up)])
    check_kernel_device(gate_name, gate)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (torch.nn.functional.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) * torch.sigmoid(gate.to(acc))).to(x.dtype)


def swiglu_backward_reference(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out=None):
    """(dg, du) of `swiglu_reference`, as the backward kernel computes them; `out` as `_swiglu_backward`'s
    (may be gate and up themselves: both results are formed before either is written)."""
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, dh = gate.to(acc), up.to(acc), dh.to(acc)
    sig = torch.sigmoid(g)
    du = dh * g * sig
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    if out is None:
        return dg.to(gate.dtype), du.to(up.dtype)
    out[0].copy_(dg)
    out[1].copy_(du)
    return out
