"""`dequantize_nf4` against bitsandbytes' own `dequantize_4bit`: bit-identical, nested absmax or not."""

import importlib
import warnings

import pytest
import torch
from helpers import dtype_id
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth_lite.kernels import dequantize_nf4
from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference, dequantize_nf4_row_range

dequantize_module = importlib.import_module("unsloth_lite.kernels.dequantize_nf4")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import bitsandbytes as bnb
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.functional import QuantState

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (47, 64) and (1, 64) with blocksize 128: rows shorter than a block; (33, 130), (129, 257), (3, 5), (2, 3, 66):
# element counts that are not a multiple of the blocksize (bitsandbytes pads the last block); 257, 5: odd counts.
SHAPES = [(47, 64), (33, 130), (1, 64), (129, 257), (64, 256), (3, 5), (2, 3, 66)]


def quantize(shape, dtype, nested, blocksize, device, quant_storage=torch.uint8):
    """A bitsandbytes NF4 `Params4bit` of a random weight (quantized on `.to(device)`, as `Linear4bit` does)."""
    w = 3 * torch.randn(shape, dtype=dtype)
    p = bnb.nn.Params4bit(
        w,
        requires_grad=False,
        quant_type="nf4",
        compress_statistics=nested,
        blocksize=blocksize,
        quant_storage=quant_storage,
    )
    p = p.to(device)
    assert p.bnb_quantized and p.quant_state.nested == nested and p.quant_state.dtype == dtype
    return p


def bnb_dequantize(packed, qs):
    """bitsandbytes' `dequantize_4bit(packed, qs)`, except where bitsandbytes 0.50.2's CPU kernel is wrong.

    Its AVX-512 CPU kernel (csrc/cpu_ops.cpp `dequantizeBlockwise4bitCpu`, taken when the last dim is a multiple
    of 16) reads absmax[row * (cols // blocksize) + col // blocksize], which is only right when each row holds
    whole blocks. There, use bitsandbytes' pure-PyTorch backend (`backends/default/ops.py`), which indexes the
    flat blocks that `quantize_4bit`, the CUDA kernel and the scalar C++ fallback use.
    """
    shape = tuple(qs.shape)
    if packed.device.type == "cpu" and shape[-1] % 16 == 0 and shape[-1] % qs.blocksize != 0:
        absmax = qs.absmax
        if qs.nested:
            absmax = bnb.functional.dequantize_blockwise(qs.absmax, qs.state2)
            absmax += qs.offset
        compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)  # skip torch.compile
        return compute(packed.reshape(-1).view(torch.uint8), absmax, qs.code, qs.blocksize, shape, qs.dtype)
    # reshape: for 1-D shapes bitsandbytes' CPU op returns (1, n)
    return bnb.functional.dequantize_4bit(packed, qs).reshape(shape)


def assert_bit_identical(actual, expected, name="output"):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert not torch.isnan(actual).any(), f"{name}: {int(torch.isnan(actual).sum())} NaN (unwritten) elements"
    if not torch.equal(actual, expected):
        diff = actual != expected
        first = diff.nonzero()[:5].tolist()
        raise AssertionError(f"{name}: {int(diff.sum())} of {actual.numel()} elements differ, first at {first}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dequantize_nf4_matches_bitsandbytes(dtype, nested, blocksize, shape, device):
    p = quantize(shape, dtype, nested, blocksize, device)
    expected = bnb_dequantize(p.data, p.quant_state)
    assert_bit_identical(dequantize_nf4(p), expected)
    assert_bit_identical(dequantize_nf4_reference(p.data, p.quant_state), expected, "reference")


@pytest.mark.parametrize("blocksize", [32, 256, 1024, 4096])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_dequantize_nf4_other_blocksizes(nested, blocksize, device):
    p = quantize((37, 130), torch.bfloat16, nested, blocksize, device)
    assert_bit_identical(dequantize_nf4(p), bnb_dequantize(p.data, p.quant_state))


# Element counts of each residue mod 32 that matters (0, 16, 8, odd): Triton specialises the kernel's sizes on
# divisibility by 16, so each compiles its own kernel; Triton 3.6 miscompiled n ≡ 16 (mod 32) at blocksize 256
# with 16-bit outputs (see `_dequantize_nf4_kernel_n_unspecialised`).
@pytest.mark.parametrize("shape", [(32, 43), (16, 43), (8, 43), (5, 43)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("blocksize", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dequantize_nf4_size_specialisations(dtype, blocksize, shape, device):
    p = quantize(shape, dtype, False, blocksize, device)
    assert_bit_identical(dequantize_nf4(p), bnb_dequantize(p.data, p.quant_state))


def test_dequantize_nf4_many_nested_blocks(device):
    """More than 256 absmax values: several blocks of the nested (8-bit) absmax quantization."""
    p = quantize((300, 130), torch.bfloat16, True, 64, device)
    assert p.quant_state.absmax.numel() > 2 * p.quant_state.state2.blocksize
    assert_bit_identical(dequantize_nf4(p), bnb_dequantize(p.data, p.quant_state))


def test_dequantize_nf4_bitsandbytes_cpu_kernel_row_bug(device):
    """The shapes `bnb_dequantize` routes to bitsandbytes' PyTorch backend: ours matches it (see its docstring)."""
    p = quantize((47, 64), torch.float32, False, 128, device)
    qs = p.quant_state
    expected = _dequantize_4bit_compute.__wrapped__(p.data.reshape(-1), qs.absmax, qs.code, 128, qs.shape, qs.dtype)
    assert_bit_identical(dequantize_nf4(p), expected)


@settings(max_examples=10, deadline=None)
@given(
    shape=st.lists(st.integers(1, 150), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    nested=st.booleans(),
    blocksize=st.sampled_from([32, 64, 128, 256]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_nf4_hypothesis(shape, dtype, nested, blocksize, seed, device):
    torch.manual_seed(seed)
    if torch.Size(shape).numel() < 3:
        shape = [*shape[:-1], shape[-1] + 2]  # bnb's dequantize_4bit transposes outputs of packed shape [1, 1]
    p = quantize(tuple(shape), dtype, nested, blocksize, device)
    expected = bnb_dequantize(p.data, p.quant_state)
    assert_bit_identical(dequantize_nf4(p), expected)
    assert_bit_identical(dequantize_nf4_reference(p.data, p.quant_state), expected, "reference")


def test_dequantize_nf4_params_and_raw_pair_agree(device):
    p = quantize((33, 130), torch.bfloat16, True, 64, device)
    from_params = dequantize_nf4(p)
    from_pair = dequantize_nf4(p.data, p.quant_state)
    w = 3 * torch.randn(33, 130, dtype=torch.bfloat16, device=device)
    packed, qs = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert_bit_identical(from_pair, from_params)
    assert_bit_identical(dequantize_nf4(packed, qs), bnb_dequantize(packed, qs), "functional quantize_4bit pair")


def test_dequantize_nf4_state_dict_round_trip(device):
    """A QuantState rebuilt from a (safetensors-style) state dict, as when loading a pre-quantized checkpoint."""
    p = quantize((33, 130), torch.bfloat16, True, 64, device)
    qs = QuantState.from_dict(p.quant_state.as_dict(packed=True), device=torch.device(device))
    assert_bit_identical(dequantize_nf4(p.data, qs), bnb_dequantize(p.data, p.quant_state))


def test_dequantize_nf4_non_uint8_quant_storage(device):
    p = quantize((32, 128), torch.bfloat16, True, 64, device, quant_storage=torch.bfloat16)
    assert p.data.dtype == torch.bfloat16
    assert_bit_identical(dequantize_nf4(p), bnb_dequantize(p.data, p.quant_state))


def test_dequantize_nf4_out(device):
    p = quantize((33, 130), torch.bfloat16, True, 64, device)
    q = quantize((33, 130), torch.bfloat16, False, 64, device)
    out = torch.full((33, 130), float("nan"), dtype=torch.bfloat16, device=device)
    result = dequantize_nf4(p, out=out)
    assert result is out
    assert_bit_identical(out, bnb_dequantize(p.data, p.quant_state))
    assert dequantize_nf4(q.data, q.quant_state, out=out) is out  # one buffer reused across layers
    assert_bit_identical(out, bnb_dequantize(q.data, q.quant_state))


def test_dequantize_nf4_follows_changed_storage(device):
    """Checked launch arguments are kept per QuantState: new packed bytes or absmax under the same state (or
    a state changed in place) must be read again, not served from the kept arguments."""
    p = quantize((33, 130), torch.bfloat16, True, 64, device)
    qs = p.quant_state
    assert_bit_identical(dequantize_nf4(p.data, qs), bnb_dequantize(p.data, qs))
    other = quantize((33, 130), torch.bfloat16, True, 64, device)
    assert_bit_identical(dequantize_nf4(other.data, qs), bnb_dequantize(other.data, qs), "other bytes")
    qs.absmax = other.quant_state.absmax.clone()
    assert_bit_identical(dequantize_nf4(p.data, qs), bnb_dequantize(p.data, qs), "other absmax")
    qs.quant_type = "fp4"
    with pytest.raises(ValueError, match="quant_type is 'fp4'"):
        dequantize_nf4(p.data, qs)


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def test_dequantize_nf4_rejects_fp4(device):
    w = torch.randn(16, 64, device=device)
    p = bnb.nn.Params4bit(w, requires_grad=False, quant_type="fp4", blocksize=64).to(device)
    with pytest.raises(ValueError, match=r"^quant_state.quant_type is 'fp4'"):
        dequantize_nf4(p)


def test_dequantize_nf4_missing_quant_state(device):
    packed = torch.zeros(512, 1, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"^quant_state is missing"):
        dequantize_nf4(packed)
    with pytest.raises(ValueError, match=r"^quant_state must be a bitsandbytes QuantState"):
        dequantize_nf4(packed, object())


def _into_rows_with_gaps(p, dtype, gap, device):
    """`dequantize_nf4` into a row-strided view of a NaN-filled `[rows, cols + gap]` buffer: the buffer."""
    rows, cols = p.quant_state.shape
    wide = torch.full((rows, cols + gap), float("nan"), dtype=dtype, device=device)
    assert dequantize_nf4(p, out=wide[:, :cols]).data_ptr() == wide.data_ptr()
    return wide


def _assert_rows_with_gaps(wide, p, gap):
    cols = p.quant_state.shape[1]
    assert_bit_identical(wide[:, :cols], bnb_dequantize(p.data, p.quant_state), "rows")
    assert bool(wide[:, cols:].isnan().all()), "the gaps between rows were written"


@pytest.mark.parametrize("gap", [2, 16, 48])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dequantize_nf4_into_rows_with_gaps(dtype, gap, device):
    """A row-strided `out` (rows of whole blocks, an even gap): each row where it belongs, the gaps untouched."""
    p = quantize((37, 192), dtype, True, 64, device)
    _assert_rows_with_gaps(_into_rows_with_gaps(p, dtype, gap, device), p, gap)


def test_dequantize_nf4_bad_out(device):
    p = quantize((16, 64), torch.bfloat16, False, 64, device)
    with pytest.raises(ValueError, match=r"^out has shape \(64, 16\) but quant_state.shape is \(16, 64\)"):
        dequantize_nf4(p, out=torch.empty(64, 16, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match=r"^out has dtype torch.float16 but quant_state.dtype is torch.bfloat16"):
        dequantize_nf4(p, out=torch.empty(16, 64, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match=r"^out is on meta"):
        dequantize_nf4(p, out=torch.empty(16, 64, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match=r"^out must be contiguous"):
        dequantize_nf4(p, out=torch.empty(64, 16, dtype=torch.bfloat16, device=device).t())
    with pytest.raises(ValueError, match=r"^out must be contiguous, or rows of whole blocks an even count apart"):
        dequantize_nf4(p, out=torch.empty(16, 67, dtype=torch.bfloat16, device=device)[:, :64])  # odd gap
    q = quantize((16, 96), torch.bfloat16, False, 64, device)
    with pytest.raises(ValueError, match=r"^out must be contiguous, or rows of whole blocks"):
        dequantize_nf4(q, out=torch.empty(16, 98, dtype=torch.bfloat16, device=device)[:, :96])  # partial blocks
    with pytest.raises(ValueError, match=r"^out must be a torch.Tensor"):
        dequantize_nf4(p, out="buffer")


def test_dequantize_nf4_too_few_packed_bytes(device):
    p = quantize((16, 64), torch.bfloat16, False, 64, device)
    with pytest.raises(ValueError, match=r"^weight holds 256 packed bytes"):
        dequantize_nf4(p.data[:256], p.quant_state)


# ----------------------------------------------------------------------------------------------------------
# CUDA, compiled Triton


# The kernel's settings: each byte's two weights stored as one word or interleaved; codes from the 16 fp32 codes
# or from the 256-entry table of pairs (one load a byte)
SETTINGS = [dict(PAIRED_STORE=True), dict(PAIRED_STORE=False), dict(PAIRED_STORE=True, LOOKUP="pairs")]


@pytest.fixture(params=SETTINGS, ids=["paired", "interleaved", "paired-pairs"])
def settings(request, monkeypatch):
    for name, value in request.param.items():
        monkeypatch.setattr(dequantize_module, name, value)
    dequantize_module._LAUNCHES.clear()
    yield request.param
    dequantize_module._LAUNCHES.clear()


@pytest.mark.parametrize("shape", [(33, 130), (129, 257), (64, 256), (2, 3, 66)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dequantize_nf4_settings(settings, dtype, shape, device):
    """Every setting of the kernel, bit-identical to bitsandbytes (odd and partial-block sizes included), whole
    and by row range."""
    p = quantize(shape, dtype, True, 64, device)
    assert_bit_identical(dequantize_nf4(p), bnb_dequantize(p.data, p.quant_state))
    if len(shape) == 2 and shape[1] % 64 == 0:
        out = torch.full((shape[0] - 1, shape[1]), float("nan"), dtype=dtype, device=device)
        dequantize_nf4_row_range(p, 1, out)
        assert_bit_identical(out, bnb_dequantize(p.data, p.quant_state)[1:], "rows 1:")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(17408, 5120), (48, 5120), (4096, 12288), (129, 257)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_dequantize_nf4_settings_cuda(settings, dtype, shape):
    """Every setting compiled, at the Qwen3.5-27B's largest and smallest projections, the Qwen3-8B's and an odd
    size, against bitsandbytes' CUDA kernel."""
    p = quantize(shape, dtype, True, 64, "cuda")
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    expected = bnb.functional.dequantize_4bit(p.data, p.quant_state)
    assert_bit_identical(dequantize_nf4(p.data, p.quant_state, out=out), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, gap", [((17408, 5120), 32), ((10240, 5120), 64), ((4096, 4096), 16)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_dequantize_nf4_into_rows_with_gaps_cuda(settings, shape, gap):
    """Compiled, every setting, at the projections whose adapters sit beside the weight (`lora.py`)."""
    p = quantize(shape, torch.bfloat16, True, 64, "cuda")
    _assert_rows_with_gaps(_into_rows_with_gaps(p, torch.bfloat16, gap, "cuda"), p, gap)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,nested",
    [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True), (torch.float32, True)],
    ids=["bf16-nested", "bf16-flat", "fp16-nested", "fp32-nested"],
)
def test_dequantize_nf4_cuda_qwen3_8b_matrix(dtype, nested):
    """A Qwen3-8B MLP projection (4096 x 12288) against bitsandbytes' CUDA kernel, into a reused buffer too."""
    p = quantize((4096, 12288), dtype, nested, 64, "cuda")
    expected = bnb.functional.dequantize_4bit(p.data, p.quant_state)
    assert_bit_identical(dequantize_nf4(p), expected)
    out = torch.full_like(expected, float("nan"))
    assert dequantize_nf4(p.data, p.quant_state, out=out) is out
    assert_bit_identical(out, expected)
    assert_bit_identical(dequantize_nf4_reference(p.data, p.quant_state), expected, "reference")
