"""The interpreter's speed-ups (`unsloth_lite/kernels/interpreter.py`): same results, one swap of the language's
builtins a launch however many device functions the kernel calls."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import INTERPRET

from unsloth_lite.kernels.interpreter import speed_up_interpreter

pytestmark = pytest.mark.skipif(not INTERPRET, reason="tests Triton's interpreter (TRITON_INTERPRET=1)")


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _four_device_calls_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    for step in range(4):
        x = _scaled(x, step + 2.0)
    tl.store(out_ptr + offsets, x.to(tl.float32))


@triton.jit
def _no_device_call_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * 120.0)


def _builtin_swaps(monkeypatch, kernel, x):
    from triton.runtime import interpreter

    swaps = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: swaps.append(1) or patch_builtin(*args))
    out = torch.full_like(x, float("nan"))
    kernel[(x.numel() // 16,)](x, out, BLOCK=16)
    monkeypatch.undo()
    return out, len(swaps)


def test_device_calls_reuse_the_launch_swap(monkeypatch):
    assert speed_up_interpreter()
    x = torch.randn(64)
    out, swaps = _builtin_swaps(monkeypatch, _four_device_calls_kernel, x)
    torch.testing.assert_close(out, x * 120.0, rtol=1e-6, atol=0)  # 2 * 3 * 4 * 5
    plain, plain_swaps = _builtin_swaps(monkeypatch, _no_device_call_kernel, x)
    torch.testing.assert_close(plain, x * 120.0, rtol=1e-6, atol=0)
    assert swaps == plain_swaps > 0  # without the speed-up: 16 device calls' swaps more


def test_float_dtypes_keep_their_numpy_storage():
    """The cached lookup returns what Triton's table gives: bf16 stored as uint16, blocks as their elements."""
    from triton.runtime import interpreter

    assert speed_up_interpreter()
    assert interpreter._get_np_dtype(tl.bfloat16).name == "uint16"
    assert interpreter._get_np_dtype(tl.block_type(tl.float32, [4, 8])).name == "float32"
    assert interpreter._get_np_dtype(tl.block_type(tl.float16, [4, 8])).name == "float16"
    assert interpreter._get_np_dtype(tl.pointer_type(tl.float32)).name == "uint64"


@triton.jit
def _to_bf16_kernel(x_ptr, out_ptr, scalar_index, scalar_out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets).to(tl.bfloat16))
    tl.store(scalar_out_ptr, tl.load(x_ptr + scalar_index).to(tl.bfloat16))


def test_fp32_to_bf16_casts_round_to_nearest_even():
    """As compiled kernels and torch round: ties to even, NaN and infinity kept, a value past bf16's largest to
    infinity; a scalar as a block (the interpreter truncated them all)."""
    assert speed_up_interpreter()
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # half-way: to the even neighbour
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 0.0, -0.0, 1e-40])
    x = torch.cat([torch.randn(54), ties, special])
    out = torch.empty(64, dtype=torch.bfloat16)
    scalar_out = torch.empty(1, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](x, out, 55, scalar_out, BLOCK=64)
    expected = x.bfloat16()
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(out), nan) and torch.equal(out[~nan], expected[~nan])
    assert torch.equal(scalar_out[0], expected[55]) and expected[55].item() == 1 + 4 * 2**-8
