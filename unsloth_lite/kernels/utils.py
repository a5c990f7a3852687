"""Launch settings, output allocation, argument checks and the column-sum kernel shared by every op.

Weight gradients of the row-wise ops are reduced in two steps: each program accumulates the rows it owns
into one fp32 partial row, then `sum_partials` adds the partial rows. That is one store per program instead
of one atomic per element, and it is deterministic.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.interpreter import speed_up_interpreter

# Triton decides between compiling and interpreting when a kernel is decorated, so this is read once.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    speed_up_interpreter()
INTERPRETED = tl.constexpr(INTERPRET)  # the same, for jit functions (which read only constexpr globals)

# Tests set this so that any element a kernel forgets to write shows up as NaN.
POISON_OUTPUTS = os.environ.get("UNSLOTH_LITE_POISON_OUTPUTS") == "1"

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

MAX_FUSED_COLS = 65536


def row_launch_config(n_cols: int) -> tuple[int, int]:
    """Block size covering a whole row, and warps (measured best on an H200 at 4096 and 5120 columns)."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_FUSED_COLS:
        raise ValueError(f"rows of {n_cols} elements exceed the fused kernels' limit of {MAX_FUSED_COLS}")
    num_warps = 4 if block <= 1024 else 8 if block <= 8192 else 16
    return block, num_warps


def accumulator_dtype(dtype: torch.dtype):
    """fp32 math for every storage dtype; float64 stays float64 so `gradcheck` can run."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_program_count(device: torch.device, n_items: int, programs_per_sm: int = 2) -> int:
    """Programs for a grid whose programs loop over items and each emit one partial weight gradient."""
    if device.type == "cuda":
        budget = multiprocessor_count(device.index or 0) * programs_per_sm
    else:
        budget = 8  # the interpreter runs programs one after another; few programs, many rows each
    return max(1, min(n_items, budget))


def _poison(t: torch.Tensor) -> torch.Tensor:
    if POISON_OUTPUTS:
        t.fill_(float("nan"))
    return t


_CAPABILITIES: dict = {}


def compute_capability(device: torch.device) -> int:
    """The major compute capability of `device` where compiled kernels run on it (a CUDA device without the
    interpreter), else 0; cached a device."""
    if INTERPRET or device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)[0]
    return _CAPABILITIES[index]


# Programmatic dependent launch (Hopper and later) of the small decoding kernels (`decode_attention`, the DeltaNet's
# conv-state update and steps, `rms_norm_lora_down_rows`): each may start while the kernel before it finishes, its
# reads of what that kernel cannot write (its own cached state, weights, adapters) already issued, and waits for it
# before the rest. On since measured with the fused decoding launches (`models/decode.py`).
DECODE_PDL = True


def uses_decode_pdl(device: torch.device) -> bool:
    """Whether the small decoding kernels are launched as programmatic dependent launches on `device`
    (`DECODE_PDL`, on Hopper and later)."""
    return DECODE_PDL and compute_capability(device) >= 9


def pdl_launch(device: torch.device) -> dict:
    """The small decoding kernels' launch options: `PDL` and, where `uses_decode_pdl`, `launch_pdl`."""
    pdl = uses_decode_pdl(device)
    return {"PDL": pdl, **({"launch_pdl": True} if pdl else {})}


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _poison(torch.empty(shape, dtype=dtype, device=device))


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same shape and, for dense tensors (transposed views included), the same stride order."""
    return _poison(torch.empty_like(t, dtype=dtype))


def empty_strided(shape, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _poison(torch.empty_strided(shape, stride, dtype=dtype, device=device))


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and INTERPRET:
        return
    raise ValueError(
        f"{name} is on {t.device}: the Triton kernels run on CUDA tensors, or on CPU tensors when "
        "TRITON_INTERPRET=1 is set before unsloth_lite is imported"
    )


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of float32, bfloat16, float16, float64")


def check_integer(name: str, t) -> None:
    """Ids and labels: an integer tensor (not bool)."""
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an integer tensor, got {what}")


def check_same_device(names_and_tensors) -> None:
    (first_name, first), *rest = names_and_tensors
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D `[rows, cols]` view of `x` with one row stride, copying only when the leading dims don't collapse."""
    cols = x.shape[-1]
    try:
        return x.view(-1, cols)
    except RuntimeError:
        return x.reshape(-1, cols)


@triton.jit
def _sum_partials_kernel(
    partial_ptr, out_ptr, n_partials, n_cols,
    BLOCK_PARTIALS: tl.constexpr, BLOCK_COLS: tl.constexpr, ACC: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
    mask_cols = cols < n_cols
    total = tl.zeros([BLOCK_PARTIALS, BLOCK_COLS], dtype=ACC)
    for first in range(0, n_partials, BLOCK_PARTIALS):
        rows = first + tl.arange(0, BLOCK_PARTIALS)[:, None]
        total += tl.load(partial_ptr + rows * n_cols + cols, mask=(rows < n_partials) & mask_cols, other=0.0)
    tl.store(out_ptr + cols, tl.sum(total, axis=0)[None, :].to(out_ptr.dtype.element_ty), mask=mask_cols)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of a contiguous `[programs, cols]` fp32/fp64 tensor, returned in `dtype`."""
    n_partials, n_cols = partials.shape
    out = empty((n_cols,), dtype, partials.device)
    block_cols = min(triton.next_power_of_2(n_cols), 64)
    _sum_partials_kernel[(triton.cdiv(n_cols, block_cols),)](
        partials, out, n_partials, n_cols,
        BLOCK_PARTIALS=32, BLOCK_COLS=block_cols, ACC=accumulator_dtype(partials.dtype),
    )
    return out
