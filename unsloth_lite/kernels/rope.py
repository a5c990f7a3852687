"""Rotary position embedding (rotate-half convention, Hugging Face layout): one Triton pass each way.

Each head vector x of length D has three parts: lo = x[:R/2], hi = x[R/2:R] and, for partial
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

With p = partner(a) (hi for a lo element, lo for a hi one) and σ = -1 on lo, +1 on hi, both directions are
one `rotate`: forward a·c + σ·p·s, backward a·c - σ·partner(a·s); a constexpr picks the direction.
Nothing is saved for the backward but cos and sin.

q `[B, Hq, S, D]` and k `[B, Hkv, S, D]` usually arrive as transposed views of the projection output
`[B, S, H, D]`; every tensor is addressed through its own four strides, so views are never copied, and the
outputs keep the inputs' memory order. The head vectors of q, then of k, are numbered in (batch, seq, head)
order, which is memory order for the usual `[B, S, H, D]` storage; a program takes a block of consecutive
head vectors of one of them, so q and k share one launch, and cos/sin rows are gathered per head vector
(from cache: a token's heads share them).

Layout. A block is one `[BLOCK_R, BLOCK_C, BLOCK_HALF]` tile: each vector cut into chunks of R/2 columns,
chunk 0 = lo, chunk 1 = hi, the rest pass through. Every element is loaded once, with contiguous vector
loads, and the partners are picked out by sums over the chunk axis, inside the tile's own layout: no second
load at permuted columns and no sum that has to move between layouts (separate lo, hi and rest tiles get
a layout each, and the q/k norm's row sums must then move between them: its forward ran 1.24x slower that
way at Qwen3.5's D = 256 with 64 rotary dims). In place, the tile covers the rotary chunks alone.

With duplicated halves (c_lo = c_hi, s_lo = s_hi, as Hugging Face builds the tables) and a tile of the two
rotary chunks alone, cos and sin are read as `[BLOCK_R, 1, BLOCK_HALF]` tiles of their first halves and
broadcast over the chunk axis, in the tile's layout (`reads_first_halves`; a `[1, BLOCK_C, BLOCK_HALF]` load
per token, by contrast, gets a layout of its own and a conversion).
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

# Elements of head vectors a program takes, in one warp, or two where the tables are read by their first
# halves (the best of sweeps on an H200 at the K1 shapes: two warps then hold one 16-byte vector per thread
# and chunk; with full tables one warp wins, and two warps lose up to 3x wherever the rows don't fill their
# threads, as Triton 3.6 then lays warps along the chunk axis and converts layouts through shared memory).
TILE_ELEMENTS = 1024


@triton.jit
def head_rows(first_row, n_rows, n_heads, seq_len, BLOCK_R: tl.constexpr, TOKEN_ROWS: tl.constexpr):
    """Rows first_row.. of the (batch, seq, head)-ordered head vectors: (row, mask, batch, position, head), each
    `[BLOCK_R, 1, 1]`. TOKEN_ROWS (see `token_rows`): batch and sequence form one axis of tokens in every
    tensor, so the batch is 0 and the position is the token, with no division by seq_len."""
    rows = first_row + tl.arange(0, BLOCK_R)[:, None, None]
    token = rows // n_heads
    head = rows - token * n_heads
    if TOKEN_ROWS:
        b = token * 0
        s = token
    else:
        b = token // seq_len
        s = token - b * seq_len
    return rows.to(tl.int64), rows < n_rows, b.to(tl.int64), s.to(tl.int64), head.to(tl.int64)


@triton.jit
def row_offsets(row, b, s, head, sb, ss, sh, TOKEN_ROWS: tl.constexpr):
    """Offsets of the rows' head vectors in a tensor of (batch, seq, head) strides (sb, ss, sh); with
    TOKEN_ROWS the rows lie at the one stride sh."""
    if TOKEN_ROWS:
        return row * sh
    return b * sb + s * ss + head * sh


@triton.jit
def chunk_columns(half, n_cols, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """A head vector's first n_cols columns as chunks of `half` (chunk 0 = lo, 1 = hi, the rest pass through):
    (chunk `[1, BLOCK_C, 1]`, column `[1, BLOCK_C, BLOCK_HALF]`, its mask)."""
    chunk = tl.arange(0, BLOCK_C)[None, :, None]
    offset = tl.arange(0, BLOCK_HALF)[None, None, :]
    cols = chunk * half + offset
    return chunk, cols, (offset < half) & (cols < n_cols)


@triton.jit
def load_chunks(ptr, row_offsets, mask_rows, col_stride, cols, mask_cols, ACC: tl.constexpr):
    return tl.load(ptr + row_offsets + cols * col_stride, mask=mask_rows & mask_cols, other=0.0).to(ACC)


@triton.jit
def store_chunks(ptr, row_offsets, mask_rows, col_stride, cols, mask_cols, value):
    tl.store(ptr + row_offsets + cols * col_stride, value.to(ptr.dtype.element_ty), mask=mask_rows & mask_cols)


@triton.jit
def load_cos_sin(
    cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr, b, s, mask_rows, chunk, cols, mask_cols,
    half, ACC: tl.constexpr, DUPLICATED_HALVES: tl.constexpr,
):
    """cos and sin of each row's token at the rotary columns (zero elsewhere), `[BLOCK_R, BLOCK_C, BLOCK_HALF]`
    (gathered per row: the rows of one token hit the same cache lines). DUPLICATED_HALVES: both halves equal
    the first, read once as `[BLOCK_R, 1, BLOCK_HALF]` and broadcast over the chunks (the layout stays the
    tile's: a third fewer load instructions than two full tiles)."""
    if DUPLICATED_HALVES:
        first_half = tl.arange(0, cols.shape[2])[None, None, :]
        mask = mask_rows & (first_half < half)
        c = tl.load(cos_ptr + b * cos_sb + s * cos_ss + first_half * cos_sr, mask=mask, other=0.0).to(ACC)
        sn = tl.load(sin_ptr + b * sin_sb + s * sin_ss + first_half * sin_sr, mask=mask, other=0.0).to(ACC)
    else:
        mask = mask_rows & mask_cols & (chunk < 2)
        c = tl.load(cos_ptr + b * cos_sb + s * cos_ss + cols * cos_sr, mask=mask, other=0.0).to(ACC)
        sn = tl.load(sin_ptr + b * sin_sb + s * sin_ss + cols * sin_sr, mask=mask, other=0.0).to(ACC)
    return c, sn


@triton.jit
def rotate(a, chunk, c, sn, BACKWARD: tl.constexpr):
    """The rotation (or, BACKWARD, its transpose) of chunk tiles `a`; chunks past the rotary ones pass through.
    The partner of a lo element is the hi element at the same offset and vice versa; chunk sums pick them out
    without leaving the tile's layout. Forward: a·c + partner(a)·s·(-1, +1); backward: a·c - partner(a·s)·(-1, +1)."""
    source = a * sn if BACKWARD else a
    lo = tl.sum(tl.where(chunk == 0, source, 0.0), axis=1)[:, None, :]
    hi = tl.sum(tl.where(chunk == 1, source, 0.0), axis=1)[:, None, :]
    signed_partner = tl.where(chunk == 0, -hi, lo)
    if BACKWARD:
        rotated = a * c - signed_partner
    else:
        rotated = a * c + signed_partner * sn
    return tl.where(chunk < 2, rotated, a)


@triton.jit
def _rope_rows(
    x_ptr, x_sb, x_sh, x_ss, x_sd,
    out_ptr, out_sb, out_sh, out_ss, out_sd,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    first_row, n_rows, n_heads, seq_len, half, n_cols,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr, ACC: tl.constexpr, DUPLICATED_HALVES: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):
    row, mask_rows, b, s, head = head_rows(first_row, n_rows, n_heads, seq_len, BLOCK_R, TOKEN_ROWS)
    chunk, cols, mask_cols = chunk_columns(half, n_cols, BLOCK_C, BLOCK_HALF)
    x_rows = row_offsets(row, b, s, head, x_sb, x_ss, x_sh, TOKEN_ROWS)
    x = load_chunks(x_ptr, x_rows, mask_rows, x_sd, cols, mask_cols, ACC)
    c, sn = load_cos_sin(
        cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr, b, s, mask_rows, chunk, cols, mask_cols,
        half, ACC, DUPLICATED_HALVES,
    )
    y = rotate(x, chunk, c, sn, BACKWARD)
    out_rows = row_offsets(row, b, s, head, out_sb, out_ss, out_sh, TOKEN_ROWS)
    store_chunks(out_ptr, out_rows, mask_rows, out_sd, cols, mask_cols, y)


@triton.jit
def _rope_kernel(
    q_ptr, q_sb, q_sh, q_ss, q_sd,
    k_ptr, k_sb, k_sh, k_ss, k_sd,
    qo_ptr, qo_sb, qo_sh, qo_ss, qo_sd,
    ko_ptr, ko_sb, ko_sh, ko_ss, ko_sd,
    cos_ptr, cos_sb, cos_ss, cos_sr,
    sin_ptr, sin_sb, sin_ss, sin_sr,
    seq_len, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, half, n_cols,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr, ACC: tl.constexpr, DUPLICATED_HALVES: tl.constexpr, TOKEN_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    # Two calls rather than selected pointers, so each keeps its compile-time stride specialisation.
    if pid < n_q_programs:
        _rope_rows(
            q_ptr, q_sb, q_sh, q_ss, q_sd, qo_ptr, qo_sb, qo_sh, qo_ss, qo_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            pid * BLOCK_R, n_q_rows, n_q_heads, seq_len, half, n_cols,
            BLOCK_R, BLOCK_C, BLOCK_HALF, BACKWARD, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
        )
    else:
        _rope_rows(
            k_ptr, k_sb, k_sh, k_ss, k_sd, ko_ptr, ko_sb, ko_sh, ko_ss, ko_sd,
            cos_ptr, cos_sb, cos_ss, cos_sr, sin_ptr, sin_sb, sin_ss, sin_sr,
            (pid - n_q_programs) * BLOCK_R, n_k_rows, n_k_heads, seq_len, half, n_cols,
            BLOCK_R, BLOCK_C, BLOCK_HALF, BACKWARD, ACC, DUPLICATED_HALVES, TOKEN_ROWS,
        )


def chunk_sizes(n_cols: int, rotary_dim: int) -> dict:
    """BLOCK_C chunks of BLOCK_HALF columns covering head vectors of n_cols columns."""
    half = rotary_dim // 2
    return dict(BLOCK_C=triton.next_power_of_2(triton.cdiv(n_cols, half)), BLOCK_HALF=triton.next_power_of_2(half))


def reads_first_halves(duplicated_halves: bool, block_c: int) -> bool:
    """Whether the kernels read the tables' first halves alone: declared duplicated, in a tile of the two rotary
    chunks alone (full rotary, or in place). With more chunks Triton spreads the chunk axis over threads and a
    `[BLOCK_R, 1, BLOCK_HALF]` table tile gets a layout of its own, converted by shuffles that cost more than
    the loads saved (Triton 3.6, sm_90 code)."""
    return duplicated_halves and block_c == 2


def rope_launch_config(
    head_dim: int, rotary_dim: int, copy_pass: bool = True, duplicated_halves: bool = False
) -> dict:
    """Tiles of whole head vectors out of place, of their rotary part alone in place: BLOCK_R vectors of about
    TILE_ELEMENTS."""
    sizes = chunk_sizes(head_dim if copy_pass else rotary_dim, rotary_dim)
    rows = max(1, TILE_ELEMENTS // (sizes["BLOCK_C"] * sizes["BLOCK_HALF"]))
    first_halves = reads_first_halves(duplicated_halves, sizes["BLOCK_C"])
    return dict(
        sizes, BLOCK_R=1 << (rows.bit_length() - 1), DUPLICATED_HALVES=first_halves, num_warps=2 if first_halves else 1
    )


def token_rows(batch: int, seq: int, head_tensors, tables) -> bool:
    """Whether row r (the (batch, seq, head)-ordered head vector) of every `[B, H, S, D]` tensor lies at r times
    its head stride, as in the projection's `[B, S, H, D]` storage, and every table's row of token t (its
    (batch, seq) pair in order) at t times its seq stride: the kernels then address rows with one division
    (by the head count) instead of three."""
    for t in head_tensors:
        batch_stride, head_stride, seq_stride = t.stride(0), t.stride(1), t.stride(2)
        n_heads = t.shape[1]
        if seq > 1 and seq_stride != n_heads * head_stride or batch > 1 and batch_stride != seq * n_heads * head_stride:
            return False
    for table in tables:
        batch_stride, seq_stride, _ = cos_sin_strides(table, batch)
        if batch > 1 and batch_stride != seq * seq_stride:
            return False
    return True


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


def _launch_rope(
    q, k, q_out, k_out, cos, sin, backward: bool, duplicated_halves: bool, copy_pass: bool = True
) -> None:
    """Rotates q, k into q_out, k_out; `copy_pass=False` (in place) leaves the pass-through dims alone."""
    batch, n_q_heads, seq, head_dim = q.shape
    n_k_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    config = rope_launch_config(head_dim, rotary_dim, copy_pass=copy_pass, duplicated_halves=duplicated_halves)
    n_q_rows, n_k_rows = batch * seq * n_q_heads, batch * seq * n_k_heads
    n_q_programs = triton.cdiv(n_q_rows, config["BLOCK_R"])
    n_cols = head_dim if copy_pass else rotary_dim
    _rope_kernel[(n_q_programs + triton.cdiv(n_k_rows, config["BLOCK_R"]),)](
        q, *q.stride(),
        k, *k.stride(),
        q_out, *q_out.stride(),
        k_out, *k_out.stride(),
        cos, *cos_sin_strides(cos, batch),
        sin, *cos_sin_strides(sin, batch),
        seq, n_q_heads, n_k_heads, n_q_rows, n_k_rows, n_q_programs, rotary_dim // 2, n_cols,
        BACKWARD=backward, ACC=accumulator_dtype(q.dtype),
        TOKEN_ROWS=token_rows(batch, seq, (q, k, q_out, k_out), (cos, sin)), **config,
    )


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, duplicated_halves):
        q_out, k_out = empty_like(q), empty_like(k)  # keeps a transposed view's memory order
        ctx.duplicated_halves = duplicated_halves
        _launch_rope(q, k, q_out, k_out, cos, sin, backward=False, duplicated_halves=duplicated_halves)
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
        _launch_rope(dq_out, dk_out, dq, dk, cos, sin, backward=True, duplicated_halves=ctx.duplicated_halves)
        return dq, dk, None, None, None


def _writable_in_place(t: torch.Tensor) -> bool:
    """No two indices of `t` share memory (dense in the `[B, H, S, D]` or `[B, S, H, D]` order)."""
    return t.is_contiguous() or t.transpose(1, 2).is_contiguous()


class RoPEInPlaceFunction(torch.autograd.Function):
    """Rotates q and k in their own storage, and the incoming gradients in theirs: nothing is allocated and
    the pass-through dims of partial rotary are neither read nor written, in either direction."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, duplicated_halves):
        ctx.duplicated_halves = duplicated_halves
        _launch_rope(q, k, q, k, cos, sin, backward=False, duplicated_halves=duplicated_halves, copy_pass=False)
        # Autograd can't see a kernel's writes: bump the version counters so that any op that saved the
        # pre-rotation q or k for its backward raises instead of silently using rotated values.
        torch.autograd.graph.increment_version(q)
        torch.autograd.graph.increment_version(k)
        ctx.save_for_backward(cos, sin)
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        halves = ctx.duplicated_halves
        if _writable_in_place(dq_out) and _writable_in_place(dk_out):
            _launch_rope(dq_out, dk_out, dq_out, dk_out, cos, sin, True, halves, copy_pass=False)
            return dq_out, dk_out, None, None, None
        dq, dk = empty_like(dq_out), empty_like(dk_out)  # e.g. expanded gradients: no room to write in place
        _launch_rope(dq_out, dk_out, dq, dk, cos, sin, True, halves)
        return dq, dk, None, None, None


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inplace: bool = False,
    duplicated_halves: bool = False,
):
    """Rotate q `[B, Hq, S, D]` and k `[B, Hkv, S, D]` by cos/sin `[B, S, R]` or `[S, R]`; returns (q_out, k_out).

    `duplicated_halves=True` declares that cos and sin repeat their first R/2 columns in their last R/2, as
    Hugging Face's rotary embeddings build them (cat(freqs, freqs)); the kernels may then read the first halves
    alone, and do where a tile holds just the two rotary chunks (full rotary, or in place). Tables whose halves
    differ must not be declared so.

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
        return RoPEFunction.apply(q, k, cos, sin, bool(duplicated_halves))
    for name, t in (("q", q), ("k", k)):
        if t.is_leaf and t.requires_grad:
            raise ValueError(f"inplace=True would overwrite {name}, a leaf tensor that requires grad")
        if not _writable_in_place(t):
            raise ValueError(
                f"inplace=True needs {name} dense in [B, H, S, D] or [B, S, H, D] order, got strides {t.stride()}"
            )
    return RoPEInPlaceFunction.apply(q, k, cos, sin, bool(duplicated_halves))


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
