"""LoRA over a frozen base weight (dense, or bitsandbytes NF4 dequantised on the fly): the attention
projections and the whole SwiGLU MLP as autograd Functions with hand-written backward passes.

One projection, with W the frozen base `[out, in]`, b its frozen bias, A `[r, in]`, B `[out, r]`, s the scale:

    t = x Aᵀ                     (rank r, saved)
    y = x Wᵀ + b + s · t Bᵀ

Backward, with u = dy B (rank r):

    dB = s · dyᵀ t        dA = s · uᵀ x        dx = dy W + s · u A

The MLP, with projections gate (g), up (u) and down (d) and h = silu(g) ⊙ u:

    out = down(h)
    dh = dout W_d + s_d · (dout B_d) A_d,    dA_d = s_d · (dout B_d)ᵀ h,    dB_d = s_d · doutᵀ (h A_dᵀ)
    (dg, du) = SwiGLU backward of dh (see `swiglu.py`)
    dx = gate's and up's dx as above, summed.

Saved: the layer input, the pre-activations g and u, and the rank-r products t. h (the largest activation
after g and u) is not saved: the backward recomputes it from g and u. dg and du are written over g and u,
which the backward no longer needs, so beyond the recomputed h the MLP backward allocates one
[tokens, intermediate] buffer (dh), not three. The base weight is never saved: a 4-bit weight is
dequantised (`dequantize_nf4`) into one scratch buffer reused by every layer, forward and backward, and a
frozen base gets no gradient. The matrix products run on cuBLAS.
"""

from __future__ import annotations

import dataclasses

import torch

from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4, dequantize_nf4_reference
from unsloth_lite.kernels.swiglu import _swiglu_backward, _swiglu_forward
from unsloth_lite.kernels.utils import INTERPRET


@dataclasses.dataclass
class LoRAProjection:
    """A frozen base (an `nn.Parameter` or a bitsandbytes `Params4bit`), its frozen bias, and the adapter."""

    base: torch.Tensor
    bias: torch.Tensor | None
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[0]


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One flat buffer per dtype and device, grown to the largest weight seen. Kernels run in stream order,
    so a weight dequantised into it after the previous one's product was enqueued can't clobber it."""
    key = (dtype, device)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        _SCRATCH[key] = buffer
    return buffer[:numel]


def base_weight(projection: LoRAProjection, dtype: torch.dtype) -> torch.Tensor:
    """The dense frozen weight `[out, in]` in `dtype`: the parameter itself, or an NF4 weight dequantised into
    the shared scratch buffer (valid until the next call)."""
    base = projection.base
    quant_state = getattr(base, "quant_state", None)
    if quant_state is None:
        return base if base.dtype == dtype else base.to(dtype)
    if not (base.is_cuda or INTERPRET):
        return dequantize_nf4_reference(base.data, quant_state).to(dtype)
    shape = tuple(quant_state.shape)
    out = _scratch(shape[0] * shape[1], quant_state.dtype, base.device).view(shape)
    weight = dequantize_nf4(base, out=out)
    return weight if weight.dtype == dtype else weight.to(dtype)


def _project(x2d: torch.Tensor, p: LoRAProjection):
    """(y, t): the projection of rows `x2d` and its rank-r product t = x Aᵀ. The adapter runs in the input's
    dtype (PEFT keeps fp32 adapters; autograd casts their gradients back)."""
    weight = base_weight(p, x2d.dtype)
    y = torch.matmul(x2d, weight.t()) if p.bias is None else torch.addmm(p.bias.to(x2d.dtype), x2d, weight.t())
    t = torch.matmul(x2d, p.lora_a.to(x2d.dtype).t())
    y.addmm_(t, p.lora_b.to(x2d.dtype).t(), alpha=p.scale)
    return y, t


def _project_backward(dy: torch.Tensor, x2d: torch.Tensor, t: torch.Tensor, p: LoRAProjection, dx: torch.Tensor | None):
    """(dx, dA, dB), dx accumulated into `dx` (created when None)."""
    lora_a, lora_b = p.lora_a.to(dy.dtype), p.lora_b.to(dy.dtype)
    u = torch.matmul(dy, lora_b)
    d_lora_b = torch.matmul(dy.t(), t).mul_(p.scale)
    d_lora_a = torch.matmul(u.t(), x2d).mul_(p.scale)
    weight = base_weight(p, dy.dtype)
    if dx is None:
        dx = torch.matmul(dy, weight)
    else:
        dx.addmm_(dy, weight)
    dx.addmm_(u, lora_a, alpha=p.scale)
    return dx, d_lora_a, d_lora_b


def _adapter_args(projections):
    return [tensor for p in projections for tensor in (p.lora_a, p.lora_b)]


class LoRAProjectionsFunction(torch.autograd.Function):
    """Several projections of one input (q, k, v; or o alone): one saved input, one dx accumulation."""

    @staticmethod
    def forward(ctx, x, projections, *adapters):
        x2d = x.reshape(-1, x.shape[-1])
        outputs, ranks = zip(*(_project(x2d, p) for p in projections), strict=True)
        ctx.projections = projections
        ctx.input_shape = x.shape
        ctx.save_for_backward(x2d, *ranks)
        return tuple(y.view(*x.shape[:-1], p.out_features) for y, p in zip(outputs, projections, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        x2d, *ranks = ctx.saved_tensors
        dx = None
        adapter_grads = []
        for dy, t, p in zip(grads, ranks, ctx.projections, strict=True):
            dx, d_a, d_b = _project_backward(dy.reshape(-1, p.out_features), x2d, t, p, dx)
            adapter_grads += [d_a, d_b]
        return (dx.view(ctx.input_shape), None, *adapter_grads)


class LoRAMLPFunction(torch.autograd.Function):
    """down(silu(gate(x)) ⊙ up(x)), each projection with its adapter."""

    @staticmethod
    def forward(ctx, x, projections, *adapters):
        gate, up, down = projections
        x2d = x.reshape(-1, x.shape[-1])
        g, t_gate = _project(x2d, gate)
        u, t_up = _project(x2d, up)
        h = _swiglu_forward(g, u)
        out, t_down = _project(h, down)
        ctx.projections = projections
        ctx.input_shape = x.shape
        ctx.save_for_backward(x2d, g, u, t_gate, t_up, t_down)
        return out.view(*x.shape[:-1], down.out_features)

    @staticmethod
    def backward(ctx, dout):
        gate, up, down = ctx.projections
        x2d, g, u, t_gate, t_up, t_down = ctx.saved_tensors
        if getattr(ctx, "buffers_reused", False):
            raise RuntimeError("the LoRA MLP backward reuses its saved activations and cannot run twice")
        ctx.buffers_reused = True
        dout2d = dout.reshape(-1, down.out_features)
        h = _swiglu_forward(g, u)
        dh, d_down_a, d_down_b = _project_backward(dout2d, h, t_down, down, None)
        del h
        dg, du = _swiglu_backward(dh, g, u, out=(g, u))  # g and u are dead from here on
        dx, d_gate_a, d_gate_b = _project_backward(dg, x2d, t_gate, gate, None)
        dx, d_up_a, d_up_b = _project_backward(du, x2d, t_up, up, dx)
        return (dx.view(ctx.input_shape), None, d_gate_a, d_gate_b, d_up_a, d_up_b, d_down_a, d_down_b)


def lora_projections(x: torch.Tensor, projections: tuple[LoRAProjection, ...]) -> tuple[torch.Tensor, ...]:
    """`x Wᵢᵀ + bᵢ + sᵢ (x Aᵢᵀ) Bᵢᵀ` for each projection; gradients for x and every A, B."""
    return LoRAProjectionsFunction.apply(x, projections, *_adapter_args(projections))


def lora_mlp(x: torch.Tensor, gate: LoRAProjection, up: LoRAProjection, down: LoRAProjection) -> torch.Tensor:
    """The SwiGLU MLP with LoRA on all three projections; gradients for x and every A, B."""
    projections = (gate, up, down)
    return LoRAMLPFunction.apply(x, projections, *_adapter_args(projections))
