"""The word launch of `nf4_matvec` for one bf16 row, its walk written in Gluon (Triton's lower-level dialect,
explicit layouts). Same forward as `nf4_matvec.py`, no backward (inference only):

    y[n] = Σ_k x[k] · code[q[n, k]] · absmax[n, k // 64] + a[n] + s · Σ_r (Σ_p t_p[r]) · B[n, r]

a[n] the bias or the residual row (an output projection's result joining the residual stream), t the adapter's
first product x Aᵀ given (in P parts, as `nf4_gated_matvec`'s stripes give down_proj's) or written by the launch's
first r programs (as o_proj's, `nf4_matvec.GLUON_FIRST_PRODUCTS`), B its second factor.

Layout: a program owns BLOCK_N features; each thread holds all of them for WORDS_PER_THREAD consecutive words
along K (`[BLOCK_N, WORDS_PER_THREAD]` a thread, the lanes and then the warps side by side along K), so x's
pairs for a word are loaded once, into the registers of the one thread that multiplies them with BLOCK_N words,
and nothing passes through shared memory until the final reduction. The next step's words, absmax and x are
loaded into registers before the step multiplies its own (no barrier, no asynchronous copy). Per word as in the
Triton word kernel (`nf4_matvec_words.py`): the code lookup into bf16 pairs (`nf4_codes._nf4_word_lookup_ptx`),
four `fma.rn.bf16x2` with x's pairs and the two halves added in fp32 (`code_pair_sums`), times the block's
absmax, accumulated in fp32 per (feature, word of the step) and reduced over the program's threads at the end.

Why: the Triton word kernel's step (every tile's words, absmax and x copied through shared memory, x read back
there once for each of a program's features, a barrier a step) is bound inside the SM (docs/benchmarks.md, "The
word kernel under Nsight Compute"); Triton chooses its own layouts and would not keep a thread's features
together. PDL as the word kernel's: the weight's first step and B are loaded before `griddepcontrol.wait`; x, t
and the addend, which the kernel before may write, after it.

Compiled only: Gluon has no interpreter. `tests/test_nf4_matvec_gluon.py` checks it on a GPU against the
dequantised product and the Triton word kernel, and its compiled resources for sm_90 on any machine.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from unsloth_lite.kernels.gluon_sync import _gdc_launch_dependents, _gdc_wait, _thread_barrier
from unsloth_lite.kernels.lora_down import _await_first_products, _count_reader
from unsloth_lite.kernels.nf4_codes import BF16_PAIR_DOT_PTX, NF4_WORD_PAIRS_PTX
from unsloth_lite.kernels.utils import INTERPRET

BLOCK_N = 8
# Words a thread takes a step: two (eight bytes a feature). Measured on an H100 at the Qwen3-8B shape's
# projections (docs/benchmarks.md, "The word launch walked in Gluon"): one word 4-14% slower; four, prefetched
# with 4 features a program, 33-56% slower, and unprefetched with 8 (136 registers a thread; at K = 4,096 a
# single step, nothing to overlap) 19-23% slower than two at three of the four shapes.
WORDS_PER_THREAD = 2
NUM_WARPS = 4
BLOCKSIZE = 64  # weights a quantisation block: eight words, so a thread's words share one absmax


def step_weights() -> int:
    """The weights along K a program takes a step: K must be a multiple."""
    return 8 * WORDS_PER_THREAD * 32 * NUM_WARPS


def gluon_device(x: torch.Tensor) -> bool:
    """Whether the Gluon walks run on x's device: a CUDA device, compiled (Gluon has no interpreter)."""
    return not INTERPRET and x.is_cuda


def one_row_at_whole_steps(x_rows: torch.Tensor, n_in: int) -> bool:
    """One row of x as bf16 pairs (int32) on a device the Gluon walks run on, K a whole number of steps."""
    return (gluon_device(x_rows) and x_rows.dtype == torch.int32 and x_rows.shape[0] == 1
            and n_in % step_weights() == 0)


def gluon_walk_fits(x_rows: torch.Tensor, n_out: int, n_in: int) -> bool:
    """Whether the Gluon walk takes this product: `one_row_at_whole_steps` (the Qwen3-8B shape's projections, not
    the 27B's K = 5,120 or 17,408) and N a multiple of BLOCK_N."""
    return one_row_at_whole_steps(x_rows, n_in) and n_out % BLOCK_N == 0


@gluon.jit
def _walk_start(block, tables_ptr, words_per_row, blocks_per_row, BLOCK_N: gl.constexpr, STEP: gl.constexpr,
                walk: gl.constexpr):
    """(the words of a step `[STEP]`, the lookup's four tables (each lane's own copy held in registers,
    `lane_tables`), the first word and the first block of each of feature block `block`'s rows `[BLOCK_N, 1]`)."""
    features = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, walk))
    columns = gl.arange(0, STEP, layout=gl.SliceLayout(0, walk))
    lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [columns], dtype=gl.int32, is_pure=True,
                                     pack=1)
    table = tables_ptr + lane[None, :] * 8 + gl.zeros([BLOCK_N, STEP], gl.int32, walk)
    t0, t1, t2, t3 = gl.load(table), gl.load(table + 1), gl.load(table + 2), gl.load(table + 3)
    return (columns, t0, t1, t2, t3, features.to(gl.int64)[:, None] * words_per_row,
            features.to(gl.int64)[:, None] * blocks_per_row)


@gluon.jit
def _weight_step(words_ptr, absmax_ptr, row_words, row_blocks, word):
    """A step's words `[BLOCK_N, STEP]` and each word's block absmax, for the words `word` `[STEP]` of each row."""
    return gl.load(words_ptr + row_words + word[None, :]), gl.load(absmax_ptr + row_blocks + (word // 8)[None, :])


@gluon.jit
def _x_step(x_ptr, word):
    """x's four bf16 pairs (int32) of each word `[1, STEP]`."""
    return (gl.load(x_ptr + word * 4)[None, :], gl.load(x_ptr + word * 4 + 1)[None, :],
            gl.load(x_ptr + word * 4 + 2)[None, :], gl.load(x_ptr + word * 4 + 3)[None, :])


@gluon.jit
def _step_sums(words, scales, x01, x23, x45, x67, t0, t1, t2, t3):
    """Each word's eight products summed, times its block's absmax (fp32 `[BLOCK_N, STEP]`)."""
    c01, c23, c45, c67 = gl.inline_asm_elementwise(NF4_WORD_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r,r",
                                                   [words, t0, t1, t2, t3], dtype=(gl.int32,) * 4, is_pure=True,
                                                   pack=1)
    sums = gl.inline_asm_elementwise(BF16_PAIR_DOT_PTX, "=r,r,r,r,r,r,r,r,r",
                                     [c01, c23, c45, c67, x01, x23, x45, x67], dtype=gl.int32, is_pure=True,
                                     pack=1)
    return sums.to(gl.float32, bitcast=True) * scales


@gluon.jit
def _gluon_word_kernel(
    x_ptr, words_ptr, absmax_ptr, tables_ptr, addend_ptr, t_ptr, t_part_stride, lora_b_ptr, lora_b_row_stride,
    lora_b_col_stride, scale, out_ptr, words_per_row, blocks_per_row, rank, xv_ptr, lora_a_ptr, flags_ptr, n_in,
    BLOCK_N: gl.constexpr, WORDS_PER_THREAD: gl.constexpr, NUM_WARPS: gl.constexpr, ADDEND: gl.constexpr,
    HAS_LORA: gl.constexpr, T_PARTS: gl.constexpr, BLOCK_P: gl.constexpr, BLOCK_R: gl.constexpr,
    FIRST_PRODUCTS: gl.constexpr, FIRST_BLOCK_K: gl.constexpr, PDL: gl.constexpr,
):
    """Program i: `_word_program` of feature block i. FIRST_PRODUCTS: programs i < rank write t = x Aᵀ a column
    each (`_first_product_column`; xv_ptr: x's elements, lora_a_ptr: A `[rank, K]`) and the others, feature block
    i - rank, await it before their epilogue as the Triton launches' readers do (`lora_down`'s protocol: the
    writers have the launch's lowest program ids, so they are scheduled before any program that waits)."""
    program = gl.program_id(0)
    writers = 0
    if FIRST_PRODUCTS:
        writers = rank
        if program < rank:
            _first_product_column(program, xv_ptr, lora_a_ptr, t_ptr, flags_ptr, n_in, FIRST_BLOCK_K, NUM_WARPS,
                                  PDL)
    if program >= writers:
        _word_program(
            program - writers, x_ptr, words_ptr, absmax_ptr, tables_ptr, addend_ptr, t_ptr, t_part_stride,
            lora_b_ptr, lora_b_row_stride, lora_b_col_stride, scale, out_ptr, words_per_row, blocks_per_row, rank,
            flags_ptr, gl.num_programs(0) - writers, BLOCK_N, WORDS_PER_THREAD, NUM_WARPS, ADDEND, HAS_LORA, T_PARTS,
            BLOCK_P, BLOCK_R, FIRST_PRODUCTS, PDL,
        )


@gluon.jit
def _first_product_column(j, x_ptr, a_ptr, t_ptr, flags_ptr, n_in, BLOCK_K: gl.constexpr,
                          NUM_WARPS: gl.constexpr, PDL: gl.constexpr):
    """Column j of t = x Aᵀ (x `[K]`, A `[width, K]` contiguous, both any float dtype, widened to fp32) stored at
    t_ptr[j], then counted on `flags_ptr[0]` (released at GPU scope after a barrier: every thread's part of the sum
    is in the store). Each thread loads its elements of both whole rows at once (eight a load, all in flight: one
    round trip, where the Triton launches' first-product programs walk K in steps and so split it over several
    programs). PDL: A, which no kernel writes, is loaded before `griddepcontrol.wait`; x after it."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [NUM_WARPS], [0])
    k = gl.arange(0, BLOCK_K, layout=layout)
    inside = k < n_in
    a = gl.load(a_ptr + j.to(gl.int64) * n_in + k, mask=inside, other=0.0).to(gl.float32)
    if PDL:
        _gdc_wait()
    x = gl.load(x_ptr + k, mask=inside, other=0.0).to(gl.float32)
    gl.store(t_ptr + j, gl.sum(x * a, axis=0))
    _thread_barrier()  # every thread's part of the sum in the store before the release
    gl.atomic_add(flags_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _word_program(
    block, x_ptr, words_ptr, absmax_ptr, tables_ptr, addend_ptr, t_ptr, t_part_stride, lora_b_ptr,
    lora_b_row_stride, lora_b_col_stride, scale, out_ptr, words_per_row, blocks_per_row, rank, flags_ptr, readers,
    BLOCK_N: gl.constexpr, WORDS_PER_THREAD: gl.constexpr, NUM_WARPS: gl.constexpr, ADDEND: gl.constexpr,
    HAS_LORA: gl.constexpr, T_PARTS: gl.constexpr, BLOCK_P: gl.constexpr, BLOCK_R: gl.constexpr,
    AWAIT_T: gl.constexpr, PDL: gl.constexpr,
):
    """Features [block · BLOCK_N, (block + 1) · BLOCK_N) of one weight, the whole row (module docstring). x_ptr:
    x's bf16 pairs (int32); words_ptr: the packed weight's int32 words `[N, K / 8]`; absmax_ptr: fp32 `[N, K /
    64]`; tables_ptr: `lane_tables` (int32 `[32, 8]`); addend_ptr `[N]` (ADDEND); t_ptr: fp32 `[T_PARTS, rank]`
    parts `t_part_stride` apart, B `[N, rank]` (HAS_LORA). AWAIT_T: t is written by the launch's first programs:
    loaded after the walk, once `flags_ptr` says it is ready, this program then counted as one of `readers`."""
    walk: gl.constexpr = gl.BlockedLayout([BLOCK_N, WORDS_PER_THREAD], [1, 32], [1, NUM_WARPS], [1, 0])
    # the epilogue's: B `[BLOCK_N, BLOCK_R]` and t's parts `[BLOCK_P, BLOCK_R]` spread over the threads, a register
    # or two each while the walk runs (held whole by each thread, 16 parts of rank 16 spill)
    spread: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [NUM_WARPS, 1], [1, 0])
    STEP: gl.constexpr = WORDS_PER_THREAD * 32 * NUM_WARPS  # words along K a step of the program
    columns, t0, t1, t2, t3, row_words, row_blocks = _walk_start(block, tables_ptr, words_per_row, blocks_per_row,
                                                                 BLOCK_N, STEP, walk)
    words, scales = _weight_step(words_ptr, absmax_ptr, row_words, row_blocks, columns)
    out_features = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, spread))
    lora_b, t_parts = 0.0, 0.0  # unread without an adapter
    r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, spread))
    if HAS_LORA:
        lora_b = _adapter_rows(lora_b_ptr, lora_b_row_stride, lora_b_col_stride, out_features, r, rank)
    if PDL:
        _gdc_wait()
    if HAS_LORA and not AWAIT_T:  # issued before the walk, as `matvec_epilogue.T_BEFORE_WALK` does
        t_parts = _t_parts(t_ptr, t_part_stride, r, rank, T_PARTS, BLOCK_P, spread)
    x01, x23, x45, x67 = _x_step(x_ptr, columns)
    acc = gl.zeros([BLOCK_N, STEP], gl.float32, walk)
    for w0 in range(STEP, words_per_row, STEP):
        word = w0 + columns
        next_words, next_scales = _weight_step(words_ptr, absmax_ptr, row_words, row_blocks, word)
        n01, n23, n45, n67 = _x_step(x_ptr, word)
        acc += _step_sums(words, scales, x01, x23, x45, x67, t0, t1, t2, t3)
        words, scales, x01, x23, x45, x67 = next_words, next_scales, n01, n23, n45, n67
    acc += _step_sums(words, scales, x01, x23, x45, x67, t0, t1, t2, t3)
    if PDL:
        _gdc_launch_dependents()
    if AWAIT_T:
        _await_first_products(flags_ptr, rank)
        t_parts = _t_parts(t_ptr, t_part_stride, r, rank, T_PARTS, BLOCK_P, spread)
        _count_reader(flags_ptr, block, readers)
    y = _product_outputs(acc, gl.SliceLayout(1, spread), out_features, addend_ptr, t_parts, lora_b, scale, ADDEND,
                         HAS_LORA)
    gl.store(out_ptr + out_features, y.to(out_ptr.dtype.element_ty))


@gluon.jit
def _t_parts(t_ptr, t_part_stride, r, rank, T_PARTS: gl.constexpr, BLOCK_P: gl.constexpr, layout: gl.constexpr):
    """t's parts `[BLOCK_P, BLOCK_R]` in `layout` (0 past the parts and the rank), summed in `_product_outputs`."""
    p = gl.arange(0, BLOCK_P, layout=gl.SliceLayout(1, layout))
    return gl.load(t_ptr + p[:, None] * t_part_stride + r[None, :], mask=(p[:, None] < T_PARTS) & (r[None, :] < rank),
                   other=0.0)


@gluon.jit
def _adapter_rows(b_ptr, b_row_stride, b_col_stride, features, r, rank):
    """B's rows of the program's features `[BLOCK_N, BLOCK_R]` (0 past the rank), as stored."""
    return gl.load(b_ptr + features[:, None].to(gl.int64) * b_row_stride + r[None, :] * b_col_stride,
                   mask=r[None, :] < rank, other=0.0)


@gluon.jit
def _product_outputs(acc, layout: gl.constexpr, features, addend_ptr, t_parts, b, scale, ADDEND: gl.constexpr,
                     LORA: gl.constexpr):
    """A product's outputs `[BLOCK_N]` in fp32 from its walk's sums `acc` `[BLOCK_N, STEP]`: reduced into
    `layout`, the adapter's s · t Bᵀ (LORA; t the sum of its parts `[P, BLOCK_R]`, B's rows `_adapter_rows`) and
    the addend (ADDEND) added."""
    y = gl.convert_layout(gl.sum(acc, axis=1), layout)
    if LORA:
        t = gl.sum(t_parts, axis=0)
        y += scale * gl.sum(b.to(gl.float32) * t[None, :], axis=1)
    if ADDEND:
        y += gl.load(addend_ptr + features).to(gl.float32)
    return y


def launch_gluon_walk(x_rows, words, absmax, tables, out, n_out: int, n_in: int, addend=None, lora_t=None,
                      t_parts: int = 1, t_part_stride: int = 0, lora_b=None, scale: float = 1.0,
                      pdl: bool = False, first=None) -> None:
    """`_gluon_word_kernel` into `out` `[1, N]` for a product `gluon_walk_fits` takes: x_rows `[1, K / 2]` int32,
    the weight's words and flat fp32 absmax, the lookup's `lane_tables`; addend `[1, N]` or None; lora_t fp32
    `[1, r]` (the first of `t_parts` parts `t_part_stride` apart) with lora_b `[N, r]`, or None. `first`: (x `[1,
    K]`, A `[r, K]` contiguous, the ready flags and counters `first_product_flags`): lora_t is written by the
    launch's first r programs, x Aᵀ, instead of given."""
    rank = lora_t.shape[-1] if lora_t is not None else 0
    b = lora_b if lora_t is not None else out
    xv, lora_a, flags = first if first is not None else (out, out, out)
    _gluon_word_kernel[((rank if first is not None else 0) + n_out // BLOCK_N,)](
        x_rows, words, absmax, tables, addend if addend is not None else out,
        lora_t if lora_t is not None else out, t_part_stride, b, b.stride(0), b.stride(-1), float(scale), out,
        n_in // 8, n_in // BLOCKSIZE, rank, xv, lora_a, flags, n_in,
        BLOCK_N=BLOCK_N, WORDS_PER_THREAD=WORDS_PER_THREAD, NUM_WARPS=NUM_WARPS, ADDEND=addend is not None,
        HAS_LORA=rank > 0, T_PARTS=t_parts, BLOCK_P=triton.next_power_of_2(t_parts),
        BLOCK_R=max(2, triton.next_power_of_2(rank)), FIRST_PRODUCTS=first is not None,
        FIRST_BLOCK_K=triton.next_power_of_2(n_in), PDL=pdl, num_warps=NUM_WARPS,
        **({"launch_pdl": True} if pdl else {}),
    )
