"""Fused LoRA projections and MLP over dense and NF4 bases, against float64 references; and patched
PEFT models (dense and 4-bit) against the unpatched ones."""

import bitsandbytes as bnb
import pytest
import torch
import torch.nn.functional as F
from helpers import TOLERANCE, assert_close, dtype_id

from unsloth_lite.kernels import lora
from unsloth_lite.kernels.lora import LoRAProjection, lora_mlp, lora_projections


def make_projection(n_in, n_out, rank, device, dtype, nf4=False, bias=False):
    weight = torch.randn(n_out, n_in, device=device, dtype=dtype) / n_in**0.5
    if nf4:
        packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        base = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", bnb_quantized=True)
        dense = bnb.functional.dequantize_4bit(packed, state)
    else:
        base = dense = weight
    lora_a = (torch.randn(rank, n_in, device=device, dtype=dtype) / n_in**0.5).requires_grad_()
    lora_b = (torch.randn(n_out, rank, device=device, dtype=dtype) / rank**0.5).requires_grad_()
    b = torch.randn(n_out, device=device, dtype=dtype) if bias else None
    projection = LoRAProjection(base, b, lora_a, lora_b, scale=1.7)
    return projection, dense


def reference_projection(x, dense, p):
    y = x @ dense.double().t() + 1.7 * (x @ p.lora_a.double().t()) @ p.lora_b.double().t()
    return y if p.bias is None else y + p.bias.double()


def leaf64(t):
    return t.detach().double().requires_grad_()


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "added"])
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_lora_projections(nf4, dtype, joined, device, monkeypatch):
    """q/k/v-shaped (outputs twice the input's width): over NF4 bases the adapters' updates are formed in the
    products (`joined`) or added after them, with the same results."""
    monkeypatch.setattr(lora, "ADAPTERS_IN_PRODUCTS", joined)
    x = torch.randn(3, 5, 64, device=device, dtype=dtype, requires_grad=True)
    made = [make_projection(64, n_out, 4, device, dtype, nf4=nf4, bias=True) for n_out in (64, 32, 32)]
    projections = tuple(p for p, _ in made)
    assert lora._joins_adapters(x.view(-1, 64), projections) == (joined and nf4)
    outputs = lora_projections(x, projections)
    grads = [torch.randn_like(y) for y in outputs]
    torch.autograd.backward(outputs, grads)

    x64 = leaf64(x)
    refs = []
    for p, dense in made:
        p64 = LoRAProjection(None, p.bias, leaf64(p.lora_a), leaf64(p.lora_b), p.scale)
        refs.append((p64, reference_projection(x64, dense, p64)))
    torch.autograd.backward([r for _, r in refs], [g.double() for g in grads])
    tol = TOLERANCE[dtype]
    for y, (p64, ref), (p, _) in zip(outputs, refs, made, strict=True):
        assert_close(y, ref, tol, "y")
        assert_close(p.lora_a.grad, p64.lora_a.grad, tol, "dA")
        assert_close(p.lora_b.grad, p64.lora_b.grad, tol, "dB")
    assert_close(x.grad, x64.grad, tol, "dx")


@pytest.mark.parametrize("output_needed", [True, False], ids=["output", "gradients-only"])
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_lora_mlp(nf4, dtype, output_needed, device):
    """Without `output_needed` (a checkpoint's recomputation) the output is not computed and the backward runs
    the whole MLP itself; the gradients are the same."""
    check_lora_mlp(nf4, dtype, output_needed, device, seq=7)


@pytest.mark.parametrize(("dtype", "nf4"), [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-nf4"])
def test_lora_mlp_row_blocks(dtype, nf4, device, monkeypatch):
    """The recomputation's backward over two row blocks (280 rows at a budget of 20,000 elements: 256 + 24),
    the adapters' gradients summed over them."""
    monkeypatch.setattr(lora, "MLP_BLOCK_ELEMENTS", 20_000)
    assert [(b.start, b.stop) for b in lora.mlp_row_blocks(280, 192)] == [(0, 256), (256, 280)]
    check_lora_mlp(nf4, dtype, False, device, seq=140)


def check_lora_mlp(nf4, dtype, output_needed, device, seq):
    hidden, inter = 64, 192
    x = torch.randn(2, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    shapes = ((hidden, inter), (hidden, inter), (inter, hidden))
    made = [make_projection(*shape, 8, device, dtype, nf4=nf4) for shape in shapes]
    out = lora_mlp(x, *(p for p, _ in made), output_needed=output_needed)
    grad = torch.randn_like(out)
    out.backward(grad)

    x64 = leaf64(x)
    p64 = [LoRAProjection(None, None, leaf64(p.lora_a), leaf64(p.lora_b), p.scale) for p, _ in made]
    gate = reference_projection(x64, made[0][1], p64[0])
    up = reference_projection(x64, made[1][1], p64[1])
    ref = reference_projection(F.silu(gate) * up, made[2][1], p64[2])
    ref.backward(grad.double())
    tol = TOLERANCE[dtype]
    assert out.shape == ref.shape
    if output_needed:
        assert_close(out, ref, tol, "out")
    assert_close(x.grad, x64.grad, tol, "dx")
    for (p, _), q, name in zip(made, p64, ("gate", "up", "down"), strict=True):
        assert_close(p.lora_a.grad, q.lora_a.grad, tol, f"{name} dA")
        assert_close(p.lora_b.grad, q.lora_b.grad, tol, f"{name} dB")


def test_lora_mlp_backward_twice_raises(device):
    x = torch.randn(4, 64, device=device, requires_grad=True)
    made = [make_projection(*shape, 4, device, torch.float32) for shape in ((64, 96), (64, 96), (96, 64))]
    out = lora_mlp(x, *(p for p, _ in made))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        out.sum().backward()


@pytest.mark.gpu
def test_lora_mlp_qwen3_8b_layer_nf4():
    """One Qwen3-8B MLP (4096 -> 12288 -> 4096), NF4 bases, bf16, 2 x 512 tokens, against an fp32 reference."""
    x = torch.randn(2, 512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    shapes = ((4096, 12288), (4096, 12288), (12288, 4096))
    made = [make_projection(*shape, 16, "cuda", torch.bfloat16, nf4=True) for shape in shapes]
    out = lora_mlp(x, *(p for p, _ in made))
    grad = torch.randn_like(out)
    out.backward(grad)

    def ref_projection(v, dense, p):
        return v @ dense.float().t() + p.scale * (v @ p.lora_a.float().t()) @ p.lora_b.float().t()

    x32 = x.detach().float().requires_grad_()
    p32 = [LoRAProjection(None, None, p.lora_a.detach().float().requires_grad_(),
                          p.lora_b.detach().float().requires_grad_(), p.scale) for p, _ in made]
    gate = ref_projection(x32, made[0][1], p32[0])
    up = ref_projection(x32, made[1][1], p32[1])
    ref = ref_projection(F.silu(gate) * up, made[2][1], p32[2])
    ref.backward(grad.float())
    assert_close(out, ref, 1e-2, "out")
    assert_close(x.grad, x32.grad, 1e-2, "dx")
    for (p, _), q in zip(made, p32, strict=True):
        assert_close(p.lora_a.grad, q.lora_a.grad, 2e-2, "dA")
        assert_close(p.lora_b.grad, q.lora_b.grad, 2e-2, "dB")
