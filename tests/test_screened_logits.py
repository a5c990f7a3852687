"""`screened_logits` (a greedy step's logits from the lm_head, screened by its int8 copy): the argmax of every row
that of the full product, ties included; the candidates' values those of the product in the head's dtype, -inf
elsewhere."""

import pytest
import torch
from helpers import dtype_id

from unsloth_lite.kernels import screened_logits as screened_logits_module
from unsloth_lite.kernels.matvec_epilogue import _arrival_counters
from unsloth_lite.kernels.screened_logits import BLOCK_N, int8_rows, screened_logits


def _head(vocab, hidden, dtype, device):
    weight = (torch.randn(vocab, hidden, device=device) * 0.05).to(dtype)
    x = torch.randn(4, hidden, device=device).to(dtype)
    return weight, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("vocab,hidden", [(3 * BLOCK_N + 5, 96), (2 * BLOCK_N, 200)])
def test_screened_logits_keep_the_argmax(vocab, hidden, dtype, device):
    weight, x = _head(vocab, hidden, dtype, device)
    weight[vocab - 1] = weight[7]  # a tie across blocks: the first index wins
    x[1] = x[1] / x[1].abs().max()
    weight[3] = x[1] * 3  # row 1's maximum far above the rest: few candidates
    quantized, scale, _ = int8_rows(weight)
    got = screened_logits(x, weight, quantized, scale)
    full = (x.double() @ weight.double().t()).to(dtype)
    assert got.dtype == dtype and got.shape == full.shape
    assert torch.equal(got.float().argmax(dim=-1), full.float().argmax(dim=-1))
    candidates = torch.isfinite(got)
    assert candidates.sum(dim=1).min() >= 1 and not candidates[1].all()
    diff = (got.float() - full.float())[candidates].abs()
    assert diff.max() <= 1e-5 + 2 ** -7 * full.float()[candidates].abs().max(), diff.max()
    largest = full.float().max(dim=1, keepdim=True).values
    assert candidates[full.float() >= largest - 1e-3].all(), "every near maximum is a candidate"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_exempt_rows_keep_the_masked_argmax(dtype, device):
    """Exempt rows (end-of-sequence ids a minimum-new-tokens step masks after the head) are always computed and
    never bound the screen: with them masked, the argmax is still the full product's; negative ids are ignored."""
    vocab, hidden = 3 * BLOCK_N + 5, 96
    weight, x = _head(vocab, hidden, dtype, device)
    x = x / x.abs().amax(dim=1, keepdim=True)
    weight[11], weight[vocab - 2] = x[0] * 3, x[2] * 3  # rows 0 and 2: one logit far above the rest, exempt
    quantized, scale, _ = int8_rows(weight)
    exempt = torch.tensor([vocab - 2, -1, 11], device=device)
    got = screened_logits(x, weight, quantized, scale, exempt)
    full = (x.double() @ weight.double().t()).to(dtype).float()
    assert torch.isfinite(got[:, [11, vocab - 2]]).all()
    masked = full.clone()
    masked[:, [11, vocab - 2]] = float("-inf")
    got_masked = got.float().clone()
    got_masked[:, [11, vocab - 2]] = float("-inf")
    assert torch.equal(got_masked.argmax(dim=-1), masked.argmax(dim=-1))
    assert torch.equal(got.float().argmax(dim=-1), full.argmax(dim=-1))
    without = screened_logits(x, weight, quantized, scale)
    assert torch.isfinite(without[0]).sum() == 1, "without exemption row 0's outstanding logit is its only candidate"
    with pytest.raises(ValueError, match="exempt must be"):
        screened_logits(x, weight, quantized, scale, torch.zeros(9, dtype=torch.int64, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_int8_rows_by_passes(dtype, device):
    """The copy made a few rows at a time is the copy made at once; every weight within half a step, the rounding's
    norm that of the weight's own rounding; the weight left as it was."""
    weight, _ = _head(70, 64, dtype, device)
    weight[5] = 0
    original = weight.clone()
    quantized, scale, error_norm = int8_rows(weight, rows_a_pass=16)
    whole = int8_rows(weight, rows_a_pass=1000)
    assert all(torch.equal(a, b) for a, b in zip((quantized, scale, error_norm), whole, strict=True))
    assert quantized.abs().max() == 127 and not quantized[5].any()
    error = weight.double() - quantized.double() * scale.double()[:, None]
    assert (error.abs() <= scale[:, None] * 0.5001).all()
    torch.testing.assert_close(error_norm.double(), error.norm(dim=1), rtol=1e-5, atol=1e-12)
    assert torch.equal(weight, original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_norm_bound_keeps_the_argmax(dtype, device, monkeypatch):
    """`NORM_BOUND` (the bound also by Cauchy–Schwarz): the argmax and the near maxima of every row kept, the
    candidates' values the product's, no more candidates than the plain bound leaves, the counter back at 0 for
    the next launch."""
    vocab, hidden = 4 * BLOCK_N + 3, 300
    weight, x = _head(vocab, hidden, dtype, device)
    weight[vocab - 1] = weight[7]
    quantized, scale, error_norm = int8_rows(weight)
    monkeypatch.setattr(screened_logits_module, "NORM_BOUND", False)
    plain = screened_logits(x, weight, quantized, scale, error_norm=error_norm)
    monkeypatch.setattr(screened_logits_module, "NORM_BOUND", True)
    full = (x.double() @ weight.double().t()).to(dtype).float()
    for _ in range(2):
        got = screened_logits(x, weight, quantized, scale, error_norm=error_norm)
        assert torch.equal(got.float().argmax(dim=-1), full.argmax(dim=-1))
        candidates = torch.isfinite(got)
        assert (candidates <= torch.isfinite(plain)).all() and candidates.sum() <= torch.isfinite(plain).sum()
        diff = (got.float() - full)[candidates].abs()
        assert diff.max() <= 1e-5 + 2 ** -7 * full[candidates].abs().max(), diff.max()
        largest = full.max(dim=1, keepdim=True).values
        assert candidates[full >= largest - 1e-3].all()
        assert not _arrival_counters(torch.device(device), 1).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_int8_products_keep_the_argmax(dtype, device, monkeypatch):
    """`INT8_PRODUCTS` (x as two int8 parts a tile, integer products): with outlying features in x (a few 50x
    larger, as in hidden states) and rows of tiny values, the argmax and every near maximum kept, the candidates'
    values the product's, and the parts' residual loosening the bound by little: at most a few more candidates
    than the screen with x's own products."""
    vocab, hidden = 6 * BLOCK_N + 7, 520
    weight, x = _head(vocab, hidden, dtype, device)
    x = x.float()
    x[:, [3, 200, 301]] *= 50
    x[2] *= 1e-3
    x = x.to(dtype)
    weight[9] = (x[0].float() / x[0].float().norm() * 2).to(dtype)  # row 0 dominated by one logit
    weight[vocab - 1] = weight[7]
    quantized, scale, error_norm = int8_rows(weight)
    full = (x.double() @ weight.double().t()).to(dtype).float()
    monkeypatch.setattr(screened_logits_module, "INT8_PRODUCTS", False)
    own = torch.isfinite(screened_logits(x, weight, quantized, scale, error_norm=error_norm))
    monkeypatch.setattr(screened_logits_module, "INT8_PRODUCTS", True)
    got = screened_logits(x, weight, quantized, scale, error_norm=error_norm)
    assert torch.equal(got.float().argmax(dim=-1), full.argmax(dim=-1))
    candidates = torch.isfinite(got)
    diff = (got.float() - full)[candidates].abs()
    assert diff.max() <= 1e-5 + 2 ** -7 * full[candidates].abs().max(), diff.max()
    largest = full.max(dim=1, keepdim=True).values
    assert candidates[full >= largest - 1e-3 * largest.abs()].all()
    assert candidates[0].sum() <= 3 and candidates.sum() <= own.sum() * 1.1 + 4, (candidates.sum(), own.sum())
    assert not _arrival_counters(torch.device(device), 1).any()


def test_screened_logits_refuse_bad_inputs(device):
    weight, x = _head(70, 64, torch.float32, device)
    quantized, scale, _ = int8_rows(weight)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        screened_logits(torch.randn(9, 64, device=device), weight, quantized, scale)
    with pytest.raises(ValueError, match="int8_rows"):
        screened_logits(x, weight, quantized[:10], scale)


@pytest.mark.gpu
@pytest.mark.parametrize("int8_products", [False, True], ids=["converted", "int8_products"])
@pytest.mark.parametrize("norm_bound", [False, True], ids=["plain", "norm_bound"])
@pytest.mark.parametrize("vocab,hidden", [(151936, 4096), (248320, 5120)], ids=["qwen3_8b", "qwen3_5_27b"])
def test_screened_logits_qwen_heads_cuda(vocab, hidden, norm_bound, int8_products, monkeypatch):
    monkeypatch.setattr(screened_logits_module, "NORM_BOUND", norm_bound)
    monkeypatch.setattr(screened_logits_module, "INT8_PRODUCTS", int8_products)
    weight = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(torch.bfloat16)
    quantized, scale, error_norm = int8_rows(weight)
    for rows in (1, 8):
        x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
        got = screened_logits(x, weight, quantized, scale, error_norm=error_norm)
        full = x @ weight.t()
        assert torch.equal(got.float().argmax(dim=-1), full.float().argmax(dim=-1))
        candidates = torch.isfinite(got)
        wanted = candidates.any(dim=0).nonzero().squeeze(1)  # float64 only there: the whole head is 10 GB
        exact = (x.double() @ weight[wanted].double().t()).to(torch.bfloat16).float()
        diff = (got.float()[:, wanted] - exact)[candidates[:, wanted]].abs()
        assert diff.max() <= 2 ** -7 * exact.abs().max()
