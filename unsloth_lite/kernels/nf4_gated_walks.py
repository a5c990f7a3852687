"""The gate-and-up launch's walks along K (`nf4_gated_matvec.py`): each program's sums of x with its features of
both NF4 weights, gate and up, for all rows, x's tile loaded once for both. The blocked kernel's walk
(`_gated_blocked_sums`: two weights a byte, the code book looked up) and the word kernel's (`_gated_word_sums`:
32-bit words, eight codes decoded at once, STAGES tiles in flight or the next tile in registers a step ahead);
`nf4_matvec_blocked.py` and `nf4_matvec_words.py` describe the two walks for one weight.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_wait

from unsloth_lite.kernels.nf4_codes import _nf4_codes, _nf4_word_codes
from unsloth_lite.kernels.nf4_matvec_blocked import _blocked_tile_loads
from unsloth_lite.kernels.nf4_matvec_words import (
    _accumulate,
    _lane_tables,
    _word_loads,
    _word_sums,
    _word_tile,
    _word_x,
)


@triton.jit
def _tile_codes(b0, packed_ptr, absmax_ptr, table_ptr, features, mask_features, blocks_per_row,
                BLOCKSIZE: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, LOOKUP: tl.constexpr,
                BF16_CODES: tl.constexpr):
    """(code_even · absmax, code_odd · absmax) `[N, B, HALF]` of one weight's tile of quantisation blocks at b0:
    its decoded even and odd weights (the high and the low nibble of each byte)."""
    absmax, packed, _, _ = _blocked_tile_loads(
        b0, packed_ptr, absmax_ptr, absmax_ptr, absmax_ptr, absmax_ptr, 1, features, mask_features,
        blocks_per_row, BLOCKSIZE, False, BLOCKS_PER_TILE,
    )
    code_even, code_odd = _nf4_codes(packed, table_ptr, LOOKUP, BF16_CODES)
    return code_even, code_odd, absmax


@triton.jit
def _tile_products(code_even, code_odd, absmax, x_even, x_odd):
    return (code_even * x_even[None, :, :] + code_odd * x_odd[None, :, :]) * absmax


@triton.jit
def _reduced(acc, partial, BLOCK_M: tl.constexpr):
    if BLOCK_M == 1:
        acc += tl.sum(tl.sum(partial, axis=2), axis=1)[None, :]
    return acc


@triton.jit
def _gated_blocked_sums(
    x_ptr, x_row_stride, x_col_stride, gate_packed_ptr, gate_absmax_ptr, up_packed_ptr, up_absmax_ptr, table_ptr,
    features, n_rows, n_out, n_in, BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr, PDL: tl.constexpr,
):
    """(gate sums, up sums) `[BLOCK_M, BLOCK_N]` over K by the blocked kernel's walk, x's tile loaded once for
    both weights."""
    HALF: tl.constexpr = BLOCKSIZE // 2
    rows = tl.arange(0, BLOCK_M)
    mask_features = features < n_out
    blocks_per_row = n_in // BLOCKSIZE
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    partial_gate = tl.zeros([BLOCK_N, BLOCKS_PER_TILE, HALF], dtype=tl.float32)  # one row: reduced at the end
    partial_up = tl.zeros([BLOCK_N, BLOCKS_PER_TILE, HALF], dtype=tl.float32)
    for b0 in range(0, blocks_per_row, BLOCKS_PER_TILE):
        gate_even, gate_odd, gate_absmax = _tile_codes(
            b0, gate_packed_ptr, gate_absmax_ptr, table_ptr, features, mask_features, blocks_per_row, BLOCKSIZE,
            BLOCKS_PER_TILE, LOOKUP, BF16_CODES)
        up_even, up_odd, up_absmax = _tile_codes(
            b0, up_packed_ptr, up_absmax_ptr, table_ptr, features, mask_features, blocks_per_row, BLOCKSIZE,
            BLOCKS_PER_TILE, LOOKUP, BF16_CODES)
        if PDL:
            gdc_wait()  # returns at once after the first tile
        blocks = b0 + tl.arange(0, BLOCKS_PER_TILE)
        mask_x = (blocks < blocks_per_row)[:, None, None]
        byte_in_row = blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]
        x_pairs_ptr = x_ptr + (2 * byte_in_row[:, :, None] + tl.arange(0, 2)[None, None, :]) * x_col_stride
        for m in tl.static_range(BLOCK_M):
            mask_row = mask_x & ((tl.arange(0, BLOCKS_PER_TILE) * 0 + m) < n_rows)[:, None, None]
            x_even, x_odd = tl.split(tl.load(x_pairs_ptr + m * x_row_stride, mask=mask_row, other=0.0).to(tl.float32))
            gate = _tile_products(gate_even, gate_odd, gate_absmax, x_even, x_odd)
            up = _tile_products(up_even, up_odd, up_absmax, x_even, x_odd)
            acc_gate, partial_gate = _accumulate(gate, m, rows, acc_gate, partial_gate, BLOCK_M)
            acc_up, partial_up = _accumulate(up, m, rows, acc_up, partial_up, BLOCK_M)
    return _reduced(acc_gate, partial_gate, BLOCK_M), _reduced(acc_up, partial_up, BLOCK_M)


@triton.jit
def _gated_word_sums(
    x_ptr, x_row_stride, gate_words_ptr, gate_absmax_ptr, up_words_ptr, up_absmax_ptr, code_ptr, tables_ptr,
    features, n_rows, n_out, n_in, BLOCKSIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, PTX: tl.constexpr, BF16_CODES: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr, WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """`_gated_blocked_sums` by the word kernel's walk (`nf4_matvec_words.py`): both weights read as words, each
    decoded word's sum with x's tile, loaded once for both, scaled by its block's absmax; the loads of STAGES
    tiles in flight, or with PREFETCH the next tile's loaded into registers a step ahead (`_prefetched_word_walk`:
    the last step reloads its own tile)."""
    WORDS: tl.constexpr = BLOCKSIZE // 8
    mask_features = (features < n_out) | WHOLE_TILES
    blocks_per_row = n_in // BLOCKSIZE
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    partial_gate = tl.zeros([BLOCK_N, BLOCKS_PER_TILE, WORDS], dtype=tl.float32)  # one row: reduced at the end
    partial_up = tl.zeros([BLOCK_N, BLOCKS_PER_TILE, WORDS], dtype=tl.float32)
    tables = _lane_tables(tables_ptr, PTX, BF16_CODES)
    t0, t1, t2, t3, t4, t5, t6, t7 = tables
    if PREFETCH:
        last_block = (blocks_per_row - 1) // BLOCKS_PER_TILE * BLOCKS_PER_TILE
        gate_words, gate_absmax, word_in_row, mask_blocks = _word_loads(
            0, gate_words_ptr, gate_absmax_ptr, gate_absmax_ptr, gate_absmax_ptr, gate_absmax_ptr, 1, features,
            mask_features, blocks_per_row, BLOCKSIZE, False, BLOCKS_PER_TILE, WHOLE_TILES,
        )
        up_words, up_absmax, _, _ = _word_loads(
            0, up_words_ptr, up_absmax_ptr, up_absmax_ptr, up_absmax_ptr, up_absmax_ptr, 1, features, mask_features,
            blocks_per_row, BLOCKSIZE, False, BLOCKS_PER_TILE, WHOLE_TILES,
        )
        if PDL:
            gdc_wait()  # x is the kernel before's output
        x = _word_x(x_ptr, 0, x_row_stride, word_in_row, mask_blocks, n_rows, X_PAIRS)
        for b0 in range(0, blocks_per_row, BLOCKS_PER_TILE):
            next_block = tl.minimum(b0 + BLOCKS_PER_TILE, last_block)
            next_gate_words, next_gate_absmax, next_word_in_row, next_mask_blocks = _word_loads(
                next_block, gate_words_ptr, gate_absmax_ptr, gate_absmax_ptr, gate_absmax_ptr, gate_absmax_ptr, 1,
                features, mask_features, blocks_per_row, BLOCKSIZE, False, BLOCKS_PER_TILE, WHOLE_TILES,
            )
            next_up_words, next_up_absmax, _, _ = _word_loads(
                next_block, up_words_ptr, up_absmax_ptr, up_absmax_ptr, up_absmax_ptr, up_absmax_ptr, 1, features,
                mask_features, blocks_per_row, BLOCKSIZE, False, BLOCKS_PER_TILE, WHOLE_TILES,
            )
            next_x = _word_x(x_ptr, 0, x_row_stride, next_word_in_row, next_mask_blocks, n_rows, X_PAIRS)
            gate_codes = _nf4_word_codes(gate_words, code_ptr, t0, t1, t2, t3, t4, t5, t6, t7, PTX, BF16_CODES)
            up_codes = _nf4_word_codes(up_words, code_ptr, t0, t1, t2, t3, t4, t5, t6, t7, PTX, BF16_CODES)
            acc_gate, partial_gate, acc_up, partial_up = _gated_tile_sums(
                gate_codes, gate_absmax, up_codes, up_absmax, x, x_ptr, x_row_stride, word_in_row, mask_blocks,
                n_rows, acc_gate, partial_gate, acc_up, partial_up, BLOCK_M, X_PAIRS, BF16_CODES,
            )
            gate_words, gate_absmax = next_gate_words, next_gate_absmax
            up_words, up_absmax = next_up_words, next_up_absmax
            word_in_row, mask_blocks, x = next_word_in_row, next_mask_blocks, next_x
    else:
        if PDL and STAGES > 1:
            gdc_wait()  # the pipelined loop loads x for later tiles before its body runs: wait first
        for b0 in tl.range(0, blocks_per_row, BLOCKS_PER_TILE, num_stages=STAGES):
            gate_codes, gate_absmax, word_in_row, mask_blocks = _word_tile(
                b0, gate_words_ptr, gate_absmax_ptr, gate_absmax_ptr, gate_absmax_ptr, gate_absmax_ptr, 1, code_ptr,
                tables, features, mask_features, blocks_per_row, BLOCKSIZE, False, BLOCKS_PER_TILE, PTX, BF16_CODES,
                WHOLE_TILES, False,
            )
            up_codes, up_absmax, _, _ = _word_tile(
                b0, up_words_ptr, up_absmax_ptr, up_absmax_ptr, up_absmax_ptr, up_absmax_ptr, 1, code_ptr, tables,
                features, mask_features, blocks_per_row, BLOCKSIZE, False, BLOCKS_PER_TILE, PTX, BF16_CODES,
                WHOLE_TILES, PDL and STAGES == 1,
            )
            x = _word_x(x_ptr, 0, x_row_stride, word_in_row, mask_blocks, n_rows, X_PAIRS)
            acc_gate, partial_gate, acc_up, partial_up = _gated_tile_sums(
                gate_codes, gate_absmax, up_codes, up_absmax, x, x_ptr, x_row_stride, word_in_row, mask_blocks,
                n_rows, acc_gate, partial_gate, acc_up, partial_up, BLOCK_M, X_PAIRS, BF16_CODES,
            )
    return _reduced(acc_gate, partial_gate, BLOCK_M), _reduced(acc_up, partial_up, BLOCK_M)


@triton.jit
def _gated_tile_sums(gate_codes, gate_absmax, up_codes, up_absmax, x, x_ptr, x_row_stride, word_in_row, mask_blocks,
                     n_rows, acc_gate, partial_gate, acc_up, partial_up, BLOCK_M: tl.constexpr, X_PAIRS: tl.constexpr,
                     BF16_CODES: tl.constexpr):
    """The sums (`_accumulate`) with one decoded tile of both weights added; x: row 0's tile, the others read
    here."""
    rows = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        if m > 0:
            x = _word_x(x_ptr, m, x_row_stride, word_in_row, mask_blocks, n_rows, X_PAIRS)
        gate = _word_sums(gate_codes, x, X_PAIRS, BF16_CODES) * gate_absmax
        up = _word_sums(up_codes, x, X_PAIRS, BF16_CODES) * up_absmax
        acc_gate, partial_gate = _accumulate(gate, m, rows, acc_gate, partial_gate, BLOCK_M)
        acc_up, partial_up = _accumulate(up, m, rows, acc_up, partial_up, BLOCK_M)
    return acc_gate, partial_gate, acc_up, partial_up
