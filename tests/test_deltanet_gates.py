import pytest
import torch
from helpers import TOLERANCE, assert_close, cast_inputs, dtype_id, transposed_randn_grad

from unsloth_lite.kernels import deltanet_gates
from unsloth_lite.kernels.deltanet_gates import deltanet_gates_reference

NAMES = ["a", "b", "A_log", "dt_bias"]


def _inputs(shape, spread=3.0):
    n_heads = shape[-1]
    a = spread * torch.randn(shape)
    b = spread * torch.randn(shape)
    # A as Qwen3.5 initialises it: uniform in [0.01, 16], stored as its log.
    a_log = torch.empty(n_heads).uniform_(0.01, 16).log()
    dt_bias = torch.randn(n_heads)
    return [a, b, a_log, dt_bias]


def _check(inputs, dtype, device, input_dtypes=None, make_grad=None, tol=None):
    """Forward and backward against the float64 reference; g is fp32, β in b's dtype."""
    tol = TOLERANCE[dtype] if tol is None else tol
    dtypes = [dtype if d is None else d for d in (input_dtypes or [None] * 4)]
    xs = cast_inputs(inputs, dtypes, device)
    refs = [x.detach().double().requires_grad_(x.requires_grad) for x in xs]
    g, beta = deltanet_gates(*xs)
    ref_g, ref_beta = deltanet_gates_reference(*refs)
    assert g.dtype == (torch.float64 if xs[0].dtype == torch.float64 else torch.float32)
    assert beta.dtype == xs[1].dtype
    assert g.shape == xs[0].shape and beta.shape == xs[1].shape
    # g is computed from the same (rounded) inputs in fp32: fp32 accuracy whatever the storage dtype.
    assert_close(g, ref_g, TOLERANCE[torch.float32], "g")
    assert_close(beta, ref_beta, tol, "beta")
    if not any(x.requires_grad for x in xs):
        return xs
    make_grad = make_grad or (lambda out: torch.randn(out.shape, device=out.device).to(out.dtype))
    grads = [make_grad(g), make_grad(beta)]
    pairs = [(o, gr) for o, gr in zip((g, beta), grads, strict=True) if o.requires_grad]
    ref_pairs = [(o, gr.double()) for o, gr in zip((ref_g, ref_beta), grads, strict=True) if o.requires_grad]
    torch.autograd.backward([o for o, _ in pairs], [gr for _, gr in pairs])
    torch.autograd.backward([o for o, _ in ref_pairs], [gr for _, gr in ref_pairs])
    for name, x, ref in zip(NAMES, xs, refs, strict=True):
        if not x.requires_grad:
            assert x.grad is None, f"{name} does not require grad but got a gradient"
            continue
        assert x.grad.dtype == x.dtype, f"d{name} has dtype {x.grad.dtype}, expected {x.dtype}"
        # da and the parameter gradients come from an fp32 dg: fp32 accuracy, rounded once to the dtype.
        assert_close(x.grad, ref.grad, TOLERANCE[x.dtype], f"d{name}")
    return xs


@pytest.mark.parametrize("shape", [(1, 48), (37, 48), (2, 65, 16), (3, 5), (2, 3, 7)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_deltanet_gates_matches_reference(dtype, shape, device):
    inputs = [t.requires_grad_() for t in _inputs(shape)]
    _check(inputs, dtype, device)


def test_deltanet_gates_softplus_threshold_and_tails(device):
    # u = a + dt_bias across both sides of torch's threshold (20) and deep into the negative tail.
    a = torch.tensor([-60.0, -30.0, -18.0, -1.0, 0.0, 0.5, 19.0, 19.999, 20.0, 20.001, 21.0, 45.0]).repeat(3, 1)
    b = torch.linspace(-40, 40, a.numel()).view(a.shape)
    a_log = torch.randn(a.shape[-1])
    dt_bias = torch.zeros(a.shape[-1])
    _check([t.requires_grad_() for t in (a, b, a_log, dt_bias)], torch.float32, device)


def test_deltanet_gates_many_rows(device):
    # More row tiles than backward programs: partial rows cover several tiles each.
    inputs = [t.requires_grad_() for t in _inputs((4 * 9 * 21 + 3, 48))]
    _check(inputs, torch.float32, device)


@pytest.mark.parametrize("needs", [(True, False, False, False), (False, True, False, False),
                                   (False, False, True, True), (True, True, False, True)],
                         ids=["a", "b", "params", "a_b_dt"])
def test_deltanet_gates_partial_grads(needs, device):
    inputs = [t.requires_grad_(n) for t, n in zip(_inputs((9, 48)), needs, strict=True)]
    _check(inputs, torch.float32, device)


def test_deltanet_gates_bf16_with_fp32_parameters(device):
    inputs = [t.requires_grad_() for t in _inputs((2, 17, 48))]
    xs = _check(inputs, torch.bfloat16, device, input_dtypes=[None, None, torch.float32, torch.float32])
    assert xs[2].grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_deltanet_gates_non_contiguous(dtype, device):
    # a and b as column halves of one projection output, read through their row stride; transposed grads.
    ab = torch.randn(2, 9, 2 * 48) * 3
    a, b = ab[..., :48], ab[..., 48:]
    a_log, dt_bias = _inputs((48,))[2:]
    inputs = [t.requires_grad_() for t in (a, b, a_log, dt_bias)]
    _check(inputs, dtype, device, make_grad=transposed_randn_grad)


def test_deltanet_gates_no_grad(device):
    with torch.no_grad():
        _check(_inputs((5, 48)), torch.bfloat16, device)


def test_deltanet_gates_gradcheck(device):
    a, b = torch.randn(2, 3, 5, dtype=torch.float64, device=device).unbind(0)
    a_log, dt_bias = torch.randn(2, 5, dtype=torch.float64, device=device).unbind(0)
    args = tuple(t.clone().requires_grad_() for t in (a, b, a_log, dt_bias))
    assert torch.autograd.gradcheck(deltanet_gates, args)


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def test_deltanet_gates_wrong_shapes(device):
    a = torch.randn(4, 6, device=device)
    h = torch.randn(6, device=device)
    with pytest.raises(ValueError, match=r"^b has shape \(4, 5\)"):
        deltanet_gates(a, torch.randn(4, 5, device=device), h, h)
    with pytest.raises(ValueError, match=r"^A_log has shape \(5,\)"):
        deltanet_gates(a, a, torch.randn(5, device=device), h)
    with pytest.raises(ValueError, match=r"^dt_bias has shape \(1, 6\)"):
        deltanet_gates(a, a, h, h[None])
    with pytest.raises(ValueError, match=r"^a must have at least one dimension"):
        deltanet_gates(torch.tensor(1.0, device=device), torch.tensor(1.0, device=device), h[:1], h[:1])


def test_deltanet_gates_wrong_dtypes(device):
    a = torch.randn(4, 6, device=device)
    h = torch.randn(6, device=device)
    with pytest.raises(ValueError, match=r"^b has dtype"):
        deltanet_gates(a, a.int(), h, h)
    with pytest.raises(ValueError, match=r"^dt_bias has dtype"):
        deltanet_gates(a, a, h, h.long())
    with pytest.raises(ValueError, match=r"^A_log must be a torch.Tensor"):
        deltanet_gates(a, a, [1.0] * 6, h)


def test_deltanet_gates_empty_input(device):
    a = torch.randn(0, 6, device=device, dtype=torch.bfloat16)
    h = torch.randn(6, device=device)
    g, beta = deltanet_gates(a, a, h, h)
    assert g.shape == (0, 6) and g.dtype == torch.float32 and beta.dtype == torch.bfloat16
