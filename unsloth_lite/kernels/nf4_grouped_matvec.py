"""Several NF4 projections of one input in one launch, for decoding: q, k and v of an attention layer, or the
four input projections of a Gated DeltaNet layer (qkv, z, and the 48-feature b and a).

For x `[M, K]` (M ≤ 8 rows) and up to four NF4 weights W_i `[N_i, K]` (`nf4_matvec`'s forward for each):

    y_i = x W_iᵀ + b_i + s_i · t_i B_iᵀ        t_i: columns of one t = x [A_1; ...]ᵀ (`lora_down_rows`)

The launch's programs are those of the weights' own kernels side by side: program p belongs to the first weight
whose range of programs holds it and runs `nf4_matvec`'s walk over that weight's rows (the word kernel's,
`_word_walk`, where `nf4_matvec.WORD_KERNEL` is on, else the blocked kernel's, `_blocked_sums`; the same tile for
all: the widest weight's), so each y_i has the bits of its own `nf4_matvec` at that tile where the adapters share
a rank (a smaller one's sum runs over the group's widest). Why: one launch instead of up to four,
and the small projections (k and v of 1,024 features, the DeltaNet's b and a of 48) run beside the large one
instead of after it; launched one after the other, each waits for the one before (programmatic dependent launch
orders them) though none reads another's output. No backward: inference only. The absmax is read flat
(`nf4_matvec.fp32_absmax`).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents

from unsloth_lite.kernels import nf4_grouped_gluon as gluon
from unsloth_lite.kernels import nf4_matvec as matvec  # its settings (tiles, lookup, PDL) are read at each call
from unsloth_lite.kernels.dequantize_nf4 import _launch
from unsloth_lite.kernels.lora_down import (
    LORA_BLOCK_K,
    MAX_ADAPTERS_PER_LAUNCH,
    MAX_ROWS,
    _await_first_products,
    _count_reader,
    _first_product_program,
    first_product_args,
    lora_down_rows,
    no_first_products,
)
from unsloth_lite.kernels.matvec_epilogue import (
    _adapter_b,
    _adapter_t,
    _early_t,
    _finish_product,
    t_before_walk,
)
from unsloth_lite.kernels.nf4_codes import LOOKUPS, code_pairs
from unsloth_lite.kernels.nf4_matvec import packed_words, word_kernel_rows
from unsloth_lite.kernels.nf4_matvec_blocked import _blocked_sums
from unsloth_lite.kernels.nf4_matvec_state import lane_tables
from unsloth_lite.kernels.nf4_matvec_words import _word_walk
from unsloth_lite.kernels.utils import INTERPRET, empty

MAX_WEIGHTS = 4  # the DeltaNet's four input projections
# The launch's walks in Gluon for one bf16 row where they fit (`nf4_grouped_gluon.py`, with
# `nf4_matvec.GLUON_WALK`: the Qwen3-8B shape's q/k/v), t given (no first products in the launch). Compiled
# offline for sm_90, not yet run on a GPU: off until measured.
GLUON_GROUPED = False


@triton.jit
def _nf4_grouped_matvec_kernel(
    x_ptr, x_row_stride, x_col_stride, table_ptr, tables_ptr, t_ptr, t_row_stride,
    packed0, absmax0, bias0, b0, b0_row_stride, b0_col_stride, scale0, out0, n_out0, t_col0, rank0, end0,
    packed1, absmax1, bias1, b1, b1_row_stride, b1_col_stride, scale1, out1, n_out1, t_col1, rank1, end1,
    packed2, absmax2, bias2, b2, b2_row_stride, b2_col_stride, scale2, out2, n_out2, t_col2, rank2, end2,
    packed3, absmax3, bias3, b3, b3_row_stride, b3_col_stride, scale3, out3, n_out3, t_col3, rank3,
    n_rows, n_in,
    xv_ptr, xv_row_stride, xv_col_stride, a0_ptr, a1_ptr, a2_ptr, first_rank0, first_rank1, width, first_partial_ptr,
    first_arrivals_ptr, flags_ptr, first_splits,
    BLOCKSIZE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, BLOCK_R: tl.constexpr, LOOKUP: tl.constexpr,
    BF16_CODES: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr, WORDS: tl.constexpr, PREFETCH: tl.constexpr,
    WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr, FIRST_PRODUCTS: tl.constexpr, FIRST_BLOCK_K: tl.constexpr,
    T_EARLY: tl.constexpr,
):
    """Program p: weight i, the first with p < end_i (the slots past the last weight repeat it and are never
    reached), features [(p - end_{i-1}) · BLOCK_N, ...) of it for all rows. WORDS: the word kernel's walk (the
    packed weights as int32 words, x as `word_kernel_rows` gives it, `table_ptr` the code book, `tables_ptr` the
    lane tables; WHOLE_TILES and X_PAIRS as in `_nf4_matvec_words_kernel`), else the blocked kernel's.
    FIRST_PRODUCTS (the word walk): the adapters' first products t in the launch, by its first width ·
    first_splits programs, as the word kernel's FIRST_PRODUCTS; the weights' programs come after them. T_EARLY: t,
    given, loaded before the walk (`matvec_epilogue.t_before_walk`)."""
    if FIRST_PRODUCTS:
        writers = width * first_splits
        if tl.program_id(0) < writers:
            _first_product_program(
                xv_ptr, xv_row_stride, xv_col_stride, a0_ptr, a1_ptr, a2_ptr, first_rank0, first_rank1, width, t_ptr,
                t_row_stride, n_rows, n_in, first_partial_ptr, first_arrivals_ptr, flags_ptr, first_splits, BLOCK_M,
                FIRST_BLOCK_K, PDL,
            )
        else:
            _grouped_program(
                tl.program_id(0) - writers, x_ptr, x_row_stride, x_col_stride, table_ptr, tables_ptr, t_ptr,
                t_row_stride,
                packed0, absmax0, bias0, b0, b0_row_stride, b0_col_stride, scale0, out0, n_out0, t_col0, rank0, end0,
                packed1, absmax1, bias1, b1, b1_row_stride, b1_col_stride, scale1, out1, n_out1, t_col1, rank1, end1,
                packed2, absmax2, bias2, b2, b2_row_stride, b2_col_stride, scale2, out2, n_out2, t_col2, rank2, end2,
                packed3, absmax3, bias3, b3, b3_row_stride, b3_col_stride, scale3, out3, n_out3, t_col3, rank3,
                n_rows, n_in, flags_ptr, width, tl.num_programs(0) - writers,
                BLOCKSIZE, HAS_BIAS, HAS_LORA, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, BLOCK_R, LOOKUP, BF16_CODES, PDL,
                STAGES, WORDS, PREFETCH, WHOLE_TILES, X_PAIRS, True, False,
            )
    else:
        _grouped_program(
            tl.program_id(0), x_ptr, x_row_stride, x_col_stride, table_ptr, tables_ptr, t_ptr, t_row_stride,
            packed0, absmax0, bias0, b0, b0_row_stride, b0_col_stride, scale0, out0, n_out0, t_col0, rank0, end0,
            packed1, absmax1, bias1, b1, b1_row_stride, b1_col_stride, scale1, out1, n_out1, t_col1, rank1, end1,
            packed2, absmax2, bias2, b2, b2_row_stride, b2_col_stride, scale2, out2, n_out2, t_col2, rank2, end2,
            packed3, absmax3, bias3, b3, b3_row_stride, b3_col_stride, scale3, out3, n_out3, t_col3, rank3,
            n_rows, n_in, flags_ptr, 0, 0,
            BLOCKSIZE, HAS_BIAS, HAS_LORA, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, BLOCK_R, LOOKUP, BF16_CODES, PDL,
            STAGES, WORDS, PREFETCH, WHOLE_TILES, X_PAIRS, False, T_EARLY,
        )


@triton.jit
def _grouped_program(
    pid, x_ptr, x_row_stride, x_col_stride, table_ptr, tables_ptr, t_ptr, t_row_stride,
    packed0, absmax0, bias0, b0, b0_row_stride, b0_col_stride, scale0, out0, n_out0, t_col0, rank0, end0,
    packed1, absmax1, bias1, b1, b1_row_stride, b1_col_stride, scale1, out1, n_out1, t_col1, rank1, end1,
    packed2, absmax2, bias2, b2, b2_row_stride, b2_col_stride, scale2, out2, n_out2, t_col2, rank2, end2,
    packed3, absmax3, bias3, b3, b3_row_stride, b3_col_stride, scale3, out3, n_out3, t_col3, rank3,
    n_rows, n_in,
    flags_ptr, width, readers,
    BLOCKSIZE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, BLOCK_R: tl.constexpr, LOOKUP: tl.constexpr,
    BF16_CODES: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr, WORDS: tl.constexpr, PREFETCH: tl.constexpr,
    WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr, AWAIT_T: tl.constexpr, T_EARLY: tl.constexpr,
):
    """The grouped launch's program `pid` among the weights' programs (`_nf4_grouped_matvec_kernel`). AWAIT_T: t
    comes from the launch's first programs (awaited before t's load, the program counted once it is issued, as in
    the word kernel's `_word_program`)."""
    if pid < end0:
        packed, absmax, bias, lora_b, scale, out, n_out = packed0, absmax0, bias0, b0, scale0, out0, n_out0
        b_row_stride, b_col_stride, t_col, rank, start = b0_row_stride, b0_col_stride, t_col0, rank0, 0
    elif pid < end1:
        packed, absmax, bias, lora_b, scale, out, n_out = packed1, absmax1, bias1, b1, scale1, out1, n_out1
        b_row_stride, b_col_stride, t_col, rank, start = b1_row_stride, b1_col_stride, t_col1, rank1, end0
    elif pid < end2:
        packed, absmax, bias, lora_b, scale, out, n_out = packed2, absmax2, bias2, b2, scale2, out2, n_out2
        b_row_stride, b_col_stride, t_col, rank, start = b2_row_stride, b2_col_stride, t_col2, rank2, end1
    else:
        packed, absmax, bias, lora_b, scale, out, n_out = packed3, absmax3, bias3, b3, scale3, out3, n_out3
        b_row_stride, b_col_stride, t_col, rank, start = b3_row_stride, b3_col_stride, t_col3, rank3, end2
    features = (pid - start) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    b_rows = _adapter_b(lora_b, b_row_stride, b_col_stride, features, n_out, rank, HAS_LORA, BLOCK_R)
    t = _early_t(t_ptr + t_col, t_row_stride, rank, rows, n_rows, HAS_LORA, BLOCK_R, 0, 1, PDL, T_EARLY)
    if WORDS:
        acc, partial = _word_walk(
            x_ptr, x_row_stride, packed, absmax, table_ptr, tables_ptr, absmax, absmax, absmax, 1, features, n_rows,
            n_out, n_in, 0, n_in // BLOCKSIZE, BLOCKSIZE, False, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, LOOKUP == 0,
            BF16_CODES, PDL, STAGES, WHOLE_TILES, X_PAIRS, PREFETCH,
        )
    else:
        acc, partial = _blocked_sums(
            x_ptr, x_row_stride, x_col_stride, packed, absmax, table_ptr, absmax, absmax, absmax, 1, features,
            n_rows, n_out, n_in, 0, n_in // BLOCKSIZE, BLOCKSIZE, False, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, LOOKUP,
            BF16_CODES, PDL, STAGES,
        )
    if PDL:
        gdc_launch_dependents()
    if AWAIT_T:
        _await_first_products(flags_ptr, width)
    if not T_EARLY:
        t = _adapter_t(t_ptr + t_col, t_row_stride, rank, rows, n_rows, HAS_LORA, BLOCK_R, 0, 1)
    if AWAIT_T:
        _count_reader(flags_ptr, pid, readers)
    _finish_product(
        acc, partial, rows, features, n_rows, n_out, absmax, absmax, bias, t, b_rows, scale, out, n_out, BLOCK_M,
        False, HAS_BIAS, HAS_LORA,
    )


def grouped_matvec_supported(x: torch.Tensor, weights, biases, loras) -> bool:
    """Whether `nf4_grouped_matvec` takes x and these weights: 2 to MAX_WEIGHTS NF4 weights of one input width,
    dtype and block size whose rows hold whole blocks (and the tile along K too), biases on all or none (of one
    dtype), adapters' B of one dtype, 1 to 8 rows of x on a kernel device, and an fp32 absmax at hand for each
    (`nf4_matvec.fp32_absmax`)."""
    if not 2 <= len(weights) <= MAX_WEIGHTS or x.dtype == torch.float64:
        return False
    if len({lora[0].dtype for lora in loras if lora is not None}) > 1:
        return False
    states = [getattr(w, "quant_state", None) for w in weights]
    if any(s is None or s.quant_type != "nf4" or len(s.shape) != 2 for s in states):
        return False
    n_in, blocksize, dtype = states[0].shape[1], states[0].blocksize, states[0].dtype
    if any((s.shape[1], s.blocksize, s.dtype) != (n_in, blocksize, dtype) for s in states):
        return False
    if len({None if b is None else b.dtype for b in biases}) != 1:
        return False
    widest = max(s.shape[0] for s in states)
    tile_k = (matvec.word_tile(widest, n_in, "grouped") if matvec.WORD_KERNEL else matvec.blocked_tile(widest))[1]
    rows = x.numel() // max(n_in, 1)
    if n_in % blocksize or tile_k % blocksize or x.shape[-1] != n_in or not 1 <= rows <= MAX_ROWS:
        return False
    if not (x.is_cuda or (INTERPRET and x.device.type == "cpu")) or any(w.device != x.device for w in weights):
        return False
    return all(matvec.fp32_absmax(w) is not None for w in weights)


def nf4_grouped_matvec(x: torch.Tensor, weights, biases, loras, lora_t: torch.Tensor | None = None,
                       lora_as: list[torch.Tensor] | None = None):
    """`[x W_iᵀ + b_i + s_i t_i B_iᵀ for each weight]` for x `[..., K]` and 2 to 4 NF4 `Params4bit` W_i
    (module docstring), each `[..., N_i]` in x's dtype. `biases`: one per weight (all None or all tensors);
    `loras`: one per weight, None or (B_i `[N_i, r_i]`, s_i); `lora_t`: fp32 `[rows, Σ r_i]` with unit column
    stride, the adapted weights' t side by side in their order (`lora_down_rows`), or None with `lora_as`, the
    adapted weights' A_i in their order: t then computed in the launch (`nf4_matvec.FIRST_PRODUCTS_IN_LAUNCH`, the
    word walk, up to MAX_ADAPTERS_PER_LAUNCH adapters) or by `lora_down_rows`. Inputs `grouped_matvec_supported`
    refuses raise ValueError. No autograd."""
    if not grouped_matvec_supported(x, weights, biases, loras):
        raise ValueError("nf4_grouped_matvec takes 1 to 8 rows of x and 2 to 4 NF4 weights of one input width, "
                         "dtype and block size, whole blocks along K, biases on all or none "
                         "(grouped_matvec_supported)")
    n_in = int(weights[0].quant_state.shape[1])
    x2d = x.reshape(-1, n_in)
    n_rows = x2d.shape[0]
    ranks = [lora[0].shape[1] if lora is not None else 0 for lora in loras]
    bf16_codes = matvec.uses_bf16_codes(weights[0].quant_state.dtype)
    tables = lane_tables(x.device, bf16_codes) if matvec.WORD_KERNEL else None
    words = tables is not None  # the word kernel's walk, else the blocked one's
    block_m = triton.next_power_of_2(n_rows)
    widths = [int(w.quant_state.shape[0]) for w in weights]
    widest = max(widths)
    block_n, tile_k, warps, _ = matvec.word_tile(widest, n_in, "grouped") if words else matvec.blocked_tile(widest)
    programs = [triton.cdiv(n, block_n) for n in widths]  # each weight's, side by side
    first = no_first_products(x2d)
    if sum(ranks) and lora_t is None and lora_as is not None:
        if [a.shape[0] for a in lora_as] != [r for r in ranks if r]:
            raise ValueError(f"lora_as must hold the adapted weights' A in order; got ranks "
                             f"{[a.shape[0] for a in lora_as]} for {[r for r in ranks if r]}")
        if matvec.FIRST_PRODUCTS_IN_LAUNCH and words and len(lora_as) <= MAX_ADAPTERS_PER_LAUNCH:
            lora_t, first = first_product_args(x2d, lora_as, block_m, sum(programs))
        else:
            lora_t = lora_down_rows(x2d, lora_as)
    if sum(ranks) and (lora_t is None or lora_t.shape[1] != sum(ranks)):
        raise ValueError(f"lora_t must hold the adapters' {sum(ranks)} columns side by side")
    outputs, slots, first_column, end = [], [], 0, 0
    for weight, bias, lora, rank, weight_programs in zip(weights, biases, loras, ranks, programs, strict=True):
        n_out = int(weight.quant_state.shape[0])
        t_cols = lora_t[:, first_column:first_column + rank] if rank else None
        matvec._check_args(x, weight, bias, None, lora[0] if lora else None, t_cols, n_out, n_in)
        out = empty((n_rows, n_out), x.dtype, x.device)
        # a weight without an adapter reads none (rank 0) but passes a B of the others' dtype
        lora_b = lora[0] if lora is not None else next((lo[0] for lo in loras if lo is not None), out)
        end += weight_programs
        packed = _launch(weight, None).inputs[0]
        slots.append((packed_words(packed) if words else packed, matvec.fp32_absmax(weight),
                      bias if bias is not None else out,
                      lora_b, lora_b.stride(0), lora_b.stride(-1), float(lora[1]) if lora else 0.0, out, n_out,
                      first_column, rank, end))
        outputs.append(out.view(*x.shape[:-1], n_out))
        first_column += rank
    blocksize = int(weights[0].quant_state.blocksize)
    t = lora_t if lora_t is not None else slots[0][7]
    pdl = matvec.uses_pdl(x.device)
    x_rows, x_pairs = word_kernel_rows(x2d) if words else (x2d, False)
    if (GLUON_GROUPED and first.programs == 0 and matvec.gluon_walk_form(words, blocksize, bf16_codes, x_pairs)
            and gluon.gluon_grouped_fits(x_rows, widths, n_in)):
        # each weight's slot without its width, its programs' end at the Gluon walk's BLOCK_N
        ends = itertools.accumulate(n // gluon.BLOCK_N for n in widths)
        gluon_slots = [(*slot[:8], *slot[9:11], end) for slot, end in zip(slots, ends, strict=True)]
        gluon_slots += [gluon_slots[-1]] * (MAX_WEIGHTS - len(gluon_slots))
        gluon.launch_gluon_grouped(x_rows, tables, t, gluon_slots, n_in, biases[0] is not None, ranks, pdl)
        return outputs
    slots += [slots[-1]] * (MAX_WEIGHTS - len(slots))
    code = _launch(weights[0], None).inputs[2]
    table = code_pairs(code) if matvec.LOOKUP == "pairs" and not words else code
    stages = matvec.word_stages(widest, n_in, "grouped") if words else matvec.PIPELINE_STAGES
    _nf4_grouped_matvec_kernel[(first.programs + end,)](
        x_rows, x_rows.stride(0), x_rows.stride(1), table,
        tables if words else code, t, t.stride(0), *(arg for slot in slots[:-1] for arg in slot), *slots[-1][:-1],
        n_rows, n_in, *first,
        BLOCKSIZE=blocksize, HAS_BIAS=biases[0] is not None,
        HAS_LORA=sum(ranks) > 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCKS_PER_TILE=tile_k // blocksize,
        BLOCK_R=max(2, triton.next_power_of_2(max(ranks))), LOOKUP=LOOKUPS.index(matvec.LOOKUP),
        BF16_CODES=matvec.word_code_form(bf16_codes, x_pairs), PDL=pdl, WORDS=words,
        STAGES=stages, PREFETCH=matvec.REGISTER_PREFETCH,
        T_EARLY=t_before_walk(sum(ranks) > 0, first.programs == 0, stages, matvec.REGISTER_PREFETCH),
        WHOLE_TILES=all(n % block_n == 0 for n in widths) and n_in % tile_k == 0, X_PAIRS=x_pairs,
        FIRST_PRODUCTS=first.programs > 0, FIRST_BLOCK_K=LORA_BLOCK_K, num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return outputs
