import importlib

import pytest
import torch
from helpers import (
    COS_FORMS,
    check_op,
    dtype_id,
    expanded_randn_grad,
    first_halves_repeated,
    hf_cos_sin,
    make_cos_sin,
    make_qk,
    transposed_randn_grad,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth_lite.kernels import qk_norm_rope
from unsloth_lite.kernels.qk_norm_rope import qk_norm_rope_reference

NAMES = ["q", "k", "q_weight", "k_weight", "cos", "sin"]

# (batch, q_heads, kv_heads, seq, head_dim, rotary_dim)
CASES = [
    (2, 4, 2, 5, 48, 48),  # full rotary, GQA
    (2, 4, 2, 5, 48, 12),  # partial rotary R = D/4
    (1, 8, 1, 9, 64, 16),  # B=1, MQA, partial R = D/4 (Qwen3.5's form)
    (3, 2, 2, 1, 32, 32),  # S=1, MHA
    (2, 6, 3, 3, 20, 6),  # head_dim not a power of two, odd half (3), partial
    (2, 8, 2, 9, 128, 32),  # many row blocks: backward programs walk several blocks each (weight grads)
]


def case_id(case):
    b, hq, hk, s, d, r = case
    return f"B{b}-Hq{hq}-Hkv{hk}-S{s}-D{d}-R{r}"


def _inputs(
    case, cos_form="bsr", layout="bshd", train_q_weight=True, train_k_weight=True, duplicated_halves=False
):
    batch, n_q, n_k, seq, head_dim, rotary_dim = case
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, layout=layout)
    q_weight = torch.randn(head_dim).requires_grad_(train_q_weight)
    k_weight = torch.randn(head_dim).requires_grad_(train_k_weight)
    cos, sin = make_cos_sin(batch, seq, rotary_dim, cos_form)
    if duplicated_halves:
        cos, sin = first_halves_repeated(cos), first_halves_repeated(sin)
    return [q.requires_grad_(), k.requires_grad_(), q_weight, k_weight, cos, sin]


def _check(inputs, dtype, device, eps=1e-6, offset=0.0, duplicated_halves=False, **kwargs):
    return check_op(
        lambda *a: qk_norm_rope(*a, eps=eps, offset=offset, duplicated_halves=duplicated_halves),
        lambda *a: qk_norm_rope_reference(*a, eps=eps, offset=offset),
        inputs,
        dtype,
        device,
        names=NAMES,
        **kwargs,
    )


def _assert_memory_order_kept(result):
    (q_out, k_out), (q, k) = result.outputs, result.inputs[:2]
    assert q_out.stride() == q.stride(), f"q_out strides {q_out.stride()} != q strides {q.stride()}"
    assert k_out.stride() == k.stride(), f"k_out strides {k_out.stride()} != k strides {k.stride()}"


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_qk_norm_rope_matches_reference(dtype, case, offset, duplicated_halves, device):
    inputs = _inputs(case, duplicated_halves=duplicated_halves)
    result = _check(inputs, dtype, device, offset=offset, duplicated_halves=duplicated_halves)
    if case[3] > 1:
        assert not result.inputs[0].is_contiguous()  # transposed views of [B, S, H, D]
    _assert_memory_order_kept(result)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=case_id)
def test_qk_norm_rope_row_blocks_straddling_tokens(case, monkeypatch, device):
    """Blocks of 8 head vectors over tokens of 6 and 3 (or 4 and 2) heads: blocks straddle tokens, and the
    last one of q and of k may be part-full."""
    module = importlib.import_module("unsloth_lite.kernels.qk_norm_rope")
    original = module.launch_config
    monkeypatch.setattr(module, "launch_config", lambda *a: dict(original(*a), BLOCK_R=8))
    _check(_inputs(case), torch.float32, device, offset=1.0)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=case_id)
def test_qk_norm_rope_fp16(case, device):
    _assert_memory_order_kept(_check(_inputs(case), torch.float16, device, offset=1.0))


@pytest.mark.parametrize("cos_form", COS_FORMS)
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=case_id)
def test_qk_norm_rope_cos_forms(case, cos_form, device):
    _check(_inputs(case, cos_form=cos_form), torch.float32, device, offset=1.0)


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("trained", ["none", "q_weight", "k_weight", "both"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=case_id)
def test_qk_norm_rope_frozen_and_trained_weights(case, trained, offset, duplicated_halves, device):
    inputs = _inputs(
        case, train_q_weight=trained in ("q_weight", "both"), train_k_weight=trained in ("k_weight", "both"),
        duplicated_halves=duplicated_halves,
    )
    result = _check(inputs, torch.bfloat16, device, offset=offset, duplicated_halves=duplicated_halves)
    q_weight, k_weight = result.inputs[2:4]
    assert (q_weight.grad is None) == (trained not in ("q_weight", "both"))
    assert (k_weight.grad is None) == (trained not in ("k_weight", "both"))


@pytest.mark.parametrize("rotary_dim", [48, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_qk_norm_rope_contiguous_bhsd(dtype, rotary_dim, device):
    result = _check(_inputs((2, 4, 2, 5, 48, rotary_dim), layout="bhsd"), dtype, device)
    assert result.outputs[0].is_contiguous() and result.outputs[1].is_contiguous()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("rotary_dim", [48, 12])
def test_qk_norm_rope_gradients_keep_memory_order(layout, rotary_dim, device):
    """dq/dk as the Function returns them (before autograd's leaf-layout copy) have the inputs' strides."""
    q, k = make_qk(2, 4, 2, 5, 48, layout=layout, device=device)
    q.requires_grad_()
    k.requires_grad_()
    q_weight = torch.randn(48, device=device, requires_grad=True)
    k_weight = torch.randn(48, device=device, requires_grad=True)
    cos, sin = make_cos_sin(2, 5, rotary_dim, "bsr", device=device)
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, cos, sin)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (torch.randn_like(q_out), torch.randn_like(k_out)))
    assert dq.stride() == q.stride() and dk.stride() == k.stride()


@pytest.mark.parametrize("make_grad", [transposed_randn_grad, expanded_randn_grad], ids=["transposed", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_qk_norm_rope_non_contiguous_upstream_grad(dtype, make_grad, device):
    result = _check(_inputs(CASES[1]), dtype, device, offset=1.0, make_grad=make_grad)
    assert not result.grads[0].is_contiguous()


def test_qk_norm_rope_fp32_weights_with_bf16_q_k(device):
    result = _check(
        _inputs(CASES[1]),
        torch.bfloat16,
        device,
        offset=1.0,
        input_dtypes=[None, None, torch.float32, torch.float32, None, None],
    )
    assert result.outputs[0].dtype == torch.bfloat16
    assert result.inputs[2].grad.dtype == torch.float32


def test_qk_norm_rope_eps_and_small_inputs(device):
    inputs = _inputs(CASES[1])
    inputs[0] = (1e-3 * inputs[0].detach()).requires_grad_()
    _check(inputs, torch.float32, device, eps=1e-5, offset=1.0)


def test_qk_norm_rope_only_weights_trained(device):
    inputs = _inputs(CASES[1])
    inputs[0] = inputs[0].detach()
    inputs[1] = inputs[1].detach()
    result = _check(inputs, torch.float32, device)
    assert result.inputs[0].grad is None and result.inputs[1].grad is None


def _hf_rms_norm(x, weight, eps, offset):
    """Qwen3RMSNorm (offset 0) / Qwen3.5's zero-centred RMSNorm (offset 1), written out independently."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32 if input_dtype != torch.float64 else torch.float64)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return ((offset + weight) * hidden).to(input_dtype)


def _hf_rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def _hf_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, offset):
    q, k = _hf_rms_norm(q, q_weight, eps, offset), _hf_rms_norm(k, k_weight, eps, offset)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    q = torch.cat([q[..., :r] * cos + _hf_rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
    k = torch.cat([k[..., :r] * cos + _hf_rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
    return q, k


@pytest.mark.parametrize("offset,rotary_dim", [(0.0, 64), (1.0, 16)], ids=["qwen3", "qwen3.5"])
def test_qk_norm_rope_matches_hugging_face_formula_with_real_angles(offset, rotary_dim, device):
    q, k = make_qk(2, 4, 2, 9, 64, layout="bshd")
    cos, sin = hf_cos_sin(9, rotary_dim, batch=2)
    inputs = [
        q.requires_grad_(),
        k.requires_grad_(),
        torch.randn(64).requires_grad_(),
        torch.randn(64).requires_grad_(),
        cos,
        sin,
    ]
    check_op(
        lambda *a: qk_norm_rope(*a, eps=1e-6, offset=offset),
        lambda *a: _hf_qk_norm_rope(*a, eps=1e-6, offset=offset),
        inputs,
        torch.float32,
        device,
        names=NAMES,
    )


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 2),
    seq=st.integers(1, 4),
    n_k=st.integers(1, 3),
    group=st.integers(1, 3),
    half_d=st.integers(1, 24),
    data=st.data(),
    cos_form=st.sampled_from(COS_FORMS),
    layout=st.sampled_from(["bshd", "bhsd"]),
    offset=st.sampled_from([0.0, 1.0]),
    train_weights=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_qk_norm_rope_hypothesis(
    batch, seq, n_k, group, half_d, data, cos_form, layout, offset, train_weights, seed, device
):
    head_dim = 2 * half_d
    rotary_dim = 2 * data.draw(st.integers(1, half_d), label="half_rotary_dim")
    torch.manual_seed(seed)
    case = (batch, n_k * group, n_k, seq, head_dim, rotary_dim)
    inputs = _inputs(case, cos_form, layout, train_weights, train_weights)
    _assert_memory_order_kept(_check(inputs, torch.float32, device, offset=offset))


@pytest.mark.parametrize(
    "rotary_dim,offset,cos_form", [(6, 0.0, "bsr"), (2, 1.0, "sr")], ids=["full", "partial-offset1"]
)
def test_qk_norm_rope_gradcheck(rotary_dim, offset, cos_form, device):
    f64 = dict(dtype=torch.float64, device=device)
    q = torch.randn(1, 2, 2, 6, **f64).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 1, 2, 6, **f64).requires_grad_()
    q_weight = torch.randn(6, **f64).requires_grad_()
    k_weight = torch.randn(6, **f64).requires_grad_()
    cos, sin = make_cos_sin(1, 2, rotary_dim, cos_form, device=device, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: qk_norm_rope(a, b, c, d, cos, sin, eps=1e-6, offset=offset), (q, k, q_weight, k_weight)
    )


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def _args(device, batch=2, n_q=4, n_k=2, seq=5, head_dim=8, rotary_dim=8):
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, device=device)
    cos, sin = make_cos_sin(batch, seq, rotary_dim, "bsr", device=device)
    q_weight, k_weight = torch.randn(head_dim, device=device), torch.randn(head_dim, device=device)
    return dict(q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin)


def test_qk_norm_rope_valid_args_do_not_raise(device):
    qk_norm_rope(**_args(device))


@pytest.mark.parametrize("name", ["q_weight", "k_weight"])
@pytest.mark.parametrize("shape", [(7,), (9,), (1, 8), ()], ids=["short", "long", "2d", "scalar"])
def test_qk_norm_rope_weight_wrong_shape(name, shape, device):
    args = _args(device)
    args[name] = torch.randn(shape, device=device)
    with pytest.raises(ValueError, match=rf"^{name} has shape .*expected \(8,\)"):
        qk_norm_rope(**args)


@pytest.mark.parametrize("name", NAMES)
def test_qk_norm_rope_integer_dtype(name, device):
    args = _args(device)
    args[name] = args[name].to(torch.int64)
    with pytest.raises(ValueError, match=rf"^{name} has dtype torch.int64"):
        qk_norm_rope(**args)


def test_qk_norm_rope_q_not_4d(device):
    args = _args(device)
    args["q"] = args["q"].reshape(2, 4, 40)
    with pytest.raises(ValueError, match=r"^q has shape \(2, 4, 40\); expected 4 dims"):
        qk_norm_rope(**args)


def test_qk_norm_rope_k_not_4d(device):
    args = _args(device)
    args["k"] = args["k"][0]
    with pytest.raises(ValueError, match=r"^k has shape .*expected 4 dims"):
        qk_norm_rope(**args)


@pytest.mark.parametrize("k_shape", [(1, 2, 5, 8), (2, 2, 6, 8), (2, 2, 5, 10)], ids=["batch", "seq", "head_dim"])
def test_qk_norm_rope_k_mismatch(k_shape, device):
    args = _args(device)
    args["k"] = torch.randn(k_shape, device=device)
    with pytest.raises(ValueError, match=r"^k has shape .*must match q's"):
        qk_norm_rope(**args)


def test_qk_norm_rope_dtype_mismatch(device):
    args = _args(device)
    args["k"] = args["k"].to(torch.float16)
    with pytest.raises(ValueError, match=r"^q has dtype torch.float32 but k has dtype torch.float16"):
        qk_norm_rope(**args)


def test_qk_norm_rope_cos_sin_shape_mismatch(device):
    args = _args(device)
    args["sin"] = args["sin"][:1]
    with pytest.raises(ValueError, match=r"^cos has shape \(2, 5, 8\) but sin has shape \(1, 5, 8\)"):
        qk_norm_rope(**args)


@pytest.mark.parametrize("cos_shape", [(2, 6, 8), (4, 5, 8), (6, 8)], ids=["seq", "batch", "seq_2d"])
def test_qk_norm_rope_cos_wrong_shape(cos_shape, device):
    args = _args(device)
    args["cos"], args["sin"] = torch.randn(cos_shape, device=device), torch.randn(cos_shape, device=device)
    with pytest.raises(ValueError, match=r"^cos has shape"):
        qk_norm_rope(**args)


@pytest.mark.parametrize("rotary_dim", [5, 1])
def test_qk_norm_rope_odd_rotary_dim(rotary_dim, device):
    args = _args(device)
    args["cos"], args["sin"] = make_cos_sin(2, 5, rotary_dim, "bsr", device=device)
    with pytest.raises(ValueError, match=rf"^cos has rotary dim {rotary_dim}"):
        qk_norm_rope(**args)


def test_qk_norm_rope_rotary_dim_above_head_dim(device):
    args = _args(device)
    args["cos"], args["sin"] = make_cos_sin(2, 5, 12, "bsr", device=device)
    with pytest.raises(ValueError, match=r"^cos has rotary dim 12; expected an even number between 2 and head_dim=8"):
        qk_norm_rope(**args)


def test_qk_norm_rope_empty_inputs(device):
    args = _args(device, batch=1, seq=0)
    q_out, k_out = qk_norm_rope(**args)
    assert q_out.shape == args["q"].shape and k_out.shape == args["k"].shape


def test_qk_norm_rope_normalises_q_when_k_has_no_heads(device):
    args = _args(device, batch=1)
    args["k"] = torch.randn(1, 0, 5, 8, device=device)
    args["q"].requires_grad_()
    args["q_weight"].requires_grad_()
    check_op(qk_norm_rope, qk_norm_rope_reference, [args[name] for name in NAMES], torch.float32, device, names=NAMES)


@pytest.mark.parametrize("trained_weights", [False, True], ids=["frozen", "trained"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(20, 20), (24, 6)])
def test_qk_norm_rope_token_rows_match_general_addressing(head_dim, rotary_dim, trained_weights, monkeypatch, device):
    """Rows addressed by token (one division) and by (batch, position, head): the same bits, both directions."""
    module = importlib.import_module("unsloth_lite.kernels.qk_norm_rope")
    batch, n_q, n_k, seq = 2, 6, 3, 7
    q, k = (t.to(device) for t in make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd"))
    cos, sin = (t.to(device) for t in make_cos_sin(batch, seq, rotary_dim, "bsr"))
    weights = [1 + 0.1 * torch.randn(head_dim, device=device) for _ in range(2)]
    grads = [torch.randn_like(q), torch.randn_like(k)]
    assert module.token_rows(batch, seq, (q, k), (cos, sin))

    def run():
        inputs = [q.clone().requires_grad_(), k.clone().requires_grad_()]
        inputs += [w.clone().requires_grad_(trained_weights) for w in weights]
        outputs = qk_norm_rope(*inputs, cos, sin)
        wanted = [t for t in inputs if t.requires_grad]
        return [o.detach() for o in outputs] + list(torch.autograd.grad(outputs, wanted, grads))

    by_token = run()
    monkeypatch.setattr(module, "token_rows", lambda *args: False)
    general = run()
    assert len(by_token) == (6 if trained_weights else 4)
    for i, (a, b) in enumerate(zip(by_token, general, strict=True)):
        assert not torch.isnan(a).any(), i
        assert torch.equal(a, b), f"output {i}: addressing by token differs from addressing by (batch, position, head)"
