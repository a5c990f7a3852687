"""fused_linear_cross_entropy against a float64 PyTorch reference computed from the same (dtype-rounded) inputs.

Loss and gradients of hidden, weight and bias for every reduction, ignored labels (some, all), softcap, frozen
weight, several chunks (CHUNK_BYTES patched small), non-contiguous inputs, gradcheck, argument errors. The
`gpu` tests run compiled at moderate and full sizes and capture forward + backward in a CUDA graph.
"""

import gc
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCE, assert_close, cast_inputs, dtype_id
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth_lite.kernels import fused_linear_cross_entropy
from unsloth_lite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_reference

# The module (for monkeypatching CHUNK_BYTES): `unsloth_lite.kernels.fused_linear_cross_entropy` as an attribute
# is the function, which the package re-exports under the module's name.
flce = importlib.import_module("unsloth_lite.kernels.fused_linear_cross_entropy")

REPO = Path(__file__).resolve().parent.parent
REDUCTIONS = ["mean", "sum", "none"]
IGNORE = -100


def _make(n, h, v, *, logit_std=1.0, ignore_frac=0.25, bias=False, train_weight=True, train_hidden=True):
    """fp32 hidden [n, h], weight [v, h] scaled so the logits have about `logit_std`, labels with ignored rows."""
    hidden = torch.randn(n, h).requires_grad_(train_hidden)
    weight = (logit_std / max(h, 1) ** 0.5 * torch.randn(v, h)).requires_grad_(train_weight)
    labels = torch.randint(0, v, (n,))
    labels[torch.rand(n) < ignore_frac] = IGNORE
    b = (0.5 * torch.randn(v)).requires_grad_() if bias else None
    return hidden, weight, labels, b


def _check(hidden, weight, labels, dtype, device, *, bias=None, reduction="mean", softcap=None,
           ignore_index=IGNORE, tol=None, upstream=None):
    """Runs ours on `dtype` copies of the inputs (layout of views kept) and the reference on float64 copies
    of those rounded values; backpropagates the same upstream gradient; checks loss and every gradient."""
    tol = TOLERANCE[dtype] if tol is None else tol
    names = ["hidden", "weight"] + (["bias"] if bias is not None else [])
    tensors = [hidden, weight] + ([bias] if bias is not None else [])
    xs = cast_inputs(tensors, [dtype] * len(tensors), device)
    refs = [x.detach().to(torch.float64).requires_grad_(x.requires_grad) for x in xs]
    labels = labels.to(device)

    def call(fn, args):
        b = args[2] if bias is not None else None
        return fn(args[0], args[1], labels, ignore_index, reduction, bias=b, softcap=softcap)

    loss = call(fused_linear_cross_entropy, xs)
    ref = call(fused_linear_cross_entropy_reference, refs)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.device == xs[0].device
    assert_close(loss, ref, tol, "loss")
    if reduction == "none":
        assert bool((loss[labels == ignore_index] == 0).all()), "ignored rows must have loss 0"

    if any(x.requires_grad for x in xs):
        if upstream is None:
            upstream = torch.randn(loss.shape, device=device, dtype=loss.dtype)
        torch.autograd.backward(loss, upstream)
        torch.autograd.backward(ref, upstream.to(torch.float64))
    for name, x, r in zip(names, xs, refs, strict=True):
        if not x.requires_grad:
            assert x.grad is None, f"{name} is frozen but got a gradient"
            continue
        assert x.grad is not None, f"no gradient reached {name}"
        assert x.grad.dtype == x.dtype, f"d{name} has dtype {x.grad.dtype}, expected {x.dtype}"
        assert_close(x.grad, r.grad, tol, f"d{name}")
    return loss, xs


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(1, 16, 50), (37, 33, 257)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
def test_flce_matches_reference(dtype, shape, reduction, device):
    hidden, weight, labels, _ = _make(*shape)
    if shape[0] == 1:
        labels[0] = 3  # the one row is not ignored
    _check(hidden, weight, labels, dtype, device, reduction=reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("softcap", [None, 30.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_flce_bias_and_softcap(dtype, softcap, reduction, device):
    # logits of a few units: a softcap of 2 saturates many of them
    hidden, weight, labels, bias = _make(37, 33, 257, logit_std=3.0, bias=True)
    _check(hidden, weight, labels, dtype, device, bias=bias, reduction=reduction, softcap=softcap)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_flce_frozen_weight(dtype, reduction, device):
    hidden, weight, labels, _ = _make(37, 33, 257, train_weight=False)
    _, (h, w) = _check(hidden, weight, labels, dtype, device, reduction=reduction)
    assert w.grad is None and h.grad is not None


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_only_weight_and_bias_trained(reduction, device):
    hidden, weight, labels, bias = _make(37, 33, 257, bias=True, train_hidden=False)
    _check(hidden, weight, labels, torch.float32, device, bias=bias, reduction=reduction, softcap=5.0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_flce_all_labels_ignored(dtype, reduction, device):
    """Mean over no labels is 0 (not NaN) and every gradient is exactly 0."""
    hidden, weight, labels, bias = _make(9, 16, 50, bias=True, ignore_frac=1.0)
    assert bool((labels == IGNORE).all())
    loss, xs = _check(hidden, weight, labels, dtype, device, bias=bias, reduction=reduction)
    assert bool((loss == 0).all())
    for x in xs:
        assert bool((x.grad == 0).all())


def test_flce_other_ignore_index(device):
    hidden, weight, labels, _ = _make(37, 33, 257, ignore_frac=0.0)
    labels[::3] = 7  # a real class used as the ignore index
    _check(hidden, weight, labels, torch.float32, device, ignore_index=7)


def test_flce_int32_labels(device):
    hidden, weight, labels, _ = _make(37, 33, 257)
    _check(hidden, weight, labels.to(torch.int32), torch.float32, device)


def test_flce_chunk_rows():
    # The most rows whose logits fit the budget, a multiple of 256: 768 and 512 at the Qwen vocabularies (bf16).
    assert flce.chunk_rows(16384, 151936, 2) == 768
    assert flce.chunk_rows(16384, 248320, 2) == 512
    assert 768 * 151936 * 2 <= flce.CHUNK_BYTES < 256 * 2**20
    assert flce.chunk_rows(16384, 151936, 4) == 256  # fp32 logits
    assert flce.chunk_rows(16384, 151936, 2, trained_weight=True) == 6912
    assert flce.chunk_rows(100, 1000, 2) == 100  # at most N
    assert flce.chunk_rows(16384, 2**20, 2) == 64  # 120 rows fit: a power of two
    assert flce.chunk_rows(10, 2**30, 2) == 1  # at least 1


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("rows", [4, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_flce_several_chunks(dtype, rows, reduction, device, monkeypatch):
    """N larger than the chunk: several chunks share the buffer; the last one is partial."""
    n, h, v = (37, 33, 257) if rows == 4 else (150, 16, 50)
    element_size = torch.tensor([], dtype=dtype).element_size()
    budget = (rows + rows // 2) * v * element_size  # 6 or 96 rows fit: the power of two below is `rows`
    monkeypatch.setattr(flce, "CHUNK_BYTES", budget)
    monkeypatch.setattr(flce, "CHUNK_BYTES_TRAINED_WEIGHT", budget)
    assert flce.chunk_rows(n, v, element_size) == rows and n % rows != 0
    hidden, weight, labels, bias = _make(n, h, v, bias=True, logit_std=3.0)
    _check(hidden, weight, labels, dtype, device, bias=bias, reduction=reduction, softcap=4.0)


@pytest.mark.parametrize("layout", ["transposed", "col_slice", "row_slice"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_flce_non_contiguous_inputs(dtype, layout, device, monkeypatch):
    monkeypatch.setattr(flce, "CHUNK_BYTES", 8 * 257 * 4)  # several chunks of the views
    n, h, v = 37, 33, 257
    if layout == "transposed":
        hidden, weight = torch.randn(h, n).t(), torch.randn(h, v).t() / h**0.5
    elif layout == "col_slice":
        hidden, weight = torch.randn(n, 2 * h)[:, ::2], torch.randn(v, 3 * h)[:, 1::3] / h**0.5
    else:
        hidden, weight = torch.randn(n + 5, h)[3:-2], torch.randn(v + 4, h)[4:] / h**0.5
    assert not hidden.is_contiguous() or layout == "row_slice"
    labels = torch.randint(0, v, (n,))
    labels[::4] = IGNORE
    for reduction in ("mean", "none"):
        _check(hidden.requires_grad_(), weight.requires_grad_(), labels, dtype, device, reduction=reduction)


def test_flce_non_contiguous_upstream_grad(device):
    """reduction none under `.sum()` / `.mean()` gets an expanded (stride 0) upstream gradient."""
    hidden, weight, labels, _ = _make(37, 33, 257)
    xs = cast_inputs([hidden, weight], [torch.float32] * 2, device)
    refs = [x.detach().double().requires_grad_() for x in xs]
    fused_linear_cross_entropy(*xs, labels.to(device), reduction="none").sum().mul(0.5).backward()
    fused_linear_cross_entropy_reference(*refs, labels.to(device), reduction="none").sum().mul(0.5).backward()
    for name, x, r in zip(["hidden", "weight"], xs, refs, strict=True):
        assert_close(x.grad, r.grad, TOLERANCE[torch.float32], f"d{name}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_flce_backward_twice_with_retained_graph(reduction, device):
    """The in-forward gradients are scaled in place by the first upstream gradient; a second backward through
    the retained graph rescales them."""
    hidden, weight, labels, bias = _make(37, 33, 257, bias=True)
    xs = cast_inputs([hidden, weight, bias], [torch.float32] * 3, device)
    refs = [x.detach().double().requires_grad_() for x in xs]
    labels = labels.to(device)
    loss = fused_linear_cross_entropy(xs[0], xs[1], labels, reduction=reduction, bias=xs[2])
    ref = fused_linear_cross_entropy_reference(refs[0], refs[1], labels, reduction=reduction, bias=refs[2])
    for upstream in (2.0, -0.5, 3.0):
        grads = torch.autograd.grad(loss, xs, torch.tensor(upstream, device=device), retain_graph=True)
        ref_grads = torch.autograd.grad(ref, refs, torch.tensor(upstream, device=device).double(), retain_graph=True)
        for name, g, r in zip(["hidden", "weight", "bias"], grads, ref_grads, strict=True):
            assert_close(g, r, TOLERANCE[torch.float32], f"d{name} for upstream {upstream}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_no_grad(reduction, device):
    hidden, weight, labels, bias = _make(37, 33, 257, bias=True)
    hidden, weight, bias, labels = hidden.to(device), weight.to(device), bias.to(device), labels.to(device)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, bias=bias, softcap=3.0)
    ref = fused_linear_cross_entropy_reference(
        hidden.double(), weight.double(), labels, reduction=reduction, bias=bias.double(), softcap=3.0
    )
    assert loss.grad_fn is None and loss.dtype == torch.float32
    assert_close(loss, ref, TOLERANCE[torch.float32], "loss")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_empty_batch(reduction, device):
    hidden = torch.randn(0, 16, device=device, requires_grad=True)
    weight = torch.randn(50, 16, device=device, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.int64, device=device)
    loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    loss.sum().backward()
    assert hidden.grad.shape == (0, 16) and bool((weight.grad == 0).all())


@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(1, 24),
    h=st.integers(1, 40),
    v=st.integers(1, 300),
    reduction=st.sampled_from(REDUCTIONS),
    softcap=st.sampled_from([None, 1.5, 20.0]),
    with_bias=st.booleans(),
    train_weight=st.booleans(),
    chunk=st.sampled_from([None, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_flce_hypothesis(n, h, v, reduction, softcap, with_bias, train_weight, chunk, seed, device):
    torch.manual_seed(seed)
    hidden, weight, labels, bias = _make(n, h, v, logit_std=2.0, bias=with_bias, train_weight=train_weight)
    saved = flce.CHUNK_BYTES
    if chunk is not None:
        flce.CHUNK_BYTES = chunk * v * 4
    try:
        _check(hidden, weight, labels, torch.float32, device, bias=bias, reduction=reduction, softcap=softcap)
    finally:
        flce.CHUNK_BYTES = saved


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_gradcheck(reduction, device, monkeypatch):
    monkeypatch.setattr(flce, "CHUNK_BYTES", 2 * 7 * 8)  # two fp64 rows per chunk
    hidden = torch.randn(5, 3, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, device=device, requires_grad=True)
    labels = torch.tensor([1, IGNORE, 6, 0, 2], device=device)
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_linear_cross_entropy(h, w, labels, reduction=reduction, bias=b, softcap=2.0),
        (hidden, weight, bias),
    )


# ----------------------------------------------------------------------------------------------------------
# Argument errors


def _args(device, n=4, h=8, v=10, dtype=torch.float32):
    return (
        torch.randn(n, h, device=device, dtype=dtype),
        torch.randn(v, h, device=device, dtype=dtype),
        torch.randint(0, v, (n,), device=device),
    )


def test_flce_errors_dims(device):
    hidden, weight, labels = _args(device)
    with pytest.raises(ValueError, match=r"^hidden must be 2-D"):
        fused_linear_cross_entropy(hidden[None], weight, labels)
    with pytest.raises(ValueError, match=r"^weight must be 2-D"):
        fused_linear_cross_entropy(hidden, weight[0], labels)
    with pytest.raises(ValueError, match=r"^weight has shape \(10, 9\) but hidden has H=8"):
        fused_linear_cross_entropy(hidden, torch.randn(10, 9, device=device), labels)
    with pytest.raises(ValueError, match=r"^weight has no rows"):
        fused_linear_cross_entropy(hidden, weight[:0], labels)


def test_flce_errors_labels(device):
    hidden, weight, labels = _args(device)
    with pytest.raises(ValueError, match=r"^labels has shape \(3,\); expected \(4,\)"):
        fused_linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match=r"^labels has shape \(4, 1\)"):
        fused_linear_cross_entropy(hidden, weight, labels[:, None])
    for bad in (labels.float(), labels.bool()):
        with pytest.raises(ValueError, match=r"^labels must be an integer tensor"):
            fused_linear_cross_entropy(hidden, weight, bad)
    with pytest.raises(ValueError, match=r"^labels must be an integer tensor, got list"):
        fused_linear_cross_entropy(hidden, weight, [1, 2, 3, 4])


def test_flce_errors_dtypes(device):
    hidden, weight, labels = _args(device)
    with pytest.raises(ValueError, match=r"^hidden has dtype torch.float32 but weight has dtype torch.bfloat16"):
        fused_linear_cross_entropy(hidden, weight.bfloat16(), labels)
    with pytest.raises(ValueError, match=r"^hidden has dtype torch.int64"):
        fused_linear_cross_entropy(hidden.long(), weight, labels)
    with pytest.raises(ValueError, match=r"^weight has dtype torch.int32"):
        fused_linear_cross_entropy(hidden, weight.int(), labels)


def test_flce_errors_bias(device):
    hidden, weight, labels = _args(device)
    with pytest.raises(ValueError, match=r"^bias has shape \(9,\); expected \(10,\)"):
        fused_linear_cross_entropy(hidden, weight, labels, bias=torch.randn(9, device=device))
    with pytest.raises(ValueError, match=r"^bias has shape \(1, 10\)"):
        fused_linear_cross_entropy(hidden, weight, labels, bias=torch.randn(1, 10, device=device))
    with pytest.raises(ValueError, match=r"^bias has dtype torch.bfloat16 but hidden has dtype torch.float32"):
        fused_linear_cross_entropy(hidden, weight, labels, bias=torch.randn(10, device=device).bfloat16())


def test_flce_errors_reduction_and_softcap(device):
    hidden, weight, labels = _args(device)
    with pytest.raises(ValueError, match=r"^reduction must be one of .* got 'avg'"):
        fused_linear_cross_entropy(hidden, weight, labels, reduction="avg")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^softcap must be positive"):
            fused_linear_cross_entropy(hidden, weight, labels, softcap=bad)


# ----------------------------------------------------------------------------------------------------------
# The benchmark script's CPU mode, so that it cannot rot


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_loss_tiny():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(["scripts", "."]))
    result = subprocess.run(
        [sys.executable, "scripts/bench_loss.py", "--tiny"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unsloth_lite" in result.stdout and "torch" in result.stdout.replace("unsloth_lite", "")


# ----------------------------------------------------------------------------------------------------------
# Compiled, on CUDA


@pytest.fixture
def _free_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize("chunk_mib", [None, 8])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gpu_flce_moderate(dtype, reduction, chunk_mib, monkeypatch):
    if chunk_mib is not None:
        monkeypatch.setattr(flce, "CHUNK_BYTES", chunk_mib * 2**20)
    hidden, weight, labels, bias = _make(1000, 1023, 32003, logit_std=3.0, bias=True)
    _check(hidden, weight, labels, dtype, "cuda", bias=bias, reduction=reduction, softcap=30.0)
    hidden, weight, labels, _ = _make(1000, 1023, 32003, train_weight=False)
    _check(hidden, weight, labels, dtype, "cuda", reduction=reduction)


def _chunked_reference(hidden, weight, labels, need_dw, rows=1024):
    """Mean loss, dhidden and (need_dw) dweight in fp32, a chunk of rows at a time so that it fits."""
    w = weight.float()
    n_valid = (labels != IGNORE).sum().clamp(min=1).float()
    loss = torch.zeros((), device=hidden.device)
    dh = torch.empty(hidden.shape, device=hidden.device)
    dw = torch.zeros(w.shape, device=hidden.device) if need_dw else None
    for start in range(0, hidden.shape[0], rows):
        h, y = hidden[start:start + rows].float(), labels[start:start + rows]
        logits = h @ w.t()
        loss += torch.nn.functional.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
        grad = torch.softmax(logits, -1)
        del logits
        valid = y != IGNORE
        grad[valid.nonzero().squeeze(1), y[valid]] -= 1
        grad *= (valid.float() / n_valid)[:, None]
        dh[start:start + rows] = grad @ w
        if need_dw:
            dw += grad.t() @ h
        del grad
    return loss / n_valid, dh, dw


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen_w", "trained_w"])
def test_gpu_flce_full_size(train_weight):
    n, h, v = 16384, 4096, 151936
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_(train_weight)
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::7] = IGNORE
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    grads = torch.autograd.grad(loss, [hidden, weight] if train_weight else [hidden])
    ref_loss, ref_dh, ref_dw = _chunked_reference(hidden.detach(), weight.detach(), labels, train_weight)
    assert loss.dtype == torch.float32
    assert_close(loss, ref_loss, 1e-2, "loss")
    assert_close(grads[0], ref_dh, 1e-2, "dhidden")
    if train_weight:
        assert_close(grads[1], ref_dw, 1e-2, "dweight")


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gpu_flce_cuda_graph(reduction, monkeypatch):
    """Forward + backward captured in a CUDA graph (which fails on any host synchronisation), then replayed on
    new inputs copied into the captured tensors: same results as eager."""
    monkeypatch.setattr(flce, "CHUNK_BYTES", 4 * 2**20)  # several chunks
    n, h, v = 2048, 512, 32003
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,), device="cuda")
    upstream = torch.randn((n,) if reduction == "none" else (), device="cuda")

    def step():
        loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, bias=bias, softcap=30.0)
        return (loss, *torch.autograd.grad(loss, [hidden, weight, bias], upstream))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    with torch.no_grad():
        hidden.copy_(torch.randn_like(hidden))
        labels.copy_(torch.randint(0, v, (n,), device="cuda"))
        labels[::3] = IGNORE
        upstream.copy_(torch.randn_like(upstream))
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    for name, got, want in zip(["loss", "dhidden", "dweight", "dbias"], captured, eager, strict=True):
        assert_close(got, want, 1e-5, name)
