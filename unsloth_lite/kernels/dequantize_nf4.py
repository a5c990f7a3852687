"""NF4 dequantization of bitsandbytes 4-bit weights in one Triton launch, nested absmax included.

bitsandbytes stores a weight W of `quant_state.shape` (n elements, row-major) as packed uint8 bytes, two 4-bit
codes per byte, high nibble first, split into quantization blocks of `B = quant_state.blocksize` elements:

    q[2i]     = byte[i] >> 4
    q[2i + 1] = byte[i] & 0xF
    W[e]      = dtype(code[q[e]] · absmax[e // B])          (product in fp32, one rounding to `dtype`)

`code` is the 16-entry NF4 table (`quant_state.code`). With double quantization (`quant_state.nested`) the
absmax values are themselves 8-bit codes, blockwise over blocks of `B2 = state2.blocksize` absmax values:

    absmax[j] = fp32(state2.code[qabsmax[j]] · state2.absmax[j // B2]) + offset    (two fp32 roundings)

which is how `bitsandbytes.functional.dequantize_4bit` computes it (`dequantize_blockwise`, then `+= offset`).
The kernel follows that order of operations exactly and is launched with fp fusion off, so the multiply and add
are never contracted into an FMA: the result is bit-identical to bitsandbytes.

Each program owns ROWS whole quantization blocks, a [ROWS, B / 2] tile of packed bytes: one absmax (or one
nested absmax dequantization) per row, the two nibbles of each byte interleaved into a [ROWS, B] output tile.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.utils import check_kernel_device, empty

# Output elements per program; a program covers max(1, TILE_ELEMENTS // blocksize) quantization blocks.
TILE_ELEMENTS = 4096

BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _fp32_to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, in integer ops: what bitsandbytes' CPU `float_to_bf16`, CUDA's
    `__float2bfloat16` and torch's `.to(torch.bfloat16)` do for finite values (Triton's interpreter truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _dequantize_nf4(
    packed_ptr, absmax_ptr, code_ptr,
    nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize,
    out_ptr,
    n_elements, n_bytes, n_blocks,
    HALF_BLOCK: tl.constexpr, ROWS: tl.constexpr, NESTED: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # quantization blocks of this program
    mask_blocks = blocks < n_blocks
    if NESTED:
        qabsmax = tl.load(absmax_ptr + blocks, mask=mask_blocks, other=0).to(tl.int32)
        nested_scale = tl.load(nested_absmax_ptr + blocks // nested_blocksize, mask=mask_blocks, other=0.0)
        absmax = tl.load(nested_code_ptr + qabsmax).to(tl.float32) * nested_scale.to(tl.float32)
        absmax = absmax + tl.load(offset_ptr).to(tl.float32)
    else:
        absmax = tl.load(absmax_ptr + blocks, mask=mask_blocks, other=0.0).to(tl.float32)

    byte = blocks[:, None] * HALF_BLOCK + tl.arange(0, HALF_BLOCK)[None, :]
    packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    high = tl.load(code_ptr + (packed >> 4)) * absmax[:, None]
    low = tl.load(code_ptr + (packed & 0xF)) * absmax[:, None]
    values = tl.interleave(high, low)  # [ROWS, 2 * HALF_BLOCK]: element 2i from byte i's high nibble
    if out_ptr.dtype.element_ty == tl.bfloat16:
        values = _fp32_to_bf16_rne(values)
    else:
        values = values.to(out_ptr.dtype.element_ty)

    element = blocks[:, None] * (2 * HALF_BLOCK) + tl.arange(0, 2 * HALF_BLOCK)[None, :]
    tl.store(out_ptr + element, values, mask=element < n_elements)


def _quant_state_of(weight, quant_state):
    if quant_state is None:
        quant_state = getattr(weight, "quant_state", None)
    if quant_state is None:
        raise ValueError(
            "quant_state is missing: pass a bitsandbytes Params4bit (with .quant_state) as weight, "
            "or the packed uint8 tensor and its QuantState as quant_state"
        )
    for attr in ("absmax", "shape", "code", "blocksize", "quant_type", "dtype"):
        if not hasattr(quant_state, attr):
            kind = type(quant_state).__name__
            raise ValueError(f"quant_state must be a bitsandbytes QuantState; {kind} has no attribute {attr!r}")
    return quant_state


def _check_quant_state(qs, device: torch.device) -> None:
    if qs.quant_type != "nf4":
        raise ValueError(f"quant_state.quant_type is {qs.quant_type!r}; dequantize_nf4 only handles 'nf4'")
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError("quant_state uses bitsandbytes' CPU-only packed layout (packing_format_for_cpu); not NF4 rows")
    if qs.dtype not in OUTPUT_DTYPES:
        raise ValueError(f"quant_state.dtype is {qs.dtype}; expected one of float32, bfloat16, float16")
    if qs.blocksize not in BNB_BLOCKSIZES:
        raise ValueError(f"quant_state.blocksize is {qs.blocksize}; expected one of {BNB_BLOCKSIZES}")
    if qs.shape is None:
        raise ValueError("quant_state.shape is None")
    tensors = [("quant_state.absmax", qs.absmax), ("quant_state.code", qs.code)]
    if qs.nested:
        tensors += [
            ("quant_state.state2.absmax", qs.state2.absmax),
            ("quant_state.state2.code", qs.state2.code),
            ("quant_state.offset", qs.offset),
        ]
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but weight is on {device}")
    if qs.code.numel() != 16:
        raise ValueError(f"quant_state.code has {qs.code.numel()} entries; an NF4 table has 16")
    n_blocks = triton.cdiv(_numel(qs.shape), qs.blocksize)
    if qs.absmax.numel() < n_blocks:
        raise ValueError(f"quant_state.absmax has {qs.absmax.numel()} values; {n_blocks} blocks need one each")
    if qs.nested:
        if qs.absmax.dtype != torch.uint8:
            raise ValueError(f"quant_state.absmax of a nested state has dtype {qs.absmax.dtype}; expected uint8")
        if qs.state2.dtype != torch.float32:
            raise ValueError(f"quant_state.state2.dtype is {qs.state2.dtype}; expected float32")
        if qs.state2.code.numel() != 256:
            raise ValueError(f"quant_state.state2.code has {qs.state2.code.numel()} entries; expected 256")
        if qs.offset.numel() != 1:
            raise ValueError(f"quant_state.offset has {qs.offset.numel()} values; expected one")
        if not isinstance(qs.state2.blocksize, int) or qs.state2.blocksize <= 0:
            raise ValueError(f"quant_state.state2.blocksize is {qs.state2.blocksize!r}; expected a positive int")
        n_nested = triton.cdiv(qs.absmax.numel(), qs.state2.blocksize)
        if qs.state2.absmax.numel() < n_nested:
            raise ValueError(
                f"quant_state.state2.absmax has {qs.state2.absmax.numel()} values; {n_nested} blocks need one each"
            )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _packed_bytes(weight: torch.Tensor, n_elements: int) -> torch.Tensor:
    """The packed storage as a flat uint8 tensor (bitsandbytes' `quant_storage` may be another dtype)."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a Params4bit or a packed torch.Tensor, got {type(weight).__name__}")
    packed = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    packed = packed.detach().contiguous().reshape(-1)
    if packed.dtype == torch.bool:
        raise ValueError("weight has dtype torch.bool; expected packed uint8 storage")
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    n_bytes = (n_elements + 1) // 2
    if packed.numel() < n_bytes:
        raise ValueError(
            f"weight holds {packed.numel()} packed bytes; quant_state.shape of {n_elements} elements needs {n_bytes}"
        )
    return packed


def _check_out(out, shape, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)} but quant_state.shape is {tuple(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype} but quant_state.dtype is {dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but weight is on {device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


@dataclasses.dataclass
class _Launch:
    """The checked arguments of one weight's dequantization, kept while its storage stays the same."""

    key: tuple
    shape: torch.Size
    dtype: torch.dtype
    n_elements: int
    grid: tuple
    inputs: tuple  # the kernel's arguments before `out`
    sizes: tuple  # ... and after it
    meta: dict  # constexprs and launch options
    kernel: object


_dequantize_nf4_kernel = triton.jit(_dequantize_nf4)
# Triton 3.6 miscompiles the specialisation where n_elements is a multiple of 16 and n_bytes is not (n ≡ 16 mod
# 32; seen with blocksize 256 and 16-bit outputs: the bytes' layout conversion addresses shared memory out of
# alignment). Such weights take a kernel that does not specialise n_elements. Real layers' sizes are multiples
# of 32 and keep the specialised kernel.
_dequantize_nf4_kernel_n_unspecialised = triton.jit(_dequantize_nf4, do_not_specialize=["n_elements"])


# Per QuantState, by id and weakly held (QuantState is unhashable; the entry goes with it): checks and argument
# preparation run once per weight, not on each of the three dequantizations a training step makes of every
# frozen NF4 weight.
_LAUNCHES: dict[int, tuple[weakref.ref, _Launch]] = {}


def _storage_key(weight, qs) -> tuple:
    tensors = [weight, qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code, qs.offset] if qs.nested else [])
    return tuple((t.data_ptr(), t.device, t.dtype) for t in tensors) + (
        tuple(qs.shape), qs.dtype, qs.blocksize, qs.quant_type, bool(qs.nested)
    )


def _launch(weight, quant_state) -> _Launch:
    qs = _quant_state_of(weight, quant_state)
    key = _storage_key(weight, qs) if isinstance(weight, torch.Tensor) else None
    cached = _LAUNCHES.get(id(qs))
    if cached is not None and cached[0]() is qs and key is not None and cached[1].key == key:
        return cached[1]
    shape = torch.Size(qs.shape)
    n_elements = _numel(shape)
    packed = _packed_bytes(weight, n_elements)
    device = packed.device
    _check_quant_state(qs, device)
    check_kernel_device("weight", packed)
    blocksize = qs.blocksize
    rows = max(1, TILE_ELEMENTS // blocksize)
    n_blocks = triton.cdiv(n_elements, blocksize)
    code = qs.code.to(torch.float32)
    if qs.nested:
        nested = (qs.state2.code.to(torch.float32), qs.state2.absmax, qs.offset.reshape(1), qs.state2.blocksize)
    else:
        nested = (code, qs.absmax, code, 1)  # unused
    n_bytes = (n_elements + 1) // 2
    launch = _Launch(
        key=key, shape=shape, dtype=qs.dtype, n_elements=n_elements, grid=(triton.cdiv(n_blocks, rows),),
        inputs=(packed, qs.absmax, code, *nested), sizes=(n_elements, n_bytes, n_blocks),
        meta=dict(HALF_BLOCK=blocksize // 2, ROWS=rows, NESTED=bool(qs.nested), num_warps=4, enable_fp_fusion=False),
        kernel=(
            _dequantize_nf4_kernel_n_unspecialised if n_elements % 16 == 0 and n_bytes % 16 else _dequantize_nf4_kernel
        ),
    )
    if id(qs) not in _LAUNCHES:
        weakref.finalize(qs, _LAUNCHES.pop, id(qs), None)
    _LAUNCHES[id(qs)] = (weakref.ref(qs), launch)
    return launch


def dequantize_nf4(weight, quant_state=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight of a bitsandbytes NF4 `Params4bit` (or of a packed uint8 tensor and its `QuantState`).

    Returns a tensor of `quant_state.shape` and `quant_state.dtype`, bit-identical to
    `bitsandbytes.functional.dequantize_4bit(packed, quant_state)`, written into `out` when given (which must be
    contiguous, of that shape and dtype, on the weight's device). One exception, a bitsandbytes 0.50.2 bug: its
    AVX-512 CPU kernel misplaces absmax blocks when the last dim is a multiple of 16 but not of the blocksize;
    there this matches bitsandbytes' CUDA kernel and its pure-PyTorch backend instead.
    """
    launch = _launch(weight, quant_state)
    device = launch.inputs[0].device
    if out is None:
        out = empty(launch.shape, launch.dtype, device)
    else:
        _check_out(out, launch.shape, launch.dtype, device)
    if launch.n_elements:
        launch.kernel[launch.grid](*launch.inputs, out, *launch.sizes, **launch.meta)
    return out


def dequantize_nf4_reference(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """Plain-PyTorch `dequantize_nf4(packed, quant_state)`, same arithmetic (runs on any device, no Triton).
    It is the CPU path's dequantisation, run for every 4-bit product of a training step, hence one gather per
    byte (a table of the byte's two code values) and one broadcast product per block."""
    qs = quant_state
    n = _numel(qs.shape)
    data = packed.detach().contiguous().reshape(-1)
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    code = qs.code.float()
    byte_values = torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1)  # byte -> (high, low)
    values = byte_values[data[: (n + 1) // 2].long()].reshape(-1)
    if qs.nested:
        qabsmax = qs.absmax.reshape(-1).to(torch.int64)
        nested_block = torch.arange(qabsmax.numel(), device=qabsmax.device) // qs.state2.blocksize
        absmax = qs.state2.code.float()[qabsmax] * qs.state2.absmax.float()[nested_block]
        absmax = absmax + qs.offset.float()
    else:
        absmax = qs.absmax.reshape(-1).float()
    n_blocks = triton.cdiv(n, qs.blocksize)
    if values.numel() != n_blocks * qs.blocksize:  # the last block is partial
        values = torch.nn.functional.pad(values[:n], (0, n_blocks * qs.blocksize - n))
    values = values.view(n_blocks, qs.blocksize) * absmax[:n_blocks, None]
    return values.reshape(-1)[:n].to(qs.dtype).reshape(qs.shape)
