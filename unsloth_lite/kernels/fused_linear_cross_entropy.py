"""Cross-entropy of a linear layer's output (the LM head), without ever holding the `[N, V]` logits.

Forward, for each row n with hidden state h_n, label y_n and c the optional softcap (math in fp32):

    l_n = h_n · Wᵀ (+ b)                    logits, `[V]`
    z_n = c · tanh(l_n / c)                  only with a softcap; otherwise z_n = l_n
    loss_n = logsumexp(z_n) - z_n[y_n]       0 where y_n == ignore_index

    reduction "sum": Σ_n loss_n     "mean": Σ_n loss_n / max(n_valid, 1)     "none": the vector loss_n

n_valid counts the labels other than ignore_index. A batch whose labels are all ignored therefore has loss 0
under "mean" (not NaN, as `F.cross_entropy` gives) and zero gradients.

Backward. With p_n = softmax(z_n) and s_n the upstream gradient of row n (grad_output / max(n_valid, 1) for
"mean", grad_output for "sum", grad_output[n] for "none", 0 for ignored rows):

    ∂loss_n/∂z_n = p_n - onehot(y_n)
    z = c · tanh(l / c)  ⇒  ∂z/∂l = 1 - tanh²(l / c)
    g_n = s_n · (p_n - onehot(y_n)) · ∂z/∂l          the gradient of the logits, `[V]`
    dh_n = g_n · W        dW = Σ_n g_nᵀ h_n        db = Σ_n g_n

Rows are processed in chunks of C rows, C chosen so that the chunk's logits (C x V in the input dtype) fit
in `CHUNK_BYTES`; one buffer of that size is allocated per call and reused by every chunk. Per chunk, the
logits come from cuBLAS (`matmul`/`addmm` into the buffer), then two Triton kernels whose programs each take
one segment of one row (a few hundred rows alone would leave the GPU mostly idle): the first makes an
online max / sum-exp over its segment and picks the target logit where the label falls; the second combines
a row's partials into logsumexp, stores the row loss, and overwrites its segment of logits in place with
g_n. dh (straight into the returned gradient), dW and db are then accumulated from the buffer by cuBLAS.
The gradient's dtype is the input dtype (fp32 for fp32 inputs); every reduction of the kernels is in fp32
(fp64 for fp64 inputs, so that `gradcheck` can run, whose loss is fp64). The loss is returned in fp32.

Cost. With "mean"/"sum" (training) the scalar upstream gradient only scales the result, so g_n is computed
in the forward and the backward just multiplies the saved dh, dW, db by grad_output in place: 2NHV FLOPs for
the logits plus 2NHV for dh, 4NHV in all with a frozen weight (+2NHV for dW when the weight is trained).
Recomputing the logits in the backward, as "none" must (its upstream gradient is a vector, unknown in the
forward), costs 6NHV (8NHV trained). The Triton kernels read each logit twice and write it once, a few
percent of the matmul time at LLM sizes.

Memory beyond the inputs and the returned gradients: the logits buffer (at most `CHUNK_BYTES`, 248 MiB, with a
frozen weight; `CHUNK_BYTES_TRAINED_WEIGHT` when dW is computed, whose passes it amortises), the
fp32 row losses (4N bytes, 8N with "none" which keeps logsumexp per row) and a V-sized fp32 column sum per
chunk when the bias is trained. "mean"/"sum" save only the gradients for the backward, not hidden or
weight; "none" saves hidden, weight, labels, bias (references, no copies) and logsumexp.

No host synchronisation: n_valid is a device tensor read by the kernel through a pointer, the loss is
formed by device ops, the upstream gradient is applied unconditionally, and every shape and loop bound
depends only on input shapes. Forward and backward can therefore be captured in a CUDA graph.

Backward twice through one graph (`retain_graph=True`): "mean"/"sum" scale the saved gradients in place by
the first upstream gradient g₁; a later backward returns them rescaled by g / g₁ (exact, but NaN if g₁ was
exactly 0). "none" recomputes and has no such caveat.

Labels outside [0, V) other than ignore_index give undefined results (they are not checked on the device).

An NF4 weight (a frozen bitsandbytes `Params4bit`) takes the path of `fused_linear_cross_entropy_nf4.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference
from unsloth_lite.kernels.utils import (
    accumulator_dtype,
    check_float,
    check_integer,
    check_kernel_device,
    check_same_device,
    empty,
)

# Bytes of the one chunk-logits buffer a call allocates (C x V in the input dtype). With a frozen weight the
# bound keeps the extra memory under 256 MiB (768 rows at Qwen3's 152k vocabulary, 512 at Qwen3.5's 248k).
# A trained weight's dW update reads and writes all of dW once per chunk, so it gets larger chunks (fewer
# dW passes).
CHUNK_BYTES = 248 * 2**20
CHUNK_BYTES_TRAINED_WEIGHT = 2048 * 2**20

# Each row of logits is split into segments of BLOCKS_PER_SEGMENT blocks of BLOCK_V, one program each, so
# that a chunk of a few hundred rows still puts thousands of programs in flight. Compiled sizes were measured
# on an H200; the interpreter's are small so that tests cross several blocks and segments.
GPU_BLOCK_V = 4096
CPU_BLOCK_V = 128
BLOCKS_PER_SEGMENT = 4
CPU_BLOCKS_PER_SEGMENT = 2
NUM_WARPS = 4

REDUCTIONS = ("mean", "sum", "none")

# How the kernel scales the gradient of a row (the SCALE constexpr).
_SCALE_ONE = 0  # "sum": grad_output is applied in the backward
_SCALE_DIVIDE = 1  # "mean": 1 / max(n_valid, 1), the divisor read from a device scalar
_SCALE_PER_ROW = 2  # "none" backward: grad_output[row]


@triton.jit
def _tanh(y):
    """tanh from `tl.exp` (libdevice is not available in the interpreter). Below |y| = 2⁻⁵, where
    (1 - e^{-2|y|}) / (1 + e^{-2|y|}) loses relative precision to cancellation, a series exact to fp64
    rounding there (so the switch is seamless even for gradcheck's finite differences)."""
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    y2 = y * y
    near = a * (1.0 + y2 * (-0.3333333333333333 + y2 * (0.13333333333333333 + y2 * -0.05396825396825397)))
    t = tl.where(a < 0.03125, near, far)
    return tl.where(y < 0, -t, t)


@triton.jit
def _softcapped(x, softcap, SOFTCAP: tl.constexpr):
    if SOFTCAP:
        return softcap * _tanh(x / softcap)
    return x


@triton.jit
def _logsumexp_partials_kernel(
    logits_ptr, logits_row_stride, labels_ptr,
    max_ptr, sum_ptr, target_ptr,
    n_cols, segment_len,
    softcap, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):
    """Program (row, segment): online max and sum-exp of the row's logits in [segment·len, (segment+1)·len),
    and, in the segment holding the label, the target's (softcapped) logit."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    n_segments = tl.num_programs(1)
    base = logits_ptr + row * logits_row_stride
    first = segment * segment_len
    last = tl.minimum(first + segment_len, n_cols)
    cols = first + tl.arange(0, BLOCK_V)
    mask = cols < last
    x = _softcapped(tl.load(base + cols, mask=mask, other=0.0).to(ACC), softcap, SOFTCAP)
    x = tl.where(mask, x, float("-inf"))
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    for start in range(first + BLOCK_V, last, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < last
        x = _softcapped(tl.load(base + cols, mask=mask, other=0.0).to(ACC), softcap, SOFTCAP)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(max_ptr + row * n_segments + segment, m)
    tl.store(sum_ptr + row * n_segments + segment, s)
    label = tl.load(labels_ptr + row)
    if (label >= first) & (label < last):
        z_target = _softcapped(tl.load(base + label).to(ACC), softcap, SOFTCAP)
        tl.store(target_ptr + row, z_target)


@triton.jit
def _cross_entropy_finish_kernel(
    logits_ptr, logits_row_stride, labels_ptr,
    max_ptr, sum_ptr, target_ptr, n_partials,
    loss_ptr, lse_ptr, scale_ptr, scale_stride,
    n_cols, segment_len, ignore_index, softcap,
    BLOCK_V: tl.constexpr, BLOCK_PARTIALS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_LSE: tl.constexpr,
    WRITE_LOSS: tl.constexpr, WRITE_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr, SCALE: tl.constexpr,
    ACC: tl.constexpr,
):
    """Program (row, segment): logsumexp from the row's partials (or the saved one, HAS_LSE); segment 0
    stores the row loss and logsumexp; with WRITE_GRAD every program overwrites its segment of logits in
    place with the gradient of the pre-softcap logits."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    if HAS_LSE:
        lse = tl.load(lse_ptr + row).to(ACC)
    else:
        parts = tl.arange(0, BLOCK_PARTIALS)
        mask_parts = parts < n_partials
        m_parts = tl.load(max_ptr + row * n_partials + parts, mask=mask_parts, other=float("-inf"))
        s_parts = tl.load(sum_ptr + row * n_partials + parts, mask=mask_parts, other=0.0)
        m = tl.max(m_parts, axis=0)
        lse = m + tl.log(tl.sum(s_parts * tl.exp(m_parts - m), axis=0))
        if segment == 0:
            if WRITE_LSE:
                tl.store(lse_ptr + row, lse.to(lse_ptr.dtype.element_ty))
            if WRITE_LOSS:
                # Ignored rows have no target logit (nothing wrote it): the select drops whatever is there.
                row_loss = tl.where(valid, lse - tl.load(target_ptr + row), 0.0)
                tl.store(loss_ptr + row, row_loss.to(loss_ptr.dtype.element_ty))
    if WRITE_GRAD:
        if SCALE == 1:
            scale = 1.0 / tl.load(scale_ptr).to(ACC)
        elif SCALE == 2:
            scale = tl.load(scale_ptr + row * scale_stride).to(ACC)
        else:
            scale = 1.0
        scale = tl.where(valid, scale, 0.0)
        base = logits_ptr + row * logits_row_stride
        first = segment * segment_len
        last = tl.minimum(first + segment_len, n_cols)
        for start in range(first, last, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < last
            logit = tl.load(base + cols, mask=mask, other=0.0).to(ACC)
            if SOFTCAP:
                t = _tanh(logit / softcap)
                g = tl.exp(softcap * t - lse)
                g = tl.where(cols == label, g - 1.0, g) * (1.0 - t * t)
            else:
                g = tl.exp(logit - lse)
                g = tl.where(cols == label, g - 1.0, g)
            tl.store(base + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launchers


def _launch_config(n_cols: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_V, segment length, segments per row, warps) of the row kernels."""
    on_gpu = device.type == "cuda"
    block = min(GPU_BLOCK_V if on_gpu else CPU_BLOCK_V, max(16, triton.next_power_of_2(n_cols)))
    segment_len = block * (BLOCKS_PER_SEGMENT if on_gpu else CPU_BLOCKS_PER_SEGMENT)
    return block, segment_len, triton.cdiv(n_cols, segment_len), NUM_WARPS


def chunk_rows(n_rows: int, n_cols: int, element_size: int, trained_weight: bool = False) -> int:
    """Rows per chunk: the most whose logits fit the chunk budget, in multiples of 256 so that cuBLAS tiles
    them evenly (on an H200 at V = 151,936: 768 rows 1.5% faster than 512, 640 rows 4% slower), or a power of
    two below that; at least 1 and at most n_rows."""
    budget = CHUNK_BYTES_TRAINED_WEIGHT if trained_weight else CHUNK_BYTES
    rows = max(1, budget // max(1, n_cols * element_size))
    rows = rows // 256 * 256 if rows >= 256 else 1 << (rows.bit_length() - 1)
    return max(1, min(rows, n_rows))


def _chunked_cross_entropy(
    hidden, weight, labels, bias, ignore_index: int, softcap: float | None, *,
    loss=None, lse=None, has_lse=False, scale=None, scale_mode=_SCALE_ONE,
    need_dh=False, need_dw=False, need_db=False,
):
    """Runs every chunk: logits into the one buffer, the row kernels, then the dh / dW / db products.

    `loss` (and `lse`, unless `has_lse`) are `[N]` outputs the kernel writes; with `has_lse`, `lse` is read.
    `scale` is the device tensor the kernel reads for `scale_mode` (ignored for `_SCALE_ONE`).
    Returns (dh, dW, db), None where not asked for; gradient passes run only if one of them is.
    """
    n_rows, n_hidden = hidden.shape
    n_cols = weight.shape[0]
    device = hidden.device
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    write_grad = need_dh or need_dw or need_db
    rows = chunk_rows(n_rows, n_cols, hidden.element_size(), trained_weight=need_dw)
    block, segment_len, n_segments, num_warps = _launch_config(n_cols, device)

    buffer = empty((rows, n_cols), hidden.dtype, device)
    if not has_lse:  # per (row, segment) max and sum-exp, and each row's target logit
        row_max = empty((rows, n_segments), acc, device)
        row_sum = empty((rows, n_segments), acc, device)
        target = empty((rows,), acc, device)
    dh = empty((n_rows, n_hidden), hidden.dtype, device) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=weight.dtype, device=device) if need_dw else None
    db = torch.zeros((n_cols,), dtype=acc, device=device) if need_db else None
    dummy = labels  # pointer arguments that a constexpr flag compiles away
    weight_t = weight.t()

    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        h = hidden[start:end]
        logits = buffer[: end - start]
        if bias is None:
            torch.matmul(h, weight_t, out=logits)
        else:
            torch.addmm(bias, h, weight_t, out=logits)
        chunk = end - start
        flags = dict(SOFTCAP=softcap is not None, ACC=accumulator_dtype(hidden.dtype), num_warps=num_warps)
        softcap_value = 1.0 if softcap is None else softcap
        if not has_lse:
            _logsumexp_partials_kernel[(chunk, n_segments)](
                logits, logits.stride(0), labels[start:end], row_max, row_sum, target,
                n_cols, segment_len, softcap_value, BLOCK_V=block, **flags,
            )
        scale_chunk = scale[start:end] if scale_mode == _SCALE_PER_ROW else scale
        _cross_entropy_finish_kernel[(chunk, n_segments if write_grad else 1)](
            logits, logits.stride(0), labels[start:end],
            dummy if has_lse else row_max, dummy if has_lse else row_sum, dummy if has_lse else target, n_segments,
            loss[start:end] if loss is not None else dummy,
            lse[start:end] if lse is not None else dummy,
            scale_chunk if scale_chunk is not None else dummy,
            scale_chunk.stride(0) if scale_mode == _SCALE_PER_ROW else 0,
            n_cols, segment_len, ignore_index, softcap_value,
            BLOCK_V=block, BLOCK_PARTIALS=triton.next_power_of_2(n_segments), HAS_LSE=has_lse,
            WRITE_LOSS=loss is not None, WRITE_LSE=lse is not None and not has_lse, WRITE_GRAD=write_grad,
            SCALE=scale_mode, **flags,
        )
        if need_dh:
            torch.matmul(logits, weight, out=dh[start:end])
        if need_dw:
            dw.addmm_(logits.t(), h)
        if need_db:
            db.add_(logits.sum(0, dtype=acc))
    if db is not None:
        db = db.to(bias.dtype)
    return dh, dw, db


def _row_losses(hidden, weight, labels, bias, ignore_index, softcap, lse=None):
    loss = empty((hidden.shape[0],), _loss_dtype(hidden.dtype), hidden.device)
    _chunked_cross_entropy(hidden, weight, labels, bias, ignore_index, softcap, loss=loss, lse=lse)
    return loss


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce(row_loss, labels, ignore_index: int, reduction: str):
    """The loss from the row losses, and the "mean" divisor max(n_valid, 1) as a device tensor."""
    if reduction == "none":
        return row_loss, None
    if reduction == "sum":
        return row_loss.sum(), None
    divisor = (labels != ignore_index).sum().clamp(min=1).to(row_loss.dtype)
    return row_loss.sum() / divisor, divisor


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, ignore_index, reduction, softcap):
        need_dh, need_dw, _, need_db = ctx.needs_input_grad[:4]
        ctx.reduction, ctx.ignore_index, ctx.softcap = reduction, ignore_index, softcap
        loss_dtype = _loss_dtype(hidden.dtype)
        row_loss = empty((hidden.shape[0],), loss_dtype, hidden.device)
        if reduction == "none":
            lse = empty((hidden.shape[0],), loss_dtype, hidden.device)
            _chunked_cross_entropy(hidden, weight, labels, bias, ignore_index, softcap, loss=row_loss, lse=lse)
            ctx.save_for_backward(hidden, weight, labels, bias, lse)
            return row_loss
        if reduction == "mean":
            divisor = (labels != ignore_index).sum().clamp(min=1).to(loss_dtype)
            scale_mode = _SCALE_DIVIDE
        else:
            divisor, scale_mode = None, _SCALE_ONE
        dh, dw, db = _chunked_cross_entropy(
            hidden, weight, labels, bias, ignore_index, softcap, loss=row_loss, scale=divisor,
            scale_mode=scale_mode, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
        )
        ctx.save_for_backward(dh, dw, db)
        ctx.first_grad_output = None
        loss = row_loss.sum()
        return loss / divisor if divisor is not None else loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            hidden, weight, labels, bias, lse = ctx.saved_tensors
            need_dh, need_dw, _, need_db = ctx.needs_input_grad[:4]
            dh, dw, db = _chunked_cross_entropy(
                hidden, weight, labels, bias, ctx.ignore_index, ctx.softcap, lse=lse, has_lse=True,
                scale=grad_output, scale_mode=_SCALE_PER_ROW, need_dh=need_dh, need_dw=need_dw, need_db=need_db,
            )
            return dh, dw, None, db, None, None, None
        dh, dw, db = _scaled_saved_gradients(ctx, grad_output)
        return dh, dw, None, db, None, None, None


def _scaled_saved_gradients(ctx, grad_output):
    """The gradients saved by a "mean"/"sum" forward, times the scalar upstream gradient."""
    grads = ctx.saved_tensors
    if ctx.first_grad_output is None:
        # Scale in place: no second copy of dh / dW. `.data` keeps the saved tensors' version counters, so
        # a later backward through a retained graph can still unpack (and rescale) them.
        ctx.first_grad_output = grad_output.clone()  # a device copy: the caller may reuse its tensor
        for g in grads:
            if g is not None:
                g.data.mul_(grad_output)
        return grads
    factor = grad_output / ctx.first_grad_output
    return tuple(None if g is None else g * factor for g in grads)


def _check_labels(labels, n_rows: int) -> None:
    check_integer("labels", labels)
    if labels.shape != (n_rows,):
        raise ValueError(f"labels has shape {tuple(labels.shape)}; expected ({n_rows},), one label per row of hidden")


def _common_arguments(hidden, weight, labels, bias, ignore_index, reduction: str, softcap):
    """Checks shared by the dense and NF4 paths; returns labels as contiguous int64, ignore_index as an int and
    softcap as a float (or None)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if softcap is not None:
        softcap = float(softcap)
        if not softcap > 0:
            raise ValueError(f"softcap must be positive (or None), got {softcap}")
    tensors = [("hidden", hidden), ("weight", weight), ("labels", labels)]
    check_same_device(tensors + ([("bias", bias)] if bias is not None else []))
    check_kernel_device("hidden", hidden)
    return labels.to(torch.int64).contiguous(), int(ignore_index), softcap


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T (+ bias)` (softcapped as `softcap * tanh(logits / softcap)` when
    given) against `labels`, without materialising the `[N, V]` logits.

    hidden `[N, H]`, weight `[V, H]` of one float dtype (fp32, bf16, fp16; fp64 for gradcheck), bias `[V]`
    of that dtype, labels `[N]` integer. reduction "mean" (over labels other than ignore_index), "sum", or
    "none" (per-row losses, 0 at ignored rows). The loss is fp32 (fp64 for fp64 inputs). When every label is
    ignored, "mean" returns 0 with zero gradients (not NaN). Gradients reach hidden, weight and bias where
    they require grad; a frozen weight costs no dW work. No host synchronisation (CUDA-graph capturable).

    weight may also be a bitsandbytes NF4 `Params4bit` (frozen; its `quant_state.dtype` that of hidden, H a
    multiple of its blocksize): it is dequantised a block of vocabulary rows at a time, never whole, and a
    bias must then be frozen.
    """
    if is_nf4(weight):
        # Imported here: the NF4 path builds on this module's kernels and checks.
        from unsloth_lite.kernels.fused_linear_cross_entropy_nf4 import fused_linear_cross_entropy_nf4

        return fused_linear_cross_entropy_nf4(hidden, weight, labels, ignore_index, reduction, bias, softcap)
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    n_rows, n_hidden = hidden.shape
    n_cols = weight.shape[0]
    if weight.shape[1] != n_hidden:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but hidden has H={n_hidden}; weight must be [V, {n_hidden}]"
        )
    if n_cols == 0:
        raise ValueError("weight has no rows: the vocabulary V must be at least 1")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden has dtype {hidden.dtype} but weight has dtype {weight.dtype}; they must match")
    _check_labels(labels, n_rows)
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (n_cols,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n_cols},), one entry per row of weight")
        if bias.dtype != hidden.dtype:
            raise ValueError(f"bias has dtype {bias.dtype} but hidden has dtype {hidden.dtype}; they must match")
    labels, ignore_index, softcap = _common_arguments(hidden, weight, labels, bias, ignore_index, reduction, softcap)

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs_grad:
        row_loss = _row_losses(hidden, weight, labels, bias, ignore_index, softcap)
        return _reduce(row_loss, labels, ignore_index, reduction)[0]
    return FusedLinearCrossEntropyFunction.apply(hidden, weight, labels, bias, ignore_index, reduction, softcap)


def is_nf4(weight) -> bool:
    """Whether `weight` is a bitsandbytes 4-bit `Params4bit` (it carries its `quant_state`)."""
    return getattr(weight, "quant_state", None) is not None


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch with the `[N, V]` logits materialised in fp32 (or the inputs' float64). An NF4 weight is
    dequantised whole (`dequantize_nf4_reference`)."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    if is_nf4(weight):
        weight = dequantize_nf4_reference(weight.data, weight.quant_state)
    logits = hidden.to(acc) @ weight.to(acc).t()
    if bias is not None:
        logits = logits + bias.to(acc)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    labels = labels.long()
    if reduction != "mean":
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    # F.cross_entropy's mean is NaN when every label is ignored; this op returns 0 there.
    total = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return total / (labels != ignore_index).sum().clamp(min=1).to(acc)
