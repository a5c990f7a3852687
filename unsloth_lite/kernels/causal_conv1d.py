"""Depthwise causal convolution (the Gated DeltaNet's short convolution over q, k, v), one Triton pass each way.

Forward, for x `[B, C, T]` and a weight `[C, K]` (math in fp32, result in x's dtype), per channel c:

    pre[t] = bias[c] + Σ_{j<K} w[c, j] · x[t - K + 1 + j]        y[t] = silu(pre[t])  (or pre[t])

with x taken as 0 before the start of the token's sequence. With `cu_seqlens` (packed documents, B = 1) a
sequence is a document: a token never reads values of the document before it.

Backward, with σ the logistic sigmoid and silu'(p) = σ(p) (1 + p (1 - σ(p))):

    dpre[t] = dy[t] · silu'(pre[t])   (dy[t] without the activation)
    dx[t]   = Σ_j w[c, j] · dpre[t + K - 1 - j]       (terms whose t + K - 1 - j leaves t's document are 0)
    dw[c, j] = Σ_(b, t) dpre[t] · x[t - K + 1 + j]     dbias[c] = Σ_(b, t) dpre[t]

Saved: the inputs only. pre is recomputed from x: a backward tile recomputes pre at the K positions
t, t+1, ..., t+K-1 that its dx needs (K shifted reads of the tile, which hit in cache). The usual x is the
projection's `[B, T, C]` storage seen as `[B, C, T]` through `.transpose(1, 2)`; programs take
`[T block, C block]` tiles with C contiguous, and y and dx keep x's memory order (a transposed view of a
`[B, T, C]` tensor for that input). Document bounds come from a binary search of `cu_seqlens` per token,
on chip (no host synchronisation). When the weight or bias is trained, each backward program walks a run of
T tiles of one C block and writes one fp32 partial row of dw (and of dbias); `sum_partials` adds the rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.utils import (
    INTERPRET,
    accumulator_dtype,
    check_float,
    check_kernel_device,
    check_same_device,
    empty,
    empty_strided,
    persistent_program_count,
    sum_partials,
)

MAX_KERNEL_SIZE = 8
ACTIVATIONS = (None, "silu")
# Tiles: channels (contiguous in the usual layout) × time steps.
BLOCK_C = 128
FORWARD_BLOCK_T = 32
BACKWARD_BLOCK_T = 16
if INTERPRET:  # the interpreter's cost is per operation: fewer, taller tiles
    FORWARD_BLOCK_T = BACKWARD_BLOCK_T = 64


@triton.jit
def _document_bounds(cu_ptr, n_docs, n_search_iters, t):
    """(start, end) of the document holding each token t: the last cu[i] <= t and the next boundary."""
    lo = tl.zeros(t.shape, dtype=tl.int32)
    hi = tl.zeros(t.shape, dtype=tl.int32) + n_docs
    for _ in range(n_search_iters):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid).to(tl.int64) <= t
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return tl.load(cu_ptr + lo).to(tl.int64), tl.load(cu_ptr + lo + 1).to(tl.int64)


@triton.jit
def _causal_conv1d_forward_kernel(
    x_ptr, x_b_stride, x_c_stride, x_t_stride,
    w_ptr, bias_ptr, cu_ptr,
    y_ptr, y_b_stride, y_c_stride, y_t_stride,
    n_channels, seq_len, n_c_blocks, n_t_blocks, n_docs, n_search_iters,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_CU: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    c = (pid % n_c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    batch = (pid // n_c_blocks) // n_t_blocks
    t = ((pid // n_c_blocks) % n_t_blocks).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_c = c < n_channels
    mask_t = t < seq_len
    mask = mask_t[:, None] & mask_c[None, :]
    if HAS_CU:
        start, _ = _document_bounds(cu_ptr, n_docs, n_search_iters, tl.minimum(t, seq_len - 1))
    else:
        start = tl.zeros([BLOCK_T], dtype=tl.int64)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=mask_c, other=0.0).to(ACC)
    else:
        bias = tl.zeros([BLOCK_C], dtype=ACC)
    x_base = x_ptr + batch.to(tl.int64) * x_b_stride
    pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=ACC) + bias[None, :]
    for j in tl.static_range(K):
        src = t - (K - 1) + j
        m = mask & (src >= start)[:, None]
        xv = tl.load(x_base + src[:, None] * x_t_stride + c[None, :] * x_c_stride, mask=m, other=0.0).to(ACC)
        wj = tl.load(w_ptr + c * K + j, mask=mask_c, other=0.0).to(ACC)
        pre += xv * wj[None, :]
    if SILU:
        y = pre * tl.sigmoid(pre)
    else:
        y = pre
    y_off = batch.to(tl.int64) * y_b_stride + t[:, None] * y_t_stride + c[None, :] * y_c_stride
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _causal_conv1d_backward_kernel(
    dy_ptr, dy_b_stride, dy_c_stride, dy_t_stride,
    x_ptr, x_b_stride, x_c_stride, x_t_stride,
    w_ptr, bias_ptr, cu_ptr,
    dx_ptr, dx_b_stride, dx_c_stride, dx_t_stride,
    dw_partial_ptr, dbias_partial_ptr,
    n_channels, seq_len, n_c_blocks, n_t_blocks, n_tiles, tiles_per_program, n_docs, n_search_iters,
    K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_CU: tl.constexpr,
    COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DBIAS: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    c = (pid % n_c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = c < n_channels
    taps = tl.arange(0, K_POW2)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=mask_c, other=0.0).to(ACC)
    else:
        bias = tl.zeros([BLOCK_C], dtype=ACC)
    dw_acc = tl.zeros([BLOCK_C, K_POW2], dtype=ACC)
    dbias_acc = tl.zeros([BLOCK_C], dtype=ACC)
    first_tile = (pid // n_c_blocks).to(tl.int64) * tiles_per_program
    for tile in range(first_tile, first_tile + tiles_per_program):
        batch = tile // n_t_blocks
        t = (tile % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        # (tile as a vector: the interpreter's scalar-and-vector `&` is not a boolean mask)
        mask_t = (t < seq_len) & (t * 0 + tile < n_tiles)
        if HAS_CU:
            start, end = _document_bounds(cu_ptr, n_docs, n_search_iters, tl.minimum(t, seq_len - 1))
        else:
            start = tl.zeros([BLOCK_T], dtype=tl.int64)
            end = tl.zeros([BLOCK_T], dtype=tl.int64) + seq_len
        x_base = x_ptr + batch * x_b_stride
        dy_base = dy_ptr + batch * dy_b_stride
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=ACC)
        # s-th pass: dpre at t + s, which reaches dx[t] through the tap K - 1 - s.
        for s in tl.static_range(K):
            tp = t + s
            mask = (mask_t & (tp < end))[:, None] & mask_c[None, :]
            dy = tl.load(dy_base + tp[:, None] * dy_t_stride + c[None, :] * dy_c_stride, mask=mask, other=0.0)
            dpre = dy.to(ACC)
            if SILU:
                pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=ACC) + bias[None, :]
                for j in tl.static_range(K):
                    src = tp - (K - 1) + j
                    m = mask & (src >= start)[:, None]
                    xv = tl.load(x_base + src[:, None] * x_t_stride + c[None, :] * x_c_stride, mask=m, other=0.0)
                    wj = tl.load(w_ptr + c * K + j, mask=mask_c, other=0.0).to(ACC)
                    pre += xv.to(ACC) * wj[None, :]
                sig = tl.sigmoid(pre)
                dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
            if COMPUTE_DX:
                w_tap = tl.load(w_ptr + c * K + (K - 1 - s), mask=mask_c, other=0.0).to(ACC)
                dx += dpre * w_tap[None, :]
            if s == 0:
                if COMPUTE_DBIAS:
                    dbias_acc += tl.sum(dpre, axis=0)
                if COMPUTE_DW:
                    for j in tl.static_range(K):
                        src = t - (K - 1) + j
                        m = mask & (src >= start)[:, None]
                        xv = tl.load(x_base + src[:, None] * x_t_stride + c[None, :] * x_c_stride, mask=m, other=0.0)
                        dw_j = tl.sum(dpre * xv.to(ACC), axis=0)
                        dw_acc += tl.where(taps[None, :] == j, dw_j[:, None], 0.0)
        if COMPUTE_DX:
            dx_off = batch * dx_b_stride + t[:, None] * dx_t_stride + c[None, :] * dx_c_stride
            tl.store(dx_ptr + dx_off, dx.to(dx_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])
    row = pid // n_c_blocks
    if COMPUTE_DW:
        dw_off = row * n_channels * K + c[:, None] * K + taps[None, :]
        tl.store(dw_partial_ptr + dw_off, dw_acc, mask=mask_c[:, None] & (taps < K)[None, :])
    if COMPUTE_DBIAS:
        tl.store(dbias_partial_ptr + row * n_channels + c, dbias_acc, mask=mask_c)


def _empty_in_memory_order_of(x: torch.Tensor) -> torch.Tensor:
    """A dense tensor shaped like x whose dims lie in memory in x's order (a transposed view of `[B, T, C]`
    storage for the projection's layout), also when x itself is not dense (a slice of a wider tensor)."""
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    stride = [0] * x.dim()
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= x.shape[d]
    return empty_strided(x.shape, stride, x.dtype, x.device)


def _search_iters(cu_seqlens) -> tuple[int, int]:
    if cu_seqlens is None:
        return 0, 0
    n_docs = cu_seqlens.numel() - 1
    return n_docs, max(1, n_docs.bit_length())


def _causal_conv1d_forward(x, weight, bias, silu: bool, cu_seqlens):
    batch, n_channels, seq_len = x.shape
    k = weight.shape[1]
    y = _empty_in_memory_order_of(x)
    block_c = min(BLOCK_C, triton.next_power_of_2(n_channels))
    block_t = min(FORWARD_BLOCK_T, triton.next_power_of_2(seq_len))
    n_c_blocks, n_t_blocks = triton.cdiv(n_channels, block_c), triton.cdiv(seq_len, block_t)
    n_docs, n_search_iters = _search_iters(cu_seqlens)
    _causal_conv1d_forward_kernel[(n_c_blocks * n_t_blocks * batch,)](
        x, *x.stride(),
        weight, weight if bias is None else bias, weight if cu_seqlens is None else cu_seqlens,
        y, *y.stride(),
        n_channels, seq_len, n_c_blocks, n_t_blocks, n_docs, n_search_iters,
        K=k, BLOCK_T=block_t, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=silu, HAS_CU=cu_seqlens is not None, ACC=accumulator_dtype(x.dtype),
        num_warps=4,
    )
    return y


def _causal_conv1d_backward(dy, x, weight, bias, silu: bool, cu_seqlens, needs):
    compute_dx, compute_dw, compute_dbias = needs
    batch, n_channels, seq_len = x.shape
    k = weight.shape[1]
    block_c = min(BLOCK_C, triton.next_power_of_2(n_channels))
    block_t = min(BACKWARD_BLOCK_T, triton.next_power_of_2(seq_len))
    n_c_blocks, n_t_blocks = triton.cdiv(n_channels, block_c), triton.cdiv(seq_len, block_t)
    n_tiles = batch * n_t_blocks
    if compute_dw or compute_dbias:
        n_groups = max(1, persistent_program_count(x.device, n_tiles * n_c_blocks, programs_per_sm=4) // n_c_blocks)
        tiles_per_program = triton.cdiv(n_tiles, n_groups)
        n_groups = triton.cdiv(n_tiles, tiles_per_program)
    else:
        n_groups, tiles_per_program = n_tiles, 1
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dx = _empty_in_memory_order_of(x) if compute_dx else None
    dw_partial = empty((n_groups, n_channels * k), acc, x.device) if compute_dw else None
    dbias_partial = empty((n_groups, n_channels), acc, x.device) if compute_dbias else None
    n_docs, n_search_iters = _search_iters(cu_seqlens)
    unused = x  # pointer for outputs a flag compiles away
    _causal_conv1d_backward_kernel[(n_c_blocks * n_groups,)](
        dy, *dy.stride(),
        x, *x.stride(),
        weight, weight if bias is None else bias, weight if cu_seqlens is None else cu_seqlens,
        unused if dx is None else dx, *(x.stride() if dx is None else dx.stride()),
        unused if dw_partial is None else dw_partial, unused if dbias_partial is None else dbias_partial,
        n_channels, seq_len, n_c_blocks, n_t_blocks, n_tiles, tiles_per_program, n_docs, n_search_iters,
        K=k, K_POW2=triton.next_power_of_2(k), BLOCK_T=block_t, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=silu, HAS_CU=cu_seqlens is not None,
        COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, COMPUTE_DBIAS=compute_dbias, ACC=accumulator_dtype(x.dtype),
        num_warps=4,
    )
    dw = sum_partials(dw_partial, weight.dtype).view(n_channels, k) if compute_dw else None
    dbias = sum_partials(dbias_partial, bias.dtype) if compute_dbias else None
    return dx, dw, dbias


class CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, silu, cu_seqlens):
        y = _causal_conv1d_forward(x, weight, bias, silu, cu_seqlens)
        ctx.save_for_backward(x, weight, bias, cu_seqlens)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dw, dbias = _causal_conv1d_backward(
            dy, x, weight, bias, ctx.silu, cu_seqlens, (needs[0], needs[1], bias is not None and needs[2])
        )
        return dx, dw, dbias, None, None


def _check_args(x, weight, bias, activation, cu_seqlens):
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected 3 dims [batch, channels, time]")
    n_channels = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != n_channels or not 1 <= weight.shape[1] <= MAX_KERNEL_SIZE:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}; expected ({n_channels}, K), channels of x and "
            f"1 <= K <= {MAX_KERNEL_SIZE}"
        )
    tensors = [("x", x), ("weight", weight)]
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (n_channels,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n_channels},), the channels of x")
        tensors.append(("bias", bias))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation is {activation!r}; expected 'silu' or None")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be an int32 or int64 tensor of document boundaries")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens has shape {tuple(cu_seqlens.shape)}; expected (documents + 1,)")
        if x.shape[0] != 1:
            raise ValueError(f"x has batch size {x.shape[0]}; with cu_seqlens (packed documents) it must be 1")
        tensors.append(("cu_seqlens", cu_seqlens))
    check_same_device(tensors)
    check_kernel_device("x", x)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution of x `[B, C, T]` (any strides) with weight `[C, K]`, K <= 8, then SiLU (or
    no activation), as transformers' `causal_conv1d_fn`. `cu_seqlens` `[N + 1]` (B = 1; the last entry is T)
    restarts the convolution from zeros at each document. The result keeps x's memory order."""
    _check_args(x, weight, bias, activation, cu_seqlens)
    if x.numel() == 0:
        return _empty_in_memory_order_of(x)
    return CausalConv1dFunction.apply(
        x,
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        activation == "silu",
        None if cu_seqlens is None else cu_seqlens.contiguous(),
    )


def causal_conv1d_reference(x, weight, bias=None, activation="silu", cu_seqlens=None):
    """Plain PyTorch as Hugging Face's `causal_conv1d_fn` (in fp32, or float64 for float64 x), each document of
    `cu_seqlens` run on its own; for tests and CPU runs outside the interpreter."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        pieces = [
            causal_conv1d_reference(x[..., lo:hi], weight, bias, activation)
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(pieces, dim=-1)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n_channels, seq_len = x.shape[1], x.shape[2]
    out = torch.nn.functional.conv1d(
        x.to(acc),
        weight.to(acc).unsqueeze(1),
        None if bias is None else bias.to(acc),
        padding=weight.shape[-1] - 1,
        groups=n_channels,
    )[..., :seq_len]
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    return out.to(x.dtype)
