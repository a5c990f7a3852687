"""The kernels compiled on CUDA: moderate odd shapes in fp32 and bf16 against float64 references, and the large
shapes of the benchmark spec in bf16 against fp32 references computed on the GPU (tolerance 1e-2).

Every test here is marked `gpu` and skipped without a CUDA device (or with TRITON_INTERPRET=1); the CPU test
files also run compiled on CUDA when one is present, since their `device` fixture is then "cuda".
"""

import functools
import gc

import pytest
import torch
from helpers import (
    TOLERANCE,
    check_op,
    dtype_id,
    expanded_randn_grad,
    first_halves_repeated,
    make_cos_sin,
    make_qk,
    transposed_randn_grad,
)

from unsloth_lite.kernels import apply_rope, qk_norm_rope, rms_norm, swiglu
from unsloth_lite.kernels.qk_norm_rope import qk_norm_rope_reference
from unsloth_lite.kernels.rms_norm import rms_norm_reference
from unsloth_lite.kernels.rope import apply_rope_reference
from unsloth_lite.kernels.swiglu import swiglu_reference

pytestmark = pytest.mark.gpu

CUDA = "cuda"
DTYPES = [torch.float32, torch.bfloat16]
BF16 = torch.bfloat16


def shape_id(shape):
    return "x".join(map(str, shape))


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rms_norm_check(x, weight, dtype, offset=0.0, **kwargs):
    return check_op(
        lambda a, w: rms_norm(a, w, 1e-6, offset),
        lambda a, w: rms_norm_reference(a, w, 1e-6, offset),
        [x, weight],
        dtype,
        CUDA,
        names=["x", "weight"],
        **kwargs,
    )


def _rope_check(q, k, cos, sin, dtype, duplicated_halves=False, **kwargs):
    if duplicated_halves:
        cos, sin = first_halves_repeated(cos), first_halves_repeated(sin)
    result = check_op(
        functools.partial(apply_rope, duplicated_halves=duplicated_halves), apply_rope_reference, [q, k, cos, sin],
        dtype, CUDA, names=["q", "k", "cos", "sin"], **kwargs,
    )
    (q_out, k_out), (q_in, k_in) = result.outputs, result.inputs[:2]
    assert q_out.stride() == q_in.stride() and k_out.stride() == k_in.stride()
    return result


def _qk_norm_rope_check(q, k, q_weight, k_weight, cos, sin, dtype, offset=0.0, duplicated_halves=False, **kwargs):
    if duplicated_halves:
        cos, sin = first_halves_repeated(cos), first_halves_repeated(sin)
    result = check_op(
        lambda *a: qk_norm_rope(*a, eps=1e-6, offset=offset, duplicated_halves=duplicated_halves),
        lambda *a: qk_norm_rope_reference(*a, eps=1e-6, offset=offset),
        [q, k, q_weight, k_weight, cos, sin],
        dtype,
        CUDA,
        names=["q", "k", "q_weight", "k_weight", "cos", "sin"],
        **kwargs,
    )
    (q_out, k_out), (q_in, k_in) = result.outputs, result.inputs[:2]
    assert q_out.stride() == q_in.stride() and k_out.stride() == k_in.stride()
    return result


# ----------------------------------------------------------------------------------------------------------
# Moderate odd shapes, compiled, float64 references


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 4097), (257, 1000), (1023, 2049), (3, 37, 515)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_rms_norm(dtype, shape, offset, train_weight):
    x = torch.randn(shape, device=CUDA).requires_grad_()
    weight = torch.randn(shape[-1], device=CUDA).requires_grad_(train_weight)
    result = _rms_norm_check(x, weight, dtype, offset)
    assert (result.inputs[1].grad is None) == (not train_weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_rms_norm_non_contiguous(dtype):
    x = torch.randn(257, 2 * 1000, device=CUDA)[:, ::2].requires_grad_()
    weight = torch.randn(1000, device=CUDA).requires_grad_()
    _rms_norm_check(x, weight, dtype, 1.0, make_grad=transposed_randn_grad)


@pytest.mark.parametrize("shape", [(1, 47), (513, 3001), (7, 33, 1025)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_swiglu(dtype, shape):
    gate = torch.randn(shape, device=CUDA).requires_grad_()
    up = torch.randn(shape, device=CUDA).requires_grad_()
    check_op(swiglu, swiglu_reference, [gate, up], dtype, CUDA, names=["gate", "up"])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_swiglu_halves_of_one_tensor(dtype):
    gate, up = torch.randn(513, 2 * 3001, device=CUDA).chunk(2, -1)
    check_op(
        swiglu,
        swiglu_reference,
        [gate.requires_grad_(), up.requires_grad_()],
        dtype,
        CUDA,
        names=["gate", "up"],
        make_grad=expanded_randn_grad,
    )


# (batch, q_heads, kv_heads, seq, head_dim, rotary_dim)
GPU_ROPE_CASES = [(2, 12, 4, 129, 128, 128), (3, 6, 2, 77, 256, 64), (1, 5, 5, 33, 96, 24)]


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
@pytest.mark.parametrize("cos_form", ["bsr", "sr"])
@pytest.mark.parametrize("case", GPU_ROPE_CASES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_apply_rope(dtype, case, cos_form, duplicated_halves):
    batch, n_q, n_k, seq, head_dim, rotary_dim = case
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd", device=CUDA)
    cos, sin = make_cos_sin(batch, seq, rotary_dim, cos_form, device=CUDA)
    _rope_check(q.requires_grad_(), k.requires_grad_(), cos, sin, dtype, duplicated_halves)


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("case", GPU_ROPE_CASES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_qk_norm_rope(dtype, case, offset, duplicated_halves):
    batch, n_q, n_k, seq, head_dim, rotary_dim = case
    q, k = make_qk(batch, n_q, n_k, seq, head_dim, layout="bshd", device=CUDA)
    cos, sin = make_cos_sin(batch, seq, rotary_dim, "1sr", device=CUDA)
    q_weight = torch.randn(head_dim, device=CUDA).requires_grad_()
    k_weight = torch.randn(head_dim, device=CUDA).requires_grad_()
    _qk_norm_rope_check(
        q.requires_grad_(),
        k.requires_grad_(),
        q_weight,
        k_weight,
        cos,
        sin,
        dtype,
        offset,
        duplicated_halves,
        make_grad=transposed_randn_grad,
    )


# ----------------------------------------------------------------------------------------------------------
# Benchmark-spec shapes, bf16, fp32 references on the GPU

BIG_TOL = TOLERANCE[BF16]


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_gpu_big_rms_norm(hidden, train_weight):
    x = torch.randn(16384, hidden, device=CUDA, dtype=BF16).requires_grad_()
    weight = torch.randn(hidden, device=CUDA, dtype=BF16).requires_grad_(train_weight)
    result = _rms_norm_check(x, weight, BF16, 0.0, reference_dtype=torch.float32, tol=BIG_TOL)
    assert (result.inputs[1].grad is None) == (not train_weight)


def test_gpu_big_swiglu():
    gate = torch.randn(16384, 17408, device=CUDA, dtype=BF16).requires_grad_()
    up = torch.randn(16384, 17408, device=CUDA, dtype=BF16).requires_grad_()
    check_op(
        swiglu,
        swiglu_reference,
        [gate, up],
        BF16,
        CUDA,
        names=["gate", "up"],
        reference_dtype=torch.float32,
        tol=BIG_TOL,
    )


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
def test_gpu_big_apply_rope(duplicated_halves):
    q, k = make_qk(8, 32, 8, 2048, 128, layout="bshd", device=CUDA, dtype=BF16)
    cos, sin = make_cos_sin(8, 2048, 128, "bsr", device=CUDA, dtype=BF16)
    _rope_check(
        q.requires_grad_(), k.requires_grad_(), cos, sin, BF16, duplicated_halves,
        reference_dtype=torch.float32, tol=BIG_TOL,
    )


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
def test_gpu_big_apply_rope_qwen35_partial(duplicated_halves):
    q, k = make_qk(4, 24, 4, 2048, 256, layout="bshd", device=CUDA, dtype=BF16)
    cos, sin = make_cos_sin(4, 2048, 64, "bsr", device=CUDA, dtype=BF16)
    _rope_check(
        q.requires_grad_(), k.requires_grad_(), cos, sin, BF16, duplicated_halves,
        reference_dtype=torch.float32, tol=BIG_TOL,
    )


@pytest.mark.parametrize("duplicated_halves", [False, True], ids=["tables", "duplicated-halves"])
@pytest.mark.parametrize("train_weights", [True, False], ids=["trained_w", "frozen_w"])
def test_gpu_big_qk_norm_rope_qwen35(train_weights, duplicated_halves):
    q, k = make_qk(4, 24, 4, 2048, 256, layout="bshd", device=CUDA, dtype=BF16)
    cos, sin = make_cos_sin(4, 2048, 64, "bsr", device=CUDA, dtype=BF16)
    q_weight = torch.randn(256, device=CUDA, dtype=BF16).requires_grad_(train_weights)
    k_weight = torch.randn(256, device=CUDA, dtype=BF16).requires_grad_(train_weights)
    _qk_norm_rope_check(
        q.requires_grad_(),
        k.requires_grad_(),
        q_weight,
        k_weight,
        cos,
        sin,
        BF16,
        offset=1.0,
        duplicated_halves=duplicated_halves,
        reference_dtype=torch.float32,
        tol=BIG_TOL,
    )
