"""`fused_linear_cross_entropy` of a frozen NF4 weight: the LM head's cross-entropy without the `[N, V]` logits
and without the dense weight. Forward, backward, reductions and softcap are those of
`fused_linear_cross_entropy.py`, whose kernels and checks this path reuses.

The weight: a frozen bitsandbytes `Params4bit` `[V, H]`, H a multiple of its blocksize; Qwen3.5-27B's 248,320 x
5,120 lm_head is 2.5 GB in bf16, 0.7 GB in NF4. The dense weight is never formed whole: within each chunk of
C rows the vocabulary is walked in blocks of R rows (R = 4096 on the GPU), each block dequantised into one
reused `[R, H]` buffer, and the softmax is taken online across blocks, as flash attention does over keys.
With m, s the running max and sum-exp of row n and e_v = exp(z_v - m) · ∂z_v/∂l_v, per block b:

    m' = max(m, max_{v∈b} z_v)        s' = s · e^{m - m'} + Σ_{v∈b} e^{z_v - m'}
    A' = A · e^{m - m'} + e_b W_b                     A: an fp32 [C, H] accumulator, e_b W_b by cuBLAS
    after the last block:   logsumexp = m + log s,   A / s = Σ_v p_v ∂z_v/∂l_v W_v
    dh_n = s_n (A_n / s_n - ∂z_y/∂l_y · W_y)           W_y: the label rows, gathered and dequantised

One Triton kernel per block (one program per row) folds the block into m and s, picks the target logit and
overwrites the block's logits in place with e. Each chunk dequantises the weight once and costs 4CHV FLOPs
(logits and dh), as the dense frozen path. Since a frozen weight has no dW, every reduction computes dh in
the forward: "mean"/"sum" scale it in the backward as above; "none" keeps the unscaled per-row gradient
(`[N, H]` in the input dtype) and multiplies its rows by grad_output. A bias may be given but not trained.
Memory beyond the inputs and dh: the `[R, H]` weight block, and per chunk row an fp32 H-vector, an H-vector
and R logits in the input dtype, C bounded so that these fit `NF4_CHUNK_BYTES` (C = 2048 tokens at
Qwen3.5-27B's shape: about 140 MiB); the gathered label rows `[C, H]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_row_range, dequantize_nf4_rows
from unsloth_lite.kernels.fused_linear_cross_entropy import (
    CPU_BLOCK_V,
    GPU_BLOCK_V,
    NUM_WARPS,
    _check_labels,
    _common_arguments,
    _reduce,
    _scaled_saved_gradients,
    _softcapped,
    _tanh,
)
from unsloth_lite.kernels.utils import check_float, empty

# NF4 weights: vocabulary rows dequantised at a time into the one reused weight block (40 MiB at H = 5,120 in
# bf16: large enough that cuBLAS runs near peak on it, small next to the 2.5 GB dense weight), and the budget of
# the per-row buffers that bounds the chunk (see the module docstring). The interpreter's blocks are small so
# that tests cross several vocabulary blocks.
NF4_VOCAB_BLOCK = 4096
CPU_NF4_VOCAB_BLOCK = 64
NF4_CHUNK_BYTES = 256 * 2**20


@triton.jit
def _online_softmax_block_kernel(
    logits_ptr, logits_row_stride, labels_ptr,
    max_ptr, sum_ptr, target_ptr, rescale_ptr,
    first_col, n_block_cols, softcap,
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_WEIGHTS: tl.constexpr, ACC: tl.constexpr,
):
    """Program (row) of the NF4 path: folds the row's logits of one vocabulary block (vocabulary columns
    [first_col, first_col + n_block_cols)) into its running max and sum-exp, stores exp(m_old - m_new) (the
    factor of the caller's dh accumulator), picks the target logit when the label is in the block and, with
    WRITE_WEIGHTS, overwrites the logits in place with exp(z - m_new) · ∂z/∂l."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_row_stride
    m_old = tl.load(max_ptr + row)
    m = m_old
    s = tl.load(sum_ptr + row)
    for start in range(0, n_block_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_block_cols
        x = _softcapped(tl.load(base + cols, mask=mask, other=0.0).to(ACC), softcap, SOFTCAP)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    tl.store(rescale_ptr + row, tl.exp(m_old - m))
    label = tl.load(labels_ptr + row) - first_col
    if (label >= 0) & (label < n_block_cols):
        tl.store(target_ptr + row, _softcapped(tl.load(base + label).to(ACC), softcap, SOFTCAP))
    if WRITE_WEIGHTS:
        for start in range(0, n_block_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_block_cols
            logit = tl.load(base + cols, mask=mask, other=0.0).to(ACC)
            if SOFTCAP:
                t = _tanh(logit / softcap)
                e = tl.exp(softcap * t - m) * (1.0 - t * t)
            else:
                e = tl.exp(logit - m)
            tl.store(base + cols, e.to(logits_ptr.dtype.element_ty), mask=mask)


def nf4_chunk_rows(n_rows: int, n_hidden: int, vocab_block: int, element_size: int, need_dh: bool) -> int:
    """Rows per chunk of the NF4 path: the most whose buffers (logits of a vocabulary block; with dh, the fp32
    accumulator and the block product too) fit `NF4_CHUNK_BYTES`, in multiples of 256 as `chunk_rows`."""
    per_row = vocab_block * element_size + (n_hidden * (4 + element_size) if need_dh else 0)
    rows = max(1, NF4_CHUNK_BYTES // max(1, per_row))
    rows = rows // 256 * 256 if rows >= 256 else 1 << (rows.bit_length() - 1)
    return max(1, min(rows, n_rows))


def _nf4_cross_entropy(hidden, weight, labels, bias, ignore_index: int, softcap: float | None, *,
                       row_scale=None, need_dh=False):
    """Row losses `[N]` (fp32) and, with `need_dh`, dh `[N, H]` of an NF4 weight (the module docstring's
    online softmax over vocabulary blocks). dh_n is scaled by `row_scale` (a device scalar, 1 / n_valid for
    "mean") and is 0 at ignored rows."""
    n_rows, n_hidden = hidden.shape
    n_cols = int(weight.quant_state.shape[0])
    device, dtype = hidden.device, hidden.dtype
    on_gpu = device.type == "cuda"
    vocab_block = min(n_cols, NF4_VOCAB_BLOCK if on_gpu else CPU_NF4_VOCAB_BLOCK)
    rows = nf4_chunk_rows(n_rows, n_hidden, vocab_block, hidden.element_size(), need_dh)
    block_v = min(GPU_BLOCK_V if on_gpu else CPU_BLOCK_V, max(16, triton.next_power_of_2(vocab_block)))
    f32 = torch.float32

    weight_block = empty((vocab_block, n_hidden), dtype, device)
    logits_buffer = empty((rows * vocab_block,), dtype, device)  # viewed [chunk, block columns], contiguous
    row_max, row_sum = empty((rows,), f32, device), empty((rows,), f32, device)
    target, rescale = empty((rows,), f32, device), empty((rows,), f32, device)
    loss = empty((n_rows,), f32, device)
    dh = accumulator = product = None
    if need_dh:
        dh = empty((n_rows, n_hidden), dtype, device)
        if dtype != f32:  # fp32 accumulates straight into dh
            accumulator = empty((rows, n_hidden), f32, device)
            product = empty((rows, n_hidden), dtype, device)

    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        chunk = end - start
        h, chunk_labels = hidden[start:end], labels[start:end]
        m, s, z_target, factor = row_max[:chunk], row_sum[:chunk], target[:chunk], rescale[:chunk]
        m.fill_(float("-inf"))
        s.zero_()
        z_target.zero_()  # ignored rows keep 0: finite, so the products below stay finite before masking
        if need_dh:
            acc = dh[start:end] if accumulator is None else accumulator[:chunk]
            acc.zero_()
        for first in range(0, n_cols, vocab_block):
            count = min(vocab_block, n_cols - first)
            w = dequantize_nf4_row_range(weight, first, weight_block[:count])
            logits = logits_buffer[: chunk * count].view(chunk, count)
            if bias is None:
                torch.matmul(h, w.t(), out=logits)
            else:
                torch.addmm(bias[first:first + count], h, w.t(), out=logits)
            _online_softmax_block_kernel[(chunk,)](
                logits, logits.stride(0), chunk_labels, m, s, z_target, factor,
                first, count, 1.0 if softcap is None else softcap,
                BLOCK_V=block_v, SOFTCAP=softcap is not None, WRITE_WEIGHTS=need_dh, ACC=tl.float32,
                num_warps=NUM_WARPS,
            )
            if need_dh:
                if accumulator is None:
                    acc.mul_(factor[:, None]).addmm_(logits, w)
                else:  # cuBLAS gives the bf16/fp16 product; the running sum stays fp32
                    torch.matmul(logits, w, out=product[:chunk])
                    torch.addcmul(product[:chunk], acc, factor[:, None], out=acc)
        valid = chunk_labels != ignore_index
        loss[start:end] = (m + torch.log(s) - z_target).masked_fill_(~valid, 0.0)
        if need_dh:
            # dh_n = scale_n (A_n / s_n - ∂z_y/∂l_y W_y); W_y of ignored rows (row 0) is multiplied by scale 0.
            label_rows = dequantize_nf4_rows(weight, torch.where(valid, chunk_labels, 0))
            d_target = 1.0 - (z_target / softcap) ** 2 if softcap is not None else torch.ones_like(z_target)
            scale = valid.to(f32) if row_scale is None else valid.to(f32) * row_scale
            acc.div_(s[:, None]).addcmul_(label_rows, d_target[:, None], value=-1.0).mul_(scale[:, None])
            if accumulator is not None:
                dh[start:end].copy_(acc)
    return loss, dh


class FusedLinearCrossEntropyNF4Function(torch.autograd.Function):
    """A frozen NF4 weight: dh is formed in the forward for every reduction (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, ignore_index, reduction, softcap):
        divisor = None
        if reduction == "mean":
            divisor = (labels != ignore_index).sum().clamp(min=1).to(torch.float32)
        row_loss, dh = _nf4_cross_entropy(
            hidden, weight, labels, bias, ignore_index, softcap,
            row_scale=None if divisor is None else 1.0 / divisor, need_dh=ctx.needs_input_grad[0],
        )
        ctx.reduction, ctx.first_grad_output = reduction, None
        ctx.save_for_backward(dh)
        if reduction == "none":
            return row_loss
        loss = row_loss.sum()
        return loss / divisor if divisor is not None else loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            (dh,) = ctx.saved_tensors
            dh = None if dh is None else (dh * grad_output[:, None]).to(dh.dtype)
        else:
            (dh,) = _scaled_saved_gradients(ctx, grad_output)
        return dh, None, None, None, None, None, None


def fused_linear_cross_entropy_nf4(hidden, weight, labels, ignore_index, reduction, bias, softcap):
    """`fused_linear_cross_entropy` with an NF4 `weight`: its checks, then the online softmax over vocabulary
    blocks."""
    check_float("hidden", hidden)
    qs = weight.quant_state
    if qs.quant_type != "nf4":
        raise ValueError(f"weight is a 4-bit {qs.quant_type!r} weight; only 'nf4' is supported")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    if len(qs.shape) != 2:
        raise ValueError(f"weight must be 2-D [V, H], got quant_state.shape {tuple(qs.shape)}")
    n_rows, n_hidden = hidden.shape
    n_cols = int(qs.shape[0])
    if int(qs.shape[1]) != n_hidden:
        raise ValueError(
            f"weight has shape {tuple(qs.shape)} but hidden has H={n_hidden}; weight must be [V, {n_hidden}]"
        )
    if n_cols == 0:
        raise ValueError("weight has no rows: the vocabulary V must be at least 1")
    if n_hidden % qs.blocksize:
        raise ValueError(f"an NF4 weight needs H ({n_hidden}) to be a multiple of its blocksize ({qs.blocksize})")
    if qs.dtype != hidden.dtype:
        raise ValueError(
            f"hidden has dtype {hidden.dtype} but the NF4 weight dequantises to {qs.dtype}; they must match"
        )
    if weight.requires_grad:
        raise ValueError("an NF4 weight must be frozen (requires_grad=False)")
    _check_labels(labels, n_rows)
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (n_cols,) or bias.dtype != hidden.dtype:
            raise ValueError(f"bias must be [{n_cols}] of hidden's dtype, got {tuple(bias.shape)} {bias.dtype}")
        if bias.requires_grad and torch.is_grad_enabled():
            raise ValueError("a bias with an NF4 weight must be frozen (its gradient is not computed)")
    labels, ignore_index, softcap = _common_arguments(hidden, weight, labels, bias, ignore_index, reduction, softcap)
    if not (torch.is_grad_enabled() and hidden.requires_grad):
        row_loss, _ = _nf4_cross_entropy(hidden, weight, labels, bias, ignore_index, softcap)
        return _reduce(row_loss, labels, ignore_index, reduction)[0]
    return FusedLinearCrossEntropyNF4Function.apply(hidden, weight, labels, bias, ignore_index, reduction, softcap)
