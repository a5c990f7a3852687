import pytest
import torch
from helpers import TOLERANCE, check_op, dtype_id, transposed_randn_grad

from unsloth_lite.kernels import gated_rms_norm
from unsloth_lite.kernels.gated_rms_norm import gated_rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 47), (37, 128), (5, 515), (2, 3, 47), (128,)]


def _check(x, weight, gate, dtype, device, eps=1e-6, **kwargs):
    return check_op(
        lambda a, w, z: gated_rms_norm(a, w, z, eps),
        lambda a, w, z: gated_rms_norm_reference(a, w, z, eps),
        [x, weight, gate],
        dtype,
        device,
        names=["x", "weight", "gate"],
        **kwargs,
    )


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gated_rms_norm_matches_reference(dtype, shape, train_weight, device):
    x = torch.randn(shape).requires_grad_()
    gate = torch.randn(shape).requires_grad_()
    weight = torch.randn(shape[-1]).requires_grad_(train_weight)
    result = _check(x, weight, gate, dtype, device)
    if not train_weight:
        assert result.inputs[1].grad is None


def test_gated_rms_norm_fp16(device):
    x = torch.randn(9, 128).requires_grad_()
    gate = torch.randn(9, 128).requires_grad_()
    weight = torch.randn(128).requires_grad_()
    _check(x, weight, gate, torch.float16, device)


def test_gated_rms_norm_many_short_rows(device):
    # More row tiles than backward programs: each program walks several tiles, the last one partial.
    x = torch.randn(4 * 16 * 9 + 5, 128).requires_grad_()
    gate = torch.randn(x.shape).requires_grad_()
    weight = torch.randn(128).requires_grad_()
    _check(x, weight, gate, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gated_rms_norm_eps_and_small_inputs(dtype, device):
    x = (1e-3 * torch.randn(5, 128)).requires_grad_()
    gate = torch.randn(5, 128).requires_grad_()
    weight = torch.randn(128).requires_grad_()
    _check(x, weight, gate, dtype, device, eps=1e-5)


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("layout", ["col_slice", "transposed", "heads_of_projection", "transposed_3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gated_rms_norm_non_contiguous(dtype, layout, train_weight, device):
    if layout == "col_slice":
        x = torch.randn(7, 2 * 47)[:, ::2]
        gate = torch.randn(7, 3 * 47)[:, 47:94]  # row stride 141
    elif layout == "transposed":
        x = torch.randn(47, 7).t()
        gate = torch.randn(7, 47)
    elif layout == "heads_of_projection":
        # z of Qwen3.5: [B, T, H*D] viewed as [B, T, H, D]; x a slice of a wider tensor.
        gate = torch.randn(2, 5, 3 * 32).view(2, 5, 3, 32)
        x = torch.randn(2, 5, 3, 64)[..., 16:48]
    else:
        x = torch.randn(5, 3, 47).transpose(0, 1)
        gate = torch.randn(3, 5, 47)
    x.requires_grad_()
    gate.requires_grad_()
    weight = torch.randn(x.shape[-1]).requires_grad_(train_weight)
    _check(x, weight, gate, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gated_rms_norm_non_contiguous_upstream_grad(dtype, device):
    x = torch.randn(7, 128).requires_grad_()
    gate = torch.randn(7, 128).requires_grad_()
    weight = torch.randn(128).requires_grad_()
    result = _check(x, weight, gate, dtype, device, make_grad=transposed_randn_grad)
    assert not result.grads[0].is_contiguous()


def test_gated_rms_norm_partial_grads(device):
    # Only the gate and the weight trained; then only x.
    x = torch.randn(7, 47)
    gate = torch.randn(7, 47).requires_grad_()
    weight = torch.randn(47).requires_grad_()
    result = _check(x, weight, gate, torch.float32, device)
    assert result.inputs[0].grad is None
    x.requires_grad_()
    gate.requires_grad_(False)
    weight.requires_grad_(False)
    result = _check(x, weight, gate, torch.float32, device)
    assert result.inputs[2].grad is None


def test_gated_rms_norm_mixed_dtypes(device):
    # bf16 activations, fp32 weight (a trained norm kept in fp32), fp32 gate.
    x = torch.randn(7, 128).requires_grad_()
    gate = torch.randn(7, 128).requires_grad_()
    weight = torch.randn(128).requires_grad_()
    fn = lambda a, w, z: gated_rms_norm(a, w, z)  # noqa: E731
    xs = [x.detach().bfloat16().to(device).requires_grad_(), weight.detach().to(device).requires_grad_(),
          gate.detach().to(device).requires_grad_()]
    y = fn(*xs)
    assert y.dtype == torch.bfloat16
    ref = gated_rms_norm_reference(*[t.detach().double().requires_grad_() for t in xs])
    from helpers import assert_close

    assert_close(y, ref, TOLERANCE[torch.bfloat16], "output")
    y.backward(torch.ones_like(y))
    assert xs[0].grad.dtype == torch.bfloat16
    assert xs[1].grad.dtype == torch.float32
    assert xs[2].grad.dtype == torch.float32


def test_gated_rms_norm_forward_only_no_grad(device):
    with torch.no_grad():
        _check(torch.randn(7, 128), torch.randn(128), torch.randn(7, 128), torch.bfloat16, device)


def test_gated_rms_norm_gradcheck(device):
    x = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    gate = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w, z: gated_rms_norm(a, w, z, 1e-6), (x, weight, gate))


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def test_gated_rms_norm_wrong_shapes(device):
    x = torch.randn(4, 10, device=device)
    with pytest.raises(ValueError, match=r"^weight has shape \(11,\)"):
        gated_rms_norm(x, torch.randn(11, device=device), torch.randn(4, 10, device=device))
    with pytest.raises(ValueError, match=r"^gate has shape \(4, 11\)"):
        gated_rms_norm(x, torch.randn(10, device=device), torch.randn(4, 11, device=device))


@pytest.mark.parametrize("int_dtype", [torch.int32, torch.bool])
def test_gated_rms_norm_integer_dtype(int_dtype, device):
    x = torch.randn(4, 10, device=device)
    ints = torch.ones(4, 10, device=device, dtype=int_dtype)
    with pytest.raises(ValueError, match=r"^x has dtype"):
        gated_rms_norm(ints, torch.randn(10, device=device), x)
    with pytest.raises(ValueError, match=r"^gate has dtype"):
        gated_rms_norm(x, torch.randn(10, device=device), ints)
    with pytest.raises(ValueError, match=r"^weight has dtype"):
        gated_rms_norm(x, ints[0], x)


def test_gated_rms_norm_scalar_and_non_tensor(device):
    with pytest.raises(ValueError, match=r"^x must have at least one dimension"):
        gated_rms_norm(torch.tensor(1.0, device=device), torch.randn(1, device=device), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"^gate must be a torch.Tensor"):
        gated_rms_norm(torch.randn(4, 10, device=device), torch.randn(10, device=device), 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter error")
def test_gated_rms_norm_cpu_without_interpreter(monkeypatch):
    import unsloth_lite.kernels.utils as utils

    monkeypatch.setattr(utils, "INTERPRET", False)
    with pytest.raises(ValueError, match=r"^x is on cpu"):
        gated_rms_norm(torch.randn(4, 10), torch.randn(10), torch.randn(4, 10))


def test_gated_rms_norm_empty_input(device):
    x = torch.randn(0, 10, device=device)
    assert gated_rms_norm(x, torch.randn(10, device=device), torch.randn(0, 10, device=device)).shape == (0, 10)
