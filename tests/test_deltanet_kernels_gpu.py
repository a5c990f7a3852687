"""The Gated DeltaNet kernels (causal_conv1d, gated_rms_norm, deltanet_gates) compiled on CUDA: moderate odd
shapes in fp32 and bf16 against float64 references, and Qwen3.5-27B's shapes in bf16 against fp32 references
computed on the GPU (tolerance 1e-2).

Every test here is marked `gpu` and skipped without a CUDA device (or with TRITON_INTERPRET=1).
"""

import gc

import pytest
import torch
from helpers import TOLERANCE, check_op, dtype_id, transposed_randn_grad
from test_deltanet_gates import _check as _gates_check
from test_deltanet_gates import _inputs as _gates_inputs

from unsloth_lite.kernels import causal_conv1d, gated_rms_norm
from unsloth_lite.kernels.causal_conv1d import causal_conv1d_reference
from unsloth_lite.kernels.gated_rms_norm import gated_rms_norm_reference

pytestmark = pytest.mark.gpu

CUDA = "cuda"
DTYPES = [torch.float32, torch.bfloat16]
BF16 = torch.bfloat16
BIG_TOL = TOLERANCE[BF16]

# Qwen3.5-27B's linear-attention layers: 16 key heads and 48 value heads of 128.
QWEN35_CONV_CHANNELS = 2 * 16 * 128 + 48 * 128  # 10240
QWEN35_V_HEADS = 48
QWEN35_HEAD_DIM = 128
SEQ = 2048


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _conv_check(x, weight, bias, dtype, activation="silu", cu_seqlens=None, **kwargs):
    result = check_op(
        lambda a, w, b: causal_conv1d(a, w, b, activation, cu_seqlens),
        lambda a, w, b: causal_conv1d_reference(a, w, b, activation, cu_seqlens),
        [x, weight, bias],
        dtype,
        CUDA,
        names=["x", "weight", "bias"],
        **kwargs,
    )
    assert result.outputs[0].stride() == result.inputs[0].stride()
    return result


def _norm_check(x, weight, gate, dtype, **kwargs):
    return check_op(
        gated_rms_norm, gated_rms_norm_reference, [x, weight, gate], dtype, CUDA, names=["x", "weight", "gate"],
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------------------
# Moderate odd shapes, compiled, float64 references


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "none"])
@pytest.mark.parametrize("shape", [(1, 100, 1), (2, 300, 37), (3, 1000, 130), (1, 48, 1025)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_causal_conv1d(dtype, shape, activation):
    batch, channels, seq = shape
    x = torch.randn(batch, seq, channels, device=CUDA).transpose(1, 2).requires_grad_()
    weight = torch.randn(channels, 4, device=CUDA).requires_grad_()
    bias = torch.randn(channels, device=CUDA).requires_grad_()
    _conv_check(x, weight, bias, dtype, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_causal_conv1d_cu_seqlens(dtype):
    cu_seqlens = torch.tensor([0, 3, 400, 401, 777], device=CUDA, dtype=torch.int32)
    x = torch.randn(1, 777, 300, device=CUDA).transpose(1, 2).requires_grad_()
    weight = torch.randn(300, 4, device=CUDA).requires_grad_()
    _conv_check(x, weight, None, dtype, cu_seqlens=cu_seqlens, make_grad=transposed_randn_grad)


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
@pytest.mark.parametrize("shape", [(1, 47), (4099, 128), (3, 37, 515)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_gated_rms_norm(dtype, shape, train_weight):
    x = torch.randn(shape, device=CUDA).requires_grad_()
    gate = torch.randn(shape, device=CUDA).requires_grad_()
    weight = torch.randn(shape[-1], device=CUDA).requires_grad_(train_weight)
    _norm_check(x, weight, gate, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gpu_deltanet_gates(dtype):
    _gates_check([t.to(CUDA).requires_grad_() for t in _gates_inputs((3, 1001, 48))], dtype, CUDA)


# ----------------------------------------------------------------------------------------------------------
# Qwen3.5-27B's shapes, bf16, fp32 references on the GPU


@pytest.mark.parametrize("packed", [False, True], ids=["one_sequence", "three_documents"])
def test_gpu_big_causal_conv1d_qwen35(packed):
    x = torch.randn(1, SEQ, QWEN35_CONV_CHANNELS, device=CUDA, dtype=BF16).transpose(1, 2).requires_grad_()
    weight = torch.randn(QWEN35_CONV_CHANNELS, 4, device=CUDA, dtype=BF16).requires_grad_()
    cu_seqlens = torch.tensor([0, 301, 1100, SEQ], device=CUDA, dtype=torch.int32) if packed else None
    _conv_check(x, weight, None, BF16, cu_seqlens=cu_seqlens, reference_dtype=torch.float32, tol=BIG_TOL)


@pytest.mark.parametrize("train_weight", [True, False], ids=["trained_w", "frozen_w"])
def test_gpu_big_gated_rms_norm_qwen35(train_weight):
    rows = SEQ * QWEN35_V_HEADS
    x = torch.randn(rows, QWEN35_HEAD_DIM, device=CUDA, dtype=BF16).requires_grad_()
    gate = torch.randn(rows, QWEN35_HEAD_DIM, device=CUDA, dtype=BF16).requires_grad_()
    weight = torch.randn(QWEN35_HEAD_DIM, device=CUDA, dtype=BF16).requires_grad_(train_weight)
    result = _norm_check(x, weight, gate, BF16, reference_dtype=torch.float32, tol=BIG_TOL)
    assert (result.inputs[1].grad is None) == (not train_weight)


def test_gpu_big_deltanet_gates_qwen35():
    inputs = [t.to(CUDA).requires_grad_() for t in _gates_inputs((1, SEQ, QWEN35_V_HEADS))]
    _gates_check(inputs, BF16, CUDA, input_dtypes=[None, None, torch.float32, torch.float32])
