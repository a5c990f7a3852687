"""The grouped launch of `nf4_grouped_matvec` (several projections of one input) for one bf16 row, each program
walking its weight in Gluon as `nf4_matvec_gluon`'s word launch does. Same forward as `nf4_grouped_matvec.py`,
no backward (inference only):

    y_i = x W_iᵀ + b_i + s_i · t_i B_iᵀ        t_i: columns of one t given (the norm's launch writes it)

Program p belongs to the first weight whose range of programs holds it (the weights' programs side by side, as
in the Triton launch) and runs `nf4_matvec_gluon._word_program` over that weight's features.

Compiled only: Gluon has no interpreter. `tests/test_nf4_grouped_gluon.py` checks it on a GPU against the float64
products and the Triton launch, and its compiled resources for sm_90 on any machine.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from unsloth_lite.kernels import nf4_matvec_gluon as walks
from unsloth_lite.kernels.nf4_matvec_gluon import (
    BLOCK_N,
    BLOCKSIZE,
    NUM_WARPS,
    WORDS_PER_THREAD,
    _word_program,
)


def gluon_grouped_fits(x_rows: torch.Tensor, widths: list[int], n_in: int) -> bool:
    """Whether the Gluon walk takes this group: each weight's product would (`gluon_walk_fits`: one row, every
    width a multiple of BLOCK_N, K of a step; the Qwen3-8B shape's q/k/v)."""
    return all(walks.gluon_walk_fits(x_rows, n_out, n_in) for n_out in widths)


@gluon.jit
def _gluon_grouped_kernel(
    x_ptr, tables_ptr, t_ptr,
    words0, absmax0, bias0, b0, b0_row_stride, b0_col_stride, scale0, out0, t_col0, rank0, end0,
    words1, absmax1, bias1, b1, b1_row_stride, b1_col_stride, scale1, out1, t_col1, rank1, end1,
    words2, absmax2, bias2, b2, b2_row_stride, b2_col_stride, scale2, out2, t_col2, rank2, end2,
    words3, absmax3, bias3, b3, b3_row_stride, b3_col_stride, scale3, out3, t_col3, rank3,
    words_per_row, blocks_per_row,
    BLOCK_N: gl.constexpr, WORDS_PER_THREAD: gl.constexpr, NUM_WARPS: gl.constexpr, HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr, BLOCK_R: gl.constexpr, PDL: gl.constexpr,
):
    """Program p: weight i, the first with p < end_i (the slots past the last weight repeat it and are never
    reached), its feature block p - end_{i-1}; t_col_i: its adapter's first column of t `[Σ r_i]`."""
    pid = gl.program_id(0)
    if pid < end0:
        words, absmax, bias, lora_b, scale, out, t_col, rank, start = (words0, absmax0, bias0, b0, scale0, out0,
                                                                       t_col0, rank0, 0)
        b_row_stride, b_col_stride = b0_row_stride, b0_col_stride
    elif pid < end1:
        words, absmax, bias, lora_b, scale, out, t_col, rank, start = (words1, absmax1, bias1, b1, scale1, out1,
                                                                       t_col1, rank1, end0)
        b_row_stride, b_col_stride = b1_row_stride, b1_col_stride
    elif pid < end2:
        words, absmax, bias, lora_b, scale, out, t_col, rank, start = (words2, absmax2, bias2, b2, scale2, out2,
                                                                       t_col2, rank2, end1)
        b_row_stride, b_col_stride = b2_row_stride, b2_col_stride
    else:
        words, absmax, bias, lora_b, scale, out, t_col, rank, start = (words3, absmax3, bias3, b3, scale3, out3,
                                                                       t_col3, rank3, end2)
        b_row_stride, b_col_stride = b3_row_stride, b3_col_stride
    _word_program(
        pid - start, x_ptr, words, absmax, tables_ptr, bias, t_ptr + t_col, 0, lora_b, b_row_stride, b_col_stride,
        scale, out, words_per_row, blocks_per_row, rank, out, 0, BLOCK_N, WORDS_PER_THREAD, NUM_WARPS, HAS_BIAS,
        HAS_LORA, 1, 1, BLOCK_R, False, PDL,
    )


def launch_gluon_grouped(x_rows, tables, t, slots, n_in: int, has_bias: bool, ranks: list[int],
                         pdl: bool = False) -> None:
    """`_gluon_grouped_kernel` for a group `gluon_grouped_fits` takes: x_rows `[1, K / 2]` int32; t fp32 `[1, Σ
    r_i]` (or any tensor without adapters); `slots`: four per-weight tuples (words, flat absmax, bias, B, B's two
    strides, scale, out, t's first column, rank, the end of its programs), the last repeated to fill them."""
    programs = slots[-1][-1]
    _gluon_grouped_kernel[(programs,)](
        x_rows, tables, t, *(arg for slot in slots[:-1] for arg in slot), *slots[-1][:-1],
        n_in // 8, n_in // BLOCKSIZE,
        BLOCK_N=BLOCK_N, WORDS_PER_THREAD=WORDS_PER_THREAD, NUM_WARPS=NUM_WARPS, HAS_BIAS=has_bias,
        HAS_LORA=sum(ranks) > 0, BLOCK_R=max(2, triton.next_power_of_2(max(ranks))), PDL=pdl,
        num_warps=NUM_WARPS, **({"launch_pdl": True} if pdl else {}),
    )
