"""The word walk of `nf4_matvec` written in Gluon (Triton's lower-level dialect, explicit layouts): one row of
bf16 x, y[n] = Σ_k x[k] · code[q[n, k]] · absmax[n, k // 64], no bias, adapter or residual. A measurement
kernel, not on any decoding path: it tests whether the Triton word kernel's time goes to its walk's step (x
copied through shared memory and converted to the weights' layout, a barrier a step; docs/benchmarks.md, "The
projections' bytes asked of L2 ahead").

Layout: a program owns BLOCK_N features; each thread holds all of them for WORDS_PER_THREAD consecutive words
along K (`[BLOCK_N, WORDS_PER_THREAD]` a thread, the warps side by side along K), so x's pairs for a word are
loaded once into the registers of the one thread that multiplies them with BLOCK_N words, straight from global
memory (L1), and nothing passes through shared memory until the end. Per word as in the word kernel
(`nf4_matvec_words.py`): the code lookup into bf16 pairs (`nf4_codes._nf4_word_lookup_ptx`), four `fma.rn.bf16x2`
with x's pairs and the two halves added in fp32 (`code_pair_sums`), times the block's absmax, accumulated in fp32
per (feature, word) and reduced over the program's threads at the end.

Compiled only: Gluon has no interpreter. `tests/test_nf4_matvec_gluon.py` checks it on a GPU against the
dequantised product and its compiled resources for sm_90 on any machine.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from unsloth_lite.kernels.nf4_codes import BF16_PAIR_DOT_PTX, NF4_WORD_PAIRS_PTX
from unsloth_lite.kernels.nf4_matvec import fp32_absmax, packed_words
from unsloth_lite.kernels.nf4_matvec_state import lane_tables
from unsloth_lite.kernels.utils import empty

BLOCK_N = 8
WORDS_PER_THREAD = 4  # consecutive words, in one quantisation block of 64 weights (8 words)
NUM_WARPS = 4
BLOCKSIZE = 64


@gluon.jit
def _gluon_word_kernel(x_ptr, words_ptr, absmax_ptr, tables_ptr, out_ptr, words_per_row, blocks_per_row,
                       BLOCK_N: gl.constexpr, WORDS_PER_THREAD: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Program i: features [i · BLOCK_N, (i + 1) · BLOCK_N), the whole row of words (module docstring). x_ptr:
    x's bf16 pairs (int32); words_ptr: the packed weight's int32 words `[N, K / 8]`; absmax_ptr: fp32 `[N, K /
    64]`; tables_ptr: `lane_tables` (int32 `[32, 8]`)."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_N, WORDS_PER_THREAD], [1, 32], [1, NUM_WARPS], [1, 0])
    STEP: gl.constexpr = WORDS_PER_THREAD * 32 * NUM_WARPS  # words along K a step of the program
    features = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    columns = gl.arange(0, STEP, layout=gl.SliceLayout(0, layout))
    # the lookup's tables, each lane's own copy held in registers (`lane_tables`)
    lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [columns], dtype=gl.int32, is_pure=True,
                                     pack=1)
    table = tables_ptr + lane[None, :] * 8 + gl.zeros([BLOCK_N, STEP], gl.int32, layout)
    t0, t1, t2, t3 = gl.load(table), gl.load(table + 1), gl.load(table + 2), gl.load(table + 3)
    row_words = features.to(gl.int64)[:, None] * words_per_row
    row_blocks = features.to(gl.int64)[:, None] * blocks_per_row
    acc = gl.zeros([BLOCK_N, STEP], gl.float32, layout)
    for w0 in range(0, words_per_row, STEP):
        word = w0 + columns
        words = gl.load(words_ptr + row_words + word[None, :])
        scales = gl.load(absmax_ptr + row_blocks + (word // 8)[None, :])
        x01 = gl.load(x_ptr + word * 4)[None, :]
        x23 = gl.load(x_ptr + word * 4 + 1)[None, :]
        x45 = gl.load(x_ptr + word * 4 + 2)[None, :]
        x67 = gl.load(x_ptr + word * 4 + 3)[None, :]
        c01, c23, c45, c67 = gl.inline_asm_elementwise(NF4_WORD_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r,r",
                                                       [words, t0, t1, t2, t3], dtype=(gl.int32,) * 4,
                                                       is_pure=True, pack=1)
        sums = gl.inline_asm_elementwise(BF16_PAIR_DOT_PTX, "=r,r,r,r,r,r,r,r,r",
                                         [c01, c23, c45, c67, x01, x23, x45, x67], dtype=gl.int32, is_pure=True,
                                         pack=1).to(gl.float32, bitcast=True)
        acc += sums * scales
    gl.store(out_ptr + features, gl.sum(acc, axis=1).to(gl.bfloat16))


def step_weights(words_per_thread: int = WORDS_PER_THREAD) -> int:
    """The weights along K a program takes a step: K must be a multiple."""
    return 8 * words_per_thread * 32 * NUM_WARPS


def gluon_matvec_supported(x: torch.Tensor, weight, words_per_thread: int = WORDS_PER_THREAD) -> bool:
    """One bf16 row on a CUDA device, a bf16 NF4 weight of block 64 with its flat absmax, N a multiple of BLOCK_N
    and K of a program's step (`step_weights`); the flat absmax and the lane tables made (not first made inside a
    CUDA graph's capture)."""
    state = getattr(weight, "quant_state", None)
    if state is None or not x.is_cuda or x.dtype != torch.bfloat16 or x.numel() != x.shape[-1]:
        return False
    n_out, n_in = (int(n) for n in state.shape)
    return (state.dtype == torch.bfloat16 and state.blocksize == BLOCKSIZE and n_in == x.shape[-1]
            and n_out % BLOCK_N == 0 and n_in % step_weights(words_per_thread) == 0
            and fp32_absmax(weight) is not None and lane_tables(x.device, True) is not None)


def nf4_matvec_gluon(x: torch.Tensor, weight, words_per_thread: int = WORDS_PER_THREAD) -> torch.Tensor:
    """x dequant(W)ᵀ for one bf16 row x `[..., K]` and a bf16 NF4 `Params4bit` W `[N, K]`
    (`gluon_matvec_supported`; ValueError otherwise), `words_per_thread` consecutive words a thread (4 words lie
    in one quantisation block; 1, 2 or 4): `[..., N]` in bf16. No autograd."""
    if words_per_thread not in (1, 2, 4):
        raise ValueError(f"words_per_thread must be 1, 2 or 4; got {words_per_thread}")
    if not gluon_matvec_supported(x, weight, words_per_thread):
        raise ValueError("nf4_matvec_gluon takes one bf16 row on a CUDA device and a bf16 NF4 weight of block 64, "
                         f"N a multiple of {BLOCK_N}, K of {step_weights(words_per_thread)}")
    n_out, n_in = (int(n) for n in weight.quant_state.shape)
    x_pairs = x.reshape(n_in).contiguous().view(torch.int32)
    out = empty((n_out,), torch.bfloat16, x.device)
    _gluon_word_kernel[(triton.cdiv(n_out, BLOCK_N),)](
        x_pairs, packed_words(weight.data), fp32_absmax(weight), lane_tables(x.device, True), out, n_in // 8,
        n_in // BLOCKSIZE, BLOCK_N=BLOCK_N, WORDS_PER_THREAD=words_per_thread, NUM_WARPS=NUM_WARPS,
        num_warps=NUM_WARPS,
    )
    return out.view(*x.shape[:-1], n_out)
