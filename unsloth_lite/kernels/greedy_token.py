"""A greedy decoding step's choice of the next token and its bookkeeping, in one launch.

For the step's logits `[B, V]` (any float dtype), the decoding loop's tensors and the column c of the new tokens,
per row b:

    token_b = argmax_v fp32(logits[b, v])          the first index of the maximum; a NaN counts as the maximum,
                                                   the first NaN's index wins (as `torch.argmax`); with
                                                   `suppress_eos`, the end-of-sequence ids' logits read as -inf
                                                   (Hugging Face's minimum-new-tokens processor)
    token_b = token_b if unfinished_b else pad     (with end-of-sequence ids)
    unfinished_b = unfinished_b and token_b ∉ eos
    ids[b, c] = token_b,  next_input[b, 0] = token_b,  record[b] = token_b,  record[B] = no row unfinished

and, with `advance` (the step after a forward), the position of every row advanced by one and the attention
mask opened there: `position += 1; mask[:, 0, 0, position[0]] = opened` (the loop's update after each forward,
done here, before the next forward reads them). No gradient: inference only.

Why: Hugging Face's loop and the PyTorch form of ours spend a dozen launches a token on this (the fp32 copy of the
logits, argmax, `where`, `isin`, `any`, the copies into the ids and the next input, the position's add, the
mask's fill), each a few microseconds of a GPU that at batch 1 decodes a token in 3 to 10 ms.

Programs (b, j): program j reads block j of row b's logits (BLOCK_V of them) and stores its block's maximum, the
first index where it occurs and the first NaN's index in a scratch slot, then counts itself on the row's arrival
counter; the row's last program to arrive combines the slots in block order (the same token whichever arrives
last) and writes the row's outputs, then counts the row on the launch's counter; the last row to arrive writes
the all-finished flag and advances the position and the mask. The counters are left at 0 for the next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.matvec_epilogue import _arrival_counters
from unsloth_lite.kernels.utils import INTERPRET, check_float, check_kernel_device, empty

# Logits a program reads: at Qwen's vocabularies (151,936 and 248,320) 75 and 122 programs a row (the
# interpreter: small blocks, so that the tests' small vocabularies take several).
BLOCK_V = 256 if INTERPRET else 2048
NONE = tl.constexpr(2**31 - 1)  # no index (no NaN in a block); larger than any vocabulary
MAX_EOS = 16  # end-of-sequence ids (each compared with every logit's index where they are suppressed)


@triton.jit
def _block_choice(logits_ptr, row_offset, block, vocab, eos_ptr, n_eos, suppress_eos,
                  BLOCK_V: tl.constexpr, BLOCK_E: tl.constexpr, HAS_EOS: tl.constexpr):
    """(the block's largest value, the first index where it lies, the first NaN's index or NONE) of one block of a
    row's logits, compared in fp32, the end-of-sequence ids' as -inf where `suppress_eos` is nonzero."""
    index = block * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = index < vocab
    values = tl.load(logits_ptr + row_offset + index, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_EOS:
        if suppress_eos != 0:
            for e in tl.static_range(BLOCK_E):
                eos = tl.load(eos_ptr + e, mask=e < n_eos, other=-1)
                values = tl.where(index == eos, float("-inf"), values)
    is_nan = values != values
    first_nan = tl.min(tl.where(is_nan & inside, index, NONE), axis=0)
    largest = tl.max(tl.where(is_nan, float("-inf"), values), axis=0)
    first_largest = tl.min(tl.where(inside & (values == largest), index, NONE), axis=0)
    return largest, first_largest, first_nan


@triton.jit
def _row_choice(value_ptr, index_ptr, nan_ptr, n_blocks, BLOCK_B: tl.constexpr):
    """The row's token from its blocks' slots: the first NaN's index if any block has one, else the index of the
    largest value's first block (read from L2, where the other programs stored them)."""
    blocks = tl.arange(0, BLOCK_B)
    inside = blocks < n_blocks
    first_nans = tl.load(nan_ptr + blocks, mask=inside, other=NONE, cache_modifier=".cg")
    values = tl.load(value_ptr + blocks, mask=inside, other=float("-inf"), cache_modifier=".cg")
    largest = tl.max(values, axis=0)
    first_block = tl.min(tl.where(inside & (values == largest), blocks, BLOCK_B), axis=0)
    token = tl.load(index_ptr + first_block, cache_modifier=".cg")
    first_nan = tl.min(first_nans, axis=0)
    return tl.where(first_nan != NONE, first_nan, token).to(tl.int64)


@triton.jit
def _greedy_token_kernel(
    logits_ptr, logits_row_stride, vocab,
    value_ptr, index_ptr, nan_ptr, arrivals_ptr,
    ids_ptr, ids_row_stride, column_offset, next_input_ptr, next_input_row_stride, record_ptr,
    unfinished_ptr, eos_ptr, n_eos, pad, suppress_eos,
    position_ptr, position_row_stride, mask_ptr, mask_row_stride, mask_len, opened, n_rows,
    BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_EOS: tl.constexpr, ADVANCE: tl.constexpr, MASK_BOOL: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    n_blocks = tl.num_programs(1)
    largest, first_largest, first_nan = _block_choice(
        logits_ptr, row.to(tl.int64) * logits_row_stride, block, vocab, eos_ptr, n_eos, suppress_eos,
        BLOCK_V, BLOCK_E, HAS_EOS)
    slot = row * n_blocks + block
    tl.store(value_ptr + slot, largest)
    tl.store(index_ptr + slot, first_largest)
    tl.store(nan_ptr + slot, first_nan)
    tl.debug_barrier()  # every thread's stores before the arrival (released at GPU scope by the atomic)
    if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu") == n_blocks - 1:
        tl.atomic_xchg(arrivals_ptr + row, 0, sem="relaxed", scope="gpu")
        first = row * n_blocks
        token = _row_choice(value_ptr + first, index_ptr + first, nan_ptr + first, n_blocks, BLOCK_B)
        if HAS_EOS:
            unfinished = tl.load(unfinished_ptr + row) != 0
            token = tl.where(unfinished, token, pad)
            eos = tl.load(eos_ptr + tl.arange(0, BLOCK_E), mask=tl.arange(0, BLOCK_E) < n_eos, other=-1)
            ended = tl.max((eos == token).to(tl.int32), axis=0) != 0
            tl.store(unfinished_ptr + row, (unfinished & ~ended).to(tl.int8))
        tl.store(ids_ptr + row.to(tl.int64) * ids_row_stride + column_offset, token)
        tl.store(next_input_ptr + row * next_input_row_stride, token)
        tl.store(record_ptr + row, token)
        tl.debug_barrier()
        counter = arrivals_ptr + tl.num_programs(0)
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_rows - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            rows = tl.arange(0, BLOCK_ROWS)
            in_rows = rows < n_rows
            if HAS_EOS:
                left = tl.load(unfinished_ptr + rows, mask=in_rows, other=0, cache_modifier=".cg")
                tl.store(record_ptr + n_rows, (tl.max(left.to(tl.int32), axis=0) == 0).to(tl.int64))
            else:
                tl.store(record_ptr + n_rows, 0)
            if ADVANCE:
                positions = position_ptr + rows * position_row_stride
                moved = tl.load(positions, mask=in_rows, other=0) + 1
                tl.store(positions, moved, mask=in_rows)
                opened_at = tl.sum(tl.where(rows == 0, moved, 0), axis=0)  # the first row's, as the loop fills
                target = mask_ptr + rows.to(tl.int64) * mask_row_stride + opened_at
                inside = in_rows & ((rows * 0 + opened_at) < mask_len)
                if MASK_BOOL:
                    tl.store(target, (rows * 0 + 1).to(tl.int8), mask=inside)
                else:
                    tl.store(target, (rows * 0).to(tl.float32) + opened, mask=inside)


def _check_args(logits, ids, next_input, unfinished, eos, position, mask):
    check_float("logits", logits)
    check_kernel_device("logits", logits)
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, V] with contiguous rows; got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    for name, t, dtype in (("ids", ids, torch.int64), ("next_input", next_input, torch.int64),
                           ("position", position, torch.int64)):
        if t.dtype != dtype or t.dim() != 2 or t.shape[0] != batch or t.device != logits.device:
            raise ValueError(f"{name} must be int64 [{batch}, ...] on {logits.device}; got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if unfinished is not None and (unfinished.dtype != torch.bool or tuple(unfinished.shape) != (batch,)):
        raise ValueError(f"unfinished must be bool [{batch}]; got {unfinished.dtype} {tuple(unfinished.shape)}")
    if (eos is None) != (unfinished is None):
        raise ValueError("eos and unfinished go together (both or neither)")
    if eos is not None and (eos.dtype != torch.int64 or eos.dim() != 1 or not 1 <= eos.numel() <= MAX_EOS):
        raise ValueError(f"eos must hold 1 to {MAX_EOS} int64 ids; got {eos.dtype} {tuple(eos.shape)}")
    if mask.dim() != 4 or mask.shape[0] != batch or mask.stride(-1) != 1:
        raise ValueError(f"mask must be [{batch}, 1, 1, S] with a contiguous last dimension; got "
                         f"{tuple(mask.shape)}")


def greedy_token(
    logits: torch.Tensor,
    ids: torch.Tensor,
    column: int,
    next_input: torch.Tensor,
    unfinished: torch.Tensor | None,
    eos: torch.Tensor | None,
    pad: int | None,
    position: torch.Tensor,
    mask: torch.Tensor,
    opened,
    advance: bool,
    suppress_eos: bool = False,
) -> torch.Tensor:
    """The greedy step of the module docstring on the loop's tensors, updated in place: ids `[B, L]` int64 (column
    `column`), next_input `[B, 1]` int64, unfinished `[B]` bool and eos (a 1-D int64 tensor; both None without
    end-of-sequence ids), position `[B, 1]` int64, mask `[B, 1, 1, S]` (boolean, or additive in a float dtype),
    `opened` the value that opens a position, `suppress_eos` (with eos) the end-of-sequence ids kept from being
    chosen (the step is within `min_new_tokens`). Returns record `[B + 1]` int64: the tokens and the all-finished
    flag, for one copy to the host."""
    _check_args(logits, ids, next_input, unfinished, eos, position, mask)
    batch, vocab = logits.shape
    blocks = triton.cdiv(vocab, BLOCK_V)
    device = logits.device
    values = empty((batch, blocks), torch.float32, device)
    indices = torch.empty((batch, blocks), dtype=torch.int32, device=device)
    first_nans = torch.empty((batch, blocks), dtype=torch.int32, device=device)
    record = torch.empty((batch + 1,), dtype=torch.int64, device=device)
    has_eos = eos is not None
    unfinished_arg = unfinished.view(torch.int8) if has_eos else record
    eos_arg = eos if has_eos else record
    mask_bool = mask.dtype == torch.bool
    mask_arg = mask.view(torch.int8) if mask_bool else mask
    _greedy_token_kernel[(batch, blocks)](
        logits, logits.stride(0), vocab,
        values, indices, first_nans, _arrival_counters(device, batch + 1),
        ids, ids.stride(0), column * ids.stride(1), next_input, next_input.stride(0), record,
        unfinished_arg, eos_arg, eos.numel() if has_eos else 0, 0 if pad is None else int(pad), int(suppress_eos),
        position, position.stride(0), mask_arg, mask.stride(0), mask.shape[-1], float(opened), batch,
        BLOCK_V=BLOCK_V, BLOCK_B=triton.next_power_of_2(blocks),
        BLOCK_E=max(2, triton.next_power_of_2(eos.numel() if has_eos else 1)),
        BLOCK_ROWS=max(2, triton.next_power_of_2(batch)), HAS_EOS=has_eos, ADVANCE=advance, MASK_BOOL=mask_bool,
        num_warps=4,
    )
    return record


def greedy_token_reference(logits, ids, column, next_input, unfinished, eos, pad, position, mask, opened,
                           advance, suppress_eos=False):
    """Plain-PyTorch `greedy_token` (the decoding loop's own steps)."""
    scores = logits.float()
    if suppress_eos:
        scores[:, eos] = float("-inf")
    token = scores.argmax(dim=-1)
    finished = torch.zeros((), dtype=torch.bool, device=logits.device)
    if eos is not None:
        token = torch.where(unfinished, token, pad)
        unfinished &= ~torch.isin(token, eos)
        finished = ~unfinished.any()
    ids[:, column] = token
    next_input.copy_(token[:, None])
    if advance:
        position += 1
        mask.index_fill_(3, position[0], opened)
    return torch.cat([token, finished.long()[None]])
