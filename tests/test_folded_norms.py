"""A decoder layer's RMSNorm folded into the products around it (`matvec_epilogue`'s folded norms): the product
before writes x̃ = h · (w + offset) of its result h (`nf4_matvec`'s `normed`), the products after walk x̃ and scale
their sums and their adapters' t by each row's rstd from h (`norm_in` of `nf4_matvec`, `nf4_grouped_matvec` and
`nf4_gated_matvec`). Each against float64 products of the norm's output x̃ · rstd, on every walk, with biases,
adapters (t given, and t computed in the launch) and 1 to 3 rows."""

import pytest
import torch
from helpers import TOLERANCE, assert_close, dtype_id
from test_dequantize_nf4 import quantize
from test_nf4_matvec import float64_reference

from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.lora_down import lora_down_rows
from unsloth_lite.kernels.nf4_gated_matvec import nf4_gated_matvec
from unsloth_lite.kernels.nf4_grouped_matvec import nf4_grouped_matvec
from unsloth_lite.kernels.nf4_matvec import nf4_matvec

EPS = 1e-6


@pytest.fixture(autouse=True, params=["blocked", "words", "words_prefetch"])
def walk(request, monkeypatch):
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", request.param != "blocked")
    monkeypatch.setattr(nf4_matvec_module, "REGISTER_PREFETCH", request.param == "words_prefetch")
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    return request.param


def norm_case(rows, n_in, dtype, device, offset=1.0):
    """(h, x̃ of h's norm, the norm's output x̃ · rstd in float64): h with rows of different scales, so that a
    row's rstd applied to another's would show."""
    h = (torch.randn(rows, n_in, device=device) * torch.linspace(0.5, 4.0, rows, device=device)[:, None]).to(dtype)
    weight = 0.2 * torch.randn(n_in, device=device)
    normed = (h.float() * (weight + offset)).to(dtype)
    rstd = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + EPS)
    return h, normed, normed.double() * rstd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3])
def test_output_projection_writes_the_next_norms_input(rows, dtype, device):
    """`normed`: with the residual, x̃ = y · (w + offset) of y as written, rounded once; the stripes zeroed."""
    n_out, n_in = 128, 64 * 5
    weight = quantize((n_out, n_in), dtype, True, 64, device)
    x = torch.randn(rows, n_in, dtype=dtype, device=device)
    residual = torch.randn(rows, n_out, dtype=dtype, device=device)
    norm_weight = 0.2 * torch.randn(n_out, device=device).to(dtype)
    lora_a, lora_b = 0.3 * torch.randn(4, n_in, device=device), 0.3 * torch.randn(n_out, 4, device=device)
    out = torch.full((rows, n_out), float("nan"), dtype=dtype, device=device)
    stripes = torch.full((3, rows, 100), float("nan"), device=device)  # more than one store of the zeroing loop
    y = nf4_matvec(x, weight, None, lora_a, lora_b, scale=0.5, residual=residual,
                   normed=(out, norm_weight, 1.0, stripes))
    expected = float64_reference(x, weight, None, lora_a, lora_b, 0.5) + residual.double()
    assert_close(y, expected, TOLERANCE[dtype], "y")
    assert torch.equal(out, (y.float() * (norm_weight.float() + 1.0)).to(dtype))
    assert torch.equal(stripes, torch.zeros_like(stripes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("first_in_launch", [False, True], ids=["t_given", "t_in_launch"])
def test_products_scale_by_the_folded_norms_rstd(rows, dtype, first_in_launch, device):
    """`norm_in` of one product, of the grouped launch (three widths, adapters on two, biases) and of the
    gate-and-up launch: each against float64 products of x̃ · rstd."""
    n_in = 64 * 5
    h, normed, exact_input = norm_case(rows, n_in, dtype, device)
    widths, ranks = (96, 40, 8), (4, 0, 8)
    weights = [quantize((n, n_in), dtype, True, 64, device) for n in widths]
    a = {i: 0.3 * torch.randn(r, n_in, device=device) for i, r in enumerate(ranks) if r}
    loras = [(0.3 * torch.randn(n, r, device=device), 0.5 + i) if r else None
             for i, (n, r) in enumerate(zip(widths, ranks, strict=True))]
    biases = [torch.randn(n, dtype=dtype, device=device) for n in widths]
    t = None if first_in_launch else lora_down_rows(normed, list(a.values()))

    def expected(i):
        return float64_reference(exact_input, weights[i], biases[i], a.get(i), *(loras[i] or (None, 0)))

    outputs = nf4_grouped_matvec(normed, weights, biases, loras, t, list(a.values()), norm_in=(h, EPS))
    for i, y in enumerate(outputs):
        assert_close(y, expected(i), TOLERANCE[dtype], f"grouped y{i}")
    one = nf4_matvec(normed, weights[0], biases[0], **(dict(lora_a=a[0]) if first_in_launch else
                                                       dict(lora_t=t[:, :4])), lora_b=loras[0][0],
                     scale=loras[0][1], norm_in=(h, EPS))
    assert_close(one, expected(0), TOLERANCE[dtype], "one product")

    gate, up = weights[0], quantize((widths[0], n_in), dtype, True, 64, device)
    up_b = 0.3 * torch.randn(widths[0], 8, device=device)
    gated_t = None if first_in_launch else lora_down_rows(normed, [a[0], a[2]])
    gate_t, up_t = (None, None) if first_in_launch else (gated_t[:, :4], gated_t[:, 4:])
    h_mlp = nf4_gated_matvec(normed, gate, up, biases[0], None, (loras[0][0], gate_t, 0.5), (up_b, up_t, 2.0),
                             lora_as=[a[0], a[2]] if first_in_launch else None, norm_in=(h, EPS))
    g = expected(0)
    u = float64_reference(exact_input, up, None, a[2], up_b, 2.0)
    assert_close(h_mlp, torch.nn.functional.silu(g) * u, TOLERANCE[dtype], "gate and up")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_folded_norms_at_the_qwen3_8b_shapes_cuda(rows):
    """The launches a Qwen3-8B decoding step folds its norms into, at their shapes and shipped tiles (bf16):
    o_proj and down_proj writing x̃ with the residual (down_proj split along K), the grouped q/k/v and the
    gate-and-up launch (its tile without adapters) scaling by rstd; against float64."""
    device, dtype, hidden = "cuda", torch.bfloat16, 4096
    h, normed, exact_input = norm_case(rows, hidden, dtype, device, offset=0.0)
    for n_in in (4096, 12288):
        weight = quantize((hidden, n_in), dtype, True, 64, device)
        x = torch.randn(rows, n_in, dtype=dtype, device=device)
        residual = torch.randn(rows, hidden, dtype=dtype, device=device)
        out = torch.full((rows, hidden), float("nan"), dtype=dtype, device=device)
        norm_weight = torch.randn(hidden, device=device).to(dtype)
        y = nf4_matvec(x, weight, residual=residual, normed=(out, norm_weight, 0.0, None))
        assert_close(y, float64_reference(x, weight, None, None, None, 0) + residual.double(), TOLERANCE[dtype], "y")
        assert torch.equal(out, (y.float() * norm_weight.float()).to(dtype))
    widths = (4096, 1024, 1024)
    weights = [quantize((n, hidden), dtype, True, 64, device) for n in widths]
    for i, y in enumerate(nf4_grouped_matvec(normed, weights, [None] * 3, [None] * 3, norm_in=(h, EPS))):
        assert_close(y, float64_reference(exact_input, weights[i], None, None, None, 0), TOLERANCE[dtype], f"y{i}")
    gate, up = (quantize((12288, hidden), dtype, True, 64, device) for _ in range(2))
    got = nf4_gated_matvec(normed, gate, up, norm_in=(h, EPS))
    g, u = (float64_reference(exact_input, w, None, None, None, 0) for w in (gate, up))
    assert_close(got, torch.nn.functional.silu(g) * u, TOLERANCE[dtype], "gate and up")
