"""`nf4_matvec`'s tensor-core kernel: the NF4 matrix-vector product of bf16 x (1 to 8 rows) with the codes decoded
in registers straight into `mma` operands. Same forward as `nf4_matvec.py` with the code book rounded to bf16
(`BF16_CODES`), no backward (inference only):

    y[m, n] = Σ_blocks absmax[n, b] · Σ_{k in b} code_bf16[q[n, k]] · x[m, k] + b[n] + s · (x Aᵀ Bᵀ)[m, n]

Why: the word kernel (`nf4_matvec_words.py`) spends about 54 instructions on eight weights, more than half of them
integer (the lookup, and widening the codes and x from bf16 to fp32), and the H200 issues integer instructions at
half the rate of fp32 ones: it is bound by them, at a third of the memory bandwidth. Here the lookup's bf16 pairs
are an `mma.sync.m16n8k16` operand as they come (no widening), x's bf16 pairs are the other operand as they are
read (no widening, and one copy per lane for all the warp's features), and one `mma` does the multiply-adds of
eight weights a lane: about 23 instructions for eight weights, 21 of them the lookup.

A warp owns 16 features (the `mma`'s rows) and, at a time, one quantisation block of 64 weights along K (the
`mma`'s K, four `mma` of 16); the `mma`'s eight columns are x's rows, so up to 8 rows cost the same. Lane (g, t)
(g = lane / 4, t = lane % 4) reads words 2t and 2t + 1 of the block in features g and g + 8 (8 bytes each) and
x's row g over those words' 16 elements (32 bytes; zeros past x's rows). The slots of K are the `mma`'s to
assign as long as both operands agree, so each lane's words go where the fragment layout puts its lane:

    mma j (word 2t + j // 2, its bf16 pairs p = 2 (j % 2), p + 1):
        a = (pairs p of feature g, of feature g + 8, pairs p + 1 of g, of g + 8), b = (x's pairs p, p + 1)
    d[g, 2t + c], d[g + 8, 2t + c] (c = 0, 1): the block's sums of features g, g + 8 for x's rows 2t + c
    acc += d · absmax[feature, block]      (fp32: the block's scale applied to its exact fp32 sum)

The warps of a program split the row's blocks between them (`WARPS` chunks, summed at the end), and programs
(i, j) of a K split (`SPLIT`) take chunk j of the blocks of feature block i (`matvec_epilogue._sum_of_splits`),
so that a projection of few features still has enough warps in flight. The fragments of the lanes become a
`[8, 16]` tile (x's rows by features) for `matvec_epilogue._finish_product`: bias, adapter, the split's sum.

The lanes' loads and the `mma` are inline PTX on tensors of one element a thread (element i in lane i % 32 of
warp i // 32, Triton's layout for such a tensor); the PTX is not pure, so the compiler neither moves nor repeats
it. Compiled only (`mma.sync` with bf16 operands: compute capability 8.0 or later); the interpreter runs none of
it, so `tests/test_nf4_ptx_lookup.py` runs the block's PTX, its `mma` included, for the 32 lanes of a warp on the
CPU, and the GPU tests run the kernel.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_wait

from unsloth_lite.kernels.matvec_epilogue import _arrival_counters, _finish_product
from unsloth_lite.kernels.nf4_codes import NF4_CODE, word_pair_lines
from unsloth_lite.kernels.nf4_matvec_state import lane_tables
from unsloth_lite.kernels.utils import empty

BLOCK_FEATURES = 16  # an mma's rows
MAX_ROWS = 8  # an mma's columns
MAX_GROUPED = 4  # weights of one grouped launch: the DeltaNet's four input projections


def _block_ptx(shared_lookup: bool) -> str:
    """PTX of one quantisation block for one lane: the four weight words `$8..$11` (words 2t, 2t + 1 of the block
    in feature g, then in feature g + 8), x's pairs `$12..$19`, the two features' absmax `$20, $21`, the four fp32
    accumulators `$4..$7` in and `$0..$3` out. The lookup: `shared_lookup`, `_shared_pair_lines` with the lane's
    column of the pair table in `$22`; else `word_pair_lines` with the bf16 code-book tables in `$22..$25`."""
    pairs = {name: [f"{name}{j}" for j in range(4)] for name in ("ga", "gb", "ha", "hb")}
    lines = [
        "{",
        ".reg .b32 " + ", ".join(r for regs in pairs.values() for r in regs) + ";",
        ".reg .f32 d0, d1, d2, d3, zero;",
        "mov.f32 zero, 0f00000000;",
    ]
    for name, word in zip(pairs, ("$8", "$9", "$10", "$11"), strict=True):
        if shared_lookup:
            lines += _shared_pair_lines(word, "$22", pairs[name])
        else:
            lines += word_pair_lines(word, [f"${22 + i}" for i in range(4)], pairs[name])
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    for j, (g, h) in enumerate((("ga", "ha"), ("ga", "ha"), ("gb", "hb"), ("gb", "hb"))):
        p = 2 * (j % 2)
        c = "zero, zero, zero, zero" if j == 0 else "d0, d1, d2, d3"
        lines.append(f"{mma} {{d0, d1, d2, d3}}, {{{g}{p}, {h}{p}, {g}{p + 1}, {h}{p + 1}}}, "
                     f"{{${12 + 2 * j}, ${13 + 2 * j}}}, {{{c}}};")
    lines += [f"fma.rn.f32 ${i}, d{i}, ${20 + i // 2}, ${4 + i};" for i in range(4)]
    return "\n".join(lines + ["}"])


def _shared_pair_lines(word: str, column: str, pairs: list[str]) -> list[str]:
    """PTX lines (a scope of their own) that decode the word `word` into four bf16 pairs (`word_pair_lines`' layout)
    from the pair table in shared memory: byte j of the word indexes row byte of `[256, 32]` (one entry a lane,
    so a warp's 32 lookups fall in 32 banks), `column` the address of the lane's entry of row 0."""
    lines = ["{", ".reg .b32 e, a;"]
    for j, pair in enumerate(pairs):
        lines += [f"prmt.b32 e, {word}, 0, 0x444{j};", f"mad.lo.u32 a, e, 128, {column};",
                  f"ld.shared.b32 {pair}, [a];"]
    return lines + ["}"]


PAIR_TABLE_WORDS = tl.constexpr(256 * 32)
# With PDL, the 128-byte lines of the first 16 · PREFETCH_LINES blocks of a warp's rows prefetched into L2 before
# the wait for the kernel before (a hint: no registers, no ordering)
PREFETCH_LINES = 1
BLOCK_PTX = tl.constexpr(_block_ptx(shared_lookup=False))
SHARED_BLOCK_PTX = tl.constexpr(_block_ptx(shared_lookup=True))
BLOCK_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["f"] * 4 + ["r"] * 12 + ["f"] * 2 + ["r"] * 4))
SHARED_BLOCK_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["f"] * 4 + ["r"] * 12 + ["f"] * 2 + ["r"]))
# the pair table's shared memory: declared once in the kernel, its address returned
PAIR_TABLE_PTX = tl.constexpr(f".shared .align 16 .b32 nf4_pair_table[{256 * 32}];\n"
                              "mov.u32 $0, nf4_pair_table;")
PREFETCH_PTX = tl.constexpr("prefetch.global.L2 [$1];\nprefetch.global.L2 [$2];\nmov.u32 $0, 0;")
STORE_PTX = tl.constexpr("st.shared.v4.b32 [$1], {$2, $2, $2, $2};\nmov.u32 $0, 0;")


@triton.jit
def _low(pair):
    return pair.to(tl.int32)


@triton.jit
def _high(pair):
    return (pair >> 32).to(tl.int32)


@triton.jit
def _mma_sums(
    x_ptr, x_row_stride, words_ptr, absmax_ptr, tables_ptr, n_rows, n_out, n_in, feature_block,
    WARPS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    """`[8, 16]` fp32: x's rows by features [16 · feature_block, + 16) summed over chunk `program_id(1)` of SPLIT
    along K, the program's WARPS warps each taking a part of the chunk (module docstring). x_ptr: bf16 x as
    int32 pairs, row stride in pairs, 16-byte aligned rows; words_ptr: the packed weight as bytes; absmax_ptr:
    fp32, one a 64-weight block; tables_ptr: SHARED, the pair table (`pair_table`: the lookup from shared
    memory, filled by the program first), else `lane_tables` (bf16: the lookup in registers). K a multiple of
    64. PDL: x is read only after `gdc_wait`."""
    THREADS: tl.constexpr = 32 * WARPS
    thread = tl.arange(0, THREADS)
    lane = thread % 32
    warp = thread // 32
    g = lane // 4
    t = lane % 4
    feature_g = tl.minimum(feature_block * 16 + g, n_out - 1)  # past N: a real row, never stored
    feature_h = tl.minimum(feature_block * 16 + g + 8, n_out - 1)
    blocks_per_row = n_in // 64
    chunks = SPLIT * WARPS
    chunk_blocks = tl.cdiv(blocks_per_row, chunks)
    first_block = (tl.program_id(1) * WARPS + warp) * chunk_blocks
    # 8-byte loads, one a thread: the weight's words 2t, 2t + 1 of a block in features g and g + 8, and x's row g
    # over those words' 16 elements (four loads); contiguity hidden so that each stays one element a thread
    pair_words = words_ptr.to(tl.pointer_type(tl.int64))
    g_words = pair_words + feature_g.to(tl.int64) * (n_in // 16) + t
    h_words = pair_words + feature_h.to(tl.int64) * (n_in // 16) + t
    x_lane = x_ptr.to(tl.pointer_type(tl.int64)) + g * (x_row_stride // 2) + 4 * t
    x_rows = g < n_rows
    if SHARED:  # the pair table copied into each of the 32 columns of `[256, 32]`, 16 bytes a store
        table = tl.inline_asm_elementwise(PAIR_TABLE_PTX, "=r,r", [thread], dtype=tl.int32, is_pure=False, pack=1)
        for m in tl.static_range(PAIR_TABLE_WORDS // 4 // THREADS):  # one-dimensional: one element a thread
            chunk = m * THREADS + thread
            tl.inline_asm_elementwise(STORE_PTX, "=r,r,r", [table + chunk * 16, tl.load(tables_ptr + chunk // 8)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        t0 = table + lane * 4
        t1, t2, t3 = t0, t0, t0
    else:
        tables_ptr += lane * 8
        t0, t1 = tl.load(tables_ptr), tl.load(tables_ptr + 1)
        t2, t3 = tl.load(tables_ptr + 2), tl.load(tables_ptr + 3)
    acc0 = tl.zeros([THREADS], dtype=tl.float32)
    acc1 = tl.zeros([THREADS], dtype=tl.float32)
    acc2 = tl.zeros([THREADS], dtype=tl.float32)
    acc3 = tl.zeros([THREADS], dtype=tl.float32)
    if PDL:  # the weight does not depend on the kernel before: its first lines into L2 while that one finishes
        for p in tl.static_range(PREFETCH_LINES):
            block = tl.minimum(first_block + 16 * p + 4 * t, blocks_per_row - 1)  # 4 blocks a 128-byte line
            tl.inline_asm_elementwise(PREFETCH_PTX, "=r,l,l", [g_words + block * 4, h_words + block * 4],
                                      dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()
    for step in tl.range(0, chunk_blocks, num_stages=STAGES):
        block = first_block + step
        in_row = block < blocks_per_row
        block = tl.minimum(block, blocks_per_row - 1)  # past the row: a real block, its absmax taken as 0
        g_pair = tl.load(tl.max_contiguous(g_words + block * 4, 1))
        h_pair = tl.load(tl.max_contiguous(h_words + block * 4, 1))
        x_at = tl.max_contiguous(x_lane + block * 16, 1)
        x01 = tl.load(x_at, mask=x_rows, other=0)
        x23 = tl.load(x_at + 1, mask=x_rows, other=0)
        x45 = tl.load(x_at + 2, mask=x_rows, other=0)
        x67 = tl.load(x_at + 3, mask=x_rows, other=0)
        scale_g = tl.load(absmax_ptr + feature_g.to(tl.int64) * blocks_per_row + block, mask=in_row, other=0.0)
        scale_h = tl.load(absmax_ptr + feature_h.to(tl.int64) * blocks_per_row + block, mask=in_row, other=0.0)
        operands = [acc0, acc1, acc2, acc3, _low(g_pair), _high(g_pair), _low(h_pair), _high(h_pair),
                    _low(x01), _high(x01), _low(x23), _high(x23), _low(x45), _high(x45), _low(x67), _high(x67),
                    scale_g, scale_h]
        if SHARED:
            acc0, acc1, acc2, acc3 = tl.inline_asm_elementwise(
                SHARED_BLOCK_PTX, SHARED_BLOCK_CONSTRAINTS, operands + [t0],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
        else:
            acc0, acc1, acc2, acc3 = tl.inline_asm_elementwise(
                BLOCK_PTX, BLOCK_CONSTRAINTS, operands + [t0, t1, t2, t3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
    # the warps' chunks summed: lane (g, t)'s four sums, then the [rows, features] tile
    c0 = tl.sum(tl.reshape(acc0, (WARPS, 32)), axis=0)
    c1 = tl.sum(tl.reshape(acc1, (WARPS, 32)), axis=0)
    c2 = tl.sum(tl.reshape(acc2, (WARPS, 32)), axis=0)
    c3 = tl.sum(tl.reshape(acc3, (WARPS, 32)), axis=0)
    # element (g, t, c, h) = d[feature g + 8h][row 2t + c]
    lanes = tl.reshape(tl.join(tl.join(c0, c1), tl.join(c2, c3)), (8, 4, 2, 2))
    return tl.reshape(tl.permute(lanes, (1, 2, 3, 0)), (8, 16))


@triton.jit
def _nf4_matvec_mma_kernel(
    x_ptr, x_row_stride, words_ptr, absmax_ptr, tables_ptr,
    bias_ptr, t_ptr, t_row_stride, lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale,
    out_ptr, out_row_stride, partial_ptr, arrivals_ptr,
    n_rows, n_out, n_in, rank,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr,
    WARPS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    """Program (i, j): features [16 i, 16 i + 16) over chunk j of SPLIT along K (`_mma_sums`), then bias,
    adapter and the split's sum (`matvec_epilogue._finish_product`)."""
    acc = _mma_sums(x_ptr, x_row_stride, words_ptr, absmax_ptr, tables_ptr, n_rows, n_out, n_in, tl.program_id(0),
                    WARPS, SPLIT, STAGES, PDL, SHARED, PREFETCH_LINES)
    _finish_product(
        acc, acc, tl.arange(0, 8), tl.program_id(0) * 16 + tl.arange(0, 16), n_rows, n_out, partial_ptr,
        arrivals_ptr, bias_ptr, t_ptr, t_row_stride, rank, lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale,
        out_ptr, out_row_stride, 8, PDL, SPLIT > 1, HAS_BIAS, HAS_LORA, BLOCK_R,
    )


def mma_tile(n_out: int, n_in: int) -> tuple[int, int, int]:
    """(warps a program, K split, pipelined stages) of the tensor-core kernel for a weight `[n_out, n_in]`: enough
    warps in flight to keep the H200's memory busy (about 16 a multiprocessor, 132 of them) while each warp still
    walks a few blocks."""
    feature_blocks = triton.cdiv(n_out, BLOCK_FEATURES)
    blocks = n_in // 64
    chunks = max(1, min(blocks // 4, triton.cdiv(132 * 16, feature_blocks)))
    warps = 4 if chunks >= 4 else chunks if chunks in (1, 2) else 2
    split = max(1, chunks // warps)
    return warps, split, 3


def _mma_tables(x2d: torch.Tensor, shared: bool) -> torch.Tensor | None:
    """The lookup's table where x fits the tensor-core kernels (bf16, at most 8 rows, 16-byte aligned rows), else
    None, as where the table can't be made now (a capture)."""
    if x2d.dtype != torch.bfloat16 or x2d.shape[0] > MAX_ROWS or x2d.stride(1) != 1:
        return None
    if x2d.stride(0) % 8 or x2d.data_ptr() % 16:
        return None
    return pair_table(x2d.device) if shared else lane_tables(x2d.device, True)


def _split_scratch(x2d: torch.Tensor, split: int, n_out: int, programs: int):
    """(partial `[split, 8, n_out]` fp32, arrival counters) of a K split, or (None, None) without one."""
    if split == 1:
        return None, None
    return empty((split, MAX_ROWS, n_out), torch.float32, x2d.device), _arrival_counters(x2d.device, programs)


def mma_matvec(x2d, packed, absmax, bias, t, rank, lora_b, scale, out, pdl: bool, shared: bool, tile=None) -> bool:
    """`out` = the product of x2d `[rows, K]` and the packed NF4 weight `[N, K]` (bytes; bf16 codes, 64-weight
    blocks, fp32 `absmax` a block) with bias and adapter (`t` `[rows, r]`, `lora_b` `[N, r]` where rank > 0) by
    `_nf4_matvec_mma_kernel`, its pair table in shared memory with `shared`; False (nothing launched) where x
    does not fit it (`_mma_tables`)."""
    n_out, n_in = out.shape[1], x2d.shape[1]
    tables = _mma_tables(x2d, shared)
    if tables is None or packed.data_ptr() % 8:
        return False
    warps, split, stages = tile or mma_tile(n_out, n_in)
    feature_blocks = triton.cdiv(n_out, BLOCK_FEATURES)
    partial, arrivals = _split_scratch(x2d, split, n_out, feature_blocks)
    x_pairs = x2d.view(torch.int32)
    _nf4_matvec_mma_kernel[(feature_blocks, split)](
        x_pairs, x_pairs.stride(0), packed.reshape(-1), absmax, tables,
        bias if bias is not None else out, t, t.stride(0), lora_b, lora_b.stride(0), lora_b.stride(1), float(scale),
        out, out.stride(0), out if partial is None else partial, out if arrivals is None else arrivals,
        x2d.shape[0], n_out, n_in, rank,
        HAS_BIAS=bias is not None, HAS_LORA=rank > 0, BLOCK_R=max(2, triton.next_power_of_2(rank)),
        WARPS=warps, SPLIT=split, STAGES=stages, PDL=pdl, SHARED=shared, PREFETCH_LINES=PREFETCH_LINES,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )
    return True


@triton.jit
def _nf4_grouped_mma_kernel(
    x_ptr, x_row_stride, tables_ptr, t_ptr, t_row_stride, arrivals_ptr,
    words0, absmax0, bias0, b0, b0_row_stride, b0_col_stride, scale0, out0, partial0, n_out0, t_col0, rank0, end0,
    words1, absmax1, bias1, b1, b1_row_stride, b1_col_stride, scale1, out1, partial1, n_out1, t_col1, rank1, end1,
    words2, absmax2, bias2, b2, b2_row_stride, b2_col_stride, scale2, out2, partial2, n_out2, t_col2, rank2, end2,
    words3, absmax3, bias3, b3, b3_row_stride, b3_col_stride, scale3, out3, partial3, n_out3, t_col3, rank3,
    n_rows, n_in,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr,
    WARPS: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    """Program (p, j): weight i, the first with p < end_i (slots past the last weight repeat it and are never
    reached), its feature block p - end_{i-1} over chunk j along K, as `_nf4_matvec_mma_kernel`'s program."""
    pid = tl.program_id(0)
    if pid < end0:
        words, absmax, bias, lora_b, scale, out = words0, absmax0, bias0, b0, scale0, out0
        partial, n_out = partial0, n_out0
        b_row_stride, b_col_stride, t_col, rank, start = b0_row_stride, b0_col_stride, t_col0, rank0, 0
    elif pid < end1:
        words, absmax, bias, lora_b, scale, out = words1, absmax1, bias1, b1, scale1, out1
        partial, n_out = partial1, n_out1
        b_row_stride, b_col_stride, t_col, rank, start = b1_row_stride, b1_col_stride, t_col1, rank1, end0
    elif pid < end2:
        words, absmax, bias, lora_b, scale, out = words2, absmax2, bias2, b2, scale2, out2
        partial, n_out = partial2, n_out2
        b_row_stride, b_col_stride, t_col, rank, start = b2_row_stride, b2_col_stride, t_col2, rank2, end1
    else:
        words, absmax, bias, lora_b, scale, out = words3, absmax3, bias3, b3, scale3, out3
        partial, n_out = partial3, n_out3
        b_row_stride, b_col_stride, t_col, rank, start = b3_row_stride, b3_col_stride, t_col3, rank3, end2
    acc = _mma_sums(x_ptr, x_row_stride, words, absmax, tables_ptr, n_rows, n_out, n_in, pid - start,
                    WARPS, SPLIT, STAGES, PDL, SHARED, PREFETCH_LINES)
    _finish_product(
        acc, acc, tl.arange(0, 8), (pid - start) * 16 + tl.arange(0, 16), n_rows, n_out, partial, arrivals_ptr, bias,
        t_ptr + t_col, t_row_stride, rank, lora_b, b_row_stride, b_col_stride, scale, out, n_out,
        8, PDL, SPLIT > 1, HAS_BIAS, HAS_LORA, BLOCK_R,
    )


def mma_grouped_matvec(x2d, products, t, pdl: bool, shared: bool, tile=None) -> bool:
    """The products of `nf4_grouped_matvec` in one `_nf4_grouped_mma_kernel` launch: `products` (2 to 4), each
    (packed bytes, fp32 absmax, bias or None, B or None, scale, out `[rows, N]` contiguous, t's first column,
    rank); t fp32 `[rows, Σ r]` or None. False (nothing launched) where x does not fit (`_mma_tables`)."""
    tables = _mma_tables(x2d, shared)
    if tables is None or any(packed.data_ptr() % 8 for packed, *_ in products):
        return False
    n_in = x2d.shape[1]
    warps, split, stages = tile or mma_tile(max(out.shape[1] for *_, out, _, _ in products), n_in)
    ends = list(itertools.accumulate(triton.cdiv(out.shape[1], BLOCK_FEATURES) for *_, out, _, _ in products))
    arrivals = _arrival_counters(x2d.device, ends[-1]) if split > 1 else x2d
    slots = []
    for (packed, absmax, bias, lora_b, scale, out, t_col, rank), end in zip(products, ends, strict=True):
        partial, _ = _split_scratch(x2d, split, out.shape[1], 0)
        lora_b = lora_b if lora_b is not None else out
        slots.append((packed.reshape(-1), absmax, bias if bias is not None else out, lora_b, lora_b.stride(0),
                      lora_b.stride(-1), float(scale), out, out if partial is None else partial, out.shape[1], t_col,
                      rank, end))
    slots += [slots[-1]] * (MAX_GROUPED - len(slots))
    ranks = [rank for *_, rank in products]
    x_pairs = x2d.view(torch.int32)
    t = t if t is not None else x2d
    _nf4_grouped_mma_kernel[(ends[-1], split)](
        x_pairs, x_pairs.stride(0), tables, t, t.stride(0), arrivals,
        *(arg for slot in slots[:-1] for arg in slot), *slots[-1][:-1], x2d.shape[0], n_in,
        HAS_BIAS=products[0][2] is not None, HAS_LORA=sum(ranks) > 0,
        BLOCK_R=max(2, triton.next_power_of_2(max(ranks))),
        WARPS=warps, SPLIT=split, STAGES=stages, PDL=pdl, SHARED=shared, PREFETCH_LINES=PREFETCH_LINES,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )
    return True


_PAIR_TABLES: dict = {}


def pair_table(device: torch.device) -> torch.Tensor | None:
    """int32 `[256]`: for each byte value, the bf16 codes of its high nibble (low half) and its low nibble (high
    half), the shared-memory lookup's table. None where it is missing while a CUDA graph is being captured."""
    if device not in _PAIR_TABLES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        codes = torch.tensor(NF4_CODE, dtype=torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        byte = torch.arange(256)
        pairs = codes[byte >> 4] | (codes[byte & 0xF] << 16)
        _PAIR_TABLES[device] = torch.where(pairs >= 2**31, pairs - 2**32, pairs).to(torch.int32).to(device)
    return _PAIR_TABLES[device]
