"""chunk_gated_delta_rule against the token-by-token recurrence in float64 (CPU: interpreter, small shapes), the
PyTorch references against each other and Hugging Face's, argument checks, and (marked `gpu`) Qwen3.5-27B's W2
shapes compiled on CUDA against the chunked PyTorch reference in float64."""

import gc

import pytest
import torch
import torch.nn.functional as F
from helpers import TOLERANCE, assert_close, cast_inputs, dtype_id

import unsloth_lite.kernels.gated_delta_rule as gated_delta_rule
from unsloth_lite.kernels import chunk_gated_delta_rule
from unsloth_lite.kernels.gated_delta_rule import _value_block
from unsloth_lite.kernels.gated_delta_rule_reference import (
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)

NAMES = ["q", "k", "v", "g", "beta", "initial_state"]

# fp32 inputs: the kernel sums the recurrence chunk by chunk (WY/UT form, a triangular solve per chunk) where the
# reference goes token by token; the two summation orders differ by a few fp32 ulps per step (~1e-6 relative here
# and at W2's 8k tokens on an H200). 2e-4 leaves room and still catches any wrong term.
TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-4,
    torch.bfloat16: TOLERANCE[torch.bfloat16],
    torch.float16: TOLERANCE[torch.float16],
}


def make_inputs(batch, seq, hk, group, dk, dv, *, l2=True, n_states=None, layout="contiguous", grads=NAMES):
    """fp32 inputs (leaves marked as `grads` says): g = -softplus(randn) ≤ 0, beta = sigmoid(randn) in (0, 1);
    keys unit-norm when the kernel won't normalise them. `layout="conv"`: q, k, v are views of one
    `[B, T, 2·Hk·Dk + Hv·Dv]` tensor, as Qwen3.5 slices its conv output."""
    hv = hk * group
    if layout == "conv":
        mixed = torch.randn(batch, seq, 2 * hk * dk + hv * dv)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(batch, seq, hk, dk), k.view(batch, seq, hk, dk), v.view(batch, seq, hv, dv)
        assert not q.is_contiguous()
    else:
        q, k, v = torch.randn(batch, seq, hk, dk), torch.randn(batch, seq, hk, dk), torch.randn(batch, seq, hv, dv)
    if not l2:
        k = F.normalize(k, dim=-1)
        q = q / dk**0.5
    g = -F.softplus(torch.randn(batch, seq, hv))
    beta = torch.sigmoid(torch.randn(batch, seq, hv))
    h0 = torch.randn(n_states, hv, dk, dv) if n_states else None
    tensors = [q, k, v, g, beta, h0]
    return [t.requires_grad_(name in grads) if t is not None else None for name, t in zip(NAMES, tensors, strict=True)]


def run_and_compare(inputs, dtype, device, *, l2, cu_seqlens=None, scale=None, final=True, tol=None,
                    reference=recurrent_gated_delta_rule_reference, reference_dtype=torch.float64,
                    fn=chunk_gated_delta_rule):
    """`fn` (the kernel) on `inputs` cast to `dtype` (initial state fp32) against `reference` in `reference_dtype`
    on the same rounded values: output, final state and every gradient asked for."""
    tol = TOL[dtype] if tol is None else tol
    h0 = inputs[5]
    dtypes = [dtype] * 5 + [torch.float64 if dtype == torch.float64 else torch.float32]
    xs = cast_inputs(inputs[:5] + ([h0] if h0 is not None else []), dtypes[: 5 + (h0 is not None)], device)
    if h0 is None:
        xs.append(None)
    refs = [x.detach().to(reference_dtype).requires_grad_(x.requires_grad) if x is not None else None for x in xs]
    cu = cu_seqlens.to(device) if cu_seqlens is not None else None
    kwargs = dict(scale=scale, output_final_state=final, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    o, state = fn(*xs[:5], initial_state=xs[5], **kwargs)
    ref_o, ref_state = reference(*refs[:5], initial_state=refs[5], **kwargs)
    assert o.dtype == xs[2].dtype and o.shape == xs[2].shape
    assert_close(o, ref_o, tol, "o")
    if final:
        assert state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert_close(state, ref_state, tol, "final state")
    else:
        assert state is None
    do = torch.randn(o.shape, device=device).to(o.dtype)
    outs, ref_outs, upstream = [o], [ref_o], [do]
    if final:
        outs.append(state)
        ref_outs.append(ref_state)
        upstream.append(torch.randn(state.shape, device=device))
    if not any(x is not None and x.requires_grad for x in xs):
        return xs
    torch.autograd.backward(outs, upstream)
    torch.autograd.backward(ref_outs, [u.to(reference_dtype) for u in upstream])
    for name, x, ref in zip(NAMES, xs, refs, strict=True):
        if x is None:
            continue
        if not x.requires_grad:
            assert x.grad is None, f"{name} got a gradient it did not ask for"
            continue
        assert x.grad is not None and x.grad.dtype == x.dtype, f"d{name}: missing or wrong dtype"
        assert_close(x.grad, ref.grad, tol, f"d{name}")
    return xs


# ----------------------------------------------------------------------------------------------------------
# The kernels (CPU: Triton's interpreter) against the recurrence in float64


@pytest.mark.parametrize("l2", [True, False], ids=["l2", "no_l2"])
def test_gated_delta_rule_fp32(l2, device):
    # 70 tokens: one whole chunk and a partial one; nonzero initial state.
    inputs = make_inputs(1, 70, 2, 1, 16, 16, l2=l2, n_states=1)
    run_and_compare(inputs, torch.float32, device, l2=l2)


def test_gated_delta_rule_grouped_value_heads(device):
    # Hv = 3·Hk, two sequences of 130 tokens (3 chunks, the last partial), Dv ≠ Dk, no initial state.
    inputs = make_inputs(2, 130, 1, 3, 16, 32, l2=True)
    run_and_compare(inputs, torch.float32, device, l2=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_gated_delta_rule_16bit(dtype, device):
    inputs = make_inputs(1, 70, 1, 3, 16, 16, l2=True, n_states=1)
    run_and_compare(inputs, dtype, device, l2=True)


BY_KERNEL = dict(prepare="tf32", states="tf32x3", output="tf32", free="tf32x3", reverse="tf32", values="tf32x3")


@pytest.mark.parametrize("precision", ["tf32", "tf32x3", "tf32_rounded", "bf16x3", BY_KERNEL],
                         ids=["tf32", "tf32x3", "tf32_rounded", "bf16x3", "by_kernel"])
def test_gated_delta_rule_16bit_product_precisions(precision, device, monkeypatch):
    # The other precisions of 16-bit inputs' products, for every kernel or by kernel.
    monkeypatch.setitem(gated_delta_rule.LAUNCH, "precision", precision)
    inputs = make_inputs(1, 70, 1, 3, 16, 16, l2=True, n_states=1)
    run_and_compare(inputs, torch.bfloat16, device, l2=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gated_delta_rule_non_contiguous_views(dtype, device):
    inputs = make_inputs(1, 70, 1, 2, 16, 16, l2=True, n_states=1, layout="conv")
    xs = run_and_compare(inputs, dtype, device, l2=True)
    assert not xs[0].is_contiguous()


@pytest.mark.parametrize("dv", [64, 80], ids=["one_block", "two_blocks_masked"])
def test_gated_delta_rule_value_blocks(dv, device):
    # The sequential passes take 64 state columns a program: Dv = 64 is one program per head, Dv = 80 two, the
    # second masked past column 80 (the GVA test above runs Dv = 32, a block of 32).
    assert _value_block(dv) == 64
    inputs = make_inputs(2, 40, 1, 2, 32, dv, l2=True, n_states=2)
    run_and_compare(inputs, torch.float32, device, l2=True)


def test_compiled_launches_take_the_gpu_tested_value_block(monkeypatch):
    # Compiled, every Dv runs 64-column blocks (the width the GPU tests run; narrower ones faulted on an H200),
    # a small Dv masked; only the interpreter narrows them to Dv.
    monkeypatch.setattr(gated_delta_rule, "INTERPRET", False)
    assert [_value_block(dv) for dv in (16, 32, 80, 128)] == [64, 64, 64, 64]
    monkeypatch.setattr(gated_delta_rule, "INTERPRET", True)
    assert [_value_block(dv) for dv in (16, 32, 80, 128)] == [16, 32, 64, 64]


@pytest.mark.parametrize("dk", [64, 80], ids=["64", "80_masked"])
def test_gated_delta_rule_key_dims_of_a_chunk_or_more(dk, device):
    # From Dk = 64 on, the inverse's blocks pass through each chunk's W slot instead of a buffer of their own;
    # the backward keeps T in one. 70 tokens: a whole chunk and a partial one; nonzero initial state.
    inputs = make_inputs(1, 70, 1, 2, dk, 16, l2=True, n_states=1)
    run_and_compare(inputs, torch.float32, device, l2=True)


def test_gated_delta_rule_value_dims_of_two_chunks_or_more(device):
    # From Dv = 128 on, the value-gradient kernel's flip and dq/dk shares pass through each program's own dV_new
    # and dS_C slots instead of buffers of their own; two key heads of two value heads each sum their shares.
    inputs = make_inputs(1, 70, 2, 2, 16, 128, l2=True, n_states=1)
    run_and_compare(inputs, torch.float32, device, l2=True)


SPLIT_VALUE_CASES = {
    # (batch, seq, key heads, group, Dk, Dv), dtype, initial states, cu_seqlens
    "gva3_scratch": ((1, 70, 2, 3, 16, 16), torch.float32, 1, None),
    "in_own_slots": ((1, 70, 2, 2, 16, 128), torch.float32, 1, None),  # shares in dS_C's, flip in dV_new's slot
    "bf16": ((1, 70, 1, 3, 16, 16), torch.bfloat16, 1, None),
    "varlen": ((1, 166, 1, 2, 16, 16), torch.float32, 3, [0, 65, 66, 166]),
    "no_state": ((1, 130, 2, 1, 16, 32), torch.float32, None, None),
}


@pytest.mark.parametrize("case", list(SPLIT_VALUE_CASES))
def test_gated_delta_rule_split_value_kernels(case, device, monkeypatch):
    # LAUNCH["values_split"]: the input gradients' value sums in two kernels, the state products' terms added to
    # by the chunk pairs' kernel.
    monkeypatch.setitem(gated_delta_rule.LAUNCH, "values_split", True)
    shape, dtype, n_states, cu = SPLIT_VALUE_CASES[case]
    inputs = make_inputs(*shape, l2=True, n_states=n_states)
    cu = torch.tensor(cu, dtype=torch.int32) if cu else None
    run_and_compare(inputs, dtype, device, l2=True, cu_seqlens=cu)


def test_value_sums_split_from_wide_heads(monkeypatch):
    # The default splits them where the GPU tests run both forms (Qwen3.5's Dv = 128), one kernel below.
    assert gated_delta_rule._values_split(128) and gated_delta_rule._values_split(256)
    assert not gated_delta_rule._values_split(80) and not gated_delta_rule._values_split(16)
    monkeypatch.setitem(gated_delta_rule.LAUNCH, "values_split", True)
    assert gated_delta_rule._values_split(16)
    monkeypatch.setitem(gated_delta_rule.LAUNCH, "values_split", False)
    assert not gated_delta_rule._values_split(128)


def test_gated_delta_rule_varlen(device):
    # Three documents of 65, 1 and 100 tokens packed in one row, each from its own initial state.
    cu = torch.tensor([0, 65, 66, 166], dtype=torch.int32)
    inputs = make_inputs(1, 166, 1, 2, 16, 16, l2=True, n_states=3)
    xs = run_and_compare(inputs, torch.float32, device, l2=True, cu_seqlens=cu)
    # The same as running each document alone.
    q, k, v, g, beta, h0 = (x.detach() for x in xs)
    o, state = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu.to(device),
    )
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        doc = [x[:, bos:eos] for x in (q, k, v, g, beta)]
        o_doc, state_doc = chunk_gated_delta_rule(
            *doc, initial_state=h0[n : n + 1], output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert_close(o[:, bos:eos], o_doc, 1e-5, f"o of document {n}")
        assert_close(state[n : n + 1], state_doc, 1e-5, f"final state of document {n}")


def test_gated_delta_rule_varlen_int64_no_state(device):
    cu = torch.tensor([0, 30, 130], dtype=torch.int64)
    inputs = make_inputs(1, 130, 2, 1, 16, 16, l2=False)
    run_and_compare(inputs, torch.float32, device, l2=False, cu_seqlens=cu)


@pytest.mark.parametrize("state", ["initial_state", "no_state"])
def test_gated_delta_rule_backward_by_windows(state, device, monkeypatch):
    """A sequence longer than WINDOW runs its backward window by window (here 128, 128 and 44 tokens): every
    gradient, the initial state's included, as the recurrence's."""
    monkeypatch.setattr(gated_delta_rule, "WINDOW", 128)
    calls = []
    windows = gated_delta_rule._backward_by_windows
    monkeypatch.setattr(gated_delta_rule, "_backward_by_windows", lambda *a, **kw: calls.append(1) or windows(*a, **kw))
    inputs = make_inputs(1, 300, 1, 2, 16, 16, l2=True, n_states=1 if state == "initial_state" else None)
    run_and_compare(inputs, torch.float32, device, l2=True)
    assert calls


def _count_prepares(monkeypatch):
    """The `store_t` flag of every `_prepare` launch from here on."""
    calls = []
    prepare = gated_delta_rule._prepare
    monkeypatch.setattr(
        gated_delta_rule, "_prepare", lambda *a, store_t: calls.append(store_t) or prepare(*a, store_t=store_t)
    )
    return calls


def test_gated_delta_rule_backward_reads_the_forwards_scratch(device, monkeypatch):
    # Up to WINDOW tokens, a forward under autograd keeps T, W and the states for the backward (one
    # preparation in all, T stored); under no_grad it keeps nothing (T not even stored).
    calls = _count_prepares(monkeypatch)
    inputs = make_inputs(1, 70, 1, 2, 16, 16, l2=True, n_states=1)
    xs = run_and_compare(inputs, torch.float32, device, l2=True)
    assert calls == [True]
    with torch.no_grad():
        chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], use_qk_l2norm_in_kernel=True)
    assert calls == [True, False]


def test_gated_delta_rule_varlen_longer_than_window(device, monkeypatch):
    # Documents packed past WINDOW tokens (here 128): the forward keeps nothing, the backward recomputes.
    monkeypatch.setattr(gated_delta_rule, "WINDOW", 128)
    calls = _count_prepares(monkeypatch)
    cu = torch.tensor([0, 100, 250, 300], dtype=torch.int32)
    inputs = make_inputs(1, 300, 1, 2, 16, 16, l2=True, n_states=3)
    run_and_compare(inputs, torch.float32, device, l2=True, cu_seqlens=cu)
    assert calls == [False, True]


def test_gated_delta_rule_some_grads_only(device):
    # No final state, explicit scale, g and beta frozen, an initial state without a gradient.
    inputs = make_inputs(1, 70, 1, 2, 16, 16, l2=True, n_states=1, grads=["q", "k", "v"])
    run_and_compare(inputs, torch.float32, device, l2=True, final=False, scale=0.3)


def test_gate_gradient_at_strong_decay_as_accurate_as_hugging_face_fp32(device):
    """Qwen3.5's gates decay hard (g = -A softplus(a + dt_bias), A up to 16: here g ~ -9 a token), where the
    gate gradient sums terms far larger than itself. In fp32 ours is no further from float64 than Hugging Face's
    fp32 PyTorch path on the same inputs."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    torch.manual_seed(0)
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in make_inputs(1, 128, 2, 2, 32, 32))
    g = -torch.rand(4) * 16 * F.softplus(torch.randn(1, 128, 4) + 1)
    do = torch.randn(v.shape)

    def gate_gradient(fn, dtype, dev, repeat):
        xs = [x.to(dev, dtype).requires_grad_() for x in (q, k, v, g, beta)]
        qk = [x.repeat_interleave(2, dim=2) for x in xs[:2]] if repeat else xs[:2]
        o, _ = fn(*qk, *xs[2:], use_qk_l2norm_in_kernel=True)
        o.backward(do.to(dev, dtype))
        return xs[3].grad.double().cpu()

    exact = gate_gradient(recurrent_gated_delta_rule_reference, torch.float64, "cpu", repeat=False)
    ours = gate_gradient(chunk_gated_delta_rule, torch.float32, device, repeat=False)
    theirs = gate_gradient(torch_chunk_gated_delta_rule, torch.float32, "cpu", repeat=True)
    error = float((ours - exact).norm() / exact.norm())
    assert error <= float((theirs - exact).norm() / exact.norm()), error


# ----------------------------------------------------------------------------------------------------------
# The references


@pytest.mark.parametrize("l2", [True, False], ids=["l2", "no_l2"])
def test_chunked_reference_matches_recurrence(l2):
    cu = torch.tensor([0, 100, 101, 230])
    inputs = make_inputs(1, 230, 2, 2, 8, 12, l2=l2, n_states=3)
    run_and_compare(
        inputs, torch.float64, "cpu", l2=l2, cu_seqlens=cu, tol=1e-10, fn=chunk_gated_delta_rule_reference
    )


def test_recurrent_reference_matches_hugging_face(torch_delta_rule):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    hf = modeling_qwen3_5.torch_recurrent_gated_delta_rule
    hf = getattr(hf, "__wrapped__", hf)
    q, k, v, g, beta, h0 = (x.detach().double() for x in make_inputs(2, 37, 2, 3, 8, 12, l2=True, n_states=2))
    # HF's recurrence runs in fp32 whatever it is given; ours in float64: compare at fp32 precision.
    ours = recurrent_gated_delta_rule_reference(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    # Hugging Face's model repeats q and k to the value heads before the call (releases up to 5.1x need it).
    group = v.shape[2] // q.shape[2]
    q_hv, k_hv = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    theirs = hf(q_hv, k_hv, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(ours[0], theirs[0], 1e-5, "o")
    assert_close(ours[1], theirs[1], 1e-5, "final state")


# ----------------------------------------------------------------------------------------------------------
# Argument checks


def _bad(case):
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 4, 16)
    g, beta = -torch.rand(1, 8, 4), torch.rand(1, 8, 4)
    kwargs = {}
    if case == "q":
        q = q[0]
    elif case == "k":
        k = torch.randn(1, 8, 2, 32)
    elif case == "v":
        v = torch.randn(1, 8, 3, 16)
    elif case == "head dim":
        v = torch.randn(1, 8, 4, 160)
    elif case == "g":
        g = g[..., :2]
    elif case == "beta":
        beta = beta.to(torch.int32)
    elif case == "initial_state":
        kwargs["initial_state"] = torch.randn(1, 2, 16, 16)
    elif case == "cu_seqlens":
        q, k, v, g, beta = (torch.cat([x, x]) for x in (q, k, v, g, beta))
        kwargs["cu_seqlens"] = torch.tensor([0, 4, 8], dtype=torch.int32)
    return (q, k, v, g, beta), kwargs


@pytest.mark.parametrize("case", ["q", "k", "v", "head dim", "g", "beta", "initial_state", "cu_seqlens"])
def test_gated_delta_rule_bad_arguments(case, device):
    args, kwargs = _bad(case)
    args = [a.to(device) for a in args]
    kwargs = {key: value.to(device) for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=case):
        chunk_gated_delta_rule(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Compiled on CUDA: Qwen3.5-27B's W2 shapes (B=1, Hk=16, Hv=48, Dk=Dv=128) against the chunked reference in float64.
# Launch settings do not depend on T or the batch: 64 state columns a program in the sequential passes (16 in the
# input-gradient kernel); Dv = 80 below runs a masked second block.


@pytest.fixture
def _free_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


W2 = dict(hk=16, group=3, dk=128, dv=128)
W2_VARLEN = [0, 700, 2048, 3000, 4096]


def _w2_inputs(seq, n_states, device):
    inputs = make_inputs(1, seq, W2["hk"], W2["group"], W2["dk"], W2["dv"], l2=True, n_states=n_states)
    return [x.to(device).detach().requires_grad_(x.requires_grad) if x is not None else None for x in inputs]


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize(
    ("dtype", "seq", "varlen"),
    [
        (torch.bfloat16, 2048, False),
        (torch.bfloat16, 8192, False),
        (torch.bfloat16, 4096, True),
        (torch.float32, 2048, False),
        (torch.float32, 4096, True),
    ],
    ids=["bf16-2048", "bf16-8192", "bf16-varlen", "fp32-2048", "fp32-varlen"],
)
@pytest.mark.parametrize("split", [False, True], ids=["one_value_kernel", "split_values"])
def test_gated_delta_rule_w2_shapes(dtype, seq, varlen, split, monkeypatch):
    monkeypatch.setitem(gated_delta_rule.LAUNCH, "values_split", split)
    cu = torch.tensor(W2_VARLEN, dtype=torch.int32) if varlen else None
    n_states = len(W2_VARLEN) - 1 if varlen else 1
    inputs = _w2_inputs(seq, n_states, "cuda")
    run_and_compare(
        inputs, dtype, "cuda", l2=True, cu_seqlens=cu, reference=chunk_gated_delta_rule_reference,
        reference_dtype=torch.float64,
    )


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(("dk", "dv"), [(32, 16), (16, 32)], ids=["dk32_dv16", "dk16_dv32"])
def test_gated_delta_rule_small_heads_gpu(dtype, dk, dv):
    # Head dims of tiny models: one 64-column value block, mostly masked (`_value_block`); 200 tokens, GVA 2.
    inputs = make_inputs(1, 200, 2, 2, dk, dv, l2=True, n_states=1)
    run_and_compare(
        inputs, dtype, "cuda", l2=True, reference=chunk_gated_delta_rule_reference, reference_dtype=torch.float64
    )


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_gated_delta_rule_odd_shapes_gpu(dtype):
    # Head dims that are not powers of two, 1000 tokens, conv-output views, GVA 2. fp16: the bf16 products of
    # inputs that are not exact in bf16 (their low halves' products kept).
    inputs = make_inputs(2, 1000, 3, 2, 96, 80, l2=True, n_states=2, layout="conv")
    run_and_compare(
        inputs, dtype, "cuda", l2=True, reference=chunk_gated_delta_rule_reference, reference_dtype=torch.float64
    )
