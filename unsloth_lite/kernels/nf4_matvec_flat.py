"""NF4 matrix-vector product of one bf16 row on a flat tile: `nf4_matvec`'s blocked kernel for M = 1, with no
layout conversion in its loop (an option, `nf4_matvec.FLAT_TILE`, measured against the blocked kernel).

Same product as the blocked kernel (`nf4_matvec.py`): for x `[1, K]` bf16 and W `[N, K]` in NF4,

    y[n] = Σ_b absmax[n, b] · Σ_{k in block b} code[q[n, k]] · x[k]  + bias[n] + s · (t Bᵀ)[n]

with the exact fp32 code book (or, with `BF16_CODES`, the one rounded to bf16) and fp32 sums. What differs is
how a program's tile lies in its threads. The blocked kernel's tile is `[features, blocks, bytes]` and x
`[blocks, bytes]`, broadcast over the features: the compiler holds x in another layout than the packed bytes
and converts it through shared memory every step. Here the tile is `[runs, 4]`, runs of 4 packed bytes (run r:
bytes 4 (r % (TILE_BYTES / 4)) .. + 3 of feature r // (TILE_BYTES / 4)), and x is read in the same shape as
32-bit words of two bf16 values (word j = x[2j], x[2j+1]: the even and odd element of packed byte j), straight
from the cache, redundantly across features: 4 packed bytes and their 4 x words each make one vector load (4
bytes, 16 bytes), so both lie in one layout and nothing crosses threads until the one sum per feature after the
loop; a run never crosses a quantisation block, so its absmax is decoded once. Each step moves every pointer by
TILE_BYTES instead of recomputing the addresses. Compiled for sm_90 by triton 3.6 (offline, 17408 x 5120, 8
features by 512 weights, 4 warps): a step of 16 packed bytes a thread takes 391 instructions and no barrier,
against the blocked kernel's 324 with four barriers and twenty shared-memory loads and stores; which is faster
is for the GPU to tell (`bench_nf4_matvec.py --sweep`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from unsloth_lite.kernels.dequantize_nf4 import _block_absmax
from unsloth_lite.kernels.lora_down import _store_rows
from unsloth_lite.kernels.nf4_codes import _nf4_codes


@triton.jit
def _bf16_pair_to_fp32(words):
    """(x[2j], x[2j+1]) as fp32 of the 32-bit words holding bf16 pairs (little-endian: the even one is low)."""
    even = (words << 16).to(tl.float32, bitcast=True)
    odd = (words & -65536).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def _nf4_matvec_flat_kernel(
    x_words_ptr,
    packed_ptr, absmax_ptr, table_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
    nested_blocksize: tl.constexpr,
    bias_ptr, t_ptr, t_row_stride, lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale,
    out_ptr, n_out, n_in, rank,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_BYTES: tl.constexpr, BLOCK_R: tl.constexpr,
    LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr, PDL: tl.constexpr,
):
    """One program: BLOCK_N features, K walked TILE_BYTES packed bytes (2 x TILE_BYTES weights) a step. PDL as
    in the blocked kernel: only the frozen weight's bytes and absmax are read before `gdc_wait`."""
    HALF: tl.constexpr = BLOCKSIZE // 2  # packed bytes of one quantisation block
    RUNS: tl.constexpr = BLOCK_N * TILE_BYTES // 4
    # The tile as runs of 4 bytes `[RUNS, 4]`, run r holding bytes 4 (r % (TILE_BYTES / 4)) .. + 3 of feature
    # r // (TILE_BYTES / 4): the packed bytes load 4 to a vector like x's words (4 in 16 bytes), so both lie in
    # one layout, and a run never crosses a quantisation block, so its absmax is one value (`[RUNS, 1]`).
    runs = tl.arange(0, RUNS)
    run_byte = runs % (TILE_BYTES // 4) * 4
    features = tl.program_id(0) * BLOCK_N + runs // (TILE_BYTES // 4)
    mask_features = features < n_out
    row_bytes = n_in // 2
    byte = run_byte[:, None] + tl.arange(0, 4)[None, :]
    packed_ptrs = packed_ptr + (features.to(tl.int64) * row_bytes)[:, None] + byte
    x_ptrs = x_words_ptr + byte
    blocks = features.to(tl.int64) * (n_in // BLOCKSIZE) + run_byte // HALF
    partial = tl.zeros([RUNS, 4], dtype=tl.float32)
    for k0 in range(0, row_bytes, TILE_BYTES):
        mask_runs = mask_features & (run_byte < row_bytes - k0)
        mask = mask_runs[:, None]
        packed = tl.load(packed_ptrs, mask=mask, other=0)
        absmax = _block_absmax(absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize,
                               blocks, mask_runs, NESTED)[:, None]
        if PDL:
            gdc_wait()  # returns at once after the first step
        x_even, x_odd = _bf16_pair_to_fp32(tl.load(x_ptrs, mask=mask, other=0))  # masked: x = 0
        code_even, code_odd = _nf4_codes(packed, table_ptr, LOOKUP, BF16_CODES)
        partial += (code_even * x_even + code_odd * x_odd) * absmax
        packed_ptrs += TILE_BYTES
        x_ptrs += TILE_BYTES
        blocks += TILE_BYTES // HALF
    if PDL:
        gdc_launch_dependents()
    sums = tl.sum(tl.reshape(tl.sum(partial, axis=1), [BLOCK_N, TILE_BYTES // 4]), axis=1)
    _store_rows(
        sums[None, :], tl.arange(0, 1), tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), 1, n_out, bias_ptr,
        t_ptr, t_row_stride, rank, lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale, out_ptr, 0,
        HAS_BIAS, HAS_LORA, BLOCK_R,
    )


def flat_tile_applies(x2d: torch.Tensor, n_in: int, blocksize: int) -> bool:
    """Whether the flat kernel takes this product: one bf16 row of x with unit stride along K, whole
    quantisation blocks along K."""
    return (x2d.shape[0] == 1 and x2d.dtype == torch.bfloat16 and x2d.stride(1) == 1 and n_in % blocksize == 0
            and x2d.data_ptr() % 4 == 0)


def launch_flat(x2d, args_after_x, sizes, meta, block_n: int, tile_bytes: int, warps: int, lookup: int,
                bf16_codes: bool, pdl: bool) -> None:
    """Launches the flat kernel on `nf4_matvec`'s arguments (x2d one row; the rest as the blocked kernel's after
    x and its strides, up to and including `out`; `sizes` (rows, N, K, rank))."""
    _, n_out, n_in, rank = sizes
    # drops `out_row_stride` (one row)
    (packed, absmax, table, nested_code, nested_absmax, offset, nested_blocksize, bias, t, t_row_stride, lora_b,
     lora_b_row_stride, lora_b_col_stride, scale, out, _) = args_after_x
    x_words = x2d[0].view(torch.int32)
    _nf4_matvec_flat_kernel[(triton.cdiv(n_out, block_n),)](
        x_words, packed, absmax, table, nested_code, nested_absmax, offset, nested_blocksize, bias, t,
        t_row_stride, lora_b, lora_b_row_stride, lora_b_col_stride, scale, out, n_out, n_in, rank,
        BLOCK_N=block_n, TILE_BYTES=tile_bytes, LOOKUP=lookup, BF16_CODES=bf16_codes, PDL=pdl,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}), **meta,
    )
