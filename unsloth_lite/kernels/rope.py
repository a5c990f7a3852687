"""Rotary position embedding (rotate-half convention, Hugging Face layout): one Triton pass each way.

Each head vector x of length D is split into three segments: lo = x[:R/2], hi = x[R/2:R] and, for partial
rotary (R < D, Qwen3.5 rotates the first quarter), rest = x[R:], which passes through. With c, s the cos and
sin rows of the token (c = cat(c_lo, c_hi), s = cat(s_lo, s_hi)) and rotate_half(x) = cat(-hi, lo):

    y = x · c + rotate_half(x) · s
    y_lo = lo · c_lo - hi · s_lo
    y_hi = hi · c_hi + lo · s_hi
    y_rest = rest

The map is linear in x, so the backward applies its transpose (rotate_half transposed is cat(hi, -lo)):

    dx_lo = dy_lo · c_lo + dy_hi · s_hi
    dx_hi = dy_hi · c_hi - dy_lo · s_lo
    dx_rest = dy_rest

Both directions are `out_lo = a_lo · c_lo + a_hi · m_lo`, `out_hi = a_hi · c_hi + a_lo · m_hi` with
(m_lo, m_hi) = (-s_lo, s_hi) forward and (s_hi, -s_lo) backward: one kernel, a constexpr picks the direction.
Nothing is saved for the backward but cos and sin.

q `[B, Hq, S, D]` and k `[B, Hkv, S, D]` usually arrive as transposed views of the projection output
`[B, S, H, D]`; every tensor is addressed through its own four strides, so views are never copied, and the
outputs keep the inputs' memory order. The head vectors of q, then of k, are numbered in (batch, seq, head)
order, which is memory order for the usual `[B, S, H, D]` storage; a program takes a block of consecutive
head vectors of one of them, so q and k share one launch, and cos/sin rows are gathered per head vector
(from cache: a token's heads share them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.utils import (
    accumulator_dtype,
    check_float,
    check_kernel_device,
    check_same_device,
    empty_like,
    empty_strided,
)

TILE_ELEMENTS = 1024


@triton.jit
def load_segment(ptr, row_offsets, mask_rows, col_stride, first_col, n_cols, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Columns [first_col, first_col + n_cols) of the rows at `row_offsets` (a [rows, 1] tensor)."""
    cols = tl.arange(0, BLOCK)[None, :]
    mask = mask_rows & (cols < n_cols)
    return tl.load(ptr + row_offsets + (cols + first_col) * col_stride, mask=mask, other=0.0).to(ACC)


@triton.jit
def store_segment(ptr, row_offsets, mask_rows, col_stride, first_col, n_cols, value, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)[None, :]
    mask = mask_rows & (cols < n_cols)
    tl.store(ptr + row_offsets + (cols + first_col) * col_stride, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_rows(first_row, n_rows, n_heads, seq_len, BLOCK_R: tl.constexpr):
    """Rows first_row.. of the (batch, seq, head)-ordered head vectors: (mask, batch, position, head), [BLOCK_R, 1]."""
    rows = first_row + tl.arange(0, BLOCK_R)[:, None]
    token = rows // n_heads
    return rows < n_rows, (token // seq_len).to(tl.int64), (token % seq_len).to(tl.int64), (rows % n_heads).to(tl.int64)


@triton.jit
def load_rotation(
    cos_ptr, cos_rows, cos_col_stride, sin_ptr, sin_rows, sin_col_stride, mask_rows, half,
    BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr, ACC: tl.constexpr,
):
    """(c_lo, c_hi, m_lo, m_hi) of each row's token, [BLOCK_R, BLOCK_HALF]; see the module docstring."""
    c_lo = load_segment(cos_ptr, cos_rows, mask_rows, cos_col_stride, 0, half, BLOCK_HALF, ACC)
    c_hi = load_segment(cos_ptr, cos_rows, mask_rows, cos_col_stride, half, half, BLOCK_HALF, ACC)
    s_lo = load_segment(sin_ptr, sin_rows, mask_rows, sin_col_stride, 0, half, BLOCK_HALF, ACC)
    s_hi = load_segment(sin_ptr, sin_rows, mask_rows, sin_col_stride, half, half, BLOCK_HALF, ACC)
    if BACKWARD:
        return c_lo, c_hi, s_hi, -s_lo
    return c_lo, c_hi, -s_lo, s_hi


@triton.jit
def _rope_rows(
    x_ptr, x_sb, x_sh, x_ss, x_sd,
    out_ptr, out_sb, out_sh, out_ss, out_sd,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    first_row, n_rows, n_heads, seq_len, half, n_pass,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, BACKWARD: tl.constexpr, ACC: tl.constexpr,
):
    mask_rows, b, s, head = head_rows(first_row, n_rows, n_heads, seq_len, BLOCK_R)
    x_rows = b * x_sb + s * x_ss + head * x_sh
    out_rows = b * out_sb + s * out_ss + head * out_sh
    lo = load_segment(x_ptr, x_rows, mask_rows, x_sd, 0, half, BLOCK_HALF, ACC)
    hi = load_segment(x_ptr, x_rows, mask_rows, x_sd, half, half, BLOCK_HALF, ACC)
    if HAS_PASS:
        rest = load_segment(x_ptr, x_rows, mask_rows, x_sd, 2 * half, n_pass, BLOCK_PASS, ACC)
        store_segment(out_ptr, out_rows, mask_rows, out_sd, 2 * half, n_pass, rest, BLOCK_PASS)
    c_lo, c_hi, m_lo, m_hi = load_rotation(
        cos_ptr, b * cos_sb + s * cos_ss, cos_sr, sin_ptr, b * sin_sb + s * sin_ss, sin_sr, mask_rows, half,
        BLOCK_HALF, BACKWARD, ACC,
    )
    store_segment(out_ptr, out_rows, mask_rows, out_sd, 0, half, lo * c_lo + hi * m_lo, BLOCK_HALF)
    store_segment(out_ptr, out_rows, mask_rows, out_sd, half, half, hi * c_hi + lo * m_hi, BLOCK_HALF)


@triton.jit
def _rope_kernel(
    q_ptr, q_sb, q_sh, q_ss, q_sd,
    k_ptr, k_sb, k_sh, k_ss, k_sd,
    qo_ptr, qo_sb, qo_sh, qo_ss, qo_sd,
    ko_ptr, ko_sb, ko_sh, ko_ss, ko_sd,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    seq_len, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, half, n_pass,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr, BACKWARD: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    # Two calls rather than selected pointers, so each keeps its compile-time stride specialisation.
    if pid < n_q_programs:
        _rope_rows(
            q_ptr, q_sb, q_sh, q_ss, q_sd, qo_ptr, qo_sb, qo_sh, qo_ss, qo_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            pid * BLOCK_R, n_q_rows, n_q_heads, seq_len, half, n_pass,
            BLOCK_R, BLOCK_HALF, BLOCK_PASS, HAS_PASS, BACKWARD, ACC,
        )
    else:
        _rope_rows(
            k_ptr, k_sb, k_sh, k_ss, k_sd, ko_ptr, ko_sb, ko_sh, ko_ss, ko_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            (pid - n_q_programs) * BLOCK_R, n_k_rows, n_k_heads, seq_len, half, n_pass,
            BLOCK_R, BLOCK_HALF, BLOCK_PASS, HAS_PASS, BACKWARD, ACC,
        )


def rope_launch_config(head_dim: int, rotary_dim: int, copy_pass: bool = True) -> dict:
    """A program takes BLOCK_R head vectors. Tile sizes and warps are the best of a sweep on an H200 at the K1
    shapes: full rotary at D = 128 (8 vectors, 2 warps); D = 256 with 64 rotary dims out of place (about
    2048 elements, 2 warps); the same in place, where only the 64 rotary dims are touched (16 vectors,
    4 warps: with 32-wide halves fewer warps leave too few loads in flight)."""
    half = rotary_dim // 2
    n_pass = head_dim - rotary_dim if copy_pass else 0
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(n_pass) if n_pass else 1
    row = 2 * block_half + (block_pass if n_pass else 0)
    rows_per_tile = max(1, (2 * TILE_ELEMENTS if n_pass else TILE_ELEMENTS) // row)
    return dict(
        BLOCK_R=1 << (rows_per_tile.bit_length() - 1), BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        HAS_PASS=n_pass > 0, num_warps=4 if block_half < 64 and not n_pass else 2,
    )


def cos_sin_strides(t: torch.Tensor, batch: int) -> tuple[int, int, int]:
    """(batch, seq, rotary) strides of cos or sin given as [S, R], [1, S, R] or [B, S, R]."""
    if t.dim() == 2 or t.shape[0] == 1 and batch != 1:
        return 0, t.stride(-2), t.stride(-1)
    return t.stride(0), t.stride(1), t.stride(2)


def check_rope_args(q, k, cos, sin) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    check_same_device([("q", q), ("k", k), ("cos", cos), ("sin", sin)])
    check_kernel_device("q", q)
    if q.dim() != 4:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected 4 dims [batch, q_heads, seq, head_dim]")
    if k.dim() != 4:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected 4 dims [batch, kv_heads, seq, head_dim]")
    batch, _, seq, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq, head_dim):
        raise ValueError(
            f"k has shape {tuple(k.shape)}; batch, seq and head_dim must match q's {tuple(q.shape)}"
        )
    if q.dtype != k.dtype:
        raise ValueError(f"q has dtype {q.dtype} but k has dtype {k.dtype}; they must match")
    if cos.shape != sin.shape:
        raise ValueError(f"cos has shape {tuple(cos.shape)} but sin has shape {tuple(sin.shape)}; they must match")
    if cos.dim() not in (2, 3) or cos.shape[-2] != seq or (cos.dim() == 3 and cos.shape[0] not in (1, batch)):
        raise ValueError(
            f"cos has shape {tuple(cos.shape)}; expected [{batch}, {seq}, rotary_dim] or [{seq}, rotary_dim]"
        )
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(
            f"cos has rotary dim {rotary_dim}; expected an even number between 2 and head_dim={head_dim}"
        )


def _launch_rope(q, k, q_out, k_out, cos, sin, backward: bool, copy_pass: bool = True) -> None:
    """Rotates q, k into q_out, k_out; `copy_pass=False` (in place) leaves the pass-through dims alone."""
    batch, n_q_heads, seq, head_dim = q.shape
    n_k_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    config = rope_launch_config(head_dim, rotary_dim, copy_pass=copy_pass)
    n_q_rows, n_k_rows = batch * seq * n_q_heads, batch * seq * n_k_heads
    n_q_programs = triton.cdiv(n_q_rows, config["BLOCK_R"])
    _rope_kernel[(n_q_programs + triton.cdiv(n_k_rows, config["BLOCK_R"]),)](
        q, *q.stride(),
        k, *k.stride(),
        q_out, *q_out.stride(),
        k_out, *k_out.stride(),
        cos, *cos_sin_strides(cos, batch),
        sin, *cos_sin_strides(sin, batch),
        seq, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, rotary_dim // 2, head_dim - rotary_dim,
        BACKWARD=backward, ACC=accumulator_dtype(q.dtype), **config,
    )


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q_out, k_out = empty_like(q), empty_like(k)  # keeps a transposed view's memory order
        _launch_rope(q, k, q_out, k_out, cos, sin, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.layouts = (q_out.shape, q_out.stride(), k_out.shape, k_out.stride())
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        q_shape, q_stride, k_shape, k_stride = ctx.layouts
        # Gradients in the inputs' memory order, so the transpose/view back to the projection is free.
        dq = empty_strided(q_shape, q_stride, dq_out.dtype, dq_out.device)
        dk = empty_strided(k_shape, k_stride, dk_out.dtype, dk_out.device)
        _launch_rope(dq_out, dk_out, dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def _writable_in_place(t: torch.Tensor) -> bool:
    """No two indices of `t` share memory (dense in the `[B, H, S, D]` or `[B, S, H, D]` order)."""
    return t.is_contiguous() or t.transpose(1, 2).is_contiguous()


class RoPEInPlaceFunction(torch.autograd.Function):
    """Rotates q and k in their own storage, and the incoming gradients in theirs: nothing is allocated and
    the pass-through dims of partial rotary are neither read nor written, in either direction."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        _launch_rope(q, k, q, k, cos, sin, backward=False, copy_pass=False)
        # Autograd can't see a kernel's writes: bump the version counters so that any op that saved the
        # pre-rotation q or k for its backward raises instead of silently using rotated values.
        torch.autograd.graph.increment_version(q)
        torch.autograd.graph.increment_version(k)
        ctx.save_for_backward(cos, sin)
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        if _writable_in_place(dq_out) and _writable_in_place(dk_out):
            _launch_rope(dq_out, dk_out, dq_out, dk_out, cos, sin, backward=True, copy_pass=False)
            return dq_out, dk_out, None, None
        dq, dk = empty_like(dq_out), empty_like(dk_out)  # e.g. expanded gradients: no room to write in place
        _launch_rope(dq_out, dk_out, dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False):
    """Rotate q `[B, Hq, S, D]` and k `[B, Hkv, S, D]` by cos/sin `[B, S, R]` or `[S, R]`; returns (q_out, k_out).

    `inplace=True` overwrites q and k with the result and returns views of them, and its backward rotates the
    incoming gradients in place too: with partial rotary only the first R of D dims are ever touched. Use it
    where q and k, and the gradients flowing back into them, have no other reader, as when q and k go from
    their projection straight into attention (the patched models do this). q and k must then be produced by
    an op (not leaf tensors that require grad), and must not be read again afterwards.
    """
    check_rope_args(q, k, cos, sin)
    if q.numel() == 0 and k.numel() == 0:
        return q.new_empty(q.shape), k.new_empty(k.shape)
    if not inplace:
        return RoPEFunction.apply(q, k, cos, sin)
    for name, t in (("q", q), ("k", k)):
        if t.is_leaf and t.requires_grad:
            raise ValueError(f"inplace=True would overwrite {name}, a leaf tensor that requires grad")
        if not _writable_in_place(t):
            raise ValueError(
                f"inplace=True needs {name} dense in [B, H, S, D] or [B, S, H, D] order, got strides {t.stride()}"
            )
    return RoPEInPlaceFunction.apply(q, k, cos, sin)


def rotate_half_reference(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `apply_rotary_pos_emb` on one tensor, partial rotary included, math in fp32."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    xf = x.to(acc)
    x_rot, x_pass = xf[..., :rotary_dim], xf[..., rotary_dim:]
    rotated = x_rot * cos.to(acc) + rotate_half_reference(x_rot) * sin.to(acc)
    return torch.cat((rotated, x_pass), dim=-1).to(x.dtype)


def apply_rope_reference(q, k, cos, sin):
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)
