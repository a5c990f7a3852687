"""The first half of a decoding MLP in one launch: both NF4 projections of x and the SwiGLU between them.

For x `[M, K]` (M ≤ 8 rows), NF4 gate and up weights G, U `[N, K]` (`nf4_matvec`'s layout, whole quantisation
blocks along K), biases, unmerged adapters (B `[N, r]`, t = x Aᵀ from `lora_down_rows`, scale s):

    g = round(x Gᵀ + b_g + s_g · t_g B_gᵀ)        u = round(x Uᵀ + b_u + s_u · t_u B_uᵀ)
    h = round(g · σ(g) · u)                        (fp32, σ the logistic sigmoid)

`round` is to x's dtype: g and u are rounded as `nf4_matvec` writes them and h is computed from them as
`swiglu` computes it, so h has the bits of the three launches it replaces (two products and the activation).
Each program owns BLOCK_N features of both projections: it walks K once (`nf4_gated_walks.py`: the word kernel's
walk where `nf4_matvec.WORD_KERNEL` is on, else the blocked kernel's), loads each tile of x once for both weights
(and has both weights' bytes in flight), and writes h without writing g or u. No backward: inference only. The
absmax is read flat (one fp32 value a block, `nf4_matvec_state.flat_absmax` for double-quantised weights); the K
split and the nested absmax stay with `nf4_matvec`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents

from unsloth_lite.kernels import nf4_gated_gluon as gluon
from unsloth_lite.kernels import nf4_matvec as matvec  # its settings (tiles, lookup, PDL) are read at each call
from unsloth_lite.kernels.dequantize_nf4 import _launch
from unsloth_lite.kernels.lora_down import (
    LORA_BLOCK_K,
    MAX_ROWS,
    FirstProductArgs,
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
    _output_values,
    t_before_walk,
)
from unsloth_lite.kernels.nf4_codes import LOOKUPS, code_pairs
from unsloth_lite.kernels.nf4_gated_walks import _gated_blocked_sums, _gated_word_sums
from unsloth_lite.kernels.nf4_matvec import packed_words, word_kernel_rows
from unsloth_lite.kernels.nf4_matvec_state import lane_tables
from unsloth_lite.kernels.utils import INTERPRET, empty

# The launch's walk in Gluon for one bf16 row where it fits (`nf4_gated_gluon.py`, with `nf4_matvec.GLUON_WALK`:
# the Qwen3-8B MLP), t given (no first products in the launch). Compiled offline for sm_90, not yet run on a GPU:
# off until measured.
GLUON_GATED = False


@triton.jit
def _nf4_gated_matvec_kernel(
    x_ptr, x_row_stride, x_col_stride,
    gate_packed_ptr, gate_absmax_ptr, up_packed_ptr, up_absmax_ptr, table_ptr, tables_ptr,
    gate_bias_ptr, up_bias_ptr, gate_t_ptr, up_t_ptr, t_row_stride, gate_rank, up_rank,
    gate_b_ptr, gate_b_row_stride, gate_b_col_stride, gate_scale,
    up_b_ptr, up_b_row_stride, up_b_col_stride, up_scale,
    out_ptr, out_row_stride,
    n_rows, n_out, n_in,
    xv_ptr, xv_row_stride, xv_col_stride, a0_ptr, a1_ptr, a2_ptr, first_rank0, first_rank1, width, first_partial_ptr,
    first_arrivals_ptr, flags_ptr, first_splits,
    down_a_ptr, down_rank, shares_ptr, n_stripes,
    BLOCKSIZE: tl.constexpr, GATE_BIAS: tl.constexpr, UP_BIAS: tl.constexpr, GATE_LORA: tl.constexpr,
    UP_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr,
    GATE_BLOCK_R: tl.constexpr, UP_BLOCK_R: tl.constexpr, LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr,
    PDL: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr, WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr,
    PREFETCH: tl.constexpr,
    FIRST_PRODUCTS: tl.constexpr, FIRST_BLOCK_K: tl.constexpr, DOWN_BLOCK_R: tl.constexpr, T_EARLY: tl.constexpr,
):
    """Program i: features [i · BLOCK_N, (i + 1) · BLOCK_N) of both projections for all rows (module docstring).
    PDL as in `nf4_matvec`'s blocked kernel: only the frozen weights are read before `gdc_wait`. WORDS: the word
    kernel's walk (the packed weights as int32 words, x as `word_kernel_rows` gives it, `table_ptr` the code
    book, `tables_ptr` the lane tables), else the blocked kernel's (one stage). FIRST_PRODUCTS (the word walk):
    the adapters' first products t in the launch, by its first width · first_splits programs, as the word
    kernel's FIRST_PRODUCTS; the feature blocks' programs come after them. DOWN_BLOCK_R > 0: each program adds
    its share of the down projection's first product h A_dᵀ into a stripe (`nf4_gated_matvec`'s `down_shares`).
    T_EARLY: t, given, loaded before the walk (`matvec_epilogue.t_before_walk`)."""
    if FIRST_PRODUCTS:
        writers = width * first_splits
        if tl.program_id(0) < writers:
            _first_product_program(
                xv_ptr, xv_row_stride, xv_col_stride, a0_ptr, a1_ptr, a2_ptr, first_rank0, first_rank1, width,
                gate_t_ptr, t_row_stride, n_rows, n_in, first_partial_ptr, first_arrivals_ptr, flags_ptr,
                first_splits, BLOCK_M, FIRST_BLOCK_K, PDL,
            )
        else:
            _gated_program(
                tl.program_id(0) - writers, x_ptr, x_row_stride, x_col_stride, gate_packed_ptr, gate_absmax_ptr,
                up_packed_ptr, up_absmax_ptr, table_ptr, tables_ptr, gate_bias_ptr, up_bias_ptr, gate_t_ptr,
                up_t_ptr, t_row_stride, gate_rank, up_rank, gate_b_ptr, gate_b_row_stride, gate_b_col_stride,
                gate_scale, up_b_ptr, up_b_row_stride, up_b_col_stride, up_scale, out_ptr, out_row_stride, n_rows,
                n_out, n_in, flags_ptr, width, tl.num_programs(0) - writers, down_a_ptr, down_rank, shares_ptr,
                n_stripes,
                BLOCKSIZE, GATE_BIAS, UP_BIAS, GATE_LORA, UP_LORA, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, GATE_BLOCK_R,
                UP_BLOCK_R, LOOKUP, BF16_CODES, PDL, WORDS, STAGES, WHOLE_TILES, X_PAIRS, PREFETCH, True, DOWN_BLOCK_R,
                False,
            )
    else:
        _gated_program(
            tl.program_id(0), x_ptr, x_row_stride, x_col_stride, gate_packed_ptr, gate_absmax_ptr, up_packed_ptr,
            up_absmax_ptr, table_ptr, tables_ptr, gate_bias_ptr, up_bias_ptr, gate_t_ptr, up_t_ptr, t_row_stride,
            gate_rank, up_rank, gate_b_ptr, gate_b_row_stride, gate_b_col_stride, gate_scale, up_b_ptr,
            up_b_row_stride, up_b_col_stride, up_scale, out_ptr, out_row_stride, n_rows, n_out, n_in,
            flags_ptr, 0, 0, down_a_ptr, down_rank, shares_ptr, n_stripes,
            BLOCKSIZE, GATE_BIAS, UP_BIAS, GATE_LORA, UP_LORA, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, GATE_BLOCK_R,
            UP_BLOCK_R, LOOKUP, BF16_CODES, PDL, WORDS, STAGES, WHOLE_TILES, X_PAIRS, PREFETCH, False, DOWN_BLOCK_R,
            T_EARLY,
        )


@triton.jit
def _gated_program(
    block, x_ptr, x_row_stride, x_col_stride,
    gate_packed_ptr, gate_absmax_ptr, up_packed_ptr, up_absmax_ptr, table_ptr, tables_ptr,
    gate_bias_ptr, up_bias_ptr, gate_t_ptr, up_t_ptr, t_row_stride, gate_rank, up_rank,
    gate_b_ptr, gate_b_row_stride, gate_b_col_stride, gate_scale,
    up_b_ptr, up_b_row_stride, up_b_col_stride, up_scale,
    out_ptr, out_row_stride,
    n_rows, n_out, n_in,
    flags_ptr, width, readers, down_a_ptr, down_rank, shares_ptr, n_stripes,
    BLOCKSIZE: tl.constexpr, GATE_BIAS: tl.constexpr, UP_BIAS: tl.constexpr, GATE_LORA: tl.constexpr,
    UP_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr,
    GATE_BLOCK_R: tl.constexpr, UP_BLOCK_R: tl.constexpr, LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr,
    PDL: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr, WHOLE_TILES: tl.constexpr, X_PAIRS: tl.constexpr,
    PREFETCH: tl.constexpr,
    AWAIT_T: tl.constexpr, DOWN_BLOCK_R: tl.constexpr, T_EARLY: tl.constexpr,
):
    """Feature block `block` of the gate-and-up launch (`_nf4_gated_matvec_kernel`). AWAIT_T: t comes from the
    launch's first programs (awaited before t's load, the program counted once it is issued, as in the word
    kernel's `_word_program`); the adapters' B rows are loaded before the walk. DOWN_BLOCK_R > 0: the
    block's columns of the down adapter's A (`[r, N]`, contiguous), which no kernel writes, read first (read in
    the epilogue, the kernel took 72 registers a thread instead of 64, compiled for sm_90); h's share of h Aᵀ
    added into stripe `block % n_stripes` of `shares_ptr` (`[n_stripes, rows, r]`) at the end. T_EARLY: t, given,
    loaded before the walk."""
    features = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    gate_b = _adapter_b(gate_b_ptr, gate_b_row_stride, gate_b_col_stride, features, n_out, gate_rank, GATE_LORA,
                        GATE_BLOCK_R)
    up_b = _adapter_b(up_b_ptr, up_b_row_stride, up_b_col_stride, features, n_out, up_rank, UP_LORA, UP_BLOCK_R)
    if DOWN_BLOCK_R > 0:
        down_ranks = tl.arange(0, DOWN_BLOCK_R)
        down_a = tl.load(down_a_ptr + down_ranks[None, :] * n_out + features[:, None],
                         mask=(features < n_out)[:, None] & (down_ranks < down_rank)[None, :], other=0.0)
    gate_t = _early_t(gate_t_ptr, t_row_stride, gate_rank, rows, n_rows, GATE_LORA, GATE_BLOCK_R, 0, 1, PDL, T_EARLY)
    up_t = _early_t(up_t_ptr, t_row_stride, up_rank, rows, n_rows, UP_LORA, UP_BLOCK_R, 0, 1, PDL, T_EARLY)
    if WORDS:
        acc_gate, acc_up = _gated_word_sums(
            x_ptr, x_row_stride, gate_packed_ptr, gate_absmax_ptr, up_packed_ptr, up_absmax_ptr, table_ptr,
            tables_ptr, features, n_rows, n_out, n_in, BLOCKSIZE, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, LOOKUP == 0,
            BF16_CODES, PDL, STAGES, WHOLE_TILES, X_PAIRS, PREFETCH,
        )
    else:
        acc_gate, acc_up = _gated_blocked_sums(
            x_ptr, x_row_stride, x_col_stride, gate_packed_ptr, gate_absmax_ptr, up_packed_ptr, up_absmax_ptr,
            table_ptr, features, n_rows, n_out, n_in, BLOCKSIZE, BLOCK_M, BLOCK_N, BLOCKS_PER_TILE, LOOKUP,
            BF16_CODES, PDL,
        )
    if PDL:
        gdc_launch_dependents()
    if AWAIT_T:
        _await_first_products(flags_ptr, width)
    if not T_EARLY:
        gate_t = _adapter_t(gate_t_ptr, t_row_stride, gate_rank, rows, n_rows, GATE_LORA, GATE_BLOCK_R, 0, 1)
        up_t = _adapter_t(up_t_ptr, t_row_stride, up_rank, rows, n_rows, UP_LORA, UP_BLOCK_R, 0, 1)
    if AWAIT_T:
        _count_reader(flags_ptr, block, readers)
    dtype = out_ptr.dtype.element_ty
    g = _output_values(acc_gate, rows, features, n_rows, n_out, gate_bias_ptr, gate_t, gate_b, gate_scale,
                       GATE_BIAS, GATE_LORA)
    u = _output_values(acc_up, rows, features, n_rows, n_out, up_bias_ptr, up_t, up_b, up_scale, UP_BIAS, UP_LORA)
    g = g.to(dtype).to(tl.float32)  # as the two products would write them
    u = u.to(dtype).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    mask = (rows < n_rows)[:, None] & (features < n_out)[None, :]
    h = h.to(dtype)
    tl.store(out_ptr + rows[:, None] * out_row_stride + features[None, :], h, mask=mask)
    if DOWN_BLOCK_R > 0:  # the share, from h as written; a relaxed add: the next launch reads it after this one
        h = tl.where(mask, h.to(tl.float32), 0.0)
        share = tl.sum(h[:, :, None] * down_a.to(tl.float32)[None, :, :], axis=1)  # [BLOCK_M, DOWN_BLOCK_R]
        stripe = shares_ptr + (block % n_stripes) * n_rows * down_rank
        tl.atomic_add(stripe + rows[:, None] * down_rank + down_ranks[None, :], share,
                      mask=(rows < n_rows)[:, None] & (down_ranks < down_rank)[None, :], sem="relaxed", scope="gpu")


def gated_matvec_supported(x: torch.Tensor, gate, up) -> bool:
    """Whether `nf4_gated_matvec` takes x and these weights: NF4 weights of one 2-D shape, dtype and block size
    whose rows hold whole blocks (and whose tile along K does), 1 to 8 rows of x on a kernel device, and an fp32
    absmax at hand for both (`nf4_matvec.fp32_absmax`)."""
    states = [getattr(w, "quant_state", None) for w in (gate, up)]
    if any(s is None or s.quant_type != "nf4" for s in states) or x.dtype == torch.float64:
        return False
    shape, blocksize = tuple(states[0].shape), states[0].blocksize
    if len(shape) != 2 or any((tuple(s.shape), s.blocksize, s.dtype) != (shape, blocksize, states[0].dtype)
                              for s in states):
        return False
    tiles_k = ([matvec.word_tile(*shape, "gated", adapted)[1] for adapted in (True, False)] if matvec.WORD_KERNEL
               else [matvec.blocked_tile(shape[0])[1]])
    rows = x.numel() // max(shape[1], 1)
    if (shape[1] % blocksize or any(tile_k % blocksize for tile_k in tiles_k) or x.shape[-1] != shape[1]
            or not 1 <= rows <= MAX_ROWS):
        return False
    if not (x.is_cuda or (INTERPRET and x.device.type == "cpu")) or not x.device == gate.device == up.device:
        return False
    return all(matvec.fp32_absmax(w) is not None for w in (gate, up))


def nf4_gated_matvec(x: torch.Tensor, gate, up, gate_bias: torch.Tensor | None = None,
                     up_bias: torch.Tensor | None = None, gate_lora=None, up_lora=None,
                     lora_as: list[torch.Tensor] | None = None, down_shares=None) -> torch.Tensor:
    """`silu(x Gᵀ + b_g + s_g t_g B_gᵀ) · (x Uᵀ + b_u + s_u t_u B_uᵀ)` for x `[..., K]` and NF4 `Params4bit`
    gate and up `[N, K]` (module docstring); returns `[..., N]` in x's dtype. `gate_lora`, `up_lora`: None or
    (B `[N, r]`, t `[rows, r]` fp32 with unit column stride, scale); t None in both with `lora_as`, the adapted
    weights' A in order: t then computed in the launch (`nf4_matvec.FIRST_PRODUCTS_IN_LAUNCH`, the word walk) or
    by `lora_down_rows`. `down_shares`: None or (A_d `[r, N]`, the down projection's adapter; stripes, fp32
    `[S, rows, r]` at 0): each program adds its share of h A_dᵀ into one of the S stripes, whose sum is then the
    down projection's first product (`nf4_matvec`'s `lora_t` in parts; fp32 adds in the order the programs come,
    so its last bits may differ from run to run). Inputs `gated_matvec_supported` refuses raise ValueError. No
    autograd."""
    if not gated_matvec_supported(x, gate, up):
        raise ValueError("nf4_gated_matvec takes 1 to 8 rows of x and two NF4 weights of one shape, dtype and "
                         "block size, whole blocks along K, on x's kernel device (gated_matvec_supported)")
    n_out, n_in = (int(n) for n in gate.quant_state.shape)
    x2d = x.reshape(-1, n_in)
    n_rows = x2d.shape[0]
    loras = [gate_lora, up_lora]
    launches = [_launch(w, None) for w in (gate, up)]
    bf16_codes = matvec.uses_bf16_codes(launches[0].dtype)
    tables = lane_tables(x.device, bf16_codes) if matvec.WORD_KERNEL else None
    words = tables is not None  # the word kernel's walk, else the blocked one's
    # without adapters (nor the down adapter's shares) a tile of its own (`nf4_matvec.WORD_TILES_WITHOUT_ADAPTERS`)
    adapted = gate_lora is not None or up_lora is not None or down_shares is not None
    block_n, tile_k, warps, _ = (matvec.word_tile(n_out, n_in, "gated", adapted) if words
                                 else matvec.blocked_tile(n_out))
    feature_blocks = triton.cdiv(n_out, block_n)
    first = no_first_products(x2d)
    if any(lora is not None and lora[1] is None for lora in loras):
        loras, first = _adapters_with_t(x2d, loras, lora_as, feature_blocks)
    for lora in loras:
        if lora is not None:
            matvec._check_args(x, gate, None, None, lora[0], lora[1], n_out, n_in)
    for bias in (gate_bias, up_bias):
        matvec._check_args(x, gate, bias, None, None, None, n_out, n_in)
    out = empty((n_rows, n_out), x.dtype, x.device)
    code = launches[0].inputs[2]
    table = code_pairs(code) if matvec.LOOKUP == "pairs" and not words else code
    packed = [launch.inputs[0] for launch in launches]
    x_rows, x_pairs = word_kernel_rows(x2d) if words else (x2d, False)
    if words:
        packed = [packed_words(p) for p in packed]
    t_row_stride = next((lora[1].stride(0) for lora in loras if lora is not None), 0)
    adapters = []
    # a missing adapter reads no t (rank 0) but points at the other's: the first-product programs write t there
    some_t = next((lora[1] for lora in loras if lora is not None), out)
    for lora in loras:
        b, t, scale = lora if lora is not None else (out, some_t, 0.0)
        adapters.append((t, t.shape[1] if lora is not None else 0, b, b.stride(0), b.stride(1), float(scale)))
    if all(lora is not None for lora in loras) and loras[0][1].stride(0) != loras[1][1].stride(0):
        raise ValueError("gate_lora's and up_lora's t must share a row stride (slices of one lora_down_rows)")
    blocksize = 2 * launches[0].meta["HALF_BLOCK"]
    pdl = matvec.uses_pdl(x.device)
    ranks = [a[1] for a in adapters]
    down_a, stripes = _checked_down_shares(down_shares, n_rows, n_out, x.device)
    if (GLUON_GATED and first.programs == 0 and matvec.gluon_walk_form(words, blocksize, bf16_codes, x_pairs)
            and gluon.gluon_gated_fits(x_rows, n_out, n_in)):
        gluon.launch_gluon_gated(
            x_rows, packed, [matvec.fp32_absmax(w) for w in (gate, up)], tables, out, n_out, n_in,
            (gate_bias, up_bias), [(lora[1], lora[0], lora[2]) if lora is not None else None for lora in loras],
            down_a, stripes, pdl)
        return out.view(*x.shape[:-1], n_out)
    # the blocked walk of this launch is not pipelined: one stage
    stages = matvec.word_stages(n_out, n_in, "gated", adapted) if words else 1
    _nf4_gated_matvec_kernel[(first.programs + feature_blocks,)](
        x_rows, x_rows.stride(0), x_rows.stride(1),
        packed[0], matvec.fp32_absmax(gate), packed[1], matvec.fp32_absmax(up), table, tables if words else table,
        gate_bias if gate_bias is not None else out, up_bias if up_bias is not None else out,
        adapters[0][0], adapters[1][0], t_row_stride, ranks[0], ranks[1],
        *adapters[0][2:], *adapters[1][2:],
        out, out.stride(0),
        n_rows, n_out, n_in, *first,
        down_a if down_a is not None else out, down_a.shape[0] if down_a is not None else 0,
        stripes if stripes is not None else out, stripes.shape[0] if stripes is not None else 1,
        BLOCKSIZE=blocksize, GATE_BIAS=gate_bias is not None,
        UP_BIAS=up_bias is not None,
        GATE_LORA=ranks[0] > 0, UP_LORA=ranks[1] > 0, BLOCK_M=triton.next_power_of_2(n_rows), BLOCK_N=block_n,
        BLOCKS_PER_TILE=tile_k // blocksize, GATE_BLOCK_R=max(2, triton.next_power_of_2(ranks[0])),
        UP_BLOCK_R=max(2, triton.next_power_of_2(ranks[1])),
        LOOKUP=LOOKUPS.index(matvec.LOOKUP), BF16_CODES=matvec.word_code_form(bf16_codes, x_pairs),
        PDL=pdl, WORDS=words,
        STAGES=stages,
        T_EARLY=t_before_walk(ranks[0] + ranks[1] > 0, first.programs == 0, stages, matvec.REGISTER_PREFETCH),
        WHOLE_TILES=n_out % block_n == 0 and n_in % tile_k == 0, X_PAIRS=x_pairs,
        PREFETCH=matvec.REGISTER_PREFETCH, FIRST_PRODUCTS=first.programs > 0, FIRST_BLOCK_K=LORA_BLOCK_K,
        DOWN_BLOCK_R=max(2, triton.next_power_of_2(down_a.shape[0])) if down_a is not None else 0,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )
    return out.view(*x.shape[:-1], n_out)


def _checked_down_shares(down_shares, n_rows: int, n_out: int, device) -> tuple:
    """(A_d, stripes) of `down_shares`, checked against h `[rows, N]`; (None, None) without."""
    if down_shares is None:
        return None, None
    down_a, stripes = down_shares
    rank = down_a.shape[0] if down_a.dim() == 2 else 0
    if down_a.dim() != 2 or down_a.shape[1] != n_out or rank == 0 or not down_a.is_contiguous():
        raise ValueError(f"down_shares' A must be contiguous [r > 0, {n_out}]; got {tuple(down_a.shape)}")
    if (stripes.dtype != torch.float32 or stripes.dim() != 3 or tuple(stripes.shape[1:]) != (n_rows, rank)
            or not stripes.is_contiguous()):
        raise ValueError(f"down_shares' stripes must be contiguous fp32 [S, {n_rows}, {rank}]; got {stripes.dtype} "
                         f"{tuple(stripes.shape)}")
    if down_a.device != device or stripes.device != device:
        raise ValueError(f"down_shares must be on {device}")
    return down_a, stripes


def _adapters_with_t(x2d: torch.Tensor, loras: list, lora_as: list[torch.Tensor] | None,
                     readers: int) -> tuple[list, FirstProductArgs]:
    """(gate's and up's adapters with their t, the launch's `FirstProductArgs`) where t is to be computed from
    `lora_as`: in the launch (its `readers` programs awaiting it) where `FIRST_PRODUCTS_IN_LAUNCH` and the word
    walk take it, else by one `lora_down_rows` launch. t is one `[rows, Σ r]` tensor, gate's columns first."""
    adapted = [lora for lora in loras if lora is not None]
    if any(lora[1] is not None for lora in adapted) or lora_as is None or (
            [a.shape[0] for a in lora_as] != [lora[0].shape[1] for lora in adapted]):
        raise ValueError("with t None, both adapters' t must be None and lora_as must hold their A in order")
    first = no_first_products(x2d)
    if matvec.FIRST_PRODUCTS_IN_LAUNCH and matvec.WORD_KERNEL:
        t, first = first_product_args(x2d, lora_as, triton.next_power_of_2(x2d.shape[0]), readers)
    else:
        t = lora_down_rows(x2d, lora_as)
    column, with_t = 0, []
    for lora in loras:
        if lora is None:
            with_t.append(None)
            continue
        rank = lora[0].shape[1]
        with_t.append((lora[0], t[:, column:column + rank], lora[2]))
        column += rank
    return with_t, first
