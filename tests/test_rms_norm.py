import pytest
import torch
from helpers import (
    TOLERANCE,
    assert_close,
    check_op,
    dtype_id,
    expanded_randn_grad,
    transposed_randn_grad,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth_lite.kernels import rms_norm
from unsloth_lite.kernels.rms_norm import add_rms_norm, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 47), (7, 123), (47, 515), (3, 1000), (2, 3, 123), (123,)]


def _check(x, weight, dtype, device, eps=1e-6, offset=0.0, **kwargs):
    return check_op(
        lambda a, w: rms_norm(a, w, eps, offset),
        lambda a, w: rms_norm_reference(a, w, eps, offset),
        [x, weight],
        dtype,
        device,
        names=["x", "weight"],
        **kwargs,
    )


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm_matches_reference(dtype, shape, offset, train_weight, device):
    x = torch.randn(shape).requires_grad_()
    weight = torch.randn(shape[-1]).requires_grad_(train_weight)
    result = _check(x, weight, dtype, device, offset=offset)
    if not train_weight:
        assert result.inputs[1].grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_rms_norm_eps_and_small_inputs(dtype, device):
    # Rows of small magnitude make eps matter; one larger eps than the default.
    x = (1e-3 * torch.randn(5, 123)).requires_grad_()
    weight = torch.randn(123).requires_grad_()
    _check(x, weight, dtype, device, eps=1e-5, offset=1.0)


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("layout", ["col_slice", "row_slice", "transposed", "transposed_3d", "col_slice_3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_rms_norm_non_contiguous_input(dtype, layout, train_weight, device):
    if layout == "col_slice":
        x = torch.randn(7, 2 * 123)[:, ::2]  # column stride 2
    elif layout == "row_slice":
        x = torch.randn(9, 300)[:, 10:133]  # row stride 300
    elif layout == "transposed":
        x = torch.randn(123, 7).t()  # column stride 7
    elif layout == "transposed_3d":
        x = torch.randn(5, 3, 47).transpose(0, 1)  # leading dims don't collapse into one row stride
    else:
        x = torch.randn(3, 4, 2 * 47)[..., 1::2]
    assert not x.is_contiguous()
    x.requires_grad_()
    weight = torch.randn(x.shape[-1]).requires_grad_(train_weight)
    result = _check(x, weight, dtype, device, offset=1.0)
    assert not result.inputs[0].is_contiguous()


@pytest.mark.parametrize("make_grad", [transposed_randn_grad, expanded_randn_grad], ids=["transposed", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_rms_norm_non_contiguous_upstream_grad(dtype, make_grad, device):
    x = torch.randn(7, 515).requires_grad_()
    weight = torch.randn(515).requires_grad_()
    result = _check(x, weight, dtype, device, make_grad=make_grad)
    assert not result.grads[0].is_contiguous()


def test_rms_norm_weight_only_grad(device):
    # x frozen, weight trained.
    x = torch.randn(7, 123)
    weight = torch.randn(123).requires_grad_()
    result = _check(x, weight, torch.float32, device)
    assert result.inputs[0].grad is None


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
def test_rms_norm_mixed_dtypes_bf16_x_fp32_weight(train_weight, device):
    x = torch.randn(7, 123).requires_grad_()
    weight = torch.randn(123).requires_grad_(train_weight)
    result = _check(x, weight, torch.bfloat16, device, input_dtypes=[None, torch.float32], offset=1.0)
    assert result.outputs[0].dtype == torch.bfloat16
    if train_weight:
        assert result.inputs[1].grad.dtype == torch.float32


def test_rms_norm_forward_only_no_grad(device):
    x = torch.randn(7, 123)
    weight = torch.randn(123)
    with torch.no_grad():
        _check(x, weight, torch.bfloat16, device)


@settings(max_examples=10, deadline=None)
@given(
    leading=st.lists(st.integers(1, 9), min_size=1, max_size=2),
    # hidden >= 2: with one column dx is an eps-sized cancellation, ill-conditioned for a relative error.
    hidden=st.integers(2, 700),
    offset=st.sampled_from([0.0, 1.0]),
    train_weight=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rms_norm_hypothesis(leading, hidden, offset, train_weight, seed, device):
    torch.manual_seed(seed)
    x = torch.randn(*leading, hidden).requires_grad_()
    weight = torch.randn(hidden).requires_grad_(train_weight)
    _check(x, weight, torch.float32, device, offset=offset, tol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_gradcheck(offset, device):
    x = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-6, offset), (x, weight))


def test_rms_norm_gradcheck_non_contiguous(device):
    x = torch.randn(6, 3, dtype=torch.float64, device=device).t().requires_grad_()
    weight = torch.randn(6, dtype=torch.float64, device=device).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-6, 1.0), (x, weight))


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def test_rms_norm_wrong_weight_shape(device):
    x = torch.randn(4, 10, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(11,\)"):
        rms_norm(x, torch.randn(11, device=device))
    with pytest.raises(ValueError, match=r"weight has shape \(1, 10\)"):
        rms_norm(x, torch.randn(1, 10, device=device))


@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64, torch.bool])
def test_rms_norm_integer_dtype(int_dtype, device):
    with pytest.raises(ValueError, match=r"^x has dtype"):
        rms_norm(torch.ones(4, 10, device=device, dtype=int_dtype), torch.randn(10, device=device))
    with pytest.raises(ValueError, match=r"^weight has dtype"):
        rms_norm(torch.randn(4, 10, device=device), torch.ones(10, device=device, dtype=int_dtype))


def test_rms_norm_scalar_and_non_tensor(device):
    with pytest.raises(ValueError, match=r"^x must have at least one dimension"):
        rms_norm(torch.tensor(1.0, device=device), torch.randn(1, device=device))
    with pytest.raises(ValueError, match=r"^weight must be a torch.Tensor"):
        rms_norm(torch.randn(4, 10, device=device), [1.0] * 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter error")
def test_rms_norm_cpu_without_interpreter(monkeypatch):
    import unsloth_lite.kernels.utils as utils

    monkeypatch.setattr(utils, "INTERPRET", False)
    with pytest.raises(ValueError, match=r"^x is on cpu"):
        rms_norm(torch.randn(4, 10), torch.randn(10))


def test_rms_norm_empty_input(device):
    x = torch.randn(0, 10, device=device)
    assert rms_norm(x, torch.randn(10, device=device)).shape == (0, 10)


def _add_rms_norm_reference(x, delta, weight, eps=1e-6, offset=0.0):
    total = x if delta is None else x + delta
    return total, rms_norm_reference(total, weight, eps, offset)


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(7, 123), (2, 3, 515), (1, 47)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_add_rms_norm_matches_reference(dtype, shape, offset, train_weight, device):
    """The sum and its norm, with random gradients into both (the residual stream's and the norm's), against
    float64: x and delta each get the sum of the two."""
    x, delta = torch.randn(shape).requires_grad_(), torch.randn(shape).requires_grad_()
    weight = torch.randn(shape[-1]).requires_grad_(train_weight)
    check_op(
        lambda a, d, w: add_rms_norm(a, d, w, 1e-6, offset),
        lambda a, d, w: _add_rms_norm_reference(a, d, w, 1e-6, offset),
        [x, delta, weight], dtype, device, names=["x", "delta", "weight"],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_add_rms_norm_without_delta(dtype, device):
    """Without delta the sum is x itself, whose gradient along the stream is added to the norm's."""
    x, weight = torch.randn(5, 123).requires_grad_(), torch.randn(123).requires_grad_()
    result = check_op(
        lambda a, w: add_rms_norm(a, None, w, 1e-6, 1.0),
        lambda a, w: _add_rms_norm_reference(a, None, w, 1e-6, 1.0),
        [x, weight], dtype, device, names=["x", "weight"],
    )
    assert result.outputs[0].data_ptr() == result.inputs[0].data_ptr()


@pytest.mark.parametrize("make_grad", [transposed_randn_grad, expanded_randn_grad], ids=["transposed", "expanded"])
def test_add_rms_norm_non_contiguous_grads_and_inputs(make_grad, device):
    x = torch.randn(9, 300)[:, 10:133].requires_grad_()
    delta = torch.randn(123, 9).t().requires_grad_()
    weight = torch.randn(123).requires_grad_()
    check_op(
        lambda a, d, w: add_rms_norm(a, d, w), lambda a, d, w: _add_rms_norm_reference(a, d, w),
        [x, delta, weight], torch.float32, device, names=["x", "delta", "weight"], make_grad=make_grad,
    )


def test_add_rms_norm_sum_rounded_as_a_separate_add(device):
    """In bf16 the sum is rounded before the norm reads it, as Hugging Face's add then norm compute it."""
    x, delta = (torch.randn(6, 257, device=device, dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(257, device=device)
    total, normed = add_rms_norm(x, delta, weight)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, rms_norm(x + delta, weight))


def test_add_rms_norm_kept_sum_and_buffer(device):
    """`kept_sum` is taken as the sum (what the norm reads; gradients still reach x and delta); `sum_into`
    receives the computed sum."""
    x, delta = (torch.randn(4, 96, device=device, requires_grad=True) for _ in range(2))
    weight = torch.randn(96, device=device)
    grads = [torch.randn(4, 96, device=device) for _ in range(2)]
    kept = 2 * (x + delta).detach()  # a different value shows which one the norm read
    total, normed = add_rms_norm(x, delta, weight, kept_sum=kept)
    assert total.data_ptr() == kept.data_ptr()
    torch.autograd.backward([total, normed], grads)
    reference = kept.clone().requires_grad_()
    torch.autograd.backward(list(_add_rms_norm_reference(reference, None, weight)), grads)
    for got in (x.grad, delta.grad):
        assert_close(got, reference.grad, 1e-5, "gradient through the kept sum")
    buffer = torch.full((4, 96), float("nan"), device=device)
    total, _ = add_rms_norm(x.detach(), delta.detach(), weight, sum_into=buffer)
    assert total.data_ptr() == buffer.data_ptr()
    assert_close(buffer, x + delta, 1e-6, "sum written into the buffer")


def test_add_rms_norm_sum_unused(device):
    """No gradient along the stream (the sum unused): x and delta get the norm's alone."""
    x, delta = (torch.randn(3, 64, device=device, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(64, device=device, dtype=torch.float64)
    dy = torch.randn(3, 64, device=device, dtype=torch.float64)
    add_rms_norm(x, delta, weight)[1].backward(dy)
    total = (x + delta).detach().requires_grad_()
    rms_norm_reference(total, weight).backward(dy)
    assert_close(x.grad, total.grad, 1e-10, "x.grad")
    assert_close(delta.grad, total.grad, 1e-10, "delta.grad")


@pytest.mark.parametrize("field, value, message", [
    ("delta", lambda x: x[:, :-1], r"delta has shape \(4, 31\); expected \(4, 32\), the shape of x"),
    ("delta", lambda x: x.double(), r"delta has dtype torch.float64; expected torch.float32"),
    ("kept_sum", lambda x: x[:2], r"kept_sum has shape \(2, 32\); expected \(4, 32\)"),
    ("sum_into", lambda x: x.t().contiguous().t(), r"sum_into must be a contiguous torch.float32 tensor"),
])
def test_add_rms_norm_bad_inputs(field, value, message, device):
    x = torch.randn(4, 32, device=device)
    arguments = {"delta": torch.randn(4, 32, device=device)}
    arguments[field] = value(x)
    delta = arguments.pop("delta")
    with pytest.raises(ValueError, match=message):
        add_rms_norm(x, delta, torch.randn(32, device=device), **arguments)


def test_add_rms_norm_empty_input(device):
    x = torch.randn(0, 10, device=device)
    total, normed = add_rms_norm(x, torch.randn(0, 10, device=device), torch.randn(10, device=device))
    assert total.shape == normed.shape == (0, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [5120, 4096])
def test_add_rms_norm_residual_stream_shapes_on_gpu(hidden):
    """Compiled, at the residual streams of the W1 and W2 shapes, bf16, against float64."""
    x, delta = torch.randn(2048, hidden).requires_grad_(), torch.randn(2048, hidden).requires_grad_()
    weight = torch.randn(hidden).requires_grad_()
    check_op(
        lambda a, d, w: add_rms_norm(a, d, w, 1e-6, 1.0),
        lambda a, d, w: _add_rms_norm_reference(a, d, w, 1e-6, 1.0),
        [x, delta, weight], torch.bfloat16, "cuda", names=["x", "delta", "weight"],
    )
