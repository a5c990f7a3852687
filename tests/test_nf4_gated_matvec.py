"""`nf4_gated_matvec` (the decoding MLP's gate and up products and SwiGLU in one launch) against the three
launches it replaces, `nf4_matvec` twice and `swiglu`: the same bits in the interpreter, and against float64:
1 to 8 rows, biases, adapters on both, one or neither projection, flat and nested absmax; and what it refuses."""

import pytest
import torch
from helpers import TOLERANCE, assert_close, assert_counters_settled, dtype_id
from test_dequantize_nf4 import quantize

from unsloth_lite.kernels import matvec_epilogue
from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference
from unsloth_lite.kernels.lora_down import lora_down_rows, rms_norm_lora_down_rows
from unsloth_lite.kernels.nf4_gated_matvec import gated_matvec_supported, nf4_gated_matvec
from unsloth_lite.kernels.nf4_matvec import nf4_matvec
from unsloth_lite.kernels.swiglu import swiglu


@pytest.fixture(autouse=True, params=["blocked", "words", "words_prefetch"])
def walk(request, monkeypatch):
    """The blocked kernel's walk, the word kernel's (`nf4_matvec.WORD_KERNEL`) and the word kernel's with the next
    tile loaded a step ahead (`REGISTER_PREFETCH`): the fused launch and the three launches compared take it."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", request.param != "blocked")
    monkeypatch.setattr(nf4_matvec_module, "REGISTER_PREFETCH", request.param == "words_prefetch")
    return request.param


def gated_case(shape, rows, dtype, nested, adapters, with_bias, device):
    """x, gate, up, and the keyword arguments of `nf4_gated_matvec` (adapters: which projections have one, of
    ranks 4 and 8; their t from one `lora_down_rows`, as decoding computes it)."""
    n_out, n_in = shape
    gate, up = (quantize(shape, dtype, nested, 64, device) for _ in range(2))
    x = torch.randn(rows, n_in, dtype=dtype, device=device)
    ranks = [r for r, on in zip((4, 8), adapters, strict=True) if on]
    a = [0.3 * torch.randn(r, n_in, device=device) for r in ranks]
    t = lora_down_rows(x, a) if a else None
    loras, first = [], 0
    for rank, on, scale in zip((4, 8), adapters, (0.5, 2.0), strict=True):
        if on:
            b = 0.3 * torch.randn(n_out, rank, device=device)
            loras.append((b, t[:, first:first + rank], scale, a[len([lo for lo in loras if lo is not None])]))
            first += rank
        else:
            loras.append(None)
    biases = [torch.randn(n_out, dtype=dtype, device=device) if with_bias else None, None]
    return x, gate, up, biases, loras


def unfused(x, gate, up, biases, loras):
    """The three launches: each projection through `nf4_matvec`, then `swiglu`."""
    outputs = []
    for weight, bias, lora in zip((gate, up), biases, loras, strict=True):
        adapter = dict(lora_b=lora[0], lora_t=lora[1], scale=lora[2]) if lora else {}
        outputs.append(nf4_matvec(x, weight, bias, **adapter))
    return swiglu(*outputs)


def float64_gated(x, gate, up, biases, loras):
    outputs = []
    for weight, bias, lora in zip((gate, up), biases, loras, strict=True):
        y = x.double() @ dequantize_nf4_reference(weight.data, weight.quant_state).double().t()
        if bias is not None:
            y = y + bias.double()
        if lora:
            y = y + lora[2] * (x.double() @ lora[3].double().t()) @ lora[0].double().t()
        outputs.append(y)
    g, u = outputs
    return g * torch.sigmoid(g) * u


def fused(x, gate, up, biases, loras):
    return nf4_gated_matvec(x, gate, up, *biases, *[lora[:3] if lora else None for lora in loras])


def check(shape, rows, dtype, nested, adapters, with_bias, device, exact):
    case = gated_case(shape, rows, dtype, nested, adapters, with_bias, device)
    got = fused(*case)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    if exact:  # the interpreter runs the same operations in the same order
        assert torch.equal(got, unfused(*case))
    else:
        assert_close(got, unfused(*case), TOLERANCE[dtype], "h against the three launches")
    assert_close(got, float64_gated(*case), 2 * TOLERANCE[dtype], "h")


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gated_matvec_has_the_bits_of_three_launches(rows, dtype, nested, device):
    """Two tiles along K, the last part-filled; a bias on the gate, adapters of ranks 4 and 8."""
    check((40, 64 * 5), rows, dtype, nested, (True, True), True, device, exact=device == "cpu")


@pytest.mark.parametrize("adapters", [(True, False), (False, True), (False, False)], ids=str)
def test_gated_matvec_with_one_or_no_adapter(adapters, device):
    check((40, 64 * 5), 2, torch.bfloat16, True, adapters, False, device, exact=device == "cpu")


def check_t_before_the_walk(shape, rows, device, monkeypatch):
    """The adapters' t, given (written by `lora_down_rows` just before), loaded before the walk
    (`matvec_epilogue.T_BEFORE_WALK`): the same bits as loaded in the epilogue."""
    case = gated_case(shape, rows, torch.bfloat16, True, (True, True), True, device)
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", False)
    late = fused(*case)
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", True)
    early = fused(*case)
    assert torch.equal(early, late)
    assert_close(early, float64_gated(*case), 2 * TOLERANCE[torch.bfloat16], "h")


@pytest.mark.parametrize("rows", [1, 3])
def test_gated_matvec_loads_a_given_t_before_the_walk(rows, device, monkeypatch):
    check_t_before_the_walk((40, 64 * 5), rows, device, monkeypatch)


def check_first_products_in_the_launch(shape, rows, adapters, device, walk, monkeypatch, exact):
    """`lora_as` instead of t (`FIRST_PRODUCTS_IN_LAUNCH`): t computed by the launch's first programs where the
    word walk runs (no `lora_down_rows` launch), else by one such launch; h against the three launches (t from
    `lora_down_rows`) and float64."""
    from unsloth_lite.kernels import nf4_gated_matvec as gated_module

    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    launches = []
    monkeypatch.setattr(gated_module, "lora_down_rows", lambda *args: launches.append(1) or lora_down_rows(*args))
    case = gated_case(shape, rows, torch.bfloat16, True, adapters, True, device)
    x, gate, up, biases, loras = case
    got = nf4_gated_matvec(x, gate, up, *biases, *[(lo[0], None, lo[2]) if lo else None for lo in loras],
                           lora_as=[lo[3] for lo in loras if lo])
    assert len(launches) == (0 if walk != "blocked" else 1)
    if exact:
        assert torch.equal(got, unfused(*case))
    assert_close(got, unfused(*case), TOLERANCE[torch.bfloat16], "h against the three launches")
    assert_close(got, float64_gated(*case), 2 * TOLERANCE[torch.bfloat16], "h")


@pytest.mark.parametrize("adapters", [(True, True), (False, True)], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
def test_gated_matvec_takes_the_first_products_in_its_launch(rows, adapters, device, walk, monkeypatch):
    """The first products in the launch, its readers' flags back at 0 after each of two launches."""
    for _ in range(2):
        check_first_products_in_the_launch((40, 64 * 5), rows, adapters, device, walk, monkeypatch, exact=False)
        assert_counters_settled(device)


def check_down_shares(shape, rows, dtype, device, stripes=3):
    """`down_shares`: h as without them, and the stripes (poisoned, then zeroed as the norm's launch zeroes them)
    summing to h A_dᵀ of h as written (float64 product); the down adapter's rank not a power of two."""
    case = gated_case(shape, rows, dtype, True, (True, True), True, device)
    down_a = torch.randn(5, shape[0], device=device, dtype=dtype)
    shares = torch.full((stripes, rows, 5), float("nan"), device=device)
    x = torch.randn(rows, 64, device=device, dtype=dtype)
    rms_norm_lora_down_rows(x, torch.ones(64, device=device, dtype=dtype), 1e-6, 0.0, [], zeroed=shares)
    assert torch.equal(shares, torch.zeros_like(shares)), "zeroed by the norm's launch"
    x, gate, up, biases, loras = case
    got = nf4_gated_matvec(x, gate, up, *biases, *[lora[:3] for lora in loras], down_shares=(down_a, shares))
    assert torch.equal(got, fused(*case)), "h does not change with the shares"
    assert_close(shares.sum(0), got.double() @ down_a.double().t(), TOLERANCE[torch.float32], "Σ stripes")


@pytest.mark.parametrize("rows", [1, 3])
def test_gated_matvec_writes_the_down_adapters_first_product_in_shares(rows, device):
    """Three feature blocks (the interpreter's tile) over two stripes: one stripe takes two programs' shares."""
    check_down_shares((160, 64 * 5), rows, torch.float32, device, stripes=2)
    x, gate, up, biases, loras = gated_case((40, 64 * 5), rows, torch.float32, True, (True, True), True, device)
    with pytest.raises(ValueError, match="stripes must be"):
        nf4_gated_matvec(x, gate, up, *biases, *[lora[:3] for lora in loras],
                         down_shares=(torch.randn(5, 40, device=device), torch.zeros(2, rows, 4, device=device)))


def test_gated_matvec_refuses_what_it_does_not_take(device, monkeypatch):
    x = torch.randn(1, 128, device=device)
    gate, up = (quantize((24, 128), torch.float32, True, 64, device) for _ in range(2))
    assert gated_matvec_supported(x, gate, up)
    other_shape = quantize((32, 128), torch.float32, True, 64, device)
    other_block = quantize((24, 128), torch.float32, True, 128, device)
    split_blocks = quantize((24, 96), torch.float32, True, 64, device)  # rows split the 64-weight blocks
    dense = torch.nn.Parameter(torch.randn(24, 128, device=device), requires_grad=False)
    assert not gated_matvec_supported(x, gate, other_shape)
    assert not gated_matvec_supported(x, gate, other_block)
    assert not gated_matvec_supported(x, gate, dense)
    assert not gated_matvec_supported(torch.randn(1, 96, device=device), split_blocks, split_blocks)
    assert not gated_matvec_supported(torch.randn(9, 128, device=device), gate, up)
    assert not gated_matvec_supported(x.double(), gate, up)
    with pytest.raises(ValueError, match="two NF4 weights of one shape"):
        nf4_gated_matvec(x, gate, other_shape)
    monkeypatch.setattr(nf4_matvec_module, "FLAT_ABSMAX", False)  # nested absmax: the kernel reads flat only
    assert not gated_matvec_supported(x, gate, up)
    plain = quantize((24, 128), torch.float32, False, 64, device)
    assert gated_matvec_supported(x, plain, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", [(2050, 128), (12288, 4096), (17408, 5120)], ids=str)
def test_gated_matvec_cuda(shape, rows):
    """Compiled, at the W3 models' MLP shapes (bf16 codes, PDL on Hopper) and a part-filled feature block."""
    check(shape, rows, torch.bfloat16, True, (True, True), True, "cuda", exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", [(12288, 4096), (17408, 5120)], ids=str)
def test_gated_matvec_takes_the_first_products_in_its_launch_cuda(shape, rows, walk, monkeypatch):
    for _ in range(3):  # each launch leaves its flags settled for the next
        check_first_products_in_the_launch(shape, rows, (True, True), "cuda", walk, monkeypatch, exact=False)
        assert_counters_settled("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", [(12288, 4096), (17408, 5120)], ids=str)
def test_gated_matvec_loads_a_given_t_before_the_walk_cuda(shape, rows, monkeypatch):
    check_t_before_the_walk(shape, rows, "cuda", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", [(12288, 4096), (17408, 5120)], ids=str)
def test_gated_matvec_writes_the_down_adapters_first_product_in_shares_cuda(shape, rows):
    check_down_shares(shape, rows, torch.bfloat16, "cuda", stripes=16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_gated_matvec_without_adapters_cuda(rows):
    """Without adapters at the Qwen3-8B MLP, the launch's own tile (`WORD_TILES_WITHOUT_ADAPTERS`)."""
    check((12288, 4096), rows, torch.bfloat16, True, (False, False), True, "cuda", exact=False)


def test_gated_matvec_takes_the_tile_without_adapters_only_without_them(device, walk, monkeypatch):
    """The launch asks for the tile of a launch without adapters only where it has none: neither adapter nor the
    down adapter's shares."""
    from unsloth_lite.kernels import nf4_matvec

    asked = []
    word_tile = nf4_matvec.word_tile
    monkeypatch.setattr(nf4_matvec, "word_tile", lambda *args: asked.append(args[3:]) or word_tile(*args))
    for adapters in ((False, False), (True, False)):
        x, gate, up, biases, loras = gated_case((40, 64 * 5), 2, torch.bfloat16, True, adapters, False, device)
        asked.clear()
        nf4_gated_matvec(x, gate, up, *biases, *[lo[:3] if lo else None for lo in loras])
        assert asked[-1:] == ([(any(adapters),)] if walk != "blocked" else []), (adapters, asked)
    stripes = torch.zeros(16, 2, 3, device=device)
    asked.clear()
    nf4_gated_matvec(x, gate, up, down_shares=(torch.randn(3, 40, device=device), stripes))
    assert asked[-1:] == ([(True,)] if walk != "blocked" else [])


@pytest.mark.gpu
def test_gated_matvec_replayed_in_a_cuda_graph():
    case = gated_case((12288, 4096), 1, torch.bfloat16, True, (True, True), False, "cuda")
    expected = fused(*case)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused(*case)
    captured.fill_(float("nan"))
    graph.replay()
    assert torch.equal(captured, expected)
