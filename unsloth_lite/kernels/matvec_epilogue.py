"""The ends of the decoding matrix-vector products (`nf4_matvec`'s kernels): the K split's sum and the output.

With the K split, program (i, j) of a product holds the sums of feature block i over tile j of K; instead of
a second launch, each stores its sums `[rows, features]` to its slot of an fp32 scratch `[splits, rows, N]`
and counts itself on the feature block's counter; the last to arrive adds the slots in split order and writes y.
Then y = acc + b + s · t Bᵀ with t = x Aᵀ (`lora_down_rows`): the unmerged adapter's second product, rank r; b
a bias `[N]` or an addend `[rows, N]` (the residual stream, which an output projection's result joins). B's rows
are loaded before the walk, t after it (`_adapter_b`, `_adapter_t`): only t's load is left to the epilogue
(with `T_BEFORE_WALK`, where another launch wrote t, none).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_wait

# What the products' epilogue adds (`_output_values`' BIAS): nothing, a bias a feature, an addend a row and feature.
BIAS_NONE, BIAS_FEATURES, BIAS_ROWS = 0, 1, 2
_ARRIVALS: dict = {}
# An adapter's t given by a launch before (not the launch's own first products) loaded before the walk, once
# `gdc_wait` returns, where a pipelined walk waits before its first load anyway (`t_before_walk`), instead of in
# the epilogue: the walk hides the load, and the epilogue's only load of another kernel's output is gone. Measured
# on an H100 (docs/benchmarks.md, "W3 with the given t before the walk"; the down projection's stripes are the
# t it moves by default): the Qwen3-8B step with adapters 3.363 -> 3.340, 3.379 -> 3.363 and 3.344 -> 3.318 ms
# in three runs, the Qwen3.5-27B's 9.353 -> 9.320 ms: on.
T_BEFORE_WALK = True


def t_before_walk(has_lora: bool, t_given: bool, stages: int, prefetch: bool) -> bool:
    """Whether a product's launch loads its adapters' given t before the walk (`T_BEFORE_WALK`): only where the
    walk is pipelined (its `gdc_wait` comes before any load, so waiting earlier delays nothing)."""
    return T_BEFORE_WALK and has_lora and t_given and stages > 1 and not prefetch


def _arrival_counters(device: torch.device, blocks: int, use: str = "splits") -> torch.Tensor:
    """int32 zeros, at least `blocks` of them, one set per (device, stream, use): the split kernel's arrival
    counters (or another `use`'s), which each launch leaves at 0. Launches on one stream run in order; another
    stream gets its own set."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream, use)
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < blocks:
        counters = _ARRIVALS[key] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return counters


@triton.jit
def _sum_of_splits(acc, rows, features, n_rows, n_out, partial_ptr, arrivals_ptr, split, n_splits, counter,
                   BLOCK_M: tl.constexpr):
    """(sum over the K splits of each program's sums, whether this program finishes the feature block): split
    `split` of `n_splits` stores its sums `[BLOCK_M, BLOCK_N]` in its slot of `partial_ptr` ([splits, BLOCK_M,
    n_out] fp32) and counts itself in the block's arrival counter (`arrivals_ptr + counter`); the last to arrive
    adds every slot in split order (the same bits whichever program comes last) and sets the counter back to 0
    for the next launch (no memset: a replayed CUDA graph finds it at 0)."""
    mask = (rows < n_rows)[:, None] & (features < n_out)[None, :]
    slot = (rows[:, None] * n_out + features[None, :]).to(tl.int64)
    tl.store(partial_ptr + split * BLOCK_M * n_out + slot, acc, mask=mask)
    tl.debug_barrier()  # every thread's stores before the arrival (released at GPU scope by the atomic)
    arrived = tl.atomic_add(arrivals_ptr + counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == n_splits - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(0, n_splits):  # .cg: from L2, where the other SMs' stores are
            total += tl.load(partial_ptr + s * BLOCK_M * n_out + slot, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(arrivals_ptr + counter, 0, sem="relaxed", scope="gpu")
    return total, last


@triton.jit
def _adapter_b(lora_b_ptr, lora_b_row_stride, lora_b_col_stride, features, n_out, rank, HAS_LORA: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """The adapter's B rows of the program's features, fp32 `[BLOCK_N, BLOCK_R]` (0.0 without an adapter). B is
    a weight no kernel writes: the products load it before their walk (and their `gdc_wait`), so that its
    latency hides behind the walk instead of adding to the epilogue's."""
    lora_b = 0.0
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        lora_b = tl.load(
            lora_b_ptr + features[:, None] * lora_b_row_stride + ranks[None, :] * lora_b_col_stride,
            mask=(features < n_out)[:, None] & (ranks < rank)[None, :], other=0.0,
        ).to(tl.float32)
    return lora_b


@triton.jit
def _adapter_t(t_ptr, t_row_stride, rank, rows, n_rows, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr,
               t_part_stride, T_PARTS: tl.constexpr):
    """The adapter's first products t = x Aᵀ of the program's rows, fp32 `[BLOCK_M, BLOCK_R]` (0.0 without an
    adapter): from `lora_down_rows` or the launch's first programs, or any fp32 `[rows, r]`; with T_PARTS > 1 the
    sum, in order, of T_PARTS such parts `t_part_stride` apart (shares of x Aᵀ written by the launch before)."""
    t = 0.0
    if HAS_LORA:
        ranks = tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & (ranks < rank)[None, :]
        t_rows = t_ptr + rows[:, None] * t_row_stride + ranks[None, :]
        t = tl.load(t_rows, mask=mask, other=0.0)
        for part in tl.static_range(1, T_PARTS):
            t += tl.load(t_rows + part * t_part_stride, mask=mask, other=0.0)
    return t


@triton.jit
def _early_t(t_ptr, t_row_stride, rank, rows, n_rows, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr, t_part_stride,
             T_PARTS: tl.constexpr, PDL: tl.constexpr, T_EARLY: tl.constexpr):
    """T_EARLY (`t_before_walk`): `_adapter_t` before the walk, after `gdc_wait` (t is the output of a launch
    before); else 0.0, t read in the epilogue."""
    t = 0.0
    if T_EARLY:
        if PDL:
            gdc_wait()
        t = _adapter_t(t_ptr, t_row_stride, rank, rows, n_rows, HAS_LORA, BLOCK_R, t_part_stride, T_PARTS)
    return t


@triton.jit
def _output_values(acc, rows, features, n_rows, n_out, bias_ptr, t, lora_b, scale, BIAS: tl.constexpr,
                   HAS_LORA: tl.constexpr):
    """y = acc + b + s · t Bᵀ in fp32 for the program's rows and features, with t (`_adapter_t`) and B's rows
    (`_adapter_b`) as loaded. BIAS: `BIAS_NONE`, `BIAS_FEATURES` (b `[N]`) or `BIAS_ROWS` (b `[rows, N]`,
    contiguous: an addend of each row, such as the residual stream an output projection's result joins)."""
    mask_rows = rows < n_rows
    mask_features = features < n_out
    if BIAS == 1:
        acc += tl.load(bias_ptr + features, mask=mask_features, other=0.0).to(tl.float32)[None, :]
    if BIAS == 2:
        acc += tl.load(bias_ptr + rows[:, None] * n_out + features[None, :],
                       mask=mask_rows[:, None] & mask_features[None, :], other=0.0).to(tl.float32)
    if HAS_LORA:
        acc += scale * tl.sum(t[:, None, :] * lora_b[None, :, :], axis=2)
    return acc


@triton.jit
def _store_rows(acc, rows, features, n_rows, n_out, bias_ptr, t, lora_b, scale, out_ptr, out_row_stride,
                BIAS: tl.constexpr, HAS_LORA: tl.constexpr):
    """`_output_values` stored in y's dtype: the end of a decoding matrix-vector product (`nf4_matvec`)."""
    y = _output_values(acc, rows, features, n_rows, n_out, bias_ptr, t, lora_b, scale, BIAS, HAS_LORA)
    out = out_ptr + rows[:, None] * out_row_stride + features[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows < n_rows)[:, None] & (features < n_out)[None, :])


@triton.jit
def _tile_range(blocks_per_row, BLOCKS_PER_TILE: tl.constexpr, SPLIT_K: tl.constexpr):
    """(first, end) quantisation block of the program's walk along K: with SPLIT_K (tiles a split, 0 for none)
    program (i, j) takes tiles [j · SPLIT_K, (j + 1) · SPLIT_K), else the whole row."""
    if SPLIT_K:
        first_block = tl.program_id(1) * (BLOCKS_PER_TILE * SPLIT_K)
        end_block = tl.minimum(first_block + BLOCKS_PER_TILE * SPLIT_K, blocks_per_row)
    else:
        first_block = 0
        end_block = blocks_per_row
    return first_block, end_block


@triton.jit
def _finish_product(
    acc, partial, rows, features, n_rows, n_out, partial_ptr, arrivals_ptr, bias_ptr, t, lora_b, scale, out_ptr,
    out_row_stride, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
):
    """The end of a program of the blocked or the word kernel, once its walk is done (and the next kernel let
    launch): one row's elementwise `partial` sums reduced into `acc`, the K splits summed (`_sum_of_splits`) and
    y written by the program that finishes the feature block (`_store_rows`, with the adapter's t and B rows as
    loaded)."""
    if BLOCK_M == 1:
        acc += tl.sum(tl.sum(partial, axis=2), axis=1)[None, :]
    if SPLIT_K:
        acc, last = _sum_of_splits(acc, rows, features, n_rows, n_out, partial_ptr, arrivals_ptr, tl.program_id(1),
                                   tl.num_programs(1), tl.program_id(0), BLOCK_M)
    else:
        last = True
    if last:
        _store_rows(acc, rows, features, n_rows, n_out, bias_ptr, t, lora_b, scale, out_ptr, out_row_stride, BIAS,
                    HAS_LORA)

