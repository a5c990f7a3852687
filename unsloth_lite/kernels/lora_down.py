"""The first product of unmerged LoRA adapters at decoding: t = x [A_1; ...; A_n]ᵀ for a few rows of x.

At one token per sequence the rank-r product x Aᵀ is a few thousand multiply-adds per adapter; launched one by
one, the adapters of projections that share an input (q, k and v; gate and up) would cost a launch each. One
program per adapter row walks K once, for every row of x, and writes its fp32 column of t; `nf4_matvec` then
adds s · t Bᵀ to its product (`lora_t`). With `SPLIT_K`, program (j, s) takes step s of row j alone and the row's
last program to arrive adds the steps in order (`matvec_epilogue._sum_of_splits`: deterministic, one launch).
`rms_norm_lora_down_rows` makes the RMSNorm of x and the first products of the projections that read it one
launch. Inference only.

A product's own launch can take them too (`nf4_matvec.FIRST_PRODUCTS_IN_LAUNCH`: the word kernel, the grouped
and the gate-and-up launches): its first width · steps programs are `_first_product_program`s, the split steps
above, the last of a column counting it on the launch's ready flag (a release at GPU scope after its store); the
projection's programs walk their weights meanwhile and only before their epilogue await the flag (an acquire).
The writers have the launch's lowest program ids, so they are scheduled before any program that waits, and wait
for nothing of their launch themselves; the readers count themselves in groups (a counter a group, on its own
line) as soon as their load of t is issued (the count's round trip beside the load's), and the last group's
count sets every counter and the flag back to 0 (no reader reads the flag any more, and t is not written again
before the launch ends). The await is a plain acquire load and the counters are spread because a launch has up
to a few thousand readers: read-modify-writes of one address would queue them in L2 one after another.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from unsloth_lite.kernels.matvec_epilogue import _arrival_counters, _sum_of_splits
from unsloth_lite.kernels.utils import (
    INTERPRET,
    INTERPRETED,
    check_kernel_device,
    compute_capability,
    empty,
    pdl_launch,
    row_launch_config,
)

MAX_ROWS = 8  # rows of x (tokens of all sequences together) the decoding kernels take


@triton.jit
def _x_step(x_ptr, x_row_stride, x_col_stride, rows, mask_rows, cols, n_in):
    """x's rows over columns `cols` as fp32 `[BLOCK_M, BLOCK_K]` (0 past x's rows and past K)."""
    return tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride,
                   mask=mask_rows[:, None] & (cols < n_in)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _adapter_row(j, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, n_in):
    """Row j of [A0; A1; A2] (each `[r_i, K]`, contiguous)."""
    if j < rank0:
        a_row = a0_ptr + j.to(tl.int64) * n_in
    elif j < rank0 + rank1:
        a_row = a1_ptr + (j - rank0).to(tl.int64) * n_in
    else:
        a_row = a2_ptr + (j - rank0 - rank1).to(tl.int64) * n_in
    return a_row


@triton.jit
def _lora_down_kernel(
    x_ptr, x_row_stride, x_col_stride, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, t_ptr, t_row_stride, n_rows, n_in,
    width, partial_ptr, arrivals_ptr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):
    """Column j of t = x [A0; A1; A2]ᵀ: program j walks row j of the A (`[r_i, K]`, contiguous), its loads kept
    STAGES steps ahead (`PIPELINE_STAGES`); with SPLIT_K, program (j, s) takes step s alone and the last of the
    row's programs to arrive sums the steps in order (`matvec_epilogue._sum_of_splits`: one launch, the same
    bits whichever arrives last). PDL: the adapter, which no kernel writes, is read before `gdc_wait`; x after."""
    j = tl.program_id(0)
    a_row = _adapter_row(j, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, n_in)
    rows = tl.arange(0, BLOCK_M)
    mask_rows = rows < n_rows
    if SPLIT_K:
        _split_column(x_ptr, x_row_stride, x_col_stride, a_row, j, tl.program_id(1), tl.num_programs(1), t_ptr,
                      t_row_stride, n_rows, n_in, width, partial_ptr, arrivals_ptr, BLOCK_M, BLOCK_K, PDL)
    else:
        if PDL:
            gdc_wait()
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, n_in, BLOCK_K, num_stages=STAGES):
            cols = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_row + cols, mask=cols < n_in, other=0.0).to(tl.float32)
            acc += _x_step(x_ptr, x_row_stride, x_col_stride, rows, mask_rows, cols, n_in) * a[None, :]
        if PDL:
            gdc_launch_dependents()
        tl.store(t_ptr + rows[:, None] * t_row_stride + j, tl.sum(acc, axis=1)[:, None], mask=mask_rows[:, None])


@triton.jit
def _split_column(
    x_ptr, x_row_stride, x_col_stride, a_row, j, split, n_splits, t_ptr, t_row_stride, n_rows, n_in, width,
    partial_ptr, arrivals_ptr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """Step `split` of column j of t = x Aᵀ (`a_row`: row j of A): its sum over K's columns [split · BLOCK_K,
    (split + 1) · BLOCK_K), stored in the step's slot of `partial_ptr` `[n_splits, BLOCK_M, width]`; the column's
    last step to arrive adds the slots in order, writes the column of t and returns True. PDL: A is read before
    `gdc_wait`, x after."""
    rows = tl.arange(0, BLOCK_M)
    mask_rows = rows < n_rows
    cols = split * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_row + cols, mask=cols < n_in, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    x = _x_step(x_ptr, x_row_stride, x_col_stride, rows, mask_rows, cols, n_in)
    if PDL:
        gdc_launch_dependents()
    column = tl.sum(x * a[None, :], axis=1)[:, None]
    column, last = _sum_of_splits(column, rows, j + tl.arange(0, 1), n_rows, width, partial_ptr, arrivals_ptr,
                                  split, n_splits, j, BLOCK_M)
    if last:
        tl.store(t_ptr + rows[:, None] * t_row_stride + j, column, mask=mask_rows[:, None])
    return last


@triton.jit
def _first_product_program(
    x_ptr, x_row_stride, x_col_stride, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, width, t_ptr, t_row_stride, n_rows,
    n_in, partial_ptr, arrivals_ptr, flags_ptr, n_splits, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program w < width · n_splits of a product's launch that also takes its adapters' first products t = x [A0;
    A1; A2]ᵀ (`width` columns; the FIRST_PRODUCTS of `nf4_matvec`'s word kernel, the grouped and the gate-and-up
    launches): step w // width of column w % width (`_split_column`); the column's last step counts the column as
    ready (`flags_ptr[0]`, released at GPU scope after its store of t)."""
    j = tl.program_id(0) % width
    last = _split_column(x_ptr, x_row_stride, x_col_stride, _adapter_row(j, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, n_in),
                         j, tl.program_id(0) // width, n_splits, t_ptr, t_row_stride, n_rows, n_in, width,
                         partial_ptr, arrivals_ptr, BLOCK_M, BLOCK_K, PDL)
    if last:
        tl.debug_barrier()  # every thread's store of the column before the release
        tl.atomic_add(flags_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _acquired(flags_ptr):
    """flags_ptr[0] read with acquire semantics at GPU scope: compiled, a plain `ld.acquire` (the launch's
    programs read the flag together; an atomic read-modify-write would queue them at one L2 address); under
    the interpreter, an atomic add of 0."""
    if INTERPRETED:
        value = tl.atomic_add(flags_ptr, 0, sem="acquire", scope="gpu")
    else:
        value = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flags_ptr],
                                          dtype=tl.int32, is_pure=False, pack=1)
    return value


@triton.jit
def _await_first_products(flags_ptr, width):
    """Wait until the launch's first-product programs have written every column of t (`flags_ptr[0]` = width,
    acquired at GPU scope). They are the launch's lowest program ids, so they are scheduled before any program
    that waits, and they wait for nothing of their launch."""
    ready = _acquired(flags_ptr)
    while ready < width:
        ready = _acquired(flags_ptr)


# Readers counted in groups of READER_GROUP (`_count_reader`), each group's counter on its own 128-byte line.
READER_GROUP = 32
_READER_GROUP = tl.constexpr(READER_GROUP)
_COUNTER_STRIDE = tl.constexpr(32)  # int32s: 128 bytes


@triton.jit
def _count_reader(flags_ptr, reader, readers):
    """Count reader `reader` of the launch's `readers` programs that read t: on its group's counter
    (`READER_GROUP` readers a group, each counter on its own line, so that the launch's programs do not queue
    at one address), the group's last on `flags_ptr[1]`; the last group's count sets every counter and the
    ready flag back to 0 for the next launch, when no program of this one reads them any more."""
    group = reader // _READER_GROUP
    groups = (readers + _READER_GROUP - 1) // _READER_GROUP
    in_group = tl.minimum(readers - group * _READER_GROUP, _READER_GROUP)
    group_counter = flags_ptr + (group + 1) * _COUNTER_STRIDE
    done = tl.atomic_add(group_counter, 1, sem="relaxed", scope="gpu")
    if done == in_group - 1:
        tl.atomic_xchg(group_counter, 0, sem="relaxed", scope="gpu")
        groups_done = tl.atomic_add(flags_ptr + 1, 1, sem="relaxed", scope="gpu")
        if groups_done == groups - 1:
            tl.atomic_xchg(flags_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(flags_ptr + 1, 0, sem="relaxed", scope="gpu")


def reader_counters(programs: int) -> int:
    """The int32 flags and counters a launch of `programs` readers needs (`_count_reader`)."""
    return (triton.cdiv(programs, READER_GROUP) + 1) * _COUNTER_STRIDE.value


MAX_ADAPTERS_PER_LAUNCH = 3  # q, k, v: the most projections that share an input
# One program walks a whole row of A (up to 17,408 weights at the 27B's down projection): wide steps.
LORA_BLOCK_K = 256 if INTERPRET else 1024
# Steps along K whose loads a program keeps in flight (Triton's software pipelining, asynchronous copies to shared
# memory); 1 loads each step in its own. The launch has fewer programs than the GPU has SMs (one per adapter row),
# so each program's chain of load latencies is the kernel's time. Not measured yet: 1 until it is.
PIPELINE_STAGES = 1
# Each program one step of K (grid: adapter rows x steps), the steps summed by the row's last program: the launch's
# time is one load's latency instead of a chain of them (the 27B's down projection walks 17 steps). Measured on an
# H100 (2026-12-05, Qwen3-8B shape, rank-16 adapters on 7 projections): 240.5 -> 247.8 tokens/s, on since.
SPLIT_K = True
# Programmatic dependent launch (as `nf4_matvec.PDL`, Hopper and later): the launch starts while the kernel before
# it finishes, its adapter rows already loading, and lets the product after it start in turn. Measured in the same
# run: 244.1 tokens/s alone, 246.7 with the split (within the split's own noise): off.
PDL = False


class FirstProductArgs(NamedTuple):
    """The arguments a launch with `_first_product_program`s takes after its own (unpacked with `*` into the
    launch): x's elements and strides, the adapters' rows (three pointers, the first two ranks), the width Σ r_i,
    the steps' fp32 slots `[steps, rows, width]` and their arrival counters, the ready flags, the steps along K."""

    x: torch.Tensor
    x_row_stride: int
    x_col_stride: int
    a0: torch.Tensor
    a1: torch.Tensor
    a2: torch.Tensor
    rank0: int
    rank1: int
    width: int
    slots: torch.Tensor
    arrivals: torch.Tensor
    flags: torch.Tensor
    steps: int

    @property
    def programs(self) -> int:
        """The programs the launch puts before its own: width x steps."""
        return self.width * self.steps


def no_first_products(x2d: torch.Tensor) -> FirstProductArgs:
    """The arguments of a launch without first-product programs (width 0, no steps)."""
    return FirstProductArgs(x2d, 0, 0, x2d, x2d, x2d, 0, 0, 0, x2d, x2d, x2d, 0)


def first_product_flags(device: torch.device, readers: int) -> torch.Tensor:
    """The ready flag and reader counters (int32, left at 0 by each launch) of a launch whose first programs write
    t for `readers` programs (`_await_first_products`, `_count_reader`)."""
    return _arrival_counters(device, reader_counters(readers), use="first products")


def first_product_args(x2d: torch.Tensor, lora_as: list[torch.Tensor], block_m: int,
                       readers: int) -> tuple[torch.Tensor, FirstProductArgs]:
    """(t `[rows, Σ r_i]` fp32, the launch's `FirstProductArgs`) for a launch that takes the first products of up
    to MAX_ADAPTERS_PER_LAUNCH adapters `[r_i, K]` of x itself, by steps `LORA_BLOCK_K` wide (as `lora_down_rows`
    takes them), whose `readers` programs await t."""
    group = [a.contiguous() for a in lora_as]
    width = sum(a.shape[0] for a in group)
    pointers = group + [group[-1]] * (MAX_ADAPTERS_PER_LAUNCH - len(group))
    steps = triton.cdiv(x2d.shape[1], LORA_BLOCK_K)
    t = empty((x2d.shape[0], width), torch.float32, x2d.device)
    slots = empty((steps, block_m, width), torch.float32, x2d.device)
    return t, FirstProductArgs(x2d, x2d.stride(0), x2d.stride(1), *pointers, group[0].shape[0],
                               group[1].shape[0] if len(group) > 1 else 0, width, slots,
                               _arrival_counters(x2d.device, width), first_product_flags(x2d.device, readers),
                               steps)


def lora_down_rows(x: torch.Tensor, lora_as: list[torch.Tensor]) -> torch.Tensor:
    """`x [A_1; ...; A_n]ᵀ` in fp32, `[rows, Σ r_i]`, for x `[rows, K]` (1 to MAX_ROWS rows, any float dtype)
    and adapters A_i `[r_i, K]`: the first product of each unmerged adapter of projections that share x, in one
    launch per MAX_ADAPTERS_PER_LAUNCH adapters (no fp32 copy of x, no launch per adapter). Inference only."""
    rows, n_in = x.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"lora_down_rows takes 1 to {MAX_ROWS} rows of x, got {rows}")
    if not lora_as or any(a.dim() != 2 or a.shape[1] != n_in or a.shape[0] == 0 for a in lora_as):
        raise ValueError(f"each adapter A must be [r > 0, {n_in}]; got {[tuple(a.shape) for a in lora_as]}")
    check_kernel_device("x", x)
    ranks = [a.shape[0] for a in lora_as]
    t = empty((rows, sum(ranks)), torch.float32, x.device)
    pdl = PDL and compute_capability(x.device) >= 9
    block_m = triton.next_power_of_2(rows)
    splits = triton.cdiv(n_in, LORA_BLOCK_K) if SPLIT_K else 1
    start = 0
    for first in range(0, len(lora_as), MAX_ADAPTERS_PER_LAUNCH):
        group = [a.contiguous() for a in lora_as[first:first + MAX_ADAPTERS_PER_LAUNCH]]
        pointers = group + [group[-1]] * (MAX_ADAPTERS_PER_LAUNCH - len(group))
        width = sum(a.shape[0] for a in group)
        if splits > 1:
            partial = empty((splits, block_m, width), torch.float32, x.device)
            arrivals = _arrival_counters(x.device, width)
        else:
            partial = arrivals = t
        _lora_down_kernel[(width, splits)](
            x, x.stride(0), x.stride(1), *pointers, group[0].shape[0], group[1].shape[0] if len(group) > 1 else 0,
            t[:, start:], t.stride(0), rows, n_in, width, partial, arrivals,
            BLOCK_M=block_m, BLOCK_K=LORA_BLOCK_K, STAGES=PIPELINE_STAGES, SPLIT_K=splits > 1, PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
        start += width
    return t


@triton.jit
def _rms_norm_lora_down_kernel(
    x_ptr, x_row_stride, w_ptr, eps, offset, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, y_ptr, t_ptr, t_row_stride,
    n_rows, n_in, zeroed_ptr, n_zeroed, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, HAS_T: tl.constexpr,
    PDL: tl.constexpr, BLOCK_ZEROED: tl.constexpr,
):
    """Column j of t = y [A0; A1; A2]ᵀ for y = RMSNorm(x) computed as `rms_norm`'s forward kernel computes it (one
    reduction over the row, the same expression, rounded to y's dtype); program 0 also writes y (the only program
    without HAS_T: no adapters) and zeros into `zeroed_ptr`'s `n_zeroed` fp32 (BLOCK_ZEROED > 0). PDL: the norm's
    weight and the adapter row are read before `gdc_wait`, x after it, and nothing is written before it."""
    j = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_in
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    if HAS_T:
        a = tl.load(_adapter_row(j, a0_ptr, a1_ptr, a2_ptr, rank0, rank1, n_in) + cols, mask=mask, other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if BLOCK_ZEROED > 0 and j == 0:
        zeroed = tl.arange(0, BLOCK_ZEROED)
        tl.store(zeroed_ptr + zeroed, tl.zeros([BLOCK_ZEROED], tl.float32), mask=zeroed < n_zeroed)
    for m in tl.static_range(BLOCK_M):
        if m < n_rows:
            x = tl.load(x_ptr + m * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_in + eps)
            y = (x * rstd * w).to(y_ptr.dtype.element_ty)
            if j == 0:
                tl.store(y_ptr + m * n_in + cols, y, mask=mask)
            if HAS_T:
                tl.store(t_ptr + m * t_row_stride + j, tl.sum(y.to(tl.float32) * a.to(tl.float32), axis=0))


def rms_norm_lora_down_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                            lora_as: list[torch.Tensor], zeroed: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, t): y = `rms_norm(x, weight, eps, offset)` for x `[rows, K]` (1 to MAX_ROWS rows) and t = y [A_1; ...]ᵀ
    (`lora_down_rows` of y: up to MAX_ADAPTERS_PER_LAUNCH adapters `[r_i, K]`), in one launch instead of two: each
    program normalises the few rows itself and takes one adapter row. Without adapters, y alone (t None) from one
    program: the decoding step's norm, which can be a programmatic dependent launch (`utils.DECODE_PDL`).
    `zeroed`: a contiguous fp32 tensor the launch sets to 0 (the MLP's down shares, `nf4_gated_matvec`'s
    `down_shares`, which the launch after it adds into). Inference only."""
    rows, n_in = x.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rms_norm_lora_down_rows takes 1 to {MAX_ROWS} rows of x, got {rows}")
    if len(lora_as) > MAX_ADAPTERS_PER_LAUNCH or any(
            a.dim() != 2 or a.shape[1] != n_in or a.shape[0] == 0 for a in lora_as):
        raise ValueError(f"0 to {MAX_ADAPTERS_PER_LAUNCH} adapters A of [r > 0, {n_in}]; got "
                         f"{[tuple(a.shape) for a in lora_as]}")
    if tuple(weight.shape) != (n_in,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({n_in},)")
    if zeroed is not None and (zeroed.dtype != torch.float32 or not zeroed.is_contiguous()
                               or zeroed.device != x.device):
        raise ValueError(f"zeroed must be a contiguous fp32 tensor on {x.device}; got {zeroed.dtype} "
                         f"{tuple(zeroed.shape)} on {zeroed.device}")
    check_kernel_device("x", x)
    x = x if x.stride(1) == 1 else x.contiguous()
    group = [a.contiguous() for a in lora_as]
    width = sum(a.shape[0] for a in group)
    y = empty((rows, n_in), x.dtype, x.device)
    t = empty((rows, width), torch.float32, x.device) if group else None
    pointers = (group + [group[-1]] * (MAX_ADAPTERS_PER_LAUNCH - len(group))) if group else [y] * 3
    block, warps = row_launch_config(n_in)  # rms_norm's: the same reduction, the same bits
    _rms_norm_lora_down_kernel[(max(width, 1),)](
        x, x.stride(0), weight.contiguous(), float(eps), float(offset), *pointers,
        group[0].shape[0] if group else 0, group[1].shape[0] if len(group) > 1 else 0,
        y, t if group else y, t.stride(0) if group else 0, rows, n_in,
        zeroed if zeroed is not None else y, zeroed.numel() if zeroed is not None else 0,
        BLOCK_M=triton.next_power_of_2(rows), BLOCK=block, HAS_T=bool(group), num_warps=warps,
        BLOCK_ZEROED=triton.next_power_of_2(zeroed.numel()) if zeroed is not None else 0,
        **pdl_launch(x.device),
    )
    return y, t
