"""`nf4_matvec`'s word kernel: the blocked NF4 matrix-vector product (same forward as `nf4_matvec.py`,
y[m, n] = Σ_k x[m, k] · code[q[n, k]] · absmax[n, k // blocksize] + b[n] + s · (x Aᵀ Bᵀ)[m, n], no backward:
inference only) with the weight read as 32-bit words of eight codes each, decoded eight at a time.

Why: where the blocked kernel is bound by the instructions it spends on each weight (on the H200 the bf16 code
book's fewer instructions took 14-29% off its time; with the nested absmax of the time, a fifth fewer bought
nothing), most of them are the code lookup and the handling of x (compiled offline for sm_90, 8 x 512 tile: 310
instructions for the 32 weights of a thread's step). Read as words, the nibbles of two bytes are already a
`prmt` selector in element order (`nf4_codes._nf4_word_lookup_ptx`: 27 instructions for eight bf16 codes instead
of 41), bf16 x comes as four 32-bit pairs a word, and a block's scale multiplies each word's sum of eight
products once (offline, the same tile: 216 instructions for the thread's 32 weights):

    s[n, w]  = Σ_{j<8} code[q[n, 8w + j]] · x[8w + j]          (fp32, one multiply then seven fused adds)
    acc[n]  += s[n, w] · absmax[n, 8w // blocksize]

With bf16 weights and bf16 x (`nf4_matvec.BF16_PAIR_PRODUCTS`, BF16_CODES == CODE_PAIRS) the lookup leaves the
codes as bf16 pairs and s[n, w] is four `fma.rn.bf16x2` on them and x's pairs as read (the even and the odd
weights each a bf16 chain of four), the two halves added in fp32 (`nf4_codes.code_pair_sums`; offline, 167
instructions for the thread's 32 weights).

Programs, tiles along K, the K split with its arrival counter, PDL and software pipelining are the blocked
kernel's (`_nf4_matvec_blocked_kernel`); the layout must be the blocked kernel's too: K a multiple of the
quantisation block, x's columns contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from unsloth_lite.kernels.dequantize_nf4 import _block_absmax
from unsloth_lite.kernels.lora_down import (
    _await_first_products,
    _count_reader,
    _first_product_program,
)
from unsloth_lite.kernels.matvec_epilogue import (
    _adapter_b,
    _adapter_t,
    _early_t,
    _finish_product,
    _tile_range,
)
from unsloth_lite.kernels.nf4_codes import CODE_PAIRS, _nf4_word_codes, code_pair_sums


@triton.jit
def _x_elements(x, X_PAIRS: tl.constexpr):
    """The eight fp32 tensors x[..., j], j = 0..7, of each word's x elements (nested splits of the last axis, in
    registers). X_PAIRS: x `[A, B, 4]` int32, bf16 pairs with the even element in the low half (a shift or a mask
    each); else x `[A, B, 8]` in any float dtype."""
    if X_PAIRS:
        p0, p1, p2, p3 = _x_pairs(x)
        x0, x1, x2, x3 = _low_bf16(p0), _high_bf16(p0), _low_bf16(p1), _high_bf16(p1)
        x4, x5, x6, x7 = _low_bf16(p2), _high_bf16(p2), _low_bf16(p3), _high_bf16(p3)
    else:
        a, b = tl.split(tl.reshape(x.to(tl.float32), (x.shape[0], x.shape[1], 2, 2, 2)))
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        x0, x4 = tl.split(a0)
        x2, x6 = tl.split(a1)
        x1, x5 = tl.split(b0)
        x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_pairs(x):
    """The four int32 tensors of each word's bf16 pairs of x `[A, B, 4]` (elements 2i and 2i + 1 in pair i)."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 2, 2)))
    p0, p2 = tl.split(a)
    p1, p3 = tl.split(b)
    return p0, p1, p2, p3


@triton.jit
def _low_bf16(pair):
    return (pair << 16).to(tl.float32, bitcast=True)


@triton.jit
def _high_bf16(pair):
    return (pair & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _word_sums(codes, x, X_PAIRS: tl.constexpr, BF16_CODES: tl.constexpr):
    """Σ_j codes[j] · x[j] over the eight weights of each word: codes `[N, B, W]` each, x `[B, W, 8 or 4]`
    (`_x_elements`); with BF16_CODES == CODE_PAIRS (x in pairs), four code pairs multiplied with x's pairs
    (`code_pair_sums`)."""
    if BF16_CODES == CODE_PAIRS:
        p0, p1, p2, p3 = _x_pairs(x)
        s = code_pair_sums(codes, p0[None, :, :], p1[None, :, :], p2[None, :, :], p3[None, :, :])
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_elements(x, X_PAIRS)
        c0, c1, c2, c3, c4, c5, c6, c7 = codes
        s = c0 * x0[None, :, :]  # one chain of fused multiply-adds
        s = c1 * x1[None, :, :] + s
        s = c2 * x2[None, :, :] + s
        s = c3 * x3[None, :, :] + s
        s = c4 * x4[None, :, :] + s
        s = c5 * x5[None, :, :] + s
        s = c6 * x6[None, :, :] + s
        s = c7 * x7[None, :, :] + s
    return s


@triton.jit
def _lane_tables(tables_ptr, PTX: tl.constexpr, BF16_CODES: tl.constexpr):
    """The lookup's eight table registers, each lane's own copy (`nf4_matvec_state.lane_tables`), held for the
    whole loop; zeros where the lookup reads the code book from memory (no PTX)."""
    if PTX:
        lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        tables_ptr += lane * 8
        t0, t1, t2, t3 = tl.load(tables_ptr), tl.load(tables_ptr + 1), tl.load(tables_ptr + 2), tl.load(tables_ptr + 3)
        if BF16_CODES:
            t4, t5, t6, t7 = t0, t0, t0, t0
        else:
            t4, t5 = tl.load(tables_ptr + 4), tl.load(tables_ptr + 5)
            t6, t7 = tl.load(tables_ptr + 6), tl.load(tables_ptr + 7)
    else:
        t0, t1, t2, t3, t4, t5, t6, t7 = 0, 0, 0, 0, 0, 0, 0, 0
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _word_loads(
    b0, words_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize: tl.constexpr,
    features, mask_features, blocks_per_row,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, WHOLE_TILES: tl.constexpr,
):
    """The loads of one weight's tile of quantisation blocks [b0, b0 + BLOCKS_PER_TILE): (its words `[N, B, W]`,
    each block's absmax `[N, B, 1]`, each word's index in the row `[B, W]`, which blocks lie in the row `[B]`)."""
    WORDS: tl.constexpr = BLOCKSIZE // 8  # words of one quantisation block
    blocks = b0 + tl.arange(0, BLOCKS_PER_TILE)
    mask_blocks = (blocks < blocks_per_row) | WHOLE_TILES
    mask_nb = mask_features[:, None] & mask_blocks[None, :]
    absmax = _block_absmax(
        absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize,
        features[:, None].to(tl.int64) * blocks_per_row + blocks[None, :], mask_nb, NESTED,
    )[:, :, None]
    word_in_row = blocks[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [BLOCKS_PER_TILE, WORDS]
    row_words = features.to(tl.int64) * (blocks_per_row * WORDS)
    words = tl.load(words_ptr + row_words[:, None, None] + word_in_row[None, :, :], mask=mask_nb[:, :, None],
                    other=0)
    return words, absmax, word_in_row, mask_blocks


@triton.jit
def _word_tile(
    b0, words_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize: tl.constexpr,
    code_ptr, tables, features, mask_features, blocks_per_row,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, PTX: tl.constexpr,
    BF16_CODES: tl.constexpr, WHOLE_TILES: tl.constexpr, PDL_WAIT: tl.constexpr,
):
    """One weight's tile (`_word_loads`), its words decoded: (its eight codes a word `[N, B, W]` each, absmax,
    word_in_row, mask_blocks). PDL_WAIT: `gdc_wait` once the weight's loads are issued (nothing another kernel
    writes is read before)."""
    words, absmax, word_in_row, mask_blocks = _word_loads(
        b0, words_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize, features,
        mask_features, blocks_per_row, BLOCKSIZE, NESTED, BLOCKS_PER_TILE, WHOLE_TILES,
    )
    if PDL_WAIT:
        gdc_wait()  # returns at once after the first tile
    t0, t1, t2, t3, t4, t5, t6, t7 = tables
    # masked words: finite codes, x is 0
    codes = _nf4_word_codes(words, code_ptr, t0, t1, t2, t3, t4, t5, t6, t7, PTX, BF16_CODES)
    return codes, absmax, word_in_row, mask_blocks


@triton.jit
def _word_x(x_ptr, row, x_row_stride, word_in_row, mask_blocks, n_rows, X_PAIRS: tl.constexpr):
    """Row `row` of x for a tile's words `[B, W, 8 or 4]` (`_x_elements`' layouts), 0 past the row and past
    n_rows."""
    X_WIDTH: tl.constexpr = 4 if X_PAIRS else 8  # x's values for one word
    x_offsets = word_in_row[:, :, None] * X_WIDTH + tl.arange(0, X_WIDTH)[None, None, :]
    mask_row = mask_blocks & ((mask_blocks.to(tl.int32) * 0 + row) < n_rows)
    return tl.load(x_ptr + row * x_row_stride + x_offsets, mask=mask_row[:, None, None], other=0)


@triton.jit
def _word_walk(
    x_ptr, x_row_stride, words_ptr, absmax_ptr, code_ptr, tables_ptr, nested_code_ptr, nested_absmax_ptr,
    offset_ptr, nested_blocksize: tl.constexpr, features, n_rows, n_out, n_in, first_block, end_block,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, PTX: tl.constexpr, BF16_CODES: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr, WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """(acc `[BLOCK_M, BLOCK_N]`, partial `[BLOCK_N, BLOCKS_PER_TILE, WORDS]`): the word kernel's walk over
    quantisation blocks [first_block, end_block) of the rows `features` of one weight, its sums for several rows
    in acc, for one row kept elementwise in partial (`_finish_product` reduces them). PREFETCH: each step issues
    the next tile's loads into registers before it decodes its own (STAGES ignored)."""
    WORDS: tl.constexpr = BLOCKSIZE // 8
    mask_features = (features < n_out) | WHOLE_TILES
    blocks_per_row = n_in // BLOCKSIZE
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    partial = tl.zeros([BLOCK_N, BLOCKS_PER_TILE, WORDS], dtype=tl.float32)  # one row: reduced at the end
    tables = _lane_tables(tables_ptr, PTX, BF16_CODES)
    if PREFETCH:
        acc, partial = _prefetched_word_walk(
            acc, partial, x_ptr, x_row_stride, words_ptr, absmax_ptr, code_ptr, tables, nested_code_ptr,
            nested_absmax_ptr, offset_ptr, nested_blocksize, features, mask_features, blocks_per_row, n_rows,
            first_block, end_block, BLOCKSIZE, NESTED, BLOCK_M, BLOCKS_PER_TILE, PTX, BF16_CODES, PDL, WHOLE_TILES,
            X_PAIRS,
        )
    else:
        if PDL and STAGES > 1:
            gdc_wait()  # the pipelined loop loads x for later tiles before its body runs: wait first
        for b0 in tl.range(first_block, end_block, BLOCKS_PER_TILE, num_stages=STAGES):
            codes, absmax, word_in_row, mask_blocks = _word_tile(
                b0, words_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize,
                code_ptr, tables, features, mask_features, blocks_per_row, BLOCKSIZE, NESTED, BLOCKS_PER_TILE, PTX,
                BF16_CODES, WHOLE_TILES, PDL and STAGES == 1,
            )
            x = _word_x(x_ptr, 0, x_row_stride, word_in_row, mask_blocks, n_rows, X_PAIRS)
            acc, partial = _word_tile_sums(
                acc, partial, codes, absmax, x, x_ptr, x_row_stride, word_in_row, mask_blocks, n_rows, BLOCK_M,
                X_PAIRS, BF16_CODES,
            )
    return acc, partial


@triton.jit
def _accumulate(products, m, rows, acc, partial, BLOCK_M: tl.constexpr):
    """(acc, partial) with row m's products of a tile `[N, B, W]` added: elementwise into partial for one row
    (reduced once at the end), reduced into row m of acc `[BLOCK_M, N]` for several."""
    if BLOCK_M == 1:
        partial += products
    else:
        acc += tl.where(rows[:, None] == m, tl.sum(tl.sum(products, axis=2), axis=1)[None, :], 0.0)
    return acc, partial


@triton.jit
def _word_tile_sums(acc, partial, codes, absmax, x, x_ptr, x_row_stride, word_in_row, mask_blocks, n_rows,
                    BLOCK_M: tl.constexpr, X_PAIRS: tl.constexpr, BF16_CODES: tl.constexpr):
    """acc and partial (`_word_walk`) with one decoded tile's products added; x: row 0's tile, the others read
    here."""
    rows = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        if m > 0:
            x = _word_x(x_ptr, m, x_row_stride, word_in_row, mask_blocks, n_rows, X_PAIRS)
        acc, partial = _accumulate(_word_sums(codes, x, X_PAIRS, BF16_CODES) * absmax, m, rows, acc, partial, BLOCK_M)
    return acc, partial


@triton.jit
def _prefetched_word_walk(
    acc, partial, x_ptr, x_row_stride, words_ptr, absmax_ptr, code_ptr, tables, nested_code_ptr,
    nested_absmax_ptr, offset_ptr, nested_blocksize: tl.constexpr, features, mask_features, blocks_per_row, n_rows,
    first_block, end_block, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, PTX: tl.constexpr, BF16_CODES: tl.constexpr, PDL: tl.constexpr,
    WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr,
):
    """`_word_walk` with PREFETCH: the tile a step decodes was loaded by the step before, into registers (its
    bytes arrive while that step computes; no shared memory, no barrier). The last step loads its own tile
    again (in L1 or L2) rather than masking a load past the walk. Row 0's x comes with its tile; other rows' are
    read as the tile is used."""
    last_block = first_block + (end_block - 1 - first_block) // BLOCKS_PER_TILE * BLOCKS_PER_TILE
    words, absmax, word_in_row, mask_blocks = _word_loads(
        first_block, words_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize,
        features, mask_features, blocks_per_row, BLOCKSIZE, NESTED, BLOCKS_PER_TILE, WHOLE_TILES,
    )
    if PDL:
        gdc_wait()  # x is the kernel before's output
    x = _word_x(x_ptr, 0, x_row_stride, word_in_row, mask_blocks, n_rows, X_PAIRS)
    t0, t1, t2, t3, t4, t5, t6, t7 = tables
    for b0 in range(first_block, end_block, BLOCKS_PER_TILE):
        next_words, next_absmax, next_word_in_row, next_mask_blocks = _word_loads(
            tl.minimum(b0 + BLOCKS_PER_TILE, last_block), words_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr,
            offset_ptr, nested_blocksize, features, mask_features, blocks_per_row, BLOCKSIZE, NESTED,
            BLOCKS_PER_TILE, WHOLE_TILES,
        )
        next_x = _word_x(x_ptr, 0, x_row_stride, next_word_in_row, next_mask_blocks, n_rows, X_PAIRS)
        codes = _nf4_word_codes(words, code_ptr, t0, t1, t2, t3, t4, t5, t6, t7, PTX, BF16_CODES)
        acc, partial = _word_tile_sums(
            acc, partial, codes, absmax, x, x_ptr, x_row_stride, word_in_row, mask_blocks, n_rows, BLOCK_M, X_PAIRS,
            BF16_CODES,
        )
        words, absmax, word_in_row, mask_blocks = next_words, next_absmax, next_word_in_row, next_mask_blocks
        x = next_x
    return acc, partial


@triton.jit
def _nf4_matvec_words_kernel(
    x_ptr, x_row_stride,
    words_ptr, absmax_ptr, code_ptr, tables_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
    nested_blocksize: tl.constexpr,
    bias_ptr, t_ptr, t_row_stride, lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale,
    out_ptr, out_row_stride, partial_ptr, arrivals_ptr,
    n_rows, n_out, n_in, rank,
    xv_ptr, xv_row_stride, xv_col_stride, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, width, first_partial_ptr,
    first_arrivals_ptr, flags_ptr, first_splits, t_part_stride,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
    BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, BLOCK_R: tl.constexpr,
    PTX: tl.constexpr, BF16_CODES: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    STAGES: tl.constexpr, WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
    FIRST_PRODUCTS: tl.constexpr, FIRST_BLOCK_K: tl.constexpr, T_PARTS: tl.constexpr, T_EARLY: tl.constexpr,
):
    """Program i: features [i · BLOCK_N, (i + 1) · BLOCK_N) for all rows, walking K BLOCKS_PER_TILE quantisation
    blocks at a time (with SPLIT_K, tiles a split, program (i, j) takes tiles [j · SPLIT_K, (j + 1) · SPLIT_K),
    `_sum_of_splits`). `words_ptr`: the packed
    weight as int32 words; PTX: the lookup in registers (compiled only), else from the code book `code_ptr`.
    PDL and STAGES as in `_nf4_matvec_blocked_kernel`: nothing another kernel may write is read before
    `gdc_wait`. WHOLE_TILES: N a multiple of BLOCK_N and K of the tile (every projection of the Qwen models):
    no masks. X_PAIRS: x is bf16, read as int32 pairs (`x_ptr` int32, its row stride in pairs).
    FIRST_PRODUCTS (no SPLIT_K): the adapter's first product t = x Aᵀ in the same launch, by its first
    width · first_splits programs (`lora_down._first_product_program`; x as `xv_ptr`, its elements), which every
    other program awaits before its epilogue (`_await_first_products`). T_PARTS: t given as that many parts
    `t_part_stride` apart, summed in the epilogue (`matvec_epilogue._output_values`). T_EARLY: t, given, loaded
    before the walk (`matvec_epilogue.t_before_walk`)."""
    if FIRST_PRODUCTS:
        writers = width * first_splits
        if tl.program_id(0) < writers:
            _first_product_program(
                xv_ptr, xv_row_stride, xv_col_stride, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, width, t_ptr,
                t_row_stride, n_rows, n_in, first_partial_ptr, first_arrivals_ptr, flags_ptr, first_splits, BLOCK_M,
                FIRST_BLOCK_K, PDL,
            )
        else:
            _word_program(
                tl.program_id(0) - writers, x_ptr, x_row_stride, words_ptr, absmax_ptr, code_ptr, tables_ptr,
                nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize, bias_ptr, t_ptr, t_row_stride,
                lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale, out_ptr, out_row_stride, partial_ptr,
                arrivals_ptr, n_rows, n_out, n_in, rank, flags_ptr, tl.num_programs(0) - writers, BLOCKSIZE, NESTED,
                BIAS, HAS_LORA, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, BLOCK_R, PTX, BF16_CODES, SPLIT_K, PDL, STAGES,
                WHOLE_TILES, X_PAIRS, PREFETCH, True, t_part_stride, 1, False,
            )
    else:
        _word_program(
            tl.program_id(0), x_ptr, x_row_stride, words_ptr, absmax_ptr, code_ptr, tables_ptr, nested_code_ptr,
            nested_absmax_ptr, offset_ptr, nested_blocksize, bias_ptr, t_ptr, t_row_stride, lora_b_ptr,
            lora_b_row_stride, lora_b_col_stride, scale, out_ptr, out_row_stride, partial_ptr, arrivals_ptr, n_rows,
            n_out, n_in, rank, flags_ptr, 0, BLOCKSIZE, NESTED, BIAS, HAS_LORA, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE,
            BLOCK_R, PTX, BF16_CODES, SPLIT_K, PDL, STAGES, WHOLE_TILES, X_PAIRS, PREFETCH, False, t_part_stride,
            T_PARTS, T_EARLY,
        )


@triton.jit
def _word_program(
    block, x_ptr, x_row_stride, words_ptr, absmax_ptr, code_ptr, tables_ptr, nested_code_ptr, nested_absmax_ptr,
    offset_ptr, nested_blocksize: tl.constexpr, bias_ptr, t_ptr, t_row_stride, lora_b_ptr, lora_b_row_stride,
    lora_b_col_stride, scale, out_ptr, out_row_stride, partial_ptr, arrivals_ptr, n_rows, n_out, n_in, rank,
    flags_ptr, readers, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, BLOCK_R: tl.constexpr,
    PTX: tl.constexpr, BF16_CODES: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
    WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr, PREFETCH: tl.constexpr, AWAIT_T: tl.constexpr,
    t_part_stride, T_PARTS: tl.constexpr, T_EARLY: tl.constexpr,
):
    """Feature block `block` of the word kernel: its walk and its epilogue. AWAIT_T: t comes from the launch's
    first programs (`_await_first_products` before t's load, `_count_reader` once it is issued, the count's round
    trip overlapping the load's). T_EARLY: t, given, loaded before the walk."""
    features = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    first_block, end_block = _tile_range(n_in // BLOCKSIZE, BLOCKS_PER_TILE, SPLIT_K)
    lora_b = _adapter_b(lora_b_ptr, lora_b_row_stride, lora_b_col_stride, features, n_out, rank, HAS_LORA, BLOCK_R)
    t = _early_t(t_ptr, t_row_stride, rank, rows, n_rows, HAS_LORA, BLOCK_R, t_part_stride, T_PARTS, PDL, T_EARLY)
    acc, partial = _word_walk(
        x_ptr, x_row_stride, words_ptr, absmax_ptr, code_ptr, tables_ptr, nested_code_ptr, nested_absmax_ptr,
        offset_ptr, nested_blocksize, features, n_rows, n_out, n_in, first_block, end_block, BLOCKSIZE, NESTED,
        BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, PTX, BF16_CODES, PDL, STAGES, WHOLE_TILES, X_PAIRS, PREFETCH,
    )
    if PDL:
        gdc_launch_dependents()
    if AWAIT_T:
        _await_first_products(flags_ptr, rank)
    if not T_EARLY:
        t = _adapter_t(t_ptr, t_row_stride, rank, rows, n_rows, HAS_LORA, BLOCK_R, t_part_stride, T_PARTS)
    if AWAIT_T:
        _count_reader(flags_ptr, block, readers)
    _finish_product(
        acc, partial, rows, features, n_rows, n_out, partial_ptr, arrivals_ptr, bias_ptr, t, lora_b, scale, out_ptr,
        out_row_stride, BLOCK_M, SPLIT_K, BIAS, HAS_LORA,
    )
