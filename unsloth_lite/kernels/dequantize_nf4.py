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

Parts of a 2-D weight `[V, H]`, never the whole dense matrix:

* `dequantize_nf4_row_range`: rows [r0, r1) into a given buffer (the NF4 lm_head's vocabulary blocks). When H
  is a multiple of B, those rows are the whole quantization blocks [r0·H/B, r1·H/B) and their bytes
  [r0·H/2, r1·H/2): the kernel above, started at block r0·H/B (nested absmax blocks indexed globally).
* `dequantize_nf4(out=...)` into a row-strided view (rows of whole blocks): the rows of a wider matrix whose last
  columns hold something else (`lora.py`'s adapters beside the weight).
* `dequantize_nf4_rows`: a gather of arbitrary rows (an embedding lookup). Element e = row·H + c is decoded
  on its own from byte e // 2 (high nibble when e is even) and absmax[e // B], so any H works.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from unsloth_lite.kernels.nf4_codes import LOOKUPS, _nf4_codes, code_pairs
from unsloth_lite.kernels.utils import INTERPRET, check_integer, check_kernel_device, empty

# Output elements per program; a program covers max(1, TILE_ELEMENTS // blocksize) quantization blocks.
TILE_ELEMENTS = 4096
# How `dequantize_nf4`'s kernel maps codes to values (`nf4_codes._nf4_codes`): "code_book" (a load a weight from
# the 16 fp32 codes, one cache line) or "pairs" (a load a byte from the 256-entry table of value pairs).
LOOKUP = "code_book"
# 16-bit outputs written as one 32-bit word per packed byte (`_dequantize_nf4`'s PAIRED) rather than interleaved.
PAIRED_STORE = True
# Columns of a row-gather program's tile (its rows fill the rest of TILE_ELEMENTS).
GATHER_BLOCK_COLS = 1024

BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _fp32_to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even, in integer ops: what bitsandbytes' CPU `float_to_bf16`, CUDA's
    `__float2bfloat16` and torch's `.to(torch.bfloat16)` do for finite values. Written when Triton's interpreter
    truncated `.to(tl.bfloat16)` (`kernels/interpreter.py` now rounds it to nearest even as well); kept in the
    kernels measured with it."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _block_absmax(
    absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize, blocks, mask, NESTED: tl.constexpr,
):
    """fp32 absmax of quantization blocks `blocks` (any shape), the nested 8-bit form dequantized first."""
    if NESTED:
        qabsmax = tl.load(absmax_ptr + blocks, mask=mask, other=0).to(tl.int32)
        nested_scale = tl.load(nested_absmax_ptr + blocks // nested_blocksize, mask=mask, other=0.0)
        absmax = tl.load(nested_code_ptr + qabsmax).to(tl.float32) * nested_scale.to(tl.float32)
        return absmax + tl.load(offset_ptr).to(tl.float32)
    return tl.load(absmax_ptr + blocks, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _to_output_dtype(values, out_ptr):
    if out_ptr.dtype.element_ty == tl.bfloat16:
        return _fp32_to_bf16_rne(values)
    return values.to(out_ptr.dtype.element_ty)


@triton.jit
def _output_pairs(even, odd, out_ptr, CONVERT: tl.constexpr):
    """32-bit words of two 16-bit values each, `even` in the low half, rounded to `out_ptr`'s dtype. CONVERT
    (compiled only): one `cvt.rn` a pair, round to nearest even as `_fp32_to_bf16_rne`, instead of its integer
    rounding (inline PTX: not in the interpreter)."""
    if CONVERT:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd],
                                             dtype=tl.uint32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    even_bits = _to_output_dtype(even, out_ptr).to(tl.uint16, bitcast=True).to(tl.uint32)
    odd_bits = _to_output_dtype(odd, out_ptr).to(tl.uint16, bitcast=True).to(tl.uint32)
    return even_bits | (odd_bits << 16)


def _dequantize_nf4(
    packed_ptr, absmax_ptr, code_ptr,
    nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize: tl.constexpr,
    out_ptr,
    n_elements, n_bytes, n_blocks, first_block, row_blocks, row_gap,
    HALF_BLOCK: tl.constexpr, ROWS: tl.constexpr, NESTED: tl.constexpr, LOOKUP: tl.constexpr, PAIRED: tl.constexpr,
    CONVERT: tl.constexpr, GAPS: tl.constexpr = False,
):
    """LOOKUP: how codes become values (the index of `nf4_codes.LOOKUPS`: pairs or code book). PAIRED
    (16-bit outputs, an even element count): each byte's two weights are stored as one 32-bit word, so the tile
    is written in the packed bytes' own layout, with no interleaving of the two nibbles' values. GAPS: the
    output's rows (of `row_blocks` whole blocks each) lie `row_gap` elements (an even count) apart beyond their
    length: a row-strided view."""
    # Quantization blocks of this program, counted from `first_block` (0 for the whole weight; a range of
    # whole blocks writes its first block at out_ptr). n_elements, n_bytes and n_blocks end the range.
    local_blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blocks = first_block + local_blocks
    absmax = _block_absmax(
        absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize, blocks, blocks < n_blocks, NESTED
    )

    byte = blocks[:, None] * HALF_BLOCK + tl.arange(0, HALF_BLOCK)[None, :]
    packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0)
    high, low = _nf4_codes(packed, code_ptr, LOOKUP, False)
    high = high * absmax[:, None]
    low = low * absmax[:, None]
    gap = tl.zeros_like(local_blocks)
    if GAPS:
        gap = (local_blocks // row_blocks) * row_gap
    if PAIRED:  # one 32-bit word a byte: element 2i (high nibble) in its low half, as little-endian memory holds it
        word = _output_pairs(high, low, out_ptr, CONVERT)
        local_byte = (local_blocks * HALF_BLOCK + gap // 2)[:, None] + tl.arange(0, HALF_BLOCK)[None, :]
        tl.store(out_ptr.to(tl.pointer_type(tl.uint32)) + local_byte, word, mask=byte < n_bytes)
        return
    values = tl.interleave(high, low)  # [ROWS, 2 * HALF_BLOCK]: element 2i from byte i's high nibble
    values = _to_output_dtype(values, out_ptr)

    in_block = tl.arange(0, 2 * HALF_BLOCK)[None, :]
    element = blocks[:, None] * (2 * HALF_BLOCK) + in_block
    local_element = (local_blocks * (2 * HALF_BLOCK) + gap)[:, None] + in_block
    tl.store(out_ptr + local_element, values, mask=element < n_elements)


@triton.jit
def _gather_nf4_rows_kernel(
    row_ids_ptr, packed_ptr, absmax_ptr, code_ptr,
    nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize,
    out_ptr, n_ids, n_rows, n_cols,
    BLOCKSIZE: tl.constexpr, BLOCK_IDS: tl.constexpr, BLOCK_COLS: tl.constexpr, NESTED: tl.constexpr,
):
    """Program (block of ids, block of columns): out[i, c] = W[row_ids[i], c]. Each element is decoded from
    its own nibble and its quantization block's absmax, so rows need not hold whole blocks. Ids outside
    [0, n_rows) give zero rows instead of reading out of bounds."""
    ids = tl.program_id(0).to(tl.int64) * BLOCK_IDS + tl.arange(0, BLOCK_IDS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    rows = tl.load(row_ids_ptr + ids, mask=ids < n_ids, other=0).to(tl.int64)
    mask_rows = (ids < n_ids) & (rows >= 0) & (rows < n_rows)
    mask = mask_rows[:, None] & (cols < n_cols)[None, :]
    element = rows[:, None] * n_cols + cols[None, :]
    packed = tl.load(packed_ptr + element // 2, mask=mask, other=0).to(tl.int32)
    nibble = tl.where(element % 2 == 0, packed >> 4, packed & 0xF)
    absmax = _block_absmax(
        absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, nested_blocksize, element // BLOCKSIZE, mask,
        NESTED,
    )
    values = _to_output_dtype(tl.where(mask, tl.load(code_ptr + nibble) * absmax, 0.0), out_ptr)
    out = ids[:, None] * n_cols + cols[None, :]
    tl.store(out_ptr + out, values, mask=(ids < n_ids)[:, None] & (cols < n_cols)[None, :])


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


def _check_out(out, shape, dtype: torch.dtype, device: torch.device, half_block: int | None = None) -> int:
    """Checks `out`; returns its rows' gap, the elements between one row's end and the next row's start: 0 for
    a contiguous `out`. A row-strided 2-D `out` is taken (`half_block` given) where rows are whole quantization
    blocks and the gap is even (16-bit outputs keep the bytes' word layout)."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)} but quant_state.shape is {tuple(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype} but quant_state.dtype is {dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but weight is on {device}")
    if out.is_contiguous():
        return 0
    if half_block is not None and out.dim() == 2 and out.stride(1) == 1 and out.stride(0) > out.shape[1]:
        gap = out.stride(0) - out.shape[1]
        if out.shape[1] % (2 * half_block) == 0 and gap % 2 == 0:
            return gap
    raise ValueError(f"out must be contiguous, or rows of whole blocks an even count apart; got strides {out.stride()}")


@dataclasses.dataclass
class _Launch:
    """The checked arguments of one weight's dequantization, kept while its storage stays the same."""

    key: tuple
    shape: torch.Size
    dtype: torch.dtype
    n_elements: int
    grid: tuple
    inputs: tuple  # the kernels' arguments before `out`, with the fp32 code book
    dequantize_inputs: tuple  # ... with the code table of the dequantisation kernel's LOOKUP
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
    table = code_pairs(code) if LOOKUP == "pairs" else code  # what the dequantisation kernel reads codes from
    if qs.nested:
        nested = (qs.state2.code.to(torch.float32), qs.state2.absmax, qs.offset.reshape(1), qs.state2.blocksize)
    else:
        nested = (code, qs.absmax, code, 1)  # unused
    n_bytes = (n_elements + 1) // 2
    launch = _Launch(
        key=key, shape=shape, dtype=qs.dtype, n_elements=n_elements, grid=(triton.cdiv(n_blocks, rows),),
        inputs=(packed, qs.absmax, code, *nested), sizes=(n_elements, n_bytes, n_blocks),
        dequantize_inputs=(packed, qs.absmax, table, *nested),
        meta=dict(
            HALF_BLOCK=blocksize // 2, ROWS=rows, NESTED=bool(qs.nested), num_warps=4, enable_fp_fusion=False,
            LOOKUP=LOOKUPS.index(LOOKUP),
            PAIRED=PAIRED_STORE and qs.dtype != torch.float32 and n_elements % 2 == 0, CONVERT=not INTERPRET,
        ),
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
    row_gap = _check_out(out, launch.shape, launch.dtype, device, launch.meta["HALF_BLOCK"])
    if launch.n_elements:
        row_blocks = launch.shape[-1] // (2 * launch.meta["HALF_BLOCK"]) if row_gap else 1
        launch.kernel[launch.grid](*launch.dequantize_inputs, out, *launch.sizes, 0, row_blocks, row_gap,
                                   GAPS=bool(row_gap), **launch.meta)
    return out


def _matrix_shape(launch: _Launch, what: str) -> tuple[int, int]:
    if len(launch.shape) != 2:
        raise ValueError(f"{what} needs a 2-D weight [rows, cols]; quant_state.shape is {tuple(launch.shape)}")
    return int(launch.shape[0]), int(launch.shape[1])


def dequantize_nf4_row_range(weight, first_row: int, out: torch.Tensor, quant_state=None) -> torch.Tensor:
    """Rows [first_row, first_row + len(out)) of a 2-D NF4 weight `[V, H]`, dense, written into `out`
    (`[rows, H]`, contiguous, of `quant_state.dtype`): bit-identical to `dequantize_nf4(weight)[first_row:...]`
    without touching the other rows. H must be a multiple of the blocksize, so that the rows are a run of whole
    quantization blocks (the same kernel as `dequantize_nf4`, started at the range's first block)."""
    launch = _launch(weight, quant_state)
    n_rows, n_cols = _matrix_shape(launch, "dequantize_nf4_row_range")
    blocksize = 2 * launch.meta["HALF_BLOCK"]
    if n_cols % blocksize:
        raise ValueError(f"rows of {n_cols} elements are not whole quantization blocks of {blocksize}")
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError("out must be a 2-D tensor [rows, H]")
    count = out.shape[0]
    if not 0 <= first_row <= first_row + count <= n_rows:
        raise ValueError(f"rows [{first_row}, {first_row + count}) are not within the weight's {n_rows} rows")
    _check_out(out, (count, n_cols), launch.dtype, launch.inputs[0].device)
    blocks_per_row = n_cols // blocksize
    first_block, end_block = first_row * blocks_per_row, (first_row + count) * blocks_per_row
    if end_block > first_block:
        end_element = end_block * blocksize
        grid = (triton.cdiv(end_block - first_block, launch.meta["ROWS"]),)
        launch.kernel[grid](*launch.dequantize_inputs, out, end_element, end_element // 2, end_block, first_block,
                            1, 0, **launch.meta)
    return out


def dequantize_nf4_rows(weight, row_ids: torch.Tensor, quant_state=None, out: torch.Tensor | None = None):
    """The rows `row_ids` (an integer tensor of any shape) of a 2-D NF4 weight `[V, H]`, dense: a tensor of
    `row_ids.shape + (H,)`, bit-identical to `dequantize_nf4(weight)[row_ids]`, the other rows never decoded
    (an embedding lookup). Any H. Ids outside [0, V) give zero rows (not checked: no host synchronisation)."""
    launch = _launch(weight, quant_state)
    n_rows, n_cols = _matrix_shape(launch, "dequantize_nf4_rows")
    device = launch.inputs[0].device
    check_integer("row_ids", row_ids)
    if row_ids.device != device:
        raise ValueError(f"row_ids is on {row_ids.device} but weight is on {device}")
    ids = row_ids.reshape(-1).contiguous()
    shape = (*row_ids.shape, n_cols)
    if out is None:
        out = empty(shape, launch.dtype, device)
    else:
        _check_out(out, shape, launch.dtype, device)
    if ids.numel() and n_cols:
        block_cols = min(triton.next_power_of_2(n_cols), GATHER_BLOCK_COLS)
        block_ids = max(1, TILE_ELEMENTS // block_cols)
        grid = (triton.cdiv(ids.numel(), block_ids), triton.cdiv(n_cols, block_cols))
        _gather_nf4_rows_kernel[grid](
            ids, *launch.inputs, out, ids.numel(), n_rows, n_cols,
            BLOCKSIZE=2 * launch.meta["HALF_BLOCK"], BLOCK_IDS=block_ids, BLOCK_COLS=block_cols,
            NESTED=launch.meta["NESTED"], num_warps=4, enable_fp_fusion=False,
        )
    return out


def _absmax_reference(qs, blocks: torch.Tensor) -> torch.Tensor:
    """fp32 absmax of quantization blocks `blocks`, as `_block_absmax`."""
    if qs.nested:
        qabsmax = qs.absmax.reshape(-1)[blocks].to(torch.int64)
        absmax = qs.state2.code.float()[qabsmax] * qs.state2.absmax.float()[blocks // qs.state2.blocksize]
        return absmax + qs.offset.float()
    return qs.absmax.reshape(-1).float()[blocks]


def dequantize_nf4_rows_reference(packed: torch.Tensor, quant_state, row_ids: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `dequantize_nf4_rows(packed, row_ids, quant_state)`: only the rows asked for are decoded
    (ids must lie in [0, V))."""
    qs = quant_state
    n_cols = int(qs.shape[-1])
    data = packed.detach().contiguous().reshape(-1)
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    element = row_ids.reshape(-1, 1).to(torch.int64) * n_cols + torch.arange(n_cols, device=data.device)
    byte = data[element // 2].to(torch.int64)
    nibble = torch.where(element % 2 == 0, byte >> 4, byte & 0xF)
    values = qs.code.float()[nibble] * _absmax_reference(qs, element // qs.blocksize)
    return values.to(qs.dtype).reshape(*row_ids.shape, n_cols)


def block_absmax(quant_state) -> torch.Tensor:
    """fp32 absmax of every quantisation block, a double-quantised one dequantised as bitsandbytes does:
    code₂[q] · absmax₂[block // blocksize₂] + offset."""
    qs = quant_state
    if not qs.nested:
        return qs.absmax.reshape(-1).float()
    qabsmax = qs.absmax.reshape(-1).to(torch.int64)
    nested_block = torch.arange(qabsmax.numel(), device=qabsmax.device) // qs.state2.blocksize
    absmax = qs.state2.code.float()[qabsmax] * qs.state2.absmax.float()[nested_block]
    return absmax + qs.offset.float()


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
    absmax = block_absmax(qs)
    n_blocks = triton.cdiv(n, qs.blocksize)
    if values.numel() != n_blocks * qs.blocksize:  # the last block is partial
        values = torch.nn.functional.pad(values[:n], (0, n_blocks * qs.blocksize - n))
    values = values.view(n_blocks, qs.blocksize) * absmax[:n_blocks, None]
    return values.reshape(-1)[:n].to(qs.dtype).reshape(qs.shape)
