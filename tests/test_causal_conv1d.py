import pytest
import torch
from helpers import TOLERANCE, assert_close, check_op, dtype_id, transposed_randn_grad

from unsloth_lite.kernels import causal_conv1d
from unsloth_lite.kernels.causal_conv1d import causal_conv1d_reference

DTYPES = [torch.float32, torch.bfloat16]


def _x(batch, channels, seq, layout="btc"):
    """x `[B, C, T]`: the transposed view of `[B, T, C]` storage ("btc", as Qwen3.5 passes it) or contiguous."""
    if layout == "btc":
        return torch.randn(batch, seq, channels).transpose(1, 2)
    return torch.randn(batch, channels, seq)


def _check(x, weight, bias, dtype, device, activation="silu", cu_seqlens=None, **kwargs):
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device)
    result = check_op(
        lambda a, w, b: causal_conv1d(a, w, b, activation, cu_seqlens),
        lambda a, w, b: causal_conv1d_reference(a, w, b, activation, cu_seqlens),
        [x, weight, bias],
        dtype,
        device,
        names=["x", "weight", "bias"],
        **kwargs,
    )
    out, x_in = result.outputs[0], result.inputs[0]
    # y and dx are dense, in x's memory order (x's strides when x is dense).
    assert _memory_order(out) == _memory_order(x_in) and out.is_contiguous() == x_in.is_contiguous()
    if x_in.requires_grad and torch.empty_like(x_in).stride() == x_in.stride():
        assert x_in.grad.stride() == out.stride()  # autograd copies the gradient of a non-dense leaf
    return result


def _memory_order(t):
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


@pytest.mark.parametrize("shape", [(1, 48, 37), (2, 100, 3), (1, 100, 130), (2, 48, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_causal_conv1d_matches_reference(dtype, shape, device):
    x = _x(*shape).requires_grad_()
    weight = torch.randn(shape[1], 4).requires_grad_()
    bias = torch.randn(shape[1]).requires_grad_()
    _check(x, weight, bias, dtype, device)


@pytest.mark.parametrize(("dtype", "with_bias", "activation"),
                         [(torch.float32, False, "silu"), (torch.float32, True, None), (torch.bfloat16, False, None)],
                         ids=["fp32-no_bias-silu", "fp32-bias-none", "bf16-no_bias-none"])
def test_causal_conv1d_bias_and_activation(dtype, with_bias, activation, device):
    x = _x(2, 100, 37).requires_grad_()
    weight = torch.randn(100, 4).requires_grad_()
    bias = torch.randn(100).requires_grad_() if with_bias else None
    _check(x, weight, bias, dtype, device, activation=activation)


@pytest.mark.parametrize("kernel_size", [1, 3, 8])
def test_causal_conv1d_kernel_sizes(kernel_size, device):
    x = _x(2, 48, 37).requires_grad_()
    weight = torch.randn(48, kernel_size).requires_grad_()
    bias = torch.randn(48).requires_grad_()
    _check(x, weight, bias, torch.float32, device)


def test_causal_conv1d_contiguous_bct_input(device):
    x = _x(2, 100, 37, layout="bct").requires_grad_()
    weight = torch.randn(100, 4).requires_grad_()
    _check(x, weight, None, torch.bfloat16, device, make_grad=transposed_randn_grad)


def test_causal_conv1d_strided_input(device):
    # x a channel slice of a wider [B, T, 2C] projection output: not dense, read through its strides.
    x = torch.randn(2, 37, 2 * 48)[..., 48:].transpose(1, 2).requires_grad_()
    weight = torch.randn(48, 4).requires_grad_()
    bias = torch.randn(48).requires_grad_()
    _check(x, weight, bias, torch.float32, device)


def test_causal_conv1d_many_tiles(device):
    # More T tiles than backward programs: weight partial rows cover several tiles, over two batches.
    x = _x(2, 48, 64 * 5 + 5).requires_grad_()
    weight = torch.randn(48, 4).requires_grad_()
    bias = torch.randn(48).requires_grad_()
    _check(x, weight, bias, torch.float32, device)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, False, True)],
                         ids=["x", "params", "bias"])
def test_causal_conv1d_partial_grads(needs, device):
    x = _x(1, 48, 37).requires_grad_(needs[0])
    weight = torch.randn(48, 4).requires_grad_(needs[1])
    bias = torch.randn(48).requires_grad_(needs[2])
    _check(x, weight, bias, torch.float32, device)


def test_causal_conv1d_bf16_x_fp32_weight(device):
    x = _x(1, 100, 37).requires_grad_()
    weight = torch.randn(100, 4).requires_grad_()
    bias = torch.randn(100).requires_grad_()
    result = _check(x, weight, bias, torch.bfloat16, device, input_dtypes=[None, torch.float32, torch.float32])
    assert result.outputs[0].dtype == torch.bfloat16
    assert result.inputs[1].grad.dtype == torch.float32


@pytest.mark.parametrize(("dtype", "cu_dtype"), [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)],
                         ids=["fp32-int32", "bf16-int64"])
def test_causal_conv1d_cu_seqlens(dtype, cu_dtype, device):
    # Three uneven documents, one shorter than the kernel: the reference runs each document on its own.
    cu_seqlens = torch.tensor([0, 2, 23, 41], dtype=cu_dtype)
    x = _x(1, 100, 41).requires_grad_()
    weight = torch.randn(100, 4).requires_grad_()
    bias = torch.randn(100).requires_grad_()
    _check(x, weight, bias, dtype, device, cu_seqlens=cu_seqlens)


def test_causal_conv1d_cu_seqlens_equals_separate_runs(device):
    cu = [0, 17, 20, 53]
    x = _x(1, 48, 53).to(device).requires_grad_()
    weight = torch.randn(48, 4, device=device).requires_grad_()
    y = causal_conv1d(x, weight, None, "silu", torch.tensor(cu, device=device))
    dy = torch.randn_like(y)
    (dx, dw) = torch.autograd.grad(y, (x, weight), dy)
    dw_sum = torch.zeros_like(dw)
    for lo, hi in zip(cu[:-1], cu[1:], strict=True):
        xi = x.detach()[..., lo:hi].requires_grad_()
        yi = causal_conv1d(xi, weight, None, "silu")
        dxi, dwi = torch.autograd.grad(yi, (xi, weight), dy[..., lo:hi])
        assert_close(y[..., lo:hi], yi, TOLERANCE[torch.float32], f"y of document {lo}:{hi}")
        assert_close(dx[..., lo:hi], dxi, TOLERANCE[torch.float32], f"dx of document {lo}:{hi}")
        dw_sum += dwi
    assert_close(dw, dw_sum, TOLERANCE[torch.float32], "dweight")


def test_causal_conv1d_cu_seqlens_single_document_and_single_tokens(device):
    x = _x(1, 48, 6).requires_grad_()
    weight = torch.randn(48, 4).requires_grad_()
    _check(x, weight, None, torch.float32, device, cu_seqlens=torch.tensor([0, 6]))
    x = _x(1, 48, 6).requires_grad_()
    _check(x, weight, None, torch.float32, device, cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 6]))


def test_causal_conv1d_no_grad(device):
    with torch.no_grad():
        _check(_x(2, 48, 37), torch.randn(48, 4), torch.randn(48), torch.bfloat16, device)


def test_causal_conv1d_gradcheck(device):
    # fast_mode: each full-Jacobian column is a kernel launch, slow in the interpreter.
    x = torch.randn(2, 5, 3, dtype=torch.float64, device=device).transpose(1, 2).requires_grad_()
    weight = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda a, w, b: causal_conv1d(a, w, b, "silu")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, weight, bias), fast_mode=True)
    cu = torch.tensor([0, 2, 5], device=device)
    x1 = x.detach()[:1].clone().requires_grad_()
    fn = lambda a, w, b: causal_conv1d(a, w, b, "silu", cu)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x1, weight, bias), fast_mode=True)


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def test_causal_conv1d_wrong_shapes(device):
    x = torch.randn(1, 6, 5, device=device)
    w = torch.randn(6, 4, device=device)
    with pytest.raises(ValueError, match=r"^x has shape \(6, 5\)"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match=r"^weight has shape \(5, 4\)"):
        causal_conv1d(x, torch.randn(5, 4, device=device))
    with pytest.raises(ValueError, match=r"^weight has shape \(6, 9\)"):
        causal_conv1d(x, torch.randn(6, 9, device=device))
    with pytest.raises(ValueError, match=r"^bias has shape \(5,\)"):
        causal_conv1d(x, w, torch.randn(5, device=device))
    with pytest.raises(ValueError, match=r"^activation is 'gelu'"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match=r"^x has batch size 2"):
        causal_conv1d(torch.randn(2, 6, 5, device=device), w, cu_seqlens=torch.tensor([0, 5], device=device))
    with pytest.raises(ValueError, match=r"^cu_seqlens must be an int32 or int64"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0.0, 5.0], device=device))
    with pytest.raises(ValueError, match=r"^cu_seqlens has shape \(1,\)"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([5], device=device))


def test_causal_conv1d_wrong_dtypes(device):
    x = torch.randn(1, 6, 5, device=device)
    w = torch.randn(6, 4, device=device)
    with pytest.raises(ValueError, match=r"^x has dtype"):
        causal_conv1d(x.int(), w)
    with pytest.raises(ValueError, match=r"^weight has dtype"):
        causal_conv1d(x, w.long())
    with pytest.raises(ValueError, match=r"^bias has dtype"):
        causal_conv1d(x, w, torch.ones(6, dtype=torch.bool, device=device))


def test_causal_conv1d_empty_input(device):
    x = torch.randn(1, 0, 6, device=device).transpose(1, 2)
    assert causal_conv1d(x, torch.randn(6, 4, device=device)).shape == (1, 6, 0)
