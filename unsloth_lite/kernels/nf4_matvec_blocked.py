"""The NF4 matrix-vector product's blocked and general kernels (`nf4_matvec.py` describes both and launches them):
the blocked kernel walks K a few whole quantisation blocks at a time, two weights a byte, each block's absmax read
once; the general kernel takes any shape, element e from byte e // 2 and absmax per element. The word kernel, the
gate-and-up and the grouped kernels (`nf4_matvec_words.py`, `nf4_gated_matvec.py`, `nf4_grouped_matvec.py`) share
the blocked kernel's tile loads and walk.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from unsloth_lite.kernels.dequantize_nf4 import _block_absmax, _fp32_to_bf16_rne
from unsloth_lite.kernels.matvec_epilogue import (
    _adapter_b,
    _adapter_t,
    _finish_product,
    _store_rows,
    _tile_range,
)
from unsloth_lite.kernels.nf4_codes import _nf4_codes


@triton.jit
def _blocked_tile_loads(
    b0, packed_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
    nested_blocksize: tl.constexpr, features, mask_features, blocks_per_row,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr,
):
    """The loads of the tile of quantisation blocks [b0, b0 + BLOCKS_PER_TILE): each block's absmax `[N, B, 1]`
    and packed bytes `[N, B, HALF]` (past the row: 0), with each byte's index in the row `[B, HALF]` and which
    blocks lie in the row `[B]`."""
    HALF: tl.constexpr = BLOCKSIZE // 2  # bytes of one quantisation block
    blocks = b0 + tl.arange(0, BLOCKS_PER_TILE)
    mask_blocks = blocks < blocks_per_row
    mask_nb = mask_features[:, None] & mask_blocks[None, :]
    absmax = _block_absmax(
        absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize,
        features[:, None].to(tl.int64) * blocks_per_row + blocks[None, :], mask_nb, NESTED,
    )[:, :, None]
    byte_in_row = blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [BLOCKS_PER_TILE, HALF]
    row_bytes = features.to(tl.int64) * (blocks_per_row * HALF)
    packed = tl.load(packed_ptr + row_bytes[:, None, None] + byte_in_row[None, :, :], mask=mask_nb[:, :, None],
                     other=0)
    return absmax, packed, byte_in_row, mask_blocks


@triton.jit
def _nf4_matvec_blocked_kernel(
    x_ptr, x_row_stride, x_col_stride,
    packed_ptr, absmax_ptr, table_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
    nested_blocksize: tl.constexpr,  # a compile-time constant: no 64-bit division call per absmax (in the SASS)
    bias_ptr, t_ptr, t_row_stride, lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale,
    out_ptr, out_row_stride, partial_ptr, arrivals_ptr,
    n_rows, n_out, n_in, rank,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
    BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, BLOCK_R: tl.constexpr,
    LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr,
):
    """SPLIT_K (tiles a split, 0 for none): program (i, j) takes tiles [j · SPLIT_K, (j + 1) · SPLIT_K) along K
    of feature block i (`_sum_of_splits`), so that a layer's programs are K / (SPLIT_K · tile) times as many, each
    with fewer steps: more bytes in flight per SM (one tile a split: x converted to the tile's layout once).

    PDL (launched as a programmatic dependent launch): nothing the kernel before may still write or read is
    touched before `gdc_wait` (x, the adapter's t, bias, the outputs and the split scratch all come after it);
    only the frozen weight's bytes and absmax, and the adapter's B rows, are loaded ahead of it. Every program
    waits once it has issued its first tile's weight loads (before the loop when it is pipelined), and lets the
    next kernel launch once its loop is done.

    STAGES (`PIPELINE_STAGES`): the loop's loads issued that many tiles ahead, as asynchronous copies to shared
    memory (Triton's software pipelining); 1 loads each tile in its own step."""
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    first_block, end_block = _tile_range(n_in // BLOCKSIZE, BLOCKS_PER_TILE, SPLIT_K)
    lora_b = _adapter_b(lora_b_ptr, lora_b_row_stride, lora_b_col_stride, features, n_out, rank, HAS_LORA, BLOCK_R)
    acc, partial = _blocked_sums(
        x_ptr, x_row_stride, x_col_stride, packed_ptr, absmax_ptr, table_ptr, nested_code_ptr, nested_absmax_ptr,
        offset_ptr, nested_blocksize, features, n_rows, n_out, n_in, first_block, end_block,
        BLOCKSIZE, NESTED, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, LOOKUP, BF16_CODES, PDL, STAGES,
    )
    if PDL:
        gdc_launch_dependents()
    t = _adapter_t(t_ptr, t_row_stride, rank, rows, n_rows, HAS_LORA, BLOCK_R, 0, 1)
    _finish_product(
        acc, partial, rows, features, n_rows, n_out, partial_ptr, arrivals_ptr, bias_ptr, t, lora_b, scale, out_ptr,
        out_row_stride, BLOCK_M, SPLIT_K, BIAS, HAS_LORA,
    )


@triton.jit
def _blocked_sums(
    x_ptr, x_row_stride, x_col_stride, packed_ptr, absmax_ptr, table_ptr, nested_code_ptr, nested_absmax_ptr,
    offset_ptr, nested_blocksize: tl.constexpr, features, n_rows, n_out, n_in, first_block, end_block,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr,
):
    """(acc `[BLOCK_M, BLOCK_N]`, partial `[BLOCK_N, BLOCKS_PER_TILE, HALF]`): the blocked kernel's walk over
    quantisation blocks [first_block, end_block) of the rows `features` of one weight, its sums for several rows
    in acc, for one row kept elementwise in partial (`_finish_product` reduces them)."""
    rows = tl.arange(0, BLOCK_M)
    mask_features = features < n_out
    blocks_per_row = n_in // BLOCKSIZE
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    partial = tl.zeros([BLOCK_N, BLOCKS_PER_TILE, BLOCKSIZE // 2], dtype=tl.float32)
    if PDL and STAGES > 1:
        gdc_wait()  # the pipelined loop loads x for later tiles before its body runs: wait first
    for b0 in tl.range(first_block, end_block, BLOCKS_PER_TILE, num_stages=STAGES):
        absmax, packed, byte_in_row, mask_blocks = _blocked_tile_loads(
            b0, packed_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize, features,
            mask_features, blocks_per_row, BLOCKSIZE, NESTED, BLOCKS_PER_TILE,
        )
        if PDL and STAGES == 1:
            gdc_wait()  # returns at once after the first tile
        # masked bytes: finite, x is 0
        code_even, code_odd = _nf4_codes(packed, table_ptr, LOOKUP, BF16_CODES)
        # x's even and odd elements from one contiguous load, split in registers
        x_pairs_ptr = x_ptr + (2 * byte_in_row[:, :, None] + tl.arange(0, 2)[None, None, :]) * x_col_stride
        mask_x = mask_blocks[:, None, None]
        if BLOCK_M == 1:
            x_even, x_odd = tl.split(tl.load(x_pairs_ptr, mask=mask_x, other=0.0).to(tl.float32))
            partial += (code_even * x_even[None, :, :] + code_odd * x_odd[None, :, :]) * absmax
        else:
            for m in tl.static_range(BLOCK_M):
                mask_row = mask_x & ((tl.arange(0, BLOCKS_PER_TILE) * 0 + m) < n_rows)[:, None, None]
                x_even, x_odd = tl.split(
                    tl.load(x_pairs_ptr + m * x_row_stride, mask=mask_row, other=0.0).to(tl.float32))
                products = (code_even * x_even[None, :, :] + code_odd * x_odd[None, :, :]) * absmax
                row_sum = tl.sum(tl.sum(products, axis=2), axis=1)
                acc += tl.where(rows[:, None] == m, row_sum[None, :], 0.0)
    return acc, partial


@triton.jit
def _nf4_matvec_kernel(
    x_ptr, x_row_stride, x_col_stride,
    packed_ptr, absmax_ptr, code_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize: tl.constexpr,
    bias_ptr, t_ptr, t_row_stride, lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale,
    out_ptr, out_row_stride,
    n_rows, n_out, n_in, rank,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, WEIGHT_BF16: tl.constexpr, WEIGHT_FP16: tl.constexpr,
    BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    mask_features = features < n_out
    mask_rows = rows < n_rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask_cols = cols < n_in
        mask_tile = mask_features[:, None] & mask_cols[None, :]
        element = features[:, None].to(tl.int64) * n_in + cols[None, :]
        packed = tl.load(packed_ptr + element // 2, mask=mask_tile, other=0).to(tl.int32)
        nibble = tl.where(element % 2 == 0, packed >> 4, packed & 0xF)
        absmax = _block_absmax(
            absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize, element // BLOCKSIZE,
            mask_tile, NESTED,
        )
        w = tl.load(code_ptr + nibble) * absmax  # [BLOCK_N, BLOCK_K], as dequantize_nf4 computes it in fp32
        if WEIGHT_BF16:  # rounded to the weight's dtype as the dense weight holds it
            w = _fp32_to_bf16_rne(w).to(tl.float32)
        if WEIGHT_FP16:
            w = w.to(tl.float16).to(tl.float32)
        w = tl.where(mask_tile, w, 0.0)
        x = tl.load(
            x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride,
            mask=mask_rows[:, None] & mask_cols[None, :], other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    _store_rows(
        acc, rows, features, n_rows, n_out, bias_ptr,
        _adapter_t(t_ptr, t_row_stride, rank, rows, n_rows, HAS_LORA, BLOCK_R, 0, 1),
        _adapter_b(lora_b_ptr, lora_b_row_stride, lora_b_col_stride, features, n_out, rank, HAS_LORA, BLOCK_R),
        scale, out_ptr, out_row_stride, BIAS, HAS_LORA,
    )
