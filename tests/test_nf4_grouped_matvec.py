"""`nf4_grouped_matvec` (the projections of one input in one launch) against `nf4_matvec` on each weight: the
same bits in the interpreter, float64 everywhere; two to four weights of different widths, adapters on some,
biases on all or none, 1 to 8 rows; and what it refuses."""

import pytest
import torch
from helpers import TOLERANCE, assert_close, assert_counters_settled, dtype_id
from test_dequantize_nf4 import quantize
from test_nf4_matvec import float64_reference

from unsloth_lite.kernels import matvec_epilogue
from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.lora_down import lora_down_rows
from unsloth_lite.kernels.nf4_grouped_matvec import grouped_matvec_supported, nf4_grouped_matvec
from unsloth_lite.kernels.nf4_matvec import nf4_matvec


@pytest.fixture(autouse=True, params=["blocked", "words", "words_prefetch"])
def walk(request, monkeypatch):
    """The blocked kernel's walk, the word kernel's (`nf4_matvec.WORD_KERNEL`) and the word kernel's with the next
    tile loaded a step ahead (`REGISTER_PREFETCH`): the fused launch and the separate products compared take it."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", request.param != "blocked")
    monkeypatch.setattr(nf4_matvec_module, "REGISTER_PREFETCH", request.param == "words_prefetch")
    return request.param


def group_case(widths, n_in, ranks, rows, dtype, nested, with_bias, device):
    weights = [quantize((n, n_in), dtype, nested, 64, device) for n in widths]
    x = torch.randn(rows, n_in, dtype=dtype, device=device)
    a = {i: 0.3 * torch.randn(r, n_in, device=device) for i, r in enumerate(ranks) if r}
    t = lora_down_rows(x, list(a.values())) if a else None
    loras = [(0.3 * torch.randn(n, r, device=device), 0.5 + i) if r else None
             for i, (n, r) in enumerate(zip(widths, ranks, strict=True))]
    biases = [torch.randn(n, dtype=dtype, device=device) if with_bias else None for n in widths]
    return x, weights, biases, loras, t, a


def check(widths, ranks, rows, dtype, nested, with_bias, device, exact, n_in=64 * 5):
    x, weights, biases, loras, t, a = group_case(widths, n_in, ranks, rows, dtype, nested, with_bias, device)
    outputs = nf4_grouped_matvec(x, weights, biases, loras, t)
    first = 0
    for i, (weight, bias, lora, y) in enumerate(zip(weights, biases, loras, outputs, strict=True)):
        rank = ranks[i]
        assert y.dtype == dtype and y.shape == (rows, widths[i])
        adapter = dict(lora_b=lora[0], lora_t=t[:, first:first + rank], scale=lora[1]) if rank else {}
        alone = nf4_matvec(x, weight, bias, **adapter)
        if exact:  # the same walk at the same tile in the interpreter
            assert torch.equal(y, alone), i
        else:
            assert_close(y, alone, TOLERANCE[dtype], f"y{i} against its own product")
        expected = float64_reference(x, weight, bias, a.get(i), lora[0] if lora else None, lora[1] if lora else 0)
        assert_close(y, expected, TOLERANCE[dtype], f"y{i}")
        first += rank


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_four_projections_of_different_widths(rows, dtype, nested, device):
    """The DeltaNet's four (one wide, one narrower, two a few features wide); adapters on three, biases."""
    check((96, 40, 8, 130), (4, 0, 4, 4), rows, dtype, nested, True, device, exact=device == "cpu")


def test_adapters_of_different_ranks(device):
    """Ranks 4 and 8 in one group: the rank-4 adapter's sum runs over 8 lanes (the group's widest), so only its
    last bits may differ from its own product's."""
    check((96, 40), (4, 8), 3, torch.float32, True, False, device, exact=False)


@pytest.mark.parametrize("widths,ranks", [((40, 24), (0, 0)), ((96, 16, 16), (4, 4, 4))], ids=["two", "three"])
def test_two_and_three_projections(widths, ranks, device):
    check(widths, ranks, 2, torch.bfloat16, True, False, device, exact=device == "cpu")


def test_grouped_matvec_refuses_what_it_does_not_take(device, monkeypatch):
    x, weights, biases, loras, t, _ = group_case((24, 40, 8), 128, (4, 0, 4), 1, torch.float32, True, False, device)
    assert grouped_matvec_supported(x, weights, biases, loras)
    other_width = quantize((24, 192), torch.float32, True, 64, device)
    assert not grouped_matvec_supported(x, weights[:1], biases[:1], loras[:1])  # one weight: nf4_matvec's
    assert not grouped_matvec_supported(x, weights * 2, biases * 2, loras * 2)  # six: more than four
    assert not grouped_matvec_supported(x, [weights[0], other_width], biases[:2], loras[:2])
    assert not grouped_matvec_supported(x, weights, [torch.randn(24, device=device), None, None], loras)
    assert not grouped_matvec_supported(x, weights, biases, [(loras[0][0].double(), 1.0), None, loras[2]])
    assert not grouped_matvec_supported(torch.randn(9, 128, device=device), weights, biases, loras)
    dense = torch.nn.Parameter(torch.randn(24, 128, device=device), requires_grad=False)
    assert not grouped_matvec_supported(x, [weights[0], dense], biases[:2], loras[:2])
    with pytest.raises(ValueError, match="lora_t must hold the adapters' 8 columns"):
        nf4_grouped_matvec(x, weights, biases, loras, t[:, :4])
    with pytest.raises(ValueError, match="2 to 4 NF4 weights"):
        nf4_grouped_matvec(x, [weights[0], other_width], biases[:2], loras[:2], t[:, :4])
    monkeypatch.setattr(nf4_matvec_module, "FLAT_ABSMAX", False)  # nested absmax: the kernel reads flat only
    assert not grouped_matvec_supported(x, weights, biases, loras)


def check_first_products_in_the_launch(widths, ranks, rows, n_in, device, walk, monkeypatch):
    """`lora_as` instead of t (`FIRST_PRODUCTS_IN_LAUNCH`): t computed by the launch's first programs where the
    word walk runs and at most three weights are adapted (no `lora_down_rows` launch), else by `lora_down_rows`;
    each y against float64."""
    from unsloth_lite.kernels import nf4_grouped_matvec as grouped_module

    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    launches = []
    monkeypatch.setattr(grouped_module, "lora_down_rows", lambda *args: launches.append(1) or lora_down_rows(*args))
    x, weights, biases, loras, _, a = group_case(widths, n_in, ranks, rows, torch.bfloat16, True, True, device)
    outputs = nf4_grouped_matvec(x, weights, biases, loras, None, list(a.values()))
    in_launch = walk != "blocked" and len(a) <= 3
    assert len(launches) == (0 if in_launch else 1)
    for i, (weight, bias, lora, y) in enumerate(zip(weights, biases, loras, outputs, strict=True)):
        expected = float64_reference(x, weight, bias, a.get(i), lora[0] if lora else None, lora[1] if lora else 0)
        assert_close(y, expected, TOLERANCE[torch.bfloat16], f"y{i}")


def check_t_before_the_walk(widths, ranks, rows, n_in, device, monkeypatch):
    """The adapters' t, given (written by `lora_down_rows` just before), loaded before the walk
    (`matvec_epilogue.T_BEFORE_WALK`): the same bits as loaded in the epilogue."""
    x, weights, biases, loras, t, a = group_case(widths, n_in, ranks, rows, torch.bfloat16, True, True, device)
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", False)
    late = nf4_grouped_matvec(x, weights, biases, loras, t)
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", True)
    early = nf4_grouped_matvec(x, weights, biases, loras, t)
    for i, (weight, bias, lora, y, z) in enumerate(zip(weights, biases, loras, early, late, strict=True)):
        assert torch.equal(y, z), i
        expected = float64_reference(x, weight, bias, a.get(i), lora[0] if lora else None, lora[1] if lora else 0)
        assert_close(y, expected, TOLERANCE[torch.bfloat16], f"y{i}")


@pytest.mark.parametrize("rows", [1, 3])
def test_grouped_matvec_loads_a_given_t_before_the_walk(rows, device, monkeypatch):
    """Adapters of different ranks, one weight without."""
    check_t_before_the_walk((96, 40, 8, 130), (4, 0, 8, 4), rows, 64 * 5, device, monkeypatch)


@pytest.mark.parametrize("ranks", [(4, 0, 8, 4), (4, 4, 4, 4)], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
def test_grouped_matvec_takes_the_first_products_in_its_launch(rows, ranks, device, walk, monkeypatch):
    """Three adapters of different ranks (one weight without): in the launch; four: one launch before it. The
    readers' flags back at 0 after each of two."""
    for _ in range(2):
        check_first_products_in_the_launch((96, 40, 8, 130), ranks, rows, 64 * 5, device, walk, monkeypatch)
        assert_counters_settled(device)


W3_GROUPS = {"qwen3_8b_qkv": ((4096, 1024, 1024), 4096), "qwen3_5_27b_attention": ((12288, 1024, 1024), 5120),
             "qwen3_5_27b_deltanet": ((10240, 6144, 48, 48), 5120)}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("group", list(W3_GROUPS))
def test_grouped_matvec_cuda(group, rows):
    """Compiled at the W3 models' groups (bf16 codes, PDL on Hopper), adapters on all but the last."""
    widths, n_in = W3_GROUPS[group]
    ranks = (16,) * (len(widths) - 1) + (0,)
    check(widths, ranks, rows, torch.bfloat16, True, False, "cuda", exact=False, n_in=n_in)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("group", list(W3_GROUPS))
def test_grouped_matvec_takes_the_first_products_in_its_launch_cuda(group, rows, walk, monkeypatch):
    widths, n_in = W3_GROUPS[group]
    ranks = (16,) * min(len(widths), 3) + (0,) * (len(widths) - 3)
    for _ in range(3):  # each launch leaves its flags settled for the next
        check_first_products_in_the_launch(widths, ranks, rows, n_in, "cuda", walk, monkeypatch)
        assert_counters_settled("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("group", list(W3_GROUPS))
def test_grouped_matvec_loads_a_given_t_before_the_walk_cuda(group, rows, monkeypatch):
    widths, n_in = W3_GROUPS[group]
    ranks = (16,) * (len(widths) - 1) + (0,)
    check_t_before_the_walk(widths, ranks, rows, n_in, "cuda", monkeypatch)


@pytest.mark.gpu
def test_grouped_matvec_replayed_in_a_cuda_graph():
    x, weights, biases, loras, t, _ = group_case((10240, 6144, 48, 48), 5120, (16, 16, 0, 0), 1, torch.bfloat16,
                                                 True, False, "cuda")
    expected = nf4_grouped_matvec(x, weights, biases, loras, t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nf4_grouped_matvec(x, weights, biases, loras, t)
    for y in captured:
        y.fill_(float("nan"))
    graph.replay()
    assert all(torch.equal(y, e) for y, e in zip(captured, expected, strict=True))
