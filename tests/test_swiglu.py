import pytest
import torch
from helpers import (
    check_op,
    dtype_id,
    expanded_randn_grad,
    transposed_randn_grad,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth_lite.kernels import swiglu
from unsloth_lite.kernels.swiglu import (
    _swiglu_backward,
    _swiglu_forward,
    sigmoid_gate,
    sigmoid_gate_reference,
    swiglu_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 1025 and 2100 are wider than the kernel's 1024-column block: several column blocks per row, last one masked.
SHAPES = [(1, 47), (7, 123), (47, 515), (3, 1000), (3, 2100), (2, 3, 1025), (123,)]


def _check(gate, up, dtype, device, **kwargs):
    return check_op(swiglu, swiglu_reference, [gate, up], dtype, device, names=["gate", "up"], **kwargs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_swiglu_matches_reference(dtype, shape, device):
    gate = (2 * torch.randn(shape)).requires_grad_()  # wide range of gate values: both sigmoid tails
    up = torch.randn(shape).requires_grad_()
    _check(gate, up, dtype, device)


@pytest.mark.parametrize("sigmoid", [False, True], ids=["swiglu", "sigmoid_gate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_backward_writes_h_over_dh(dtype, sigmoid, device):
    """The backward kernel's `h_out`, given dh itself and dg, du written over g and u (as the LoRA MLP calls it):
    dg and du as without it, and h the forward's, every element read before it is overwritten."""
    g = (2 * torch.randn(37, 2100, device=device)).to(dtype)
    u, dh = (torch.randn(37, 2100, device=device).to(dtype) for _ in range(2))
    expected_dg, expected_du = _swiglu_backward(dh, g, u, sigmoid=sigmoid)
    expected_h = _swiglu_forward(g, u, sigmoid=sigmoid)
    g_buffer, u_buffer, dh_buffer = g.clone(), u.clone(), dh.clone()
    dg, du = _swiglu_backward(dh_buffer, g_buffer, u_buffer, out=(g_buffer, u_buffer), sigmoid=sigmoid,
                              h_out=dh_buffer)
    assert dg.data_ptr() == g_buffer.data_ptr() and du.data_ptr() == u_buffer.data_ptr()
    for got, expected in ((dg, expected_dg), (du, expected_du), (dh_buffer, expected_h)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("shape", [(7, 123), (3, 1025), (2, 5, 47)], ids=lambda s: "x".join(map(str, s)))
def test_swiglu_halves_of_one_tensor(dtype, shape, device):
    """gate and up as the two halves of one fused projection output, `gate_up.chunk(2, -1)` (no copies)."""
    gate_up = torch.randn(*shape[:-1], 2 * shape[-1])
    gate, up = gate_up.chunk(2, -1)
    assert not gate.is_contiguous() and not up.is_contiguous()
    result = _check(gate.requires_grad_(), up.requires_grad_(), dtype, device)
    g, u = result.inputs
    assert g.stride() == gate.stride() and u.stride() == up.stride()
    assert g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()  # still one tensor's halves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_swiglu_gradient_reaches_fused_projection(dtype, device):
    """Backward through `chunk`: the gradient of the fused `gate_up` tensor is [dgate, dup]."""
    gate_up = torch.randn(7, 2 * 123).requires_grad_()
    check_op(
        lambda gu: swiglu(*gu.chunk(2, -1)),
        lambda gu: swiglu_reference(*gu.chunk(2, -1)),
        [gate_up],
        dtype,
        device,
        names=["gate_up"],
    )


@pytest.mark.parametrize("layout", ["transposed", "col_slice", "transposed_3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_swiglu_non_contiguous_inputs(dtype, layout, device):
    if layout == "transposed":
        gate, up = torch.randn(123, 7).t(), torch.randn(7, 123)
    elif layout == "col_slice":
        gate, up = torch.randn(7, 2 * 123)[:, ::2], torch.randn(7, 3 * 123)[:, ::3]
    else:
        gate, up = torch.randn(5, 3, 47).transpose(0, 1), torch.randn(3, 47, 5).permute(0, 2, 1)
    _check(gate.requires_grad_(), up.requires_grad_(), dtype, device)


@pytest.mark.parametrize("make_grad", [transposed_randn_grad, expanded_randn_grad], ids=["transposed", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_swiglu_non_contiguous_upstream_grad(dtype, make_grad, device):
    gate = torch.randn(7, 1025).requires_grad_()
    up = torch.randn(7, 1025).requires_grad_()
    result = _check(gate, up, dtype, device, make_grad=make_grad)
    assert not result.grads[0].is_contiguous()


@pytest.mark.parametrize("trained", ["gate", "up"])
def test_swiglu_one_input_trained(trained, device):
    gate = torch.randn(7, 123).requires_grad_(trained == "gate")
    up = torch.randn(7, 123).requires_grad_(trained == "up")
    _check(gate, up, torch.float32, device)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy exp
def test_swiglu_extreme_gate_values(device):
    # Large |gate|: sigmoid saturates; must stay finite and match.
    gate = torch.cat([torch.linspace(-60, 60, 120), torch.tensor([-1e4, -88.0, 88.0])]).reshape(3, 41)
    up = torch.randn(3, 41)
    _check(gate.requires_grad_(), up.requires_grad_(), torch.float32, device)


@settings(max_examples=10, deadline=None)
@given(
    leading=st.lists(st.integers(1, 9), min_size=0, max_size=2),
    hidden=st.integers(1, 2100),
    halves=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_swiglu_hypothesis(leading, hidden, halves, seed, device):
    torch.manual_seed(seed)
    if halves:
        gate, up = torch.randn(*leading, 2 * hidden).chunk(2, -1)
    else:
        gate, up = torch.randn(*leading, hidden), torch.randn(*leading, hidden)
    _check(gate.requires_grad_(), up.requires_grad_(), torch.float32, device)


def test_swiglu_gradcheck(device):
    gate = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    up = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gate, up))


def test_swiglu_gradcheck_halves(device):
    gate_up = torch.randn(3, 10, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda gu: swiglu(*gu.chunk(2, -1)), (gate_up,))


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def test_swiglu_shape_mismatch(device):
    with pytest.raises(ValueError, match=r"^gate has shape \(4, 10\) but up has shape \(4, 11\)"):
        swiglu(torch.randn(4, 10, device=device), torch.randn(4, 11, device=device))
    with pytest.raises(ValueError, match=r"^gate has shape \(4, 10\) but up has shape \(10,\)"):
        swiglu(torch.randn(4, 10, device=device), torch.randn(10, device=device))


def test_swiglu_dtype_mismatch(device):
    with pytest.raises(ValueError, match=r"^gate has dtype torch.float32 but up has dtype torch.bfloat16"):
        swiglu(torch.randn(4, 10, device=device), torch.randn(4, 10, device=device, dtype=torch.bfloat16))


@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
def test_swiglu_integer_dtype(int_dtype, device):
    with pytest.raises(ValueError, match=r"^gate has dtype"):
        swiglu(torch.ones(4, 10, device=device, dtype=int_dtype), torch.randn(4, 10, device=device))
    with pytest.raises(ValueError, match=r"^up has dtype"):
        swiglu(torch.randn(4, 10, device=device), torch.ones(4, 10, device=device, dtype=int_dtype))


def test_swiglu_scalars(device):
    with pytest.raises(ValueError, match=r"^gate and up must have at least one dimension"):
        swiglu(torch.tensor(1.0, device=device), torch.tensor(2.0, device=device))


def test_swiglu_empty_input(device):
    assert swiglu(torch.randn(0, 10, device=device), torch.randn(0, 10, device=device)).shape == (0, 10)


@pytest.mark.parametrize("shape", [(7, 123), (3, 2100), (2, 3, 1025)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sigmoid_gate_matches_reference(dtype, shape, device):
    x = torch.randn(shape).requires_grad_()
    gate = (2 * torch.randn(shape)).requires_grad_()
    check_op(sigmoid_gate, sigmoid_gate_reference, [x, gate], dtype, device, names=["x", "gate"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_sigmoid_gate_reads_the_gate_half_of_each_head(dtype, device):
    """Qwen3.5's q_proj output holds each head's query and gate side by side `[B, S, H, 2D]`: the gate half is a
    strided view, read in place."""
    query_and_gate = torch.randn(2, 5, 3, 2 * 32)
    gate = query_and_gate[..., 32:]
    x = torch.randn(2, 5, 3, 32)
    result = check_op(
        sigmoid_gate, sigmoid_gate_reference, [x.requires_grad_(), gate.requires_grad_()], dtype, device,
        names=["x", "gate"],
    )
    assert result.inputs[1].stride() == gate.stride()


def test_sigmoid_gate_rejects_mismatched_shapes(device):
    with pytest.raises(ValueError, match="gate has shape"):
        sigmoid_gate(torch.randn(3, 4, device=device), torch.randn(3, 5, device=device))
