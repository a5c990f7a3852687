"""`nf4_matvec` (decoding's 4-bit projection, LoRA unmerged) against the product with the dequantised weight,
in float64: odd shapes (rows that split a quantisation block, odd element counts), 1 to 8 rows, bias, adapter."""

import itertools

import pytest
import torch
from helpers import TOLERANCE, assert_close, assert_counters_settled, dtype_id
from test_dequantize_nf4 import quantize

from unsloth_lite.kernels import lora_down as lora_down_module
from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels import nf4_matvec_state
from unsloth_lite.kernels import utils as kernel_utils
from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference
from unsloth_lite.kernels.lora_down import lora_down_rows, rms_norm_lora_down_rows
from unsloth_lite.kernels.nf4_matvec import nf4_matvec
from unsloth_lite.kernels.nf4_matvec_reference import nf4_matvec_reference
from unsloth_lite.kernels.rms_norm import rms_norm

# (out, in): 96 and 160 split 64-element blocks across rows; 515 is odd (a byte holds two rows' nibbles): the
# general kernel. 64 and 320 hold whole blocks: the blocked one, whose tiles are part-filled along K here.
SHAPES = [(48, 96), (33, 160), (17, 515), (130, 64), (20, 320)]


@pytest.fixture(autouse=True)
def blocked_kernel(monkeypatch):
    """This file's products take the blocked kernel (and the general one): the word kernel, the default for
    whole-block shapes, has its own tests (`test_nf4_matvec_words.py`)."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", False)


def float64_reference(x, weight, bias, lora_a, lora_b, scale):
    dense = dequantize_nf4_reference(weight.data, weight.quant_state).double()
    y = x.double() @ dense.t()
    if bias is not None:
        y = y + bias.double()
    if lora_a is not None:
        y = y + scale * (x.double() @ lora_a.double().t()) @ lora_b.double().t()
    return y


def make_case(shape, rows, dtype, nested, blocksize, with_bias, rank, device):
    n_out, n_in = shape
    weight = quantize(shape, dtype, nested, blocksize, device)
    x = torch.randn(rows, n_in, dtype=dtype, device=device)
    bias = torch.randn(n_out, dtype=dtype, device=device) if with_bias else None
    lora_a = lora_b = None
    if rank:
        lora_a = 0.3 * torch.randn(rank, n_in, device=device)  # PEFT keeps fp32 adapters
        lora_b = 0.3 * torch.randn(n_out, rank, device=device)
    return x, weight, bias, lora_a, lora_b


def check(shape, rows, dtype, nested, blocksize, with_bias, rank, device):
    x, weight, bias, lora_a, lora_b = make_case(shape, rows, dtype, nested, blocksize, with_bias, rank, device)
    got = nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    expected = float64_reference(x, weight, bias, lora_a, lora_b, 0.5)
    assert_close(got, expected, TOLERANCE[dtype], "y")
    reference = nf4_matvec_reference(x, weight, bias, lora_a, lora_b, scale=0.5)
    assert_close(reference, expected, TOLERANCE[dtype], "reference y")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nf4_matvec_shapes(shape, dtype, device):
    check(shape, rows=3, dtype=dtype, nested=True, blocksize=64, with_bias=True, rank=4, device=device)


def test_nf4_matvec_wider_tiles(device):
    """N >= 2048: compiled, the blocked kernel's programs take 8 features (`blocked_tile`); 2050 part-fills the
    last program."""
    check((2050, 128), 2, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=4, device=device)


@pytest.mark.parametrize("rows", [1, 3])
def test_nf4_matvec_split_along_k(rows, device, monkeypatch):
    """K split over programs, one tile of 2 quantisation blocks each (19 splits, the last part-filled): the last
    program of each feature block sums the splits in order, so two calls give the same bits, and leaves the
    arrival counters at 0 for the next launch."""
    monkeypatch.setattr(nf4_matvec_module, "blocked_tile", lambda *_: (16, 128, 4, True))
    check_split_along_k(rows, device)


def check_split_along_k(rows, device):
    """The product with K split (the tile set by the caller) against float64; two calls give the same bits and
    leave the arrival counters at 0."""
    check((40, 64 * 37), rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=4, device=device)
    x, weight, bias, lora_a, lora_b = make_case((40, 64 * 37), rows, torch.float32, True, 64, True, 4, device)
    first = nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    assert torch.equal(first, nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5))
    assert_counters_settled()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("lookup", nf4_matvec_module.LOOKUPS)
def test_nf4_matvec_lookups(lookup, rows, dtype, device, monkeypatch):
    """Every way of mapping nibbles to code-book values (`LOOKUP`) over several tiles along K, the last
    part-filled; the PTX lookup runs compiled only."""
    if lookup == "registers" and device != "cuda":
        pytest.skip("the PTX lookup runs compiled only")
    monkeypatch.setattr(nf4_matvec_module, "LOOKUP", lookup)
    check((40, 64 * 37), rows, dtype, nested=True, blocksize=64, with_bias=True, rank=4, device=device)


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n_in", [96, 320])
def test_nf4_matvec_rows(rows, n_in, device):
    check((40, n_in), rows, torch.float32, nested=False, blocksize=64, with_bias=False, rank=0, device=device)


@pytest.mark.parametrize("n_in", [200, 384])
def test_nf4_matvec_blocksize_128_leading_dims_and_strided_x(n_in, device):
    weight = quantize((24, n_in), torch.float32, True, 128, device)
    x = torch.randn(2, n_in, 3, dtype=torch.float32, device=device)[..., 1]  # a strided view
    lora_a, lora_b = torch.randn(3, n_in, device=device), torch.randn(24, 3, device=device)
    got = nf4_matvec(x.view(2, 1, n_in), weight, lora_a=lora_a, lora_b=lora_b, scale=2.0)
    assert got.shape == (2, 1, 24)
    assert_close(got.view(2, 24), float64_reference(x, weight, None, lora_a, lora_b, 2.0), 1e-5, "y")


def test_flat_absmax_is_kept_until_the_absmax_changes(device, monkeypatch):
    """The fp32 absmax the kernels read (`FLAT_ABSMAX`) equals the nested form dequantised (bitsandbytes' own
    dequantisation on CUDA), is computed once, again (in place) after the weight's absmax changes, and anew after
    `release_flat_absmax`; the product is the nested kernel's."""
    x, weight, bias, lora_a, lora_b = make_case((40, 64 * 5), 2, torch.float32, True, 64, True, 4, device)
    qs = weight.quant_state
    flat = nf4_matvec_state.flat_absmax(qs)
    if device == "cuda":
        import bitsandbytes.functional as F

        assert torch.equal(flat, (F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).reshape(-1))
    assert flat.dtype == torch.float32 and flat.numel() == 40 * 5
    assert nf4_matvec_state.flat_absmax(qs) is flat
    with_flat = nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    monkeypatch.setattr(nf4_matvec_module, "FLAT_ABSMAX", False)
    assert_close(with_flat, nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5), 1e-6, "y against nested")
    before = flat.clone()
    qs.state2.absmax.mul_(2)
    again = nf4_matvec_state.flat_absmax(qs)
    assert again is flat  # computed again in place: a captured graph reads it by address
    assert_close(again, 2 * before - qs.offset, 1e-6, "absmax after the change")  # the offset comes after the scale
    nf4_matvec_state.release_flat_absmax([qs])
    assert nf4_matvec_state.flat_absmax(qs) is not again


@pytest.mark.parametrize("words", [False, True], ids=["blocked", "words"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,rows,with_bias", [((130, 64), 1, False), ((48, 320), 3, True), ((17, 515), 2, False)],
                         ids=["one_row", "bias", "general_kernel"])
def test_nf4_matvec_adds_the_residual(shape, rows, with_bias, dtype, words, device, monkeypatch):
    """`residual`: y + r before the one rounding, for the blocked, the word and the general kernel."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", words)
    x, weight, bias, lora_a, lora_b = make_case(shape, rows, dtype, True, 64, with_bias, 4, device)
    residual = torch.randn(rows, 1, shape[0], dtype=dtype, device=device)[:, 0]  # a row-strided view
    got = nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5, residual=residual)
    expected = float64_reference(x, weight, bias, lora_a, lora_b, 0.5) + residual.double()
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    assert_close(got, expected, TOLERANCE[dtype], "y + residual")
    reference = nf4_matvec_reference(x, weight, bias, lora_a, lora_b, scale=0.5, residual=residual)
    assert_close(reference, expected, TOLERANCE[dtype], "reference y + residual")
    with pytest.raises(ValueError, match="residual has shape"):
        nf4_matvec(x, weight, bias, residual=residual[:, :-1])


def test_nf4_matvec_refuses_grad_and_too_many_rows(device):
    weight = quantize((8, 64), torch.float32, False, 64, device)
    with pytest.raises(ValueError, match="inference only"):
        nf4_matvec(torch.randn(1, 64, requires_grad=True, device=device), weight)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        nf4_matvec(torch.randn(9, 64, device=device), weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", [*SHAPES, (5120, 5120), (17408, 5120)], ids=str)
def test_nf4_matvec_cuda(shape, rows, dtype):
    check(shape, rows, dtype, nested=True, blocksize=64, with_bias=True, rank=16, device="cuda")



@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", [*SHAPES, (5120, 5120), (17408, 5120)], ids=str)
def test_nf4_matvec_exact_codes_cuda(shape, rows, monkeypatch):
    """`BF16_CODES` off: bf16 weights decoded with the exact fp32 code book (the default rounds it to bf16, which
    `test_nf4_matvec_cuda` covers; its fp32 cases check that fp32 weights keep the exact one)."""
    monkeypatch.setattr(nf4_matvec_module, "BF16_CODES", False)
    check(shape, rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=16, device="cuda")


def test_programmatic_dependent_launch_only_on_hopper_and_later(monkeypatch):
    """`griddepcontrol` exists from compute capability 9.0: older GPUs, the CPU and the interpreter launch the
    blocked kernel as an ordinary launch."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    monkeypatch.setattr(kernel_utils, "_CAPABILITIES", {})
    for major, expected in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _index, major=major: (major, 0))
        kernel_utils._CAPABILITIES.clear()
        assert nf4_matvec_module.uses_pdl(torch.device("cuda", 0)) is expected
    assert not nf4_matvec_module.uses_pdl(torch.device("cpu"))
    monkeypatch.setattr(nf4_matvec_module, "PDL", False)
    assert not nf4_matvec_module.uses_pdl(torch.device("cuda", 0))


def test_small_decoding_kernels_take_programmatic_dependent_launch_where_asked(monkeypatch):
    """`kernels.utils.DECODE_PDL` (on by default): the small decoding kernels' launch options, on Hopper and later
    only."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    monkeypatch.setattr(kernel_utils, "_CAPABILITIES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _index: (9, 0))
    assert kernel_utils.pdl_launch(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}  # the default
    assert kernel_utils.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(kernel_utils, "DECODE_PDL", False)
    assert kernel_utils.pdl_launch(torch.device("cuda", 0)) == {"PDL": False}
    monkeypatch.setattr(kernel_utils, "DECODE_PDL", True)
    kernel_utils._CAPABILITIES.clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _index: (8, 0))
    assert kernel_utils.pdl_launch(torch.device("cuda", 0)) == {"PDL": False}


def test_bf16_code_book_only_for_bf16_weights(monkeypatch):
    """Rounding the code book to bf16 is within a bf16 weight's own rounding, not an fp32 or fp16 weight's (an
    fp32 model's greedy tokens change with it), and only the compiled PTX lookup has it."""
    monkeypatch.setattr(nf4_matvec_module, "LOOKUP", "registers")
    monkeypatch.setattr(nf4_matvec_module, "BF16_CODES", True)
    assert nf4_matvec_module.uses_bf16_codes(torch.bfloat16)
    assert not nf4_matvec_module.uses_bf16_codes(torch.float32)
    assert not nf4_matvec_module.uses_bf16_codes(torch.float16)
    monkeypatch.setattr(nf4_matvec_module, "LOOKUP", "pairs")
    assert not nf4_matvec_module.uses_bf16_codes(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("words", [False, True, "first_products"],
                         ids=["blocked", "words", "words_first_products_in_launch"])
@pytest.mark.parametrize("stages", [1, 3], ids=lambda n: f"{n}stages")
@pytest.mark.parametrize("split", [False, True], ids=["loop", "split"])
def test_nf4_matvec_programmatic_dependent_launch_chain(split, stages, words, monkeypatch):
    """`PDL`: each projection launched while the one before it finishes reads that one's output only after
    waiting for it. A chain of four (y = W4 W3 W2 W1 x, each with bias and adapter, the inputs of one the outputs
    of the one before), eager and replayed as a CUDA graph, against float64; the blocked and the word kernel, the
    latter also with each adapter's first product in its launch (`FIRST_PRODUCTS_IN_LAUNCH`)."""
    monkeypatch.setattr(nf4_matvec_module, "PDL", True)
    monkeypatch.setattr(nf4_matvec_module, "PIPELINE_STAGES", stages)
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", bool(words))
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", words == "first_products")
    if split:
        for tile in ("blocked_tile", "word_tile"):
            monkeypatch.setattr(nf4_matvec_module, tile, lambda *_: (16, 1024, 8, True))
    sizes = [4096, 12288, 4096, 1024, 4096]
    layers = [make_case((n_out, n_in), 1, torch.bfloat16, True, 64, True, 16, "cuda")[1:]
              for n_in, n_out in itertools.pairwise(sizes)]
    x = torch.randn(1, sizes[0], dtype=torch.bfloat16, device="cuda")

    def chain(y):
        for weight, bias, lora_a, lora_b in layers:
            y = nf4_matvec(y, weight, bias, lora_a, lora_b, scale=0.5) / 8  # keeps the values near unit scale
        return y

    expected = x.double()
    for weight, bias, lora_a, lora_b in layers:
        expected = float64_reference(expected.to(torch.bfloat16), weight, bias, lora_a, lora_b, 0.5) / 8
    assert_close(chain(x), expected, 4 * TOLERANCE[torch.bfloat16], "eager y")
    chain(x)  # compiled and warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        assert_close(captured, expected, 4 * TOLERANCE[torch.bfloat16], "replayed y")

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", [(1024, 4096), (5120, 5120), (17408, 5120), (5120, 17408)], ids=str)
@pytest.mark.parametrize("tile", [(8, 512, 4, True), (16, 1024, 8, True), (32, 1024, 8, True), (16, 2048, 8, True)],
                         ids=str)
def test_nf4_matvec_split_along_k_cuda(tile, shape, rows, monkeypatch):
    """K split over programs, compiled, at the W3 models' shapes: from 4 to 32 features a program, 4 and 8 warps,
    1 to 34 splits."""
    monkeypatch.setattr(nf4_matvec_module, "blocked_tile", lambda n_out: tile)
    check(shape, rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", [(40, 64 * 37), (1024, 4096), (17408, 5120), (5120, 17408)], ids=str)
def test_nf4_matvec_pipelined_cuda(shape, rows, dtype, stages, monkeypatch):
    """`PIPELINE_STAGES`: the blocked kernel's loads kept 2 to 4 tiles ahead (asynchronous copies), compiled, at
    the W3 models' shapes and a part-filled last tile."""
    monkeypatch.setattr(nf4_matvec_module, "PIPELINE_STAGES", stages)
    check(shape, rows, dtype, nested=True, blocksize=64, with_bias=True, rank=16, device="cuda")


def test_nf4_matvec_pipelined_loop_runs_everywhere(device, monkeypatch):
    """The pipelined loop's source runs in the interpreter too (which loads each tile in its own step)."""
    monkeypatch.setattr(nf4_matvec_module, "PIPELINE_STAGES", 3)
    check((40, 64 * 37), 2, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=4, device=device)


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("split", [False, True], ids=["loop", "split"])
def test_lora_down_rows_several_adapters(split, rows, stages, device, monkeypatch):
    """x [A_1; ...; A_n]ᵀ for adapters of different ranks (four adapters: two launches), bf16 rows, the loop's
    loads in their own steps or pipelined (`PIPELINE_STAGES`; the interpreter ignores it), or K split over
    programs (`SPLIT_K`, the last step part-filled): deterministic, the arrival counters left at 0."""
    monkeypatch.setattr(lora_down_module, "PIPELINE_STAGES", stages)
    monkeypatch.setattr(lora_down_module, "SPLIT_K", split)
    n_in = 600 if device != "cuda" else 5120 + 200  # several steps along K
    x = torch.randn(rows, n_in, device=device).to(torch.bfloat16)
    adapters = [torch.randn(r, n_in, device=device) for r in (4, 16, 2, 8)]
    got = lora_down_rows(x, adapters)
    expected = x.double() @ torch.cat(adapters).double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, 30)
    assert_close(got, expected, 1e-5, "t")
    assert torch.equal(got, lora_down_rows(x, adapters))
    assert_counters_settled()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows,n_in,offset", [(1, 96, 0.0), (3, 200, 1.0)])
def test_rms_norm_lora_down_rows(rows, n_in, offset, dtype, device):
    """The norm and the adapters' first products in one launch: y with `rms_norm`'s bits, t as `lora_down_rows`
    of y computes it (fp32, another summation order), three adapters of different ranks."""
    x = torch.randn(rows, 2, n_in, device=device, dtype=dtype)[:, 1]  # row-strided, as a view of a wider batch
    weight = torch.randn(n_in, device=device, dtype=dtype)
    adapters = [torch.randn(r, n_in, device=device) for r in (4, 2, 8)]
    y, t = rms_norm_lora_down_rows(x, weight, 1e-6, offset, adapters)
    assert torch.equal(y, rms_norm(x, weight, 1e-6, offset=offset))
    assert t.dtype == torch.float32 and t.shape == (rows, 14)
    assert_close(t, y.double() @ torch.cat(adapters).double().t(), 1e-5, "t")
    with pytest.raises(ValueError, match="0 to 3 adapters"):
        rms_norm_lora_down_rows(x, weight, 1e-6, offset, adapters + adapters[:1])
    y, t = rms_norm_lora_down_rows(x, weight, 1e-6, offset, [])  # the norm alone
    assert t is None and torch.equal(y, rms_norm(x, weight, 1e-6, offset=offset))


def test_nf4_matvec_takes_a_precomputed_adapter_product(device):
    """`lora_t` (a column slice of a wider product, as for projections sharing x) gives what lora_a gives."""
    x, weight, bias, lora_a, lora_b = make_case((40, 128), 2, torch.float32, True, 64, True, 4, device)
    other = torch.randn(3, 128, device=device)
    t = lora_down_rows(x, [other, lora_a])[:, 3:]
    got = nf4_matvec(x, weight, bias, lora_b=lora_b, scale=0.5, lora_t=t)
    assert_close(got, float64_reference(x, weight, bias, lora_a, lora_b, 0.5), 1e-5, "y")
    with pytest.raises(ValueError, match="replaces lora_a"):
        nf4_matvec(x, weight, lora_a=lora_a, lora_b=lora_b, lora_t=t)
    with pytest.raises(ValueError, match="lora_b has shape"):
        nf4_matvec(x, weight, lora_b=lora_b[:, :3], lora_t=t)


@pytest.mark.parametrize("words", [True, False], ids=["word_kernel", "blocked_kernel"])
def test_nf4_matvec_sums_an_adapter_product_given_in_parts(words, device, monkeypatch):
    """`lora_t` as parts `[P, rows, r]` (the stripes of a down adapter's shares), summed in the word kernel's
    epilogue, by the host for the other kernels: what `lora_a` gives, with the residual as an output projection
    takes it."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", words)
    x, weight, _, lora_a, lora_b = make_case((40, 128), 3, torch.float32, True, 64, False, 5, device)
    residual = torch.randn(3, 40, device=device)
    t = (x @ lora_a.T).contiguous()
    noise = torch.randn_like(t)
    parts = torch.stack([0.25 * t + noise, -noise, 0.75 * t])  # summing to t, no part a multiple of it
    got = nf4_matvec(x, weight, lora_b=lora_b, scale=0.5, lora_t=parts, residual=residual)
    expected = float64_reference(x, weight, None, lora_a, lora_b, 0.5) + residual.double()
    assert_close(got, expected, 1e-5, "y")
    with pytest.raises(ValueError, match="lora_t must be"):
        nf4_matvec(x, weight, lora_b=lora_b, lora_t=parts[:, :2])
