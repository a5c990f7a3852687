"""The gate-and-up launch of `nf4_gated_matvec` for one bf16 row, its walk written in Gluon as
`nf4_matvec_gluon.py`'s. Same forward as `nf4_gated_matvec.py`, no backward (inference only):

    g = round(x Gᵀ + b_g + s_g · t_g B_gᵀ)        u = round(x Uᵀ + b_u + s_u · t_u B_uᵀ)
    h = round(g · σ(g) · u)                        share_p[r] += Σ_{n in program p} h[n] · A_d[r, n]

t_g, t_u the adapters' first products, given (the norm's launch writes them), and, with the down projection's
adapter A_d, each program's share of h A_dᵀ added into stripe p mod S (`nf4_gated_matvec`'s `down_shares`).

Layout and walk as `nf4_matvec_gluon`'s, for two weights: each thread holds a program's BLOCK_N gate and BLOCK_N
up features for its WORDS_PER_THREAD consecutive words, x's pairs loaded once for both, the next step's words,
absmax and x loaded into registers before this step's products. The epilogue's adapter rows, t and A_d's
columns are spread over the program's threads (a register or two each while the walk runs) and loaded as the
word launch's are: the weights' before `griddepcontrol.wait`, t after it, before the walk.

Compiled only: Gluon has no interpreter. `tests/test_nf4_gated_gluon.py` checks it on a GPU against the float64
product and the Triton launch, and its compiled resources for sm_90 on any machine.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from unsloth_lite.kernels import nf4_matvec_gluon as walks
from unsloth_lite.kernels.gluon_sync import _gdc_launch_dependents, _gdc_wait
from unsloth_lite.kernels.nf4_matvec_gluon import (
    BLOCKSIZE,
    NUM_WARPS,
    WORDS_PER_THREAD,
    _adapter_rows,
    _product_outputs,
    _step_sums,
    _walk_start,
    _weight_step,
    _x_step,
)

# Features of each weight a program: 4, so that the two weights' words and their prefetch take the registers the
# word launch's 8 features of one weight take (offline, sm_90: see `kernel_resources.py --nf4-matvec`).
BLOCK_N = 4


def gluon_gated_fits(x_rows: torch.Tensor, n_out: int, n_in: int) -> bool:
    """Whether the Gluon gate-and-up walk takes this launch: `nf4_matvec_gluon.one_row_at_whole_steps` (the
    Qwen3-8B MLP) and N a multiple of BLOCK_N."""
    return walks.one_row_at_whole_steps(x_rows, n_in) and n_out % BLOCK_N == 0


@gluon.jit
def _gluon_gated_kernel(
    x_ptr, gate_words_ptr, gate_absmax_ptr, up_words_ptr, up_absmax_ptr, tables_ptr,
    gate_bias_ptr, up_bias_ptr, gate_t_ptr, up_t_ptr, gate_rank, up_rank,
    gate_b_ptr, gate_b_row_stride, gate_b_col_stride, gate_scale,
    up_b_ptr, up_b_row_stride, up_b_col_stride, up_scale,
    out_ptr, words_per_row, blocks_per_row, n_out, down_a_ptr, down_rank, shares_ptr, n_stripes,
    BLOCK_N: gl.constexpr, WORDS_PER_THREAD: gl.constexpr, NUM_WARPS: gl.constexpr, GATE_BIAS: gl.constexpr,
    UP_BIAS: gl.constexpr, GATE_LORA: gl.constexpr, UP_LORA: gl.constexpr, BLOCK_R: gl.constexpr,
    DOWN_BLOCK_R: gl.constexpr, PDL: gl.constexpr,
):
    """Program i: features [i · BLOCK_N, (i + 1) · BLOCK_N) of both weights, the whole row (module docstring).
    Pointers as `_gluon_word_kernel`'s, one set a weight; t_ptr fp32 `[rank]`, B `[N, rank]` (GATE_LORA,
    UP_LORA; BLOCK_R covers both ranks); down_a_ptr `[down_rank, N]` contiguous, shares_ptr fp32 `[n_stripes,
    down_rank]` (DOWN_BLOCK_R > 0)."""
    walk: gl.constexpr = gl.BlockedLayout([BLOCK_N, WORDS_PER_THREAD], [1, 32], [1, NUM_WARPS], [1, 0])
    spread: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [NUM_WARPS, 1], [1, 0])
    outputs: gl.constexpr = gl.SliceLayout(1, spread)
    STEP: gl.constexpr = WORDS_PER_THREAD * 32 * NUM_WARPS
    block = gl.program_id(0)
    columns, t0, t1, t2, t3, row_words, row_blocks = _walk_start(block, tables_ptr, words_per_row, blocks_per_row,
                                                                 BLOCK_N, STEP, walk)
    gate_words, gate_scales = _weight_step(gate_words_ptr, gate_absmax_ptr, row_words, row_blocks, columns)
    up_words, up_scales = _weight_step(up_words_ptr, up_absmax_ptr, row_words, row_blocks, columns)
    out_features = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=outputs)
    r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, spread))
    gate_b, up_b, gate_t, up_t = 0.0, 0.0, 0.0, 0.0  # unread without adapters
    if GATE_LORA:
        gate_b = _adapter_rows(gate_b_ptr, gate_b_row_stride, gate_b_col_stride, out_features, r, gate_rank)
    if UP_LORA:
        up_b = _adapter_rows(up_b_ptr, up_b_row_stride, up_b_col_stride, out_features, r, up_rank)
    if DOWN_BLOCK_R > 0:  # the program's columns of A_d, `[BLOCK_N, DOWN_BLOCK_R]`
        down_ranks = gl.arange(0, DOWN_BLOCK_R, layout=gl.SliceLayout(0, spread))
        down_a = gl.load(down_a_ptr + down_ranks[None, :] * n_out + out_features[:, None],
                         mask=down_ranks[None, :] < down_rank, other=0.0)
    if PDL:
        _gdc_wait()
    if GATE_LORA:  # as one part `[1, BLOCK_R]` (`_product_outputs`)
        gate_t = gl.load(gate_t_ptr + r[None, :], mask=r[None, :] < gate_rank, other=0.0)
    if UP_LORA:
        up_t = gl.load(up_t_ptr + r[None, :], mask=r[None, :] < up_rank, other=0.0)
    x01, x23, x45, x67 = _x_step(x_ptr, columns)
    acc_gate = gl.zeros([BLOCK_N, STEP], gl.float32, walk)
    acc_up = gl.zeros([BLOCK_N, STEP], gl.float32, walk)
    for w0 in range(STEP, words_per_row, STEP):
        word = w0 + columns
        next_gate_words, next_gate_scales = _weight_step(gate_words_ptr, gate_absmax_ptr, row_words, row_blocks,
                                                         word)
        next_up_words, next_up_scales = _weight_step(up_words_ptr, up_absmax_ptr, row_words, row_blocks, word)
        n01, n23, n45, n67 = _x_step(x_ptr, word)
        acc_gate += _step_sums(gate_words, gate_scales, x01, x23, x45, x67, t0, t1, t2, t3)
        acc_up += _step_sums(up_words, up_scales, x01, x23, x45, x67, t0, t1, t2, t3)
        gate_words, gate_scales, up_words, up_scales = next_gate_words, next_gate_scales, next_up_words, next_up_scales
        x01, x23, x45, x67 = n01, n23, n45, n67
    acc_gate += _step_sums(gate_words, gate_scales, x01, x23, x45, x67, t0, t1, t2, t3)
    acc_up += _step_sums(up_words, up_scales, x01, x23, x45, x67, t0, t1, t2, t3)
    if PDL:
        _gdc_launch_dependents()
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    # g and u rounded as `nf4_matvec` writes them
    g = _product_outputs(acc_gate, outputs, out_features, gate_bias_ptr, gate_t, gate_b, gate_scale, GATE_BIAS,
                         GATE_LORA).to(dtype).to(gl.float32)
    u = _product_outputs(acc_up, outputs, out_features, up_bias_ptr, up_t, up_b, up_scale, UP_BIAS,
                         UP_LORA).to(dtype).to(gl.float32)
    h = (g * (1.0 / (1.0 + gl.exp(-g))) * u).to(dtype)  # as `swiglu` computes it
    gl.store(out_ptr + out_features, h)
    if DOWN_BLOCK_R > 0:  # the share, from h as written; a relaxed add: the next launch reads it after this one
        share = gl.sum(h.to(gl.float32)[:, None] * down_a.to(gl.float32), axis=0)
        gl.atomic_add(shares_ptr + (block % n_stripes) * down_rank + down_ranks, share, mask=down_ranks < down_rank,
                      sem="relaxed", scope="gpu")


def launch_gluon_gated(x_rows, words, absmaxes, tables, out, n_out: int, n_in: int, biases, adapters,
                       down_a=None, stripes=None, pdl: bool = False) -> None:
    """`_gluon_gated_kernel` into `out` `[1, N]` for a launch `gluon_gated_fits` takes: x_rows `[1, K / 2]` int32;
    words, absmaxes: the gate's and the up weight's; biases: two `[N]` or None; adapters: two (t `[1, r]` fp32, B
    `[N, r]`, scale) or None; down_a `[r_d, N]` with stripes fp32 `[S, 1, r_d]`, or None."""
    ranks = [a[0].shape[-1] if a is not None else 0 for a in adapters]
    lora_args = []
    for adapter in adapters:
        t, b, scale = adapter if adapter is not None else (out, out, 0.0)
        lora_args.append((t, b, b.stride(0), b.stride(-1), float(scale)))
    _gluon_gated_kernel[(n_out // BLOCK_N,)](
        x_rows, words[0], absmaxes[0], words[1], absmaxes[1], tables,
        *(bias if bias is not None else out for bias in biases), lora_args[0][0], lora_args[1][0], *ranks,
        *lora_args[0][1:], *lora_args[1][1:],
        out, n_in // 8, n_in // BLOCKSIZE, n_out, down_a if down_a is not None else out,
        down_a.shape[0] if down_a is not None else 0, stripes if stripes is not None else out,
        stripes.shape[0] if stripes is not None else 1,
        BLOCK_N=BLOCK_N, WORDS_PER_THREAD=WORDS_PER_THREAD, NUM_WARPS=NUM_WARPS, GATE_BIAS=biases[0] is not None,
        UP_BIAS=biases[1] is not None, GATE_LORA=ranks[0] > 0, UP_LORA=ranks[1] > 0,
        BLOCK_R=max(2, triton.next_power_of_2(max(ranks))),
        DOWN_BLOCK_R=max(2, triton.next_power_of_2(down_a.shape[0])) if down_a is not None else 0, PDL=pdl,
        num_warps=NUM_WARPS, **({"launch_pdl": True} if pdl else {}),
    )
