"""Qwen3's per-head q/k RMSNorm followed by rotary embedding, in one pass each way.

Per head vector x of length D, with w' = offset + w (w is q_weight for q heads, k_weight for k heads) and the
rotation R(c, s) of `rope.py` (chunks lo, hi, rest; rest passes through when R < D):

    r = 1 / sqrt(mean(x²) + eps)      n = x · r · w'      y = R(n)

Backward. R is linear, so the gradient reaching n is its transpose applied to dy, g = Rᵀ(dy) (`rotate` with
BACKWARD). Then, as for RMSNorm, with x̂ = x · r:

    dx = r · (g · w' - x̂ · mean(g · w' · x̂))
    dw = Σ_(tokens, heads) g · x̂

Nothing but the inputs and cos/sin is saved: r is a sum over the D elements the backward loads anyway, so it
is recomputed instead of stored. Each element of q and k is read once and written once in each direction;
q and k arrive as transposed views `[B, H, S, D]` of `[B, S, H, D]` and are addressed through their strides.
Programs take blocks of head vectors as `rope.py`'s chunk tiles, one layout for every value: the row sums
(x·x, and in the backward the dot product) and dw's column sums never move between layouts. When weight
gradients are wanted each backward program walks a run of blocks and writes one fp32 partial row, and
`sum_partials` adds the rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.rms_norm import rms_norm_reference
from unsloth_lite.kernels.rope import (
    check_rope_args,
    chunk_columns,
    chunk_sizes,
    cos_sin_strides,
    head_rows,
    load_chunks,
    load_cos_sin,
    reads_first_halves,
    rope_reference,
    rotate,
    row_offsets,
    store_chunks,
    token_rows,
)
from unsloth_lite.kernels.utils import (
    INTERPRET,
    accumulator_dtype,
    check_float,
    empty,
    empty_like,
    persistent_program_count,
    sum_partials,
)

# Backward: head vectors a program, one warp (the best of a sweep on an H200 at Qwen3's D = 128 and at
# Qwen3.5's D = 256 with a 64-wide rotary part).
BACKWARD_HEAD_VECTORS_PER_PROGRAM = 4
if INTERPRET:  # the interpreter's cost is per operation, not per element: fewer, taller tiles
    BACKWARD_HEAD_VECTORS_PER_PROGRAM = 64
# Forward: warps a program, with as many head vectors as fill their threads with one 16-byte vector per
# chunk (same sweep: 85% of copy at Qwen3's shape against 74% for the backward's tile, level at Qwen3.5's).
FORWARD_WARPS = 2


def launch_config(
    head_dim: int, rotary_dim: int, element_size: int, backward: bool, duplicated_halves: bool = False
) -> dict:
    """Tiles of BLOCK_R head vectors. Fewer vectors than the warps' threads can take would be 2-9x slower:
    Triton 3.6 then lays the spare threads and warps along the chunk axis, and the partner and row sums
    cross warps through shared memory."""
    sizes = chunk_sizes(head_dim, rotary_dim)
    sizes["DUPLICATED_HALVES"] = reads_first_halves(duplicated_halves, sizes["BLOCK_C"])
    if backward:
        return dict(sizes, BLOCK_R=BACKWARD_HEAD_VECTORS_PER_PROGRAM, num_warps=1)
    threads_per_chunk = max(1, sizes["BLOCK_HALF"] * element_size // 16)
    return dict(sizes, BLOCK_R=max(1, FORWARD_WARPS * 32 // threads_per_chunk), num_warps=FORWARD_WARPS)


@triton.jit
def _inverse_rms(x, head_dim, eps):
    return (1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / head_dim + eps))[:, None, None]


@triton.jit
def _norm_rope_forward_rows(
    x_ptr, x_sb, x_sh, x_ss, x_sd,
    out_ptr, out_sb, out_sh, out_ss, out_sd,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    w_ptr, first_row, n_rows, n_heads, seq_len, half, head_dim, eps, offset,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, ACC: tl.constexpr,
    DUPLICATED_HALVES: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):
    row, mask_rows, b, s, head = head_rows(first_row, n_rows, n_heads, seq_len, BLOCK_R, TOKEN_ROWS)
    chunk, cols, mask_cols = chunk_columns(half, head_dim, BLOCK_C, BLOCK_HALF)
    x_rows = row_offsets(row, b, s, head, x_sb, x_ss, x_sh, TOKEN_ROWS)
    x = load_chunks(x_ptr, x_rows, mask_rows, x_sd, cols, mask_cols, ACC)
    w = tl.load(w_ptr + cols, mask=mask_cols, other=0.0).to(ACC) + offset
    c, sn = load_cos_sin(
        cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr, b, s, mask_rows, chunk, cols, mask_cols,
        half, ACC, DUPLICATED_HALVES,
    )
    y = rotate(x * _inverse_rms(x, head_dim, eps) * w, chunk, c, sn, False)
    out_rows = row_offsets(row, b, s, head, out_sb, out_ss, out_sh, TOKEN_ROWS)
    store_chunks(out_ptr, out_rows, mask_rows, out_sd, cols, mask_cols, y)


@triton.jit
def _norm_rope_backward_block(
    dy_ptr, dy_sb, dy_sh, dy_ss, dy_sd,
    x_ptr, x_sb, x_sh, x_ss, x_sd,
    dx_ptr, dx_sb, dx_sh, dx_ss, dx_sd,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    w, first_row, n_rows, n_heads, seq_len, half, head_dim, eps,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, ACC: tl.constexpr,
    DUPLICATED_HALVES: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):
    """dx of BLOCK_R head vectors; returns their dw contribution `[1, BLOCK_C, BLOCK_HALF]`, dead code when
    unused."""
    row, mask_rows, b, s, head = head_rows(first_row, n_rows, n_heads, seq_len, BLOCK_R, TOKEN_ROWS)
    chunk, cols, mask_cols = chunk_columns(half, head_dim, BLOCK_C, BLOCK_HALF)
    dy_rows = row_offsets(row, b, s, head, dy_sb, dy_ss, dy_sh, TOKEN_ROWS)
    x_rows = row_offsets(row, b, s, head, x_sb, x_ss, x_sh, TOKEN_ROWS)
    dy = load_chunks(dy_ptr, dy_rows, mask_rows, dy_sd, cols, mask_cols, ACC)
    x = load_chunks(x_ptr, x_rows, mask_rows, x_sd, cols, mask_cols, ACC)
    c, sn = load_cos_sin(
        cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr, b, s, mask_rows, chunk, cols, mask_cols,
        half, ACC, DUPLICATED_HALVES,
    )
    g = rotate(dy, chunk, c, sn, True)
    rstd = _inverse_rms(x, head_dim, eps)
    x_hat = x * rstd
    gw = g * w
    mean_dot = (tl.sum(tl.sum(gw * x_hat, axis=2), axis=1) / head_dim)[:, None, None]
    dx = rstd * (gw - x_hat * mean_dot)
    dx_rows = row_offsets(row, b, s, head, dx_sb, dx_ss, dx_sh, TOKEN_ROWS)
    store_chunks(dx_ptr, dx_rows, mask_rows, dx_sd, cols, mask_cols, dx)
    return tl.sum(g * x_hat, axis=0, keep_dims=True)


@triton.jit
def _norm_rope_backward_rows(
    dy_ptr, dy_sb, dy_sh, dy_ss, dy_sd,
    x_ptr, x_sb, x_sh, x_ss, x_sd,
    dx_ptr, dx_sb, dx_sh, dx_ss, dx_sd,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    w_ptr, dw_partial_ptr, first_row, last_row, n_rows, n_heads, seq_len, half, head_dim, eps, offset,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, COMPUTE_DW: tl.constexpr,
    ACC: tl.constexpr, DUPLICATED_HALVES: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):
    """Backward of head vectors [first_row, last_row): one block, or with COMPUTE_DW a run of blocks whose dw
    is summed into one partial row."""
    _, cols, mask_cols = chunk_columns(half, head_dim, BLOCK_C, BLOCK_HALF)
    w = tl.load(w_ptr + cols, mask=mask_cols, other=0.0).to(ACC) + offset
    if COMPUTE_DW:
        dw = tl.zeros([1, BLOCK_C, BLOCK_HALF], dtype=ACC)
        for block_row in range(first_row, last_row, BLOCK_R):
            dw += _norm_rope_backward_block(
                dy_ptr, dy_sb, dy_sh, dy_ss, dy_sd, x_ptr, x_sb, x_sh, x_ss, x_sd,
                dx_ptr, dx_sb, dx_sh, dx_ss, dx_sd,
                cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
                w, block_row, n_rows, n_heads, seq_len, half, head_dim, eps,
                BLOCK_R, BLOCK_C, BLOCK_HALF, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
            )
        tl.store(dw_partial_ptr + cols, dw, mask=mask_cols)
    else:
        _norm_rope_backward_block(
            dy_ptr, dy_sb, dy_sh, dy_ss, dy_sd, x_ptr, x_sb, x_sh, x_ss, x_sd,
            dx_ptr, dx_sb, dx_sh, dx_ss, dx_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            w, first_row, n_rows, n_heads, seq_len, half, head_dim, eps,
            BLOCK_R, BLOCK_C, BLOCK_HALF, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
        )


@triton.jit
def _qk_norm_rope_forward_kernel(
    q_ptr, q_sb, q_sh, q_ss, q_sd,
    k_ptr, k_sb, k_sh, k_ss, k_sd,
    qo_ptr, qo_sb, qo_sh, qo_ss, qo_sd,
    ko_ptr, ko_sb, ko_sh, ko_ss, ko_sd,
    qw_ptr, kw_ptr,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    seq_len, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, half, head_dim, eps, offset,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, ACC: tl.constexpr,
    DUPLICATED_HALVES: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_q_programs:
        _norm_rope_forward_rows(
            q_ptr, q_sb, q_sh, q_ss, q_sd, qo_ptr, qo_sb, qo_sh, qo_ss, qo_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            qw_ptr, pid * BLOCK_R, n_q_rows, n_q_heads, seq_len, half, head_dim, eps, offset,
            BLOCK_R, BLOCK_C, BLOCK_HALF, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
        )
    else:
        _norm_rope_forward_rows(
            k_ptr, k_sb, k_sh, k_ss, k_sd, ko_ptr, ko_sb, ko_sh, ko_ss, ko_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            kw_ptr, (pid - n_q_programs) * BLOCK_R, n_k_rows, n_k_heads, seq_len, half, head_dim, eps, offset,
            BLOCK_R, BLOCK_C, BLOCK_HALF, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
        )


@triton.jit
def _qk_norm_rope_backward_kernel(
    dqo_ptr, dqo_sb, dqo_sh, dqo_ss, dqo_sd,
    dko_ptr, dko_sb, dko_sh, dko_ss, dko_sd,
    q_ptr, q_sb, q_sh, q_ss, q_sd,
    k_ptr, k_sb, k_sh, k_ss, k_sd,
    dq_ptr, dq_sb, dq_sh, dq_ss, dq_sd,
    dk_ptr, dk_sb, dk_sh, dk_ss, dk_sd,
    qw_ptr, kw_ptr, dqw_partial_ptr, dkw_partial_ptr,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    seq_len, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, rows_per_program,
    half, head_dim, eps, offset,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, COMPUTE_DW: tl.constexpr,
    ACC: tl.constexpr, DUPLICATED_HALVES: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_q_programs:
        first_row = pid * rows_per_program
        _norm_rope_backward_rows(
            dqo_ptr, dqo_sb, dqo_sh, dqo_ss, dqo_sd,
            q_ptr, q_sb, q_sh, q_ss, q_sd,
            dq_ptr, dq_sb, dq_sh, dq_ss, dq_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            qw_ptr, dqw_partial_ptr + pid.to(tl.int64) * head_dim,
            first_row, tl.minimum(first_row + rows_per_program, n_q_rows), n_q_rows, n_q_heads, seq_len,
            half, head_dim, eps, offset,
            BLOCK_R, BLOCK_C, BLOCK_HALF, COMPUTE_DW, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
        )
    else:
        k_pid = pid - n_q_programs
        first_row = k_pid * rows_per_program
        _norm_rope_backward_rows(
            dko_ptr, dko_sb, dko_sh, dko_ss, dko_sd,
            k_ptr, k_sb, k_sh, k_ss, k_sd,
            dk_ptr, dk_sb, dk_sh, dk_ss, dk_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            kw_ptr, dkw_partial_ptr + k_pid.to(tl.int64) * head_dim,
            first_row, tl.minimum(first_row + rows_per_program, n_k_rows), n_k_rows, n_k_heads, seq_len,
            half, head_dim, eps, offset,
            BLOCK_R, BLOCK_C, BLOCK_HALF, COMPUTE_DW, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
        )


def _launch_forward(q, k, q_weight, k_weight, cos, sin, eps, offset, duplicated_halves):
    batch, n_q_heads, seq, head_dim = q.shape
    n_k_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    config = launch_config(head_dim, rotary_dim, q.element_size(), False, duplicated_halves)
    n_q_rows, n_k_rows = batch * seq * n_q_heads, batch * seq * n_k_heads
    n_q_programs = triton.cdiv(n_q_rows, config["BLOCK_R"])
    q_out, k_out = empty_like(q), empty_like(k)
    _qk_norm_rope_forward_kernel[(n_q_programs + triton.cdiv(n_k_rows, config["BLOCK_R"]),)](
        q, *q.stride(), k, *k.stride(),
        q_out, *q_out.stride(), k_out, *k_out.stride(),
        q_weight, k_weight,
        cos, *cos_sin_strides(cos, batch), sin, *cos_sin_strides(sin, batch),
        seq, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, rotary_dim // 2, head_dim, eps, offset,
        ACC=accumulator_dtype(q.dtype), TOKEN_ROWS=token_rows(batch, seq, (q, k, q_out, k_out), (cos, sin)),
        **config,
    )
    return q_out, k_out


def _launch_backward(
    dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, offset, compute_dw, duplicated_halves
):
    batch, n_q_heads, seq, head_dim = q.shape
    n_k_heads = k.shape[1]
    config = launch_config(head_dim, cos.shape[-1], q.element_size(), True, duplicated_halves)
    block_r = config["BLOCK_R"]
    n_q_rows, n_k_rows = batch * seq * n_q_heads, batch * seq * n_k_heads
    # One row block per program, or, for weight gradients, a run of blocks per program and one partial row each.
    blocks_per_program = 1
    if compute_dw:
        n_blocks = triton.cdiv(n_q_rows + n_k_rows, block_r)
        blocks_per_program = triton.cdiv(n_blocks, persistent_program_count(q.device, n_blocks))
    rows_per_program = blocks_per_program * block_r
    n_q_programs, n_k_programs = triton.cdiv(n_q_rows, rows_per_program), triton.cdiv(n_k_rows, rows_per_program)
    dq, dk = empty_like(q), empty_like(k)
    if compute_dw:
        partial_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        dqw_partial = empty((n_q_programs, head_dim), partial_dtype, q.device)
        dkw_partial = empty((n_k_programs, head_dim), partial_dtype, q.device)
    else:
        dqw_partial = dkw_partial = q_weight  # never written: COMPUTE_DW compiles the stores away
    _qk_norm_rope_backward_kernel[(n_q_programs + n_k_programs,)](
        dq_out, *dq_out.stride(), dk_out, *dk_out.stride(),
        q, *q.stride(), k, *k.stride(),
        dq, *dq.stride(), dk, *dk.stride(),
        q_weight, k_weight, dqw_partial, dkw_partial,
        cos, *cos_sin_strides(cos, batch), sin, *cos_sin_strides(sin, batch),
        seq, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, rows_per_program,
        cos.shape[-1] // 2, head_dim, eps, offset,
        COMPUTE_DW=compute_dw, ACC=accumulator_dtype(q.dtype),
        TOKEN_ROWS=token_rows(batch, seq, (dq_out, dk_out, q, k, dq, dk), (cos, sin)), **config,
    )
    if not compute_dw:
        return dq, dk, None, None
    return dq, dk, sum_partials(dqw_partial, q_weight.dtype), sum_partials(dkw_partial, k_weight.dtype)


class QKNormRoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps, offset, duplicated_halves):
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.offset, ctx.duplicated_halves = eps, offset, duplicated_halves
        return _launch_forward(q, k, q_weight, k_weight, cos, sin, eps, offset, duplicated_halves)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        compute_dw = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dq, dk, dqw, dkw = _launch_backward(
            dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, ctx.eps, ctx.offset, compute_dw, ctx.duplicated_halves
        )
        return dq, dk, dqw, dkw, None, None, None, None, None


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    duplicated_halves: bool = False,
):
    """Per-head RMSNorm of q and k over D (weights `[D]`), then rotary embedding; returns (q_out, k_out).
    `duplicated_halves` as in `apply_rope`."""
    check_rope_args(q, k, cos, sin)
    head_dim = q.shape[-1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_float(name, w)
        if w.shape != (head_dim,):
            raise ValueError(f"{name} has shape {tuple(w.shape)}; expected ({head_dim},), the head_dim of q and k")
        if w.device != q.device:
            raise ValueError(f"{name} is on {w.device} but q is on {q.device}")
    if q.numel() == 0 and k.numel() == 0:
        return q.new_empty(q.shape), k.new_empty(k.shape)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    return QKNormRoPEFunction.apply(
        q, k, q_weight, k_weight, cos, sin, float(eps), float(offset), bool(duplicated_halves)
    )


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps=1e-6, offset=0.0):
    return (
        rope_reference(rms_norm_reference(q, q_weight, eps, offset), cos, sin),
        rope_reference(rms_norm_reference(k, k_weight, eps, offset), cos, sin),
    )
