import pytest
import torch
from helpers import (
    COS_FORMS,
    TOLERANCE,
    assert_close,
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

from unsloth_lite.kernels import apply_rope
from unsloth_lite.kernels import rope as rope_module
from unsloth_lite.kernels.rope import apply_rope_reference

# (batch, q_heads, kv_heads, seq, head_dim, rotary_dim)
CASES = [
    (2, 4, 2, 5, 48, 48),  # full rotary, GQA
    (2, 4, 2, 5, 48, 12),  # partial rotary R = D/4
    (1, 8, 1, 9, 64, 16),  # B=1, MQA, partial R = D/4
    (3, 2, 2, 1, 32, 32),  # S=1, MHA
    (2, 6, 3, 7, 20, 6),  # head_dim not a power of two, odd half (3), partial
    (1, 3, 1, 4, 10, 10),  # tiny, full, non power of two
    (2, 8, 2, 9, 128, 32),  # many row blocks
]


def case_id(case):
    b, hq, hk, s, d, r = case
    return f"B{b}-Hq{hq}-Hkv{hk}-S{s}-D{d}-R{r}"


def _check(q, k, cos, sin, dtype, device, **kwargs):
    return check_op(
        apply_rope, apply_rope_reference, [q, k, cos, sin], dtype, device, names=["q", "k", "cos", "sin"], **kwargs
    )


def _assert_memory_order_kept(result):
    (q_out, k_out), (q, k) = result.outputs, result.inputs[:2]
    assert q_out.stride() == q.stride(), f"q_out strides {q_out.stride()} != q strides {q.stride()}"
    assert k_out.stride() == k.stride(), f"k_out strides {k_out.stride()} != k strides {k.stride()}"


@pytest.mark.parametrize("cos_form", COS_FORMS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_apply_rope_matches_reference(dtype, case, cos_form, device):
    batch, n_q, n_k, seq, head_dim, rotary_dim = case
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd")  # transposed views of [B, S, H, D]
    cos, sin = make_cos_sin(batch, seq, rotary_dim, cos_form)
    result = _check(q.requires_grad_(), k.requires_grad_(), cos, sin, dtype, device)
    if seq > 1:
        assert not result.inputs[0].is_contiguous()
    _assert_memory_order_kept(result)


def _rope_with_duplicated_halves(q, k, cos, sin):
    return apply_rope(q, k, cos, sin, duplicated_halves=True)


@pytest.mark.parametrize("cos_form", COS_FORMS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_apply_rope_duplicated_halves(dtype, case, cos_form, device):
    """Tables whose halves are equal (as Hugging Face builds them), declared so: the same result and gradients."""
    batch, n_q, n_k, seq, head_dim, rotary_dim = case
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd")
    cos, sin = (first_halves_repeated(t) for t in make_cos_sin(batch, seq, rotary_dim, cos_form))
    result = check_op(
        _rope_with_duplicated_halves, apply_rope_reference, [q.requires_grad_(), k.requires_grad_(), cos, sin],
        dtype, device, names=["q", "k", "cos", "sin"],
    )
    _assert_memory_order_kept(result)


@pytest.mark.parametrize("head_dim, rotary_dim, inplace", [(48, 48, False), (48, 48, True), (24, 6, True)])
def test_apply_rope_duplicated_halves_read_in_two_chunk_tiles(head_dim, rotary_dim, inplace, device):
    """Where a tile holds just the two rotary chunks (full rotary, or in place) the declared tables are read by
    their first halves alone: tables whose halves differ give the rotation by their first halves repeated."""
    q, k = (t.to(device) for t in make_qk(2, 4, 2, 5, head_dim, layout="bshd"))
    cos, sin = (t.to(device) for t in make_cos_sin(2, 5, rotary_dim))
    expected = apply_rope_reference(q.double(), k.double(), first_halves_repeated(cos).double(),
                                    first_halves_repeated(sin).double())
    different = apply_rope_reference(q.double(), k.double(), cos.double(), sin.double())
    got = apply_rope(q.clone(), k.clone(), cos, sin, inplace=inplace, duplicated_halves=True)
    for name, g, e, d in zip(("q", "k"), got, expected, different, strict=True):
        assert_close(g, e, TOLERANCE[torch.float32], name)
        assert float((e - d).norm()) > 0.1 * float(d.norm()), "tables whose halves differ must give another result"


@pytest.mark.parametrize(
    "batch, seq, layout, cos_form, expected",
    [
        (2, 5, "bshd", "bsr", True),  # projection views, a table row per token
        (1, 5, "bshd", "sr", True),  # one sequence: a shared table is per token too
        (2, 5, "bshd", "1sr", False),  # a table shared over the batch: position = token mod seq
        (2, 5, "bshd", "expanded", False),
        (2, 5, "bhsd", "bsr", False),  # head-major storage: rows of a token are seq apart
        (1, 1, "bhsd", "bsr", True),  # one token: any storage of its heads at one stride
    ],
)
def test_token_rows(batch, seq, layout, cos_form, expected):
    q, k = make_qk(batch, 4, 2, seq, 8, layout=layout)
    cos, sin = make_cos_sin(batch, seq, 8, cos_form)
    assert rope_module.token_rows(batch, seq, (q, k), (cos, sin)) is expected


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(20, 20), (24, 6)])
def test_apply_rope_token_rows_match_general_addressing(head_dim, rotary_dim, inplace, monkeypatch, device):
    """Rows addressed by token (one division) and by (batch, position, head): the same bits, both directions."""
    batch, n_q, n_k, seq = 2, 6, 3, 7
    q, k = (t.to(device) for t in make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd"))
    cos, sin = (t.to(device) for t in make_cos_sin(batch, seq, rotary_dim, "bsr"))
    grads = [torch.randn_like(q), torch.randn_like(k)]
    assert rope_module.token_rows(batch, seq, (q, k), (cos, sin))

    def run():
        inputs = [(t * 1).requires_grad_() for t in (q, k)]
        outputs = apply_rope(*(t * 1 for t in inputs), cos, sin, inplace=inplace)
        # in place, the backward rotates the incoming gradients in their own storage: a fresh copy each run
        input_grads = torch.autograd.grad(outputs, inputs, [g.clone() for g in grads])
        return [o.detach().clone() for o in outputs] + list(input_grads)

    by_token = run()
    monkeypatch.setattr(rope_module, "token_rows", lambda *args: False)
    general = run()
    for name, a, b in zip(("q_out", "k_out", "dq", "dk"), by_token, general, strict=True):
        assert not torch.isnan(a).any(), name
        assert torch.equal(a, b), f"{name}: addressing by token differs from addressing by (batch, position, head)"


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=case_id)
def test_apply_rope_fp16(case, device):
    batch, n_q, n_k, seq, head_dim, rotary_dim = case
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd")
    cos, sin = make_cos_sin(batch, seq, rotary_dim, "bsr")
    _assert_memory_order_kept(_check(q.requires_grad_(), k.requires_grad_(), cos, sin, torch.float16, device))


@pytest.mark.parametrize("rotary_dim", [48, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_apply_rope_contiguous_bhsd(dtype, rotary_dim, device):
    q, k = make_qk(2, 4, 2, 5, 48, layout="bhsd")
    cos, sin = make_cos_sin(2, 5, rotary_dim, "bsr")
    result = _check(q.requires_grad_(), k.requires_grad_(), cos, sin, dtype, device)
    assert result.outputs[0].is_contiguous() and result.outputs[1].is_contiguous()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("rotary_dim", [48, 12])
def test_apply_rope_gradients_keep_memory_order(layout, rotary_dim, device):
    """dq/dk as the Function returns them (before autograd's leaf-layout copy) have the inputs' strides."""
    q, k = make_qk(2, 4, 2, 5, 48, layout=layout, device=device)
    cos, sin = make_cos_sin(2, 5, rotary_dim, "bsr", device=device)
    q.requires_grad_()
    k.requires_grad_()
    q_out, k_out = apply_rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (torch.randn_like(q_out), torch.randn_like(k_out)))
    assert dq.stride() == q.stride() and dk.stride() == k.stride()


@pytest.mark.parametrize("make_grad", [transposed_randn_grad, expanded_randn_grad], ids=["transposed", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_apply_rope_non_contiguous_upstream_grad(dtype, make_grad, device):
    q, k = make_qk(2, 4, 2, 5, 48, layout="bshd")
    cos, sin = make_cos_sin(2, 5, 12, "bsr")
    result = _check(q.requires_grad_(), k.requires_grad_(), cos, sin, dtype, device, make_grad=make_grad)
    assert not result.grads[0].is_contiguous()


def test_apply_rope_mixed_grad_and_non_contiguous_cos(device):
    # Only q trained; cos/sin are a strided slice of wider tables.
    q, k = make_qk(2, 4, 2, 5, 48, layout="bshd")
    cos = torch.randn(2, 5, 2 * 48)[..., ::4]
    sin = torch.randn(2, 5, 48)[..., 3:27]
    assert cos.shape == sin.shape == (2, 5, 24) and not cos.is_contiguous()
    result = _check(q.requires_grad_(), k, cos, sin, torch.float32, device)
    assert result.inputs[1].grad is None


def test_apply_rope_fp32_tables_with_bf16_q_k(device):
    # Rotation tables kept in fp32 while q/k are bf16.
    q, k = make_qk(2, 4, 2, 5, 48, layout="bshd")
    cos, sin = make_cos_sin(2, 5, 12, "sr")
    result = _check(
        q.requires_grad_(),
        k.requires_grad_(),
        cos,
        sin,
        torch.bfloat16,
        device,
        input_dtypes=[None, None, torch.float32, torch.float32],
    )
    assert result.outputs[0].dtype == torch.bfloat16


def _hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _hf_apply_rotary_pos_emb(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb (unsqueeze_dim=1) with the partial-rotary split of Qwen3.5/GLM,
    written out independently of the package's reference."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([q_rot * cos + _hf_rotate_half(q_rot) * sin, q_pass], dim=-1)
    k_embed = torch.cat([k_rot * cos + _hf_rotate_half(k_rot) * sin, k_pass], dim=-1)
    return q_embed, k_embed


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_apply_rope_matches_hugging_face_formula_with_real_angles(rotary_dim, device):
    q, k = make_qk(2, 4, 2, 9, 64, layout="bshd")
    cos, sin = hf_cos_sin(9, rotary_dim, batch=2)
    check_op(
        apply_rope,
        _hf_apply_rotary_pos_emb,
        [q.requires_grad_(), k.requires_grad_(), cos, sin],
        torch.float32,
        device,
    )


@settings(max_examples=10, deadline=None)
@given(
    batch=st.integers(1, 2),
    seq=st.integers(1, 5),
    n_k=st.integers(1, 3),
    group=st.integers(1, 3),
    half_d=st.integers(1, 24),
    data=st.data(),
    cos_form=st.sampled_from(COS_FORMS),
    layout=st.sampled_from(["bshd", "bhsd"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_apply_rope_hypothesis(batch, seq, n_k, group, half_d, data, cos_form, layout, seed, device):
    head_dim = 2 * half_d
    rotary_dim = 2 * data.draw(st.integers(1, half_d), label="half_rotary_dim")
    torch.manual_seed(seed)
    q, k = make_qk(batch, n_k * group, n_k, seq, head_dim, layout=layout)
    cos, sin = make_cos_sin(batch, seq, rotary_dim, cos_form)
    _assert_memory_order_kept(_check(q.requires_grad_(), k.requires_grad_(), cos, sin, torch.float32, device))


@pytest.mark.parametrize("rotary_dim,cos_form", [(4, "bsr"), (2, "sr"), (2, "1sr")])
def test_apply_rope_gradcheck(rotary_dim, cos_form, device):
    q = torch.randn(2, 2, 2, 4, dtype=torch.float64, device=device).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 1, 2, 4, dtype=torch.float64, device=device, requires_grad=True)
    cos, sin = make_cos_sin(2, 2, rotary_dim, cos_form, device=device, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: apply_rope(a, b, cos, sin), (q, k))


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def _args(device, batch=2, n_q=4, n_k=2, seq=5, head_dim=8, rotary_dim=8):
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, device=device)
    cos, sin = make_cos_sin(batch, seq, rotary_dim, "bsr", device=device)
    return q, k, cos, sin


def test_apply_rope_valid_args_do_not_raise(device):
    apply_rope(*_args(device))


def test_apply_rope_q_not_4d(device):
    q, k, cos, sin = _args(device)
    with pytest.raises(ValueError, match=r"^q has shape \(2, 4, 40\); expected 4 dims"):
        apply_rope(q.reshape(2, 4, 40), k, cos, sin)
    with pytest.raises(ValueError, match=r"^q has shape .*expected 4 dims"):
        apply_rope(q[None], k, cos, sin)


def test_apply_rope_k_not_4d(device):
    q, k, cos, sin = _args(device)
    with pytest.raises(ValueError, match=r"^k has shape \(2, 2, 40\); expected 4 dims"):
        apply_rope(q, k.reshape(2, 2, 40), cos, sin)


@pytest.mark.parametrize("k_shape", [(1, 2, 5, 8), (2, 2, 4, 8), (2, 2, 5, 6)], ids=["batch", "seq", "head_dim"])
def test_apply_rope_k_mismatch(k_shape, device):
    q, _, cos, sin = _args(device)
    k = torch.randn(k_shape, device=device)
    with pytest.raises(ValueError, match=r"^k has shape .*must match q's"):
        apply_rope(q, k, cos, sin)


def test_apply_rope_dtype_mismatch(device):
    q, k, cos, sin = _args(device)
    with pytest.raises(ValueError, match=r"^q has dtype torch.float32 but k has dtype torch.bfloat16"):
        apply_rope(q, k.to(torch.bfloat16), cos, sin)


@pytest.mark.parametrize("name", ["q", "k", "cos", "sin"])
def test_apply_rope_integer_dtype(name, device):
    args = dict(zip(["q", "k", "cos", "sin"], _args(device), strict=True))
    args[name] = args[name].to(torch.int32)
    with pytest.raises(ValueError, match=rf"^{name} has dtype torch.int32"):
        apply_rope(**args)


def test_apply_rope_cos_sin_shape_mismatch(device):
    q, k, cos, sin = _args(device)
    with pytest.raises(ValueError, match=r"^cos has shape \(2, 5, 8\) but sin has shape \(2, 5, 6\)"):
        apply_rope(q, k, cos, sin[..., :6])
    with pytest.raises(ValueError, match=r"^cos has shape \(2, 5, 8\) but sin has shape \(5, 8\)"):
        apply_rope(q, k, cos, sin[0])


@pytest.mark.parametrize(
    "cos_shape", [(2, 4, 8), (3, 5, 8), (4, 8), (2, 1, 5, 8), (40,)], ids=["seq", "batch", "seq_2d", "4d", "1d"]
)
def test_apply_rope_cos_wrong_shape(cos_shape, device):
    q, k, _, _ = _args(device)
    cos, sin = torch.randn(cos_shape, device=device), torch.randn(cos_shape, device=device)
    with pytest.raises(ValueError, match=r"^cos has shape"):
        apply_rope(q, k, cos, sin)


@pytest.mark.parametrize("rotary_dim", [7, 3, 1, 0])
def test_apply_rope_odd_or_empty_rotary_dim(rotary_dim, device):
    q, k, _, _ = _args(device)
    cos, sin = make_cos_sin(2, 5, rotary_dim, "bsr", device=device)
    with pytest.raises(ValueError, match=rf"^cos has rotary dim {rotary_dim}"):
        apply_rope(q, k, cos, sin)


def test_apply_rope_rotary_dim_above_head_dim(device):
    q, k, _, _ = _args(device, head_dim=8)
    cos, sin = make_cos_sin(2, 5, 10, "bsr", device=device)
    with pytest.raises(ValueError, match=r"^cos has rotary dim 10; expected an even number between 2 and head_dim=8"):
        apply_rope(q, k, cos, sin)


def test_apply_rope_empty_inputs(device):
    q, k, cos, sin = _args(device, batch=1, seq=0)
    q_out, k_out = apply_rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape


def test_apply_rope_rotates_q_when_k_has_no_heads(device):
    q, _, cos, sin = _args(device, batch=1)
    k = torch.randn(1, 0, 5, 8, device=device)
    check_op(apply_rope, apply_rope_reference, [q.requires_grad_(), k, cos, sin], torch.float32, device)


# inplace=True: q and k (and, in the backward, their gradients) are rotated in their own storage.


def _projected_qk(batch, seq, n_q, n_k, head_dim, device, dtype):
    """q and k as attention gets them: transposed views of a projection output, which is not a leaf."""
    proj_q = torch.randn(batch, seq, n_q * head_dim, device=device, dtype=dtype, requires_grad=True)
    proj_k = torch.randn(batch, seq, n_k * head_dim, device=device, dtype=dtype, requires_grad=True)
    q = (proj_q * 1).view(batch, seq, n_q, head_dim).transpose(1, 2)
    k = (proj_k * 1).view(batch, seq, n_k, head_dim).transpose(1, 2)
    return proj_q, proj_k, q, k


def _blocks_of_four(monkeypatch):
    """Blocks of 4 head vectors: with 6, 3 or 1 heads a token they straddle tokens and may end part-full."""
    original = rope_module.rope_launch_config
    monkeypatch.setattr(rope_module, "rope_launch_config", lambda *a, **kw: dict(original(*a, **kw), BLOCK_R=4))


@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5]], ids=case_id)
def test_apply_rope_row_blocks_straddling_tokens(case, monkeypatch, device):
    _blocks_of_four(monkeypatch)
    batch, n_q, n_k, seq, head_dim, rotary_dim = case
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd")
    cos, sin = make_cos_sin(batch, seq, rotary_dim, "bsr")
    _check(q.requires_grad_(), k.requires_grad_(), cos, sin, torch.float32, device)


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
@pytest.mark.parametrize("blocks_of_four", [False, True], ids=["default-blocks", "blocks-of-four"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("head_dim, rotary_dim", [(12, 12), (24, 6)])
def test_apply_rope_inplace_matches_reference(
    dtype, head_dim, rotary_dim, blocks_of_four, duplicated_halves, monkeypatch, device
):
    if blocks_of_four:
        _blocks_of_four(monkeypatch)
    batch, seq, n_q, n_k = 2, 5, 6, 2
    proj_q, proj_k, q, k = _projected_qk(batch, seq, n_q, n_k, head_dim, device, dtype)
    cos, sin = make_cos_sin(batch, seq, rotary_dim, device=device, dtype=dtype)
    if duplicated_halves:
        cos, sin = first_halves_repeated(cos), first_halves_repeated(sin)
    q_before, k_before = q.detach().clone(), k.detach().clone()
    ref_q = proj_q.detach().double().requires_grad_()
    ref_k = proj_k.detach().double().requires_grad_()
    expected = apply_rope_reference(
        ref_q.view(batch, seq, n_q, head_dim).transpose(1, 2),
        ref_k.view(batch, seq, n_k, head_dim).transpose(1, 2),
        cos.double(), sin.double(),
    )

    q_out, k_out = apply_rope(q, k, cos, sin, inplace=True, duplicated_halves=duplicated_halves)

    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert q_out.stride() == q.stride()
    # the pass-through dims are left exactly as they were
    torch.testing.assert_close(q_out[..., rotary_dim:], q_before[..., rotary_dim:], rtol=0, atol=0)
    torch.testing.assert_close(k_out[..., rotary_dim:], k_before[..., rotary_dim:], rtol=0, atol=0)
    grads = [torch.randn_like(q_out), torch.randn_like(k_out)]
    torch.autograd.backward(expected, [g.double() for g in grads])
    torch.autograd.backward([q_out, k_out], [g.clone() for g in grads])
    tol = TOLERANCE[dtype]
    assert_close(q_out, expected[0], tol, "q_out")
    assert_close(k_out, expected[1], tol, "k_out")
    assert_close(proj_q.grad, ref_q.grad, tol, "dq")
    assert_close(proj_k.grad, ref_k.grad, tol, "dk")


def test_apply_rope_inplace_expanded_gradient(device):
    """A gradient with no room to be written in place (expanded by .sum()) takes the out-of-place backward."""
    proj_q, proj_k, q, k = _projected_qk(1, 3, 4, 2, 8, device, torch.float32)
    cos, sin = make_cos_sin(1, 3, 8, device=device)
    ref_q = proj_q.detach().double().requires_grad_()
    ref_k = proj_k.detach().double().requires_grad_()
    expected = apply_rope_reference(
        ref_q.view(1, 3, 4, 8).transpose(1, 2), ref_k.view(1, 3, 2, 8).transpose(1, 2), cos.double(), sin.double()
    )
    (expected[0].sum() + expected[1].sum()).backward()
    q_out, k_out = apply_rope(q, k, cos, sin, inplace=True)
    (q_out.sum() + k_out.sum()).backward()
    assert_close(proj_q.grad, ref_q.grad, 1e-5, "dq")
    assert_close(proj_k.grad, ref_k.grad, 1e-5, "dk")


def test_apply_rope_inplace_refuses_a_leaf(device):
    q, k = make_qk(1, 4, 2, 3, 8, device=device)
    cos, sin = make_cos_sin(1, 3, 8, device=device)
    with pytest.raises(ValueError, match="q, a leaf tensor"):
        apply_rope(q.detach().requires_grad_(), k.detach(), cos, sin, inplace=True)


def test_apply_rope_inplace_refuses_overlapping_memory(device):
    q = torch.randn(1, 1, 3, 8, device=device).expand(1, 4, 3, 8)
    k = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = make_cos_sin(1, 3, 8, device=device)
    with pytest.raises(ValueError, match="inplace=True needs q dense"):
        apply_rope(q, k, cos, sin, inplace=True)


def test_apply_rope_inplace_guards_saved_inputs(device):
    """An op that saved the pre-rotation q for its backward raises instead of using rotated values."""
    _, _, q, k = _projected_qk(1, 3, 4, 2, 8, device, torch.float32)
    cos, sin = make_cos_sin(1, 3, 8, device=device)
    squared = q * q  # saves q
    q_out, k_out = apply_rope(q, k, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (squared.sum() + q_out.sum() + k_out.sum()).backward()
