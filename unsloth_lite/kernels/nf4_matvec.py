"""NF4 matrix-vector product for decoding: a few rows of activations times a bitsandbytes 4-bit weight, the
weight read once in its packed form and dequantised in registers, with an unmerged LoRA adapter.

For x `[M, K]` (M ≤ 8 rows: one new token per sequence of a small batch), W `[N, K]` stored as NF4 (layout,
absmax and double quantisation as in `dequantize_nf4.py`), bias b `[N]`, adapter A `[r, K]`, B `[N, r]`, scale s:

    W[n, k] = dtype_W(code[q[e]] · absmax[e // blocksize])      e = n·K + k, q[e] the e-th nibble
    t       = x Aᵀ                                              (rank r, fp32, one small product)
    y[m, n] = Σ_k x[m, k] · W[n, k] + b[n] + s · Σ_j t[m, j] · B[n, j]

dtype_W is `quant_state.dtype`. The general kernel rounds each weight to it exactly as `dequantize_nf4` writes
it, so its product equals x · dequantize_nf4(W)ᵀ up to the order of the fp32 sums. The blocked kernel (below)
multiplies by the exact fp32 weights, code · absmax, instead: rounding each to bf16 costs more instructions
than the rest of the weight's work, and y moves by about its own bf16 rounding. The sums run in fp32 (but for
the word walk's bf16 pairs, `BF16_PAIR_PRODUCTS`: each word's eight products in two bf16 chains of four); y is
written in x's dtype. At one token per step a decoder reads every weight once per token, so the speed is set by
the weight bytes read (half a byte per element here, against two for a dequantised bf16 copy plus its write)
and by the instructions spent on each weight.

Each program owns BLOCK_N output features for all M rows (a matrix-vector product has too few rows for tensor
cores). Where K is a multiple of the quantisation block (every real model), the blocked kernel walks K a few whole
blocks at a time: it loads the tile's bytes as they lie (two weights a byte: the high nibble is the even element,
the low nibble the odd one, multiplied by x's even and odd elements), reads each block's absmax once (not once per
weight; as one fp32 value, `FLAT_ABSMAX`, where the nested form costs three dependent loads) and applies it once
per weight pair, maps each nibble to its code-book value (`LOOKUP`: in registers with `prmt` where compiled, else
from a table), and for one row keeps elementwise partial sums that it reduces once at the end; for several rows
each tile's decoded weights serve every row. At batch 1 the kernel is bound by instructions per weight, not by
bytes (the lookup is most of them), so each weight costs its lookup and a fused multiply-add, little more. Other
shapes (rows that split a quantisation block, odd element counts) take the general kernel: element e from byte
e // 2, absmax per element, one reduction per tile.

Split along K (`blocked_tile`'s fourth entry, tiles a split: 0 or False for none, True for one): program (i, j)
reads only tiles [j · s, (j + 1) · s) along K of feature block i, so a projection has K / (s · tile) times the
programs, each with fewer steps to walk (one tile: all its bytes in flight at once). Each stores its sums to an
fp32 slot `[splits, rows, N]`; the last to arrive at the feature block's counter (an acq_rel atomic) adds the
slots in split order (deterministic), writes y and resets the counter, so there is no second launch and no
memset. `BF16_CODES` decodes bf16 weights with the code book rounded to bf16: two of the four byte planes of the
lookup (compiled offline for sm_90: 496 instructions instead of 592 in the kernel at 8 x 512), each weight within
bf16's rounding of its exact value. With `PDL` (Hopper's programmatic dependent launch) a projection starts
loading its weight while the kernel before it finishes and waits for that kernel before it reads anything the
kernel may write; a decoding step chains hundreds of them. The code lookups are in `nf4_codes.py`, the
adapters' first product x Aᵀ in `lora_down.py`, the programs' ends (the K split's sum, bias and adapter) in
`matvec_epilogue.py`, the kept flat absmax and the word kernel's tables in `nf4_matvec_state.py`, the blocked
and general kernels themselves in `nf4_matvec_blocked.py`; the word kernel, the gate-and-up kernel and the grouped
kernel (`nf4_matvec_words.py`, `nf4_gated_matvec.py`, `nf4_grouped_matvec.py`) share the blocked kernel's pieces.

Inference only: no autograd (the weight is frozen and generation needs no gradient); `nf4_matvec` refuses
inputs that require grad.
"""

from __future__ import annotations

import torch
import triton

from unsloth_lite.kernels import nf4_matvec_gluon as gluon
from unsloth_lite.kernels.dequantize_nf4 import _launch, _quant_state_of
from unsloth_lite.kernels.lora_down import (
    LORA_BLOCK_K,
    first_product_args,
    first_product_flags,
    lora_down_rows,
    no_first_products,
)
from unsloth_lite.kernels.matvec_epilogue import (
    BIAS_FEATURES,
    BIAS_NONE,
    BIAS_ROWS,
    _arrival_counters,
    t_before_walk,
)
from unsloth_lite.kernels.nf4_codes import CODE_PAIRS, LOOKUPS, code_pairs
from unsloth_lite.kernels.nf4_matvec_blocked import _nf4_matvec_blocked_kernel, _nf4_matvec_kernel
from unsloth_lite.kernels.nf4_matvec_checks import _check_args
from unsloth_lite.kernels.nf4_matvec_state import flat_absmax, lane_tables
from unsloth_lite.kernels.nf4_matvec_words import _nf4_matvec_words_kernel
from unsloth_lite.kernels.utils import INTERPRET, compute_capability, empty

# Output features per program: N / BLOCK_N programs keep every SM busy at the hidden sizes of real models.
BLOCK_N = 16
BLOCK_K = 256 if INTERPRET else 128  # the interpreter's cost is per operation: fewer, wider tiles
# How the blocked kernel maps nibbles to code-book values (`_nf4_codes`): "registers", with `prmt` and no memory
# access (compiled only: the interpreter runs no PTX); "pairs", one load a byte from a 256-entry table of value
# pairs (2 KB: a warp's loads touch up to 16 cache lines); "code_book", one load a weight from the 16 fp32 codes
# (64 bytes: every load of a warp hits one cache line).
LOOKUP = "pairs" if INTERPRET else "registers"
# Programmatic dependent launch (Hopper and later, compiled only: `uses_pdl`): the blocked kernel may start while
# the kernel before it finishes, its first weight loads in flight before it waits for that kernel
# (`_nf4_matvec_blocked_kernel`). Measured on the H200: Qwen3-8B decoding 111 -> 116 tokens/s.
PDL = True
# The blocked kernel's PTX lookup with the code book rounded to bf16 (`_nf4_lookup_ptx`) for bf16 weights: fewer
# instructions a weight, which bound the kernel (12-20% less time on the H200 at every projection of 4,096 features
# or more); each weight within bf16's rounding of its exact value, as the bf16 weight that `dequantize_nf4` writes
# is. fp32 and fp16 weights keep the exact code book: rounded, it changes an fp32 model's greedy tokens.
BF16_CODES = True
# Tiles along K whose loads the blocked and the word kernel's loops keep in flight (Triton's software pipelining:
# asynchronous copies into shared memory, `tl.range(num_stages=)`), where 1 loads each tile in its own step: the
# next tiles' bytes keep coming while a program decodes one (profiled since, the word kernel is bound inside the
# SM, by its integer work and shared-memory reads, not by DRAM: docs/benchmarks.md). Measured on the H200
# (2026-12-05, every projection of the W3 models, one row): the word kernel with three stages took 3-21% less
# time than with one (the projections' sum a token: Qwen3-8B 4.64 -> 4.11 ms, Qwen3.5-27B 12.40 -> 11.27), the
# blocked kernel from 1% more to 18% less.
PIPELINE_STAGES = 3
# The word kernel's loop with the next tile's loads issued into registers before each step decodes its own
# (`_prefetched_word_walk`) instead of Triton's pipelining through shared memory: more bytes in flight a warp
# without a barrier a step. Not yet measured on a GPU: off.
REGISTER_PREFETCH = False
# The kernels read a double-quantised weight's absmax as one fp32 value a block (`flat_absmax`: dequantised once
# a weight, on its first product, and kept while the weight's absmax is unchanged) instead of the nested form,
# whose scale is a chain of three dependent loads a tile (8-bit absmax, its second-level code, then the
# second-level scale). 4 bytes a block more memory (0.44 GB at the Qwen3-8B shape, 1.6 GB at the 27B's); measured
# on the H200 with weights quantised without double quantisation, the same kernel took 9-11% less time a token
# (projections' sums: Qwen3-8B 5.40 -> 4.94 ms, Qwen3.5-27B 16.17 -> 14.32). `release_flat_absmax` frees them.
FLAT_ABSMAX = True
# The word kernel (`nf4_matvec_words.py`) for whole-block shapes: the weight read as 32-bit words, eight codes
# decoded at once with selectors taken from the word as it lies, a block's scale applied once per word; its loop
# spends 30% fewer instructions per weight than the blocked kernel's (offline, sm_90). Measured on the H200
# (2026-12-05, one row, one stage): faster at every projection of the W3 models, by 1-18% (Qwen3-8B 4.99 -> 4.64
# ms a token in the projections' sum, Qwen3.5-27B 14.40 -> 12.54; bitsandbytes' gemv 5.29 and 15.34).
WORD_KERNEL = True
# The word walk's products where the weight and x are bf16 (`word_code_form`): the codes kept as bf16 pairs and
# multiplied with x's bf16 pairs two at a time (`fma.rn.bf16x2`, `nf4_codes.code_pair_sums`), each word's eight
# products summed in bf16 in two chains of four, then in fp32; no widening of x or of the codes to fp32. Offline
# for sm_90 (8 x 512 tile): the word kernel's loop 58.2 -> 41.8 instructions per eight weights, the gate-and-up
# walk's 50.6 -> 37.6. Measured on an H100 (2026-12-06, docs/benchmarks.md): the Qwen3-8B shape's projections
# 3.257 -> 3.149 ms a token, its decoding 305.5 -> 317.4 tokens/s; each product's error against the exact one
# about 1.5x that of Hugging Face's bf16 weights (an emulation in float64), within the bf16 greedy-path tests.
BF16_PAIR_PRODUCTS = True
# With adapters whose first products are not given (`lora_a`, no `lora_t`; `lora_as` of the grouped and the
# gate-and-up launches), the word walk's launch computes them itself: its first width · steps programs take x Aᵀ a
# column and a step along K each (`lora_down`'s split); the others await t only before their epilogue. No
# `lora_down_rows` launch before the output projections, the norms alone (`decoder_layer.py`). With
# `decode.MLP_SHARES`, on an H100 (docs/benchmarks.md, 2026-12-06): a step with adapters 3.579 -> 3.432-3.446 ms at
# the 8B shape, 9.668 -> 9.655 at the 27B's (without the shares, on an H200: +1.5% and -1.6%): on.
FIRST_PRODUCTS_IN_LAUNCH = True
# The word launch's walk in Gluon (`nf4_matvec_gluon.py`: each thread all of a program's 8 features for its two
# words, x's pairs loaded once into its registers, the next step's loads issued before this step's products, no
# shared memory in the loop) for the products it takes: one bf16 row, K a multiple of 2,048, t given (or, with
# `GLUON_FIRST_PRODUCTS`, the first products in the launch). Measured on an H100 (docs/benchmarks.md, "The word
# launch walked in Gluon"): alone 8-12% less time than the word kernel at the Qwen3-8B shape's projections; the
# 8B's decoding step 3.032 -> 2.881 ms, adapted 3.378 -> 3.267; the 27B's 9.002 -> 8.992.
GLUON_WALK = True
# With `GLUON_WALK`, a product whose adapter's first product is in its launch (o_proj's) walked in Gluon too, its
# first r programs each writing a column of t from x's whole row at once (`nf4_matvec_gluon._first_product_column`),
# instead of on the Triton word kernel. Compiled offline for sm_90, not yet run on a GPU: off until measured.
GLUON_FIRST_PRODUCTS = False
# The word walk's tile and stages by launch ("words", "gated", "grouped") and shape, where one was measured faster
# than `blocked_tile`'s with `PIPELINE_STAGES` (`scripts/bench_word_tiles.py`, which times every candidate of
# each launch a decoding step makes): (launch, N, K) -> (features, weights along K, warps, tiles a split along K
# (0: none; only the word kernel's own launch splits), stages). A launch and shape not in it takes those defaults.
# From the sweep with the products in bf16 pairs (an H100, 2026-12-06, Qwen3-8B shape, docs/benchmarks.md): the
# down projection with four stages (19.74 -> 19.16 us). From the sweep of the adapted launches (`--adapters 16`,
# an H100, 2026-12-07): gate and up with two warps a program (34.67 -> 33.37 us).
WORD_TILES: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = {
    ("words", 4096, 12288): (8, 512, 4, False, 4),
    ("gated", 12288, 4096): (8, 512, 2, False, 3),
}
# `WORD_TILES`' form for a launch without adapters, taken first. Gate and up at 32 x 256 (the same sweep: 32.12 ->
# 30.99 us): on an H100 318.5 -> 325.4 tokens/s without adapters, 0.13 ms a step more with them (docs/benchmarks.md,
# "The word walk's products in bf16 pairs", runs 4 and 5).
WORD_TILES_WITHOUT_ADAPTERS: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = {
    ("gated", 12288, 4096): (32, 256, 4, False, 3),
}


def uses_bf16_codes(weight_dtype: torch.dtype) -> bool:
    """Whether the blocked kernel decodes a weight of `weight_dtype` (`quant_state.dtype`) with the code book
    rounded to bf16: only bf16 weights, only where the PTX lookup runs."""
    return BF16_CODES and LOOKUP == "registers" and weight_dtype == torch.bfloat16


def word_code_form(bf16_codes: bool, x_pairs: bool) -> int:
    """The word walk's BF16_CODES (`nf4_codes._nf4_word_codes`): CODE_PAIRS where `BF16_PAIR_PRODUCTS` is on and
    both the codes (`uses_bf16_codes`) and x (`word_kernel_rows`) are bf16, else `bf16_codes`."""
    return CODE_PAIRS.value if BF16_PAIR_PRODUCTS and bf16_codes and x_pairs else int(bf16_codes)


def gluon_walk_form(words: bool, blocksize: int, bf16_codes: bool, x_pairs: bool) -> bool:
    """Whether a launch on the word walk may take its Gluon form (`GLUON_WALK`): blocks of the Gluon walks' size
    and the products in bf16 pairs (`word_code_form`); each launch then asks whether its shapes fit."""
    return (GLUON_WALK and words and blocksize == gluon.BLOCKSIZE
            and word_code_form(bf16_codes, x_pairs) == CODE_PAIRS)


def uses_pdl(device: torch.device) -> bool:
    """Whether the blocked kernel is launched as a programmatic dependent launch on `device` (`PDL`, and
    `compute_capability(device) >= 9`: `griddepcontrol` does not exist before Hopper)."""
    return PDL and compute_capability(device) >= 9


def blocked_tile(n_out: int) -> tuple[int, int, int, int]:
    """(features, weights along K, warps, tiles a split along K: 0 or False for none) of the blocked kernel's
    programs. Measured on the H200 at batch 1 over the Qwen3-8B and Qwen3.5-27B projections (`bench_nf4_matvec.py
    --sweep`): 8 features by 512 weights where N is large; 4 by 1024 where N / 8 programs would leave SMs idle
    (k/v projections: N = 1024).
    The interpreter's cost is per program and per operation: few, wide tiles. Split along K (one tile of K a
    program, `_nf4_matvec_blocked_kernel`): measured slower at every projection but the 27B's 48-feature ones
    (8.4 against 9.7 us), so off."""
    if INTERPRET:
        return 64, 256, 4, False
    if n_out >= 2048:
        return 8, 512, 4, False
    return 4, 1024, 4, False


def word_tile(n_out: int, n_in: int = 0, launch: str = "words", adapted: bool = True) -> tuple[int, int, int, int]:
    """`blocked_tile`'s form for the word kernel (`WORD_KERNEL`, launch "words") and the launches on its walk
    ("gated": gate-and-up, "grouped": one input's projections, N the widest's): the entry for the launch at
    `n_out` x `n_in` (`_word_entry`), else the blocked kernel's tile, at which the word kernel was measured faster
    than the blocked kernel at every W3 projection (2026-12-05)."""
    found = _word_entry(n_out, n_in, launch, adapted)
    return found[:4] if found else blocked_tile(n_out)


def word_stages(n_out: int, n_in: int = 0, launch: str = "words", adapted: bool = True) -> int:
    """`PIPELINE_STAGES` for the word walk of `launch` at `n_out` x `n_in`, or its entry's (`_word_entry`)."""
    found = _word_entry(n_out, n_in, launch, adapted)
    return found[4] if found else PIPELINE_STAGES


def _word_entry(n_out: int, n_in: int, launch: str, adapted: bool) -> tuple | None:
    """A compiled launch's entry (None interpreted): `WORD_TILES_WITHOUT_ADAPTERS`' if unadapted, else `WORD_TILES`'."""
    if INTERPRET:
        return None
    key = (launch, n_out, n_in)
    return (None if adapted else WORD_TILES_WITHOUT_ADAPTERS.get(key)) or WORD_TILES.get(key)


def word_kernel_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(x's rows as the word kernel's walk reads them, whether as bf16 pairs): contiguous columns, and bf16 x as
    int32 pairs (its row stride then in pairs) where its rows start on 4-byte boundaries."""
    x_rows = x2d if x2d.stride(1) == 1 else x2d.contiguous()
    x_pairs = x_rows.dtype == torch.bfloat16 and x_rows.stride(0) % 2 == 0 and x_rows.data_ptr() % 4 == 0
    return (x_rows.view(torch.int32) if x_pairs else x_rows), x_pairs


def packed_words(packed: torch.Tensor) -> torch.Tensor:
    """An NF4 weight's packed bytes as the int32 words of eight codes the word kernel's walk reads."""
    return packed.reshape(-1).view(torch.int32)


def fp32_absmax(weight, quant_state=None) -> torch.Tensor | None:
    """The fp32 absmax a block of an NF4 weight (a `Params4bit`, or packed bytes with `quant_state`), as the
    kernels that read it flat take it: its own, or the kept flat form of a double-quantised weight
    (`flat_absmax`); None where that is off (`FLAT_ABSMAX`) or cannot be made now (during a capture)."""
    quant_state = _quant_state_of(weight, quant_state)
    if not quant_state.nested:
        return quant_state.absmax
    return flat_absmax(quant_state) if FLAT_ABSMAX else None


def nf4_matvec(
    x: torch.Tensor,
    weight,
    bias: torch.Tensor | None = None,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 1.0,
    quant_state=None,
    lora_t: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x dequant(W)ᵀ + b + scale · (x Aᵀ) Bᵀ` for x `[..., K]` of 1 to 8 rows and W a 2-D NF4 `Params4bit`
    `[N, K]` (or packed bytes with `quant_state`); returns `[..., N]` in x's dtype. No autograd. `lora_t`: x Aᵀ
    already computed (fp32 `[rows, r]`, unit column stride; `lora_down_rows`), given with B instead of A, or as
    parts `[P, rows, r]` whose sum it is (`nf4_gated_matvec`'s stripes of `down_shares`), summed in the epilogue.
    `residual` (`[..., N]` as the result, x's dtype): added in the epilogue before the one rounding, as an
    output projection's result joins the residual stream."""
    launch = _launch(weight, quant_state)
    if len(launch.shape) != 2:
        raise ValueError(f"nf4_matvec needs a 2-D weight; quant_state.shape is {tuple(launch.shape)}")
    n_out, n_in = int(launch.shape[0]), int(launch.shape[1])
    x2d = x.reshape(-1, n_in)
    n_rows = x2d.shape[0]
    _check_args(x, weight, bias, lora_a, lora_b, lora_t, n_out, n_in)
    if residual is not None and (residual.numel() != n_rows * n_out or residual.dtype != x.dtype):
        raise ValueError(f"residual has shape {tuple(residual.shape)} and dtype {residual.dtype}; expected "
                         f"{n_rows * n_out} elements of {x.dtype}")
    if residual is not None and bias is not None:  # one addend in the epilogue: the bias's sum with the residual
        residual, bias = residual + bias.to(residual.dtype), None
    out = empty((n_rows, n_out), x.dtype, x.device)
    packed, absmax, code, nested_code, nested_absmax, offset, nested_blocksize = launch.inputs
    nested = launch.meta["NESTED"]
    flat = fp32_absmax(weight, quant_state) if nested else None
    if flat is not None:
        absmax, nested = flat, False
    blocksize = 2 * launch.meta["HALF_BLOCK"]
    bf16_codes = uses_bf16_codes(launch.dtype)
    tables = lane_tables(x.device, bf16_codes) if WORD_KERNEL else None
    words = tables is not None  # the word kernel, else the blocked one
    block_n, tile_k, warps, tiles_a_split = word_tile(n_out, n_in) if words else blocked_tile(n_out)
    blocked = n_in % blocksize == 0 and tile_k % blocksize == 0
    feature_blocks, splits = triton.cdiv(n_out, block_n), triton.cdiv(n_in, tile_k * max(int(tiles_a_split), 1))
    split_k = int(tiles_a_split) if blocked and splits > 1 else 0  # tiles a split, 0: K not split
    first_in_launch = (FIRST_PRODUCTS_IN_LAUNCH and lora_t is None and lora_a is not None and lora_a.shape[0] > 0
                       and blocked and words and not split_k)
    x_rows, x_pairs = word_kernel_rows(x2d) if blocked and words else (x2d, False)
    gluon_walk = (blocked and not nested and gluon_walk_form(words, blocksize, bf16_codes, x_pairs)
                  and gluon.gluon_walk_fits(x_rows, n_out, n_in) and (GLUON_FIRST_PRODUCTS or not first_in_launch))
    block_m = triton.next_power_of_2(n_rows)  # rows of the blocked kernel: x's, padded
    first = no_first_products(x2d)  # the word kernel's arguments for the first products in its launch
    gluon_first = None  # the Gluon walk's
    parts, part_stride = 1, 0  # t in parts: summed in the word kernel's epilogue, by the host for the others
    if lora_t is not None and lora_t.dim() == 3:
        if blocked and words:
            parts, part_stride, lora_t = lora_t.shape[0], lora_t.stride(0), lora_t[0]
        else:
            lora_t = lora_t.sum(0)
    if lora_t is not None:
        t, rank = lora_t, lora_t.shape[1]
    elif first_in_launch and gluon_walk:
        t, rank = empty((1, lora_a.shape[0]), torch.float32, x.device), lora_a.shape[0]
        gluon_first = (x_rows.view(x.dtype), lora_a.contiguous(), first_product_flags(x.device, n_out // gluon.BLOCK_N))
    elif first_in_launch:
        (t, first), rank = first_product_args(x2d, [lora_a], block_m, feature_blocks), lora_a.shape[0]
    elif lora_a is not None and lora_a.shape[0] > 0:
        t, rank = lora_down_rows(x2d, [lora_a]), lora_a.shape[0]
    else:
        t, rank = out, 0
    has_lora = rank > 0
    lora_b_arg = lora_b if has_lora else out
    if residual is not None:
        addend, bias_kind = residual.reshape(n_rows, n_out).contiguous(), BIAS_ROWS
    else:
        addend, bias_kind = bias, BIAS_FEATURES if bias is not None else BIAS_NONE
    if gluon_walk:
        gluon.launch_gluon_walk(x_rows, packed_words(packed), absmax, tables, out, n_out, n_in, addend,
                                t if has_lora else None, parts, part_stride, lora_b, scale, uses_pdl(x.device),
                                gluon_first)
        return out.view(*x.shape[:-1], n_out)
    if split_k:
        partial = empty((splits, block_m, n_out), torch.float32, x.device)
        arrivals = _arrival_counters(x.device, feature_blocks)
    # what the kernel reads codes from: the blocked kernel's pair table, else the code book
    table = code_pairs(code) if blocked and not words and LOOKUP == "pairs" else code
    args = (
        x2d, x2d.stride(0), x2d.stride(1),
        packed, absmax, table, nested_code, nested_absmax, offset,
        nested_blocksize,
        addend if addend is not None else out, t, t.stride(0), lora_b_arg, lora_b_arg.stride(0), lora_b_arg.stride(1),
        float(scale),
        out, out.stride(0),
    )
    sizes = (n_rows, n_out, n_in, rank)
    meta = dict(
        BLOCKSIZE=blocksize, NESTED=nested, BIAS=bias_kind, HAS_LORA=has_lora,
        BLOCK_R=max(2, triton.next_power_of_2(rank)),
    )
    if blocked and words:
        pdl = uses_pdl(x.device)
        stages = word_stages(n_out, n_in)
        _nf4_matvec_words_kernel[(first.programs + feature_blocks, splits if split_k else 1)](
            x_rows, x_rows.stride(0), packed_words(packed), absmax, code, tables, *args[6:],
            *((partial, arrivals) if split_k else (out, out)), *sizes, *first,
            part_stride, T_PARTS=parts, T_EARLY=t_before_walk(has_lora, not first_in_launch, stages, REGISTER_PREFETCH),
            FIRST_PRODUCTS=first_in_launch, FIRST_BLOCK_K=LORA_BLOCK_K,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCKS_PER_TILE=tile_k // blocksize,
            PTX=LOOKUP == "registers", BF16_CODES=word_code_form(bf16_codes, x_pairs),
            SPLIT_K=split_k, PDL=pdl, STAGES=stages, num_warps=warps,
            WHOLE_TILES=n_out % block_n == 0 and n_in % tile_k == 0, X_PAIRS=x_pairs, PREFETCH=REGISTER_PREFETCH,
            **({"launch_pdl": True} if pdl else {}), **meta,
        )
    elif blocked:
        pdl = uses_pdl(x.device)
        _nf4_matvec_blocked_kernel[(feature_blocks, splits if split_k else 1)](
            *args, *((partial, arrivals) if split_k else (out, out)), *sizes,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCKS_PER_TILE=tile_k // blocksize,
            LOOKUP=LOOKUPS.index(LOOKUP), BF16_CODES=bf16_codes,
            SPLIT_K=split_k, PDL=pdl, STAGES=PIPELINE_STAGES, num_warps=warps,
            **({"launch_pdl": True} if pdl else {}), **meta,
        )
    else:
        _nf4_matvec_kernel[(triton.cdiv(n_out, BLOCK_N),)](
            *args, *sizes, BLOCK_M=max(2, triton.next_power_of_2(n_rows)), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            WEIGHT_BF16=launch.dtype == torch.bfloat16, WEIGHT_FP16=launch.dtype == torch.float16,
            enable_fp_fusion=False, num_warps=4, **meta,
        )
    return out.view(*x.shape[:-1], n_out)
