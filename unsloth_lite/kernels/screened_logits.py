"""A greedy decoding step's logits from a dense lm_head, screened by an int8 copy of it: exact where the argmax can
lie, -inf elsewhere.

For hidden rows x `[B, K]` (B <= 8), the head W `[V, K]` and its int8 copy Q with a scale a row (s_n = max_k
|W_nk| / 127, Q = round(W / s)), per row b of x:

    a_n = s_n Σ_k Q_nk x_k          the approximate logit (products exact, fp32 sums)
    e_n = C s_n Σ_k |x_k|           a bound of |z_n − a_n| for the exact z_n = Σ_k W_nk x_k: C = 1/2 for the
                                    rounding of W to Q, plus three times the fp32 sums' worst rounding
                                    (K · 127 · 2⁻²⁴ each: a's, z's and the reference product's)
    L   = max_n (a_n − e_n)         no largest logit is smaller (n over the rows not exempt)
    y_n = z_n (in W's dtype) where a_n + e_n >= L − |L| 2⁻⁶ or n is exempt, else −inf

With `NORM_BOUND` the bound is the smaller of e_n and, by Cauchy–Schwarz, r_n ||x||₂ (1 + 2⁻⁸, each norm's own
fp32 rounding) plus the three sums' rounding, where r_n = ||W_n − s_n Q_n||₂ is kept with Q (`int8_rows`). With
the rounding errors spread over ±s_n/2, r_n ≈ s_n √(K/12), so the first term is about s_n √(K/12) ||x||₂ against
s_n Σ_k |x_k| / 2: a third of the candidates at the Qwen3-8B head with random weights.

So the largest logit, and every one that could round to the same value, is computed from W itself: the argmax of
y (its first index) is that of the full product x Wᵀ. Exempt rows (the end-of-sequence ids, which a
minimum-new-tokens step masks after the head) are always computed and never set L, so the argmax stays the full
product's with any of them masked as well. Reading Q instead of W halves the bytes of the step's
largest product (the Qwen3-8B head: 0.62 GB instead of 1.24), for Q's memory beside W. No gradient: inference
only; only the argmax of y is the full product's (the other values are not logits).

With `INT8_PRODUCTS` (bf16 or fp16 x) the screen multiplies Q as it lies by x as three int8 parts: with s the
least power of two >= max_k |x_k| / 127 (a first pass over x), p = round(x / s), p' = round((x − s·p) / s'),
p'' = round((x − s·p − s'·p') / s'') for s' = s / 2⁷ and s'' = s / 2¹⁴ (|p'|, |p''| <= 64), so that x̂ = s·p +
s'·p' + s''·p'' and every residual is exact in fp32 (x has at most 11 significant bits; the scales are powers of
two). The integer products Σ_k Q_nk p_k (one tensor-core product a tile of the three parts stacked as rows) are
exact in int32 over all of K, scaled once at the end, and a_n = s_n Σ_k Q_nk x̂_k up to those fp32 roundings
(within the bound's rounding term); the bound gains 127 s_n Σ_k |x_k − x̂_k| (|Q| <= 127; the residual's sum
widened by 2⁻¹⁰ for its fp32 rounding), at most s_n · 127 · K · s / 2¹⁵: about a percent of e_n. No weight is
converted (the converting loop spends about 5.5 instructions a weight on it).

Two launches. `_screen_kernel`, a program a block of rows n: a and e for every row of x (tensor-core products of
x's parts and Q, or of x and Q's rows converted to x's dtype, exact), a + e stored, its block's max of a − e
stored; the last program to arrive (an acq_rel counter, left at 0 for the next launch) stores L from the blocks'
maxima. `_exact_kernel`, the same blocks: the rows with a candidate take x Wᵀ from W (the others skip it), and y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.matvec_epilogue import _arrival_counters
from unsloth_lite.kernels.utils import INTERPRET, empty

BLOCK_N = 64  # rows of the head a program (the exact products', and the screen's without INT8_PRODUCTS)
BLOCK_K = 128  # columns a step
MAX_ROWS = 8
MAX_EXEMPT = 8  # exempt row ids a launch takes
# The screen's bound also by Cauchy–Schwarz (module docstring): a third of the candidates at the Qwen3-8B head with
# random weights (CPU, float64 reference). Measured on an H100 (2026-12-06, docs/benchmarks.md, random weights):
# the captured decoding step 3.269 -> 3.255 ms at the Qwen3-8B shape, 9.713 -> 9.654 ms at Qwen3.5-27B's.
NORM_BOUND = True
# The screen's products on the int8 copy as it lies: x (bf16 or fp16) as three int8 parts, integer tensor-core
# products (module docstring), instead of each int8 weight converted to x's dtype. Measured on an H100 (2026-12-07,
# docs/benchmarks.md): the Qwen3-8B shape's captured step 3.050 -> 3.034 ms.
INT8_PRODUCTS = True
# Rows of the head a screen program with INT8_PRODUCTS: x's parts, made once a tile, serve twice the rows (offline
# for sm_90, triton 3.6: 3.0 instructions a weight in the loop at 128, 5.0 at 64; the converting loop 5.6 at 64).
INT8_BLOCK_N = 128


@triton.jit
def _row_block_products(x_ptr, x_row_stride, w_ptr, n_rows, features, mask_features, n_in,
                        ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """(x W_fᵀ `[ROWS, BLOCK_N]` in fp32 for the rows f of `w_ptr` (int8 or float, `[N, K]` contiguous, rows
    that are masked off never read), Σ_k |x_k| and Σ_k x_k² `[ROWS]`); x's rows at and past `n_rows` give 0."""
    rows = tl.arange(0, 16)  # tl.dot's least M: the rows past ROWS are masked off and folded away at the end
    acc = tl.zeros([16, features.shape[0]], tl.float32)
    absolute = tl.zeros([16], tl.float32)
    squares = tl.zeros([16], tl.float32)
    mask_rows = rows < n_rows
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < n_in
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + k[None, :], mask=mask_rows[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(w_ptr + features[:, None].to(tl.int64) * n_in + k[None, :],
                    mask=mask_features[:, None] & mask_k[None, :], other=0)
        x32 = x.to(tl.float32)
        absolute += tl.sum(tl.abs(x32), axis=1)
        squares += tl.sum(x32 * x32, axis=1)
        if DOT_F32:
            acc += tl.dot(x32, tl.trans(w.to(tl.float32)), input_precision="ieee" if IEEE else "tf32")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc = tl.sum(tl.reshape(acc, [16 // ROWS, ROWS, features.shape[0]]), axis=0)
    return acc, tl.sum(tl.reshape(absolute, [16 // ROWS, ROWS]), axis=0), tl.sum(
        tl.reshape(squares, [16 // ROWS, ROWS]), axis=0)


@triton.jit
def _power_of_two_at_least(value):
    """The least power of two >= `value` (> 0, fp32) by its bits: the mantissa's carry into the exponent."""
    bits = value.to(tl.int32, bitcast=True)
    return ((bits + 0x007FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _int8_part(values, inverse_scale, scale):
    """(round(values / s) as int8, values − s · that): exact in fp32 for s a power of two (module docstring)."""
    parts = tl.minimum(tl.maximum(tl.floor(values * inverse_scale + 0.5), -127.0), 127.0)
    return parts.to(tl.int8), values - parts * scale


@triton.jit
def _row_block_int8_products(x_ptr, x_row_stride, q_ptr, n_rows, features, mask_features, n_in,
                             ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """`INT8_PRODUCTS`: (Σ_k Q_fk x̂_k `[ROWS, BLOCK_N]` in fp32, Σ_k |x_k|, Σ_k x_k², Σ_k |x_k − x̂_k| `[ROWS]`)
    for the int8 rows f of `q_ptr`, where x̂ is x (bf16 or fp16) as three int8 parts (module docstring): one
    integer tensor-core product a tile, its rows the parts [p; p'; p''; 0] of x's ROWS rows, summed in int32
    over all of K (|Σ| <= K · 127 · 127) and scaled once at the end."""
    x_rows = tl.arange(0, ROWS)
    mask_rows = x_rows < n_rows
    # the rows' largest magnitudes: a first pass over x (from L2), reduced once
    largest = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + x_rows[:, None] * x_row_stride + k[None, :],
                    mask=mask_rows[:, None] & (k < n_in)[None, :], other=0.0)
        largest = tl.maximum(largest, tl.abs(x.to(tl.float32)))
    scale = _power_of_two_at_least(tl.maximum(tl.max(largest, axis=1), 1e-30) / 127.0)[:, None]
    inverse = 1.0 / scale
    acc = tl.zeros([4 * ROWS, features.shape[0]], tl.int32)
    absolute = tl.zeros([ROWS, BLOCK_K], tl.float32)
    squares = tl.zeros([ROWS, BLOCK_K], tl.float32)
    residual = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < n_in
        x = tl.load(x_ptr + x_rows[:, None] * x_row_stride + k[None, :], mask=mask_rows[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)
        q = tl.load(q_ptr + features[:, None].to(tl.int64) * n_in + k[None, :],
                    mask=mask_features[:, None] & mask_k[None, :], other=0)
        first, rest = _int8_part(x, inverse, scale)
        second, rest = _int8_part(rest, inverse * 128.0, scale * (1.0 / 128.0))
        third, rest = _int8_part(rest, inverse * 16384.0, scale * (1.0 / 16384.0))
        stacked = tl.join(tl.join(first, second), tl.join(third, tl.zeros_like(third)))  # [ROWS, K, 2, 2]
        parts = tl.reshape(tl.permute(stacked, (3, 2, 0, 1)), [4 * ROWS, BLOCK_K])  # row (c · 2 + b) · ROWS + r
        acc = tl.dot(parts, tl.trans(q), acc, out_dtype=tl.int32)
        absolute += tl.abs(x)
        squares += x * x
        residual += tl.abs(rest)
    part_scales = tl.join(tl.join(scale, scale * (1.0 / 128.0)), tl.join(scale * (1.0 / 16384.0), scale * 0.0))
    part_scales = tl.reshape(tl.permute(part_scales, (3, 2, 0, 1)), [4 * ROWS])  # in the parts' order
    products = tl.sum(tl.reshape(acc.to(tl.float32) * part_scales[:, None], [4, ROWS, features.shape[0]]), axis=0)
    return products, tl.sum(absolute, axis=1), tl.sum(squares, axis=1), tl.sum(residual, axis=1)


@triton.jit
def _screen_kernel(
    x_ptr, x_row_stride, q_ptr, scale_ptr, error_norm_ptr, exempt_ptr, n_exempt, upper_ptr, block_lower_ptr,
    lower_ptr, arrivals_ptr, n_rows, n_out, n_in, bound_factor, rounding_factor,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr, NORM_BOUND: tl.constexpr, INT8_PRODUCTS: tl.constexpr,
    ROWS: tl.constexpr,
):
    block = tl.program_id(0)
    features = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_features = features < n_out
    rows = tl.arange(0, ROWS)
    mask_rows = rows < n_rows
    scale = tl.load(scale_ptr + features, mask=mask_features, other=0.0)
    if INT8_PRODUCTS:  # x as three int8 parts: their residual's products bounded by 127 s_n Σ_k |x_k − x̂_k|
        acc, absolute, squares, residual = _row_block_int8_products(x_ptr, x_row_stride, q_ptr, n_rows, features,
                                                                    mask_features, n_in, ROWS, BLOCK_K)
        representation = 127.0 * (1 + 2.0**-10) * scale[None, :] * residual[:, None]
    else:
        acc, absolute, squares = _row_block_products(x_ptr, x_row_stride, q_ptr, n_rows, features, mask_features,
                                                     n_in, ROWS, BLOCK_K, DOT_F32, IEEE)
        representation = tl.zeros([ROWS, BLOCK_N], tl.float32)
    approximate = acc * scale[None, :]
    bound = bound_factor * scale[None, :] * absolute[:, None]
    if NORM_BOUND:  # Cauchy–Schwarz on the rounding of W, each norm's own rounding covered by 2⁻⁸
        error_norm = tl.load(error_norm_ptr + features, mask=mask_features, other=0.0)
        norm_bound = (error_norm[None, :] * tl.sqrt(squares)[:, None] * (1 + 2.0**-8)
                      + rounding_factor * scale[None, :] * absolute[:, None])
        bound = tl.minimum(bound, norm_bound)
    bound += representation
    slots = tl.arange(0, BLOCK_E)
    exempt_ids = tl.load(exempt_ptr + slots, mask=slots < n_exempt, other=-1)
    exempt = tl.max((features[:, None] == exempt_ids[None, :]).to(tl.int32), axis=1) != 0
    mask = mask_rows[:, None] & mask_features[None, :]
    upper = tl.where(exempt[None, :], float("inf"), approximate + bound)
    tl.store(upper_ptr + rows[:, None] * n_out + features[None, :], upper, mask=mask)
    least = tl.max(tl.where((mask_features & ~exempt)[None, :], approximate - bound, float("-inf")), axis=1)
    tl.store(block_lower_ptr + rows * tl.num_programs(0) + block, least, mask=mask_rows)
    tl.debug_barrier()  # every thread's stores before the arrival (released at GPU scope by the atomic)
    if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed", scope="gpu")
        lower = tl.full([ROWS], float("-inf"), tl.float32)
        for p0 in range(0, tl.num_programs(0), BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            maxima = tl.load(block_lower_ptr + rows[:, None] * tl.num_programs(0) + p[None, :],
                             mask=mask_rows[:, None] & (p < tl.num_programs(0))[None, :], other=float("-inf"),
                             cache_modifier=".cg")
            lower = tl.maximum(lower, tl.max(maxima, axis=1))
        tl.store(lower_ptr + rows, lower, mask=mask_rows)


@triton.jit
def _exact_kernel(
    x_ptr, x_row_stride, w_ptr, upper_ptr, lower_ptr, out_ptr, n_rows, n_out, n_in,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr,
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_features = features < n_out
    rows = tl.arange(0, ROWS)
    mask_rows = rows < n_rows
    mask = mask_rows[:, None] & mask_features[None, :]
    lower = tl.load(lower_ptr + rows, mask=mask_rows, other=0.0)
    threshold = lower - tl.abs(lower) * 0.015625  # two of bf16's steps below L: a tie when rounded included
    upper = tl.load(upper_ptr + rows[:, None] * n_out + features[None, :], mask=mask, other=float("-inf"))
    candidate = mask & (upper >= threshold[:, None])
    wanted = tl.max(candidate.to(tl.int32), axis=0) != 0  # a row of W some row of x needs
    exact = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if tl.max(wanted.to(tl.int32), axis=0) != 0:
        exact, _, _ = _row_block_products(x_ptr, x_row_stride, w_ptr, n_rows, features, wanted, n_in, ROWS,
                                          BLOCK_K, DOT_F32, IEEE)
    tl.store(out_ptr + rows[:, None] * n_out + features[None, :], tl.where(candidate, exact, float("-inf")),
             mask=mask)


def int8_rows(weight: torch.Tensor, rows_a_pass: int = 16384) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q int8 `[V, K]`, s fp32 `[V]`, r fp32 `[V]`): each row of `weight` over its largest magnitude / 127,
    rounded, and the rounding's 2-norm r_n = ||W_n − s_n Q_n||₂ (`NORM_BOUND`); made `rows_a_pass` rows at a time
    (their fp32 copy is all the memory it takes besides Q)."""
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    error_norm = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for first in range(0, weight.shape[0], rows_a_pass):
        rows = weight[first:first + rows_a_pass].float()
        row_scale = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        row_quantized = torch.round(rows / row_scale[:, None]).clamp_(-127, 127)
        quantized[first:first + rows_a_pass] = row_quantized
        scale[first:first + rows_a_pass] = row_scale
        error_norm[first:first + rows_a_pass] = torch.linalg.vector_norm(  # rows may be the weight itself
            rows - row_quantized.mul_(row_scale[:, None]), dim=1)
    return quantized, scale, error_norm


def rounding_factor(n_in: int) -> float:
    """The three fp32 sums' share of C (module docstring) for rows of `n_in` columns."""
    return 3 * n_in * 127 * 2.0**-24


def bound_factor(n_in: int) -> float:
    """C of the module docstring for rows of `n_in` columns."""
    return 0.5 * (1 + 2.0**-20) + rounding_factor(n_in)


def screened_logits(x: torch.Tensor, weight: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor,
                    exempt: torch.Tensor | None = None, error_norm: torch.Tensor | None = None):
    """y `[..., V]` in weight's dtype for x `[..., K]` of 1 to 8 rows, weight `[V, K]` (bf16, fp16 or fp32, the
    head without bias) and its `int8_rows` (Q, s and, for `NORM_BOUND`, r as `error_norm`): x Wᵀ at the rows where
    the argmax of each row of x can lie, −inf elsewhere (module docstring). `exempt`: int64 row ids
    `[<= MAX_EXEMPT]` on x's device (negative ones ignored) computed always and left out of the screen's bound,
    so that masking them keeps the argmax exact."""
    n_out, n_in = weight.shape
    x2d = x.reshape(-1, n_in)
    n_rows = x2d.shape[0]
    if not 1 <= n_rows <= MAX_ROWS or x.shape[-1] != n_in or x.dtype != weight.dtype:
        raise ValueError(f"screened_logits takes 1 to {MAX_ROWS} rows of x in the head's dtype {weight.dtype} and "
                         f"width {n_in}; got {tuple(x.shape)} {x.dtype}")
    if tuple(quantized.shape) != (n_out, n_in) or quantized.dtype != torch.int8 or scale.shape != (n_out,) or (
            error_norm is not None and error_norm.shape != (n_out,)):
        raise ValueError(f"quantized, scale and error_norm must be int8_rows of the head [{n_out}, {n_in}]")
    if not weight.is_contiguous() or not quantized.is_contiguous():
        raise ValueError("the head and its int8 copy must be contiguous")
    if exempt is not None and (exempt.dim() != 1 or exempt.numel() > MAX_EXEMPT or exempt.dtype != torch.int64
                               or exempt.device != x.device):
        raise ValueError(f"exempt must be int64 row ids [<= {MAX_EXEMPT}] on {x.device}; got {exempt.dtype} "
                         f"{tuple(exempt.shape)} on {exempt.device}")
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    if exempt is None:
        exempt = torch.full((1,), -1, dtype=torch.int64, device=x.device)
    int8_products = INT8_PRODUCTS and x.dtype != torch.float32
    screen_block = INT8_BLOCK_N if int8_products else BLOCK_N
    blocks = triton.cdiv(n_out, screen_block)
    device = x.device
    upper = empty((n_rows, n_out), torch.float32, device)
    block_lower = empty((n_rows, blocks), torch.float32, device)
    lower = empty((n_rows,), torch.float32, device)
    out = empty((n_rows, n_out), weight.dtype, device)
    # both kernels' products' precision, and their row arrays: 4 or MAX_ROWS rows
    shared = dict(DOT_F32=INTERPRET or x.dtype == torch.float32, IEEE=x.dtype == torch.float32,
                  ROWS=4 if n_rows <= 4 else MAX_ROWS)
    norm_bound = NORM_BOUND and error_norm is not None
    _screen_kernel[(blocks,)](
        x2d, x2d.stride(0), quantized, scale, error_norm if norm_bound else scale, exempt, exempt.numel(), upper,
        block_lower, lower, _arrival_counters(device, 1), n_rows, n_out, n_in, bound_factor(n_in),
        rounding_factor(n_in),
        BLOCK_N=screen_block, BLOCK_K=BLOCK_K, BLOCK_P=1024, BLOCK_E=MAX_EXEMPT, NORM_BOUND=norm_bound,
        INT8_PRODUCTS=int8_products, num_warps=4, **shared,
    )
    _exact_kernel[(triton.cdiv(n_out, BLOCK_N),)](
        x2d, x2d.stride(0), weight, upper, lower, out, n_rows, n_out, n_in,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, **shared,
    )
    return out.view(*x.shape[:-1], n_out)
