"""Rows of a table in pinned host memory gathered by the GPU itself: an embedding lookup with no host round trip.

    out[i, :] = table[ids[i], :]            (zero rows for ids outside [0, V))

For a table `[V, H]` in page-locked host memory and ids on a CUDA device, the kernel runs on the ids' device
and reads the rows it needs straight from host memory over the bus (pinned memory is mapped into the device's
address space under unified addressing), writing `out` on the device. Nothing waits on the host: the ids never
travel to it, so the lookup queues behind the device's work like any kernel (and can be captured in a CUDA
graph), where a host-side gather must first wait for the device to produce the ids and then leave it idle while
the host copies rows. Only the rows read cross the bus: 20 MB for 2,048 tokens of a 5,120-wide bf16 table.

No backward: the table is frozen (the ids have no gradient, and the rows' gradient has nowhere to go). Ids
outside the table give zero rows instead of reading out of bounds (not checked: that would need a host
synchronisation). Under the interpreter every tensor is on the CPU and the same kernel runs there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.utils import INTERPRET, check_integer, empty

# Columns a program copies (16-byte loads: 8 bf16 a thread with 4 warps at 1024 columns) and ids a program takes.
BLOCK_COLS = 1024
BLOCK_IDS = 4


@triton.jit
def _gather_rows_kernel(
    table_ptr, ids_ptr, out_ptr, n_ids, n_rows, n_cols, table_row_stride,
    BLOCK_IDS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Program (block of ids, block of columns): out[i, c] = table[ids[i], c], zero where ids[i] is outside."""
    ids = tl.program_id(0).to(tl.int64) * BLOCK_IDS + tl.arange(0, BLOCK_IDS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    rows = tl.load(ids_ptr + ids, mask=ids < n_ids, other=0).to(tl.int64)
    mask_cols = (cols < n_cols)[None, :]
    inside = ((ids < n_ids) & (rows >= 0) & (rows < n_rows))[:, None] & mask_cols
    values = tl.load(table_ptr + rows[:, None] * table_row_stride + cols[None, :], mask=inside, other=0)
    tl.store(out_ptr + ids[:, None] * n_cols + cols[None, :], values, mask=(ids < n_ids)[:, None] & mask_cols)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` (an integer tensor of any shape, on a CUDA device) of `table` `[V, H]` (pinned host memory,
    or the ids' device), as a tensor of `ids.shape + (H,)` in the table's dtype on the ids' device (module
    docstring). Under the interpreter both are CPU tensors."""
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"table must be 2-D with contiguous rows; got shape {tuple(table.shape)} strides "
                         f"{table.stride()}")
    check_integer("ids", ids)
    if not INTERPRET:
        if ids.device.type != "cuda":
            raise ValueError(f"ids are on {ids.device}: gather_rows runs on the ids' CUDA device")
        if table.device != ids.device and not (table.device.type == "cpu" and table.is_pinned()):
            raise ValueError(f"table is on {table.device}, neither pinned host memory nor the ids' {ids.device}")
    n_rows, n_cols = table.shape
    flat = ids.reshape(-1).contiguous()
    out = empty((*ids.shape, n_cols), table.dtype, ids.device)
    if flat.numel() and n_cols:
        block_cols = min(triton.next_power_of_2(n_cols), BLOCK_COLS)
        grid = (triton.cdiv(flat.numel(), BLOCK_IDS), triton.cdiv(n_cols, block_cols))
        _gather_rows_kernel[grid](
            table, flat, out, flat.numel(), n_rows, n_cols, table.stride(0),
            BLOCK_IDS=BLOCK_IDS, BLOCK_COLS=block_cols, num_warps=4,
        )
    return out
