"""LoRA over a frozen base weight (dense, or bitsandbytes NF4 dequantised on the fly): the attention
projections and the whole SwiGLU MLP as autograd Functions with hand-written backward passes.

One projection, with W the frozen base `[out, in]`, b its frozen bias, A `[r, in]`, B `[out, r]`, s the scale:

    t = x Aᵀ                     (rank r, saved)
    y = x Wᵀ + b + s · t Bᵀ

Where a group's outputs are at least twice as wide as its input (gate and up; q, k, v; the Gated DeltaNet's
input projections) and the bases are NF4, each output is one product y = [x | t] [W | s·B]ᵀ (+ b): W is
dequantised into the rows of a wider matrix whose last Σr columns hold s·B (zeros under the other adapters' t),
so the update is summed in the product's accumulator, not added over the finished output in a second pass that
reads and writes it; the copy of x into [x | t] costs less than that pass.

Backward, with u = dy B (rank r):

    dB = s · dyᵀ t        dA = s · uᵀ x        dx = dy W + s · u A

The MLP, with projections gate (g), up (u) and down (d) and h = silu(g) ⊙ u:

    out = down(h)
    dh = dout W_d + s_d · (dout B_d) A_d,    dA_d = s_d · (dout B_d)ᵀ h,    dB_d = s_d · doutᵀ (h A_dᵀ)
    (dg, du) = SwiGLU backward of dh (see `swiglu.py`)
    dx = gate's and up's dx as above, summed.

A caller that needs the gradient of `out` but not its value (a checkpoint's recomputation) skips
W_d's product: the backward reads only t_d = h A_dᵀ of the down projection's forward. The same holds for any
projection: its backward reads x and t, never y. The MLP goes further there: its forward saves only x and the
backward runs the whole MLP, gate and up included, over blocks of rows (`mlp_row_blocks`), so neither g and u
are kept between the recomputation and the backward nor does any [tokens, intermediate] buffer grow with the
sequence beyond a block; the adapters' gradients are summed over the blocks. No product is computed twice.

Saved: the layer input, the pre-activations g and u, and the rank-r products t. h (the largest activation
after g and u) is not saved: dh needs neither h nor t_d, and the SwiGLU backward kernel, reading g and u for
dg and du, writes h over dh for the down adapter's gradients. dg and du are written over g and u, which the
backward no longer needs, so the MLP backward allocates one [tokens, intermediate] buffer (dh, then h), not
four. The base weight is never saved: a 4-bit weight is
dequantised (`dequantize_nf4`) into one scratch buffer reused by every layer, forward and backward, and a
frozen base gets no gradient. The matrix products run on cuBLAS.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4, dequantize_nf4_reference
from unsloth_lite.kernels.swiglu import (
    _swiglu_backward,
    _swiglu_forward,
    swiglu_backward_reference,
    swiglu_reference,
)
from unsloth_lite.kernels.utils import INTERPRET


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda or INTERPRET


def _swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _swiglu_forward(g, u) if _use_kernels(g) else swiglu_reference(g, u)


def _swiglu_grads(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, out, h_out: torch.Tensor | None = None):
    """(dg, du) into `out`, and h = silu(g) u into `h_out` where given (which may be dh)."""
    if _use_kernels(g):
        return _swiglu_backward(dh, g, u, out=out, h_out=h_out)
    h = None if h_out is None else swiglu_reference(g, u)
    grads = swiglu_backward_reference(dh, g, u, out=out)
    if h_out is not None:
        h_out.copy_(h)
    return grads


@dataclasses.dataclass
class LoRAProjection:
    """A frozen base (an `nn.Parameter` or a bitsandbytes `Params4bit`), its frozen bias, and the adapter: A
    `[r, in]` and B `[out, r]`, of rank 0 for a projection without one (`frozen_projection`), which then
    shares its input's products with the projections that have one."""

    base: torch.Tensor
    bias: torch.Tensor | None
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[0]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


def frozen_projection(weight: torch.Tensor, bias: torch.Tensor | None) -> LoRAProjection:
    """A frozen linear layer (dense or NF4) without adapter, as a projection of rank 0."""
    quant_state = getattr(weight, "quant_state", None)
    out_features, in_features = tuple(quant_state.shape) if quant_state is not None else weight.shape
    dtype = quant_state.dtype if quant_state is not None else weight.dtype
    lora_a = torch.empty((0, in_features), dtype=dtype, device=weight.device)
    lora_b = torch.empty((out_features, 0), dtype=dtype, device=weight.device)
    return LoRAProjection(weight, bias, lora_a, lora_b, 0.0)


# Whether a group of projections whose outputs are at least twice as wide as their input forms each output in one
# product of [x | t] and [W | s·B] (`_joined_products`) rather than x Wᵀ and then s · t Bᵀ added to it.
ADAPTERS_IN_PRODUCTS = True

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
    return dense_weight(projection.base, dtype)


def dense_weight(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`base_weight` of a bare frozen weight (a dense parameter or an NF4 `Params4bit`)."""
    quant_state = getattr(base, "quant_state", None)
    if quant_state is None:
        return base if base.dtype == dtype else base.to(dtype)
    if not _use_kernels(base):
        # Never bitsandbytes' CPU dequantisation: it misplaces absmax blocks in rows that split a block.
        return dequantize_nf4_reference(base.data, quant_state).to(dtype)
    shape = tuple(quant_state.shape)
    out = _scratch(shape[0] * shape[1], quant_state.dtype, base.device).view(shape)
    weight = dequantize_nf4(base, out=out)
    return weight if weight.dtype == dtype else weight.to(dtype)


class _Adapters:
    """The adapters of projections that share one input, in the compute dtype, formed once per forward and
    kept for the backward (rank-sized, so cheap to keep): every A stacked into one `[Σr, in]` matrix, so one
    product gives all the rank-r products t. B is not pre-multiplied by its scale: a rounded sB is the same
    error in every token's update, which the adapters' gradients (sums over tokens) then add up coherently;
    the products take s as their alpha instead, applied in fp32 before their single rounding."""

    def __init__(self, projections, dtype: torch.dtype):
        a = [p.lora_a for p in projections]
        if len(a) == 1:
            self.a = a[0].to(dtype)
        else:
            self.a = torch.cat(a, out=a[0].new_empty((sum(t.shape[0] for t in a), a[0].shape[1]), dtype=dtype))
        self.b = [p.lora_b.to(dtype) for p in projections]
        ends = itertools.accumulate(t.shape[0] for t in a)
        self.slices = [slice(end - t.shape[0], end) for t, end in zip(a, ends, strict=True)]

    def rank_products(self, x2d: torch.Tensor) -> torch.Tensor:
        """t = x Aᵀ of every adapter, `[N, Σr]`."""
        return torch.matmul(x2d, self.a.t())


def _project_all(x2d: torch.Tensor, projections, adapters: _Adapters, output_needed: bool = True, out=None):
    """(outputs, t): the projections of rows `x2d`, and the rank-r products t = x Aᵀ of all of them `[N, Σr]`.
    The adapters run in the input's dtype (PEFT keeps fp32 adapters; autograd casts their gradients back).
    Without `output_needed` the outputs are uninitialised: the backward only needs t (module docstring).
    `out`: a buffer `[N, out_features]` per projection that its output is written into."""
    t = adapters.rank_products(x2d)
    if not output_needed:
        return [x2d.new_empty((x2d.shape[0], p.out_features)) for p in projections], t
    if _joins_adapters(x2d, projections):
        return _joined_products(x2d, t, projections, adapters, out), t
    outputs = []
    for i, (p, rows, b) in enumerate(zip(projections, adapters.slices, adapters.b, strict=True)):
        y = _linear(x2d, base_weight(p, x2d.dtype), p.bias, None if out is None else out[i])
        outputs.append(y.addmm_(t[:, rows], b.t(), alpha=p.scale) if p.rank else y)
    return outputs, t


def _linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out=None) -> torch.Tensor:
    """x Wᵀ (+ b in x's dtype), into `out` where given."""
    into = {} if out is None else {"out": out}
    if bias is None:
        return torch.matmul(x2d, weight.t(), **into)
    return torch.addmm(bias.to(x2d.dtype), x2d, weight.t(), **into)


def _joins_adapters(x2d: torch.Tensor, projections) -> bool:
    """Whether `_joined_products` forms the group's outputs: NF4 bases of x's dtype whose rows are whole
    quantisation blocks, dequantised by the kernel, and outputs at least twice as wide as x (the copy of x into
    [x | t] then costs less than the passes over the outputs it saves)."""
    if not ADAPTERS_IN_PRODUCTS or not _use_kernels(x2d) or not any(p.rank for p in projections):
        return False
    states = [getattr(p.base, "quant_state", None) for p in projections]
    return all(
        state is not None and state.dtype == x2d.dtype and x2d.shape[1] % state.blocksize == 0 for state in states
    ) and sum(p.out_features for p in projections) >= 2 * x2d.shape[1]


def _joined_products(x2d: torch.Tensor, t: torch.Tensor, projections, adapters: _Adapters, out=None):
    """The outputs y = x Wᵀ + b + s · t Bᵀ of the group, each one product of [x | t] `[N, in + Σr]` and
    [W | s·B] `[out, in + Σr]` (B in its adapter's columns of t, zeros in the others'): the adapter's update
    is summed in the product's fp32 accumulator instead of read and written back over the output. W is
    dequantised straight into the wide matrix's rows (a row-strided `dequantize_nf4`)."""
    joined = torch.cat((x2d, t), dim=1)
    n_in, width = x2d.shape[1], joined.shape[1]
    outputs = []
    for i, (p, rows) in enumerate(zip(projections, adapters.slices, strict=True)):
        weight = _scratch(p.out_features * width, x2d.dtype, x2d.device).view(p.out_features, width)
        dequantize_nf4(p.base, out=weight[:, :n_in])
        if rows.stop - rows.start < width - n_in:
            weight[:, n_in:].zero_()
        torch.mul(p.lora_b, p.scale, out=weight[:, n_in + rows.start: n_in + rows.stop])  # one rounding
        outputs.append(_linear(joined, weight, p.bias, None if out is None else out[i]))
    return outputs


def _project_all_backward(grads, x2d: torch.Tensor, t: torch.Tensor, projections, adapters: _Adapters, dx=None):
    """(dx, adapter gradients as [dA, dB] per projection); dx accumulated into `dx` (created when None)."""
    dx, u_t = _input_grad(grads, projections, adapters, dx)
    return dx, _adapter_grads(grads, x2d, t, u_t, projections, adapters)


def _unread(like: torch.Tensor) -> torch.Tensor:
    """The addend of an `addmm` with beta=0, which never reads it: allocated, not filled (no kernel)."""
    return like.new_empty(())


def _input_grad(grads, projections, adapters: _Adapters, dx=None):
    """(dx, uᵀ), dx = Σ dy W + s · u A accumulated into `dx` (created when None): neither x nor t is read."""
    dy0 = grads[0]
    # uᵀ of every projection stacked `[Σr, N]`: contiguous row blocks, so each is written by its own product and
    # dA and the adapters' share of dx take one product each.
    u_t = torch.empty((adapters.a.shape[0], dy0.shape[0]), dtype=dy0.dtype, device=dy0.device)
    for dy, p, rows, b in zip(grads, projections, adapters.slices, adapters.b, strict=True):
        if p.rank:
            torch.addmm(_unread(dy), b.t(), dy.t(), beta=0, alpha=p.scale, out=u_t[rows])  # s · (dy B)ᵀ
        weight = base_weight(p, dy.dtype)
        if dx is None:
            dx = torch.matmul(dy, weight)
        else:
            dx.addmm_(dy, weight)
    if u_t.shape[0]:
        dx.addmm_(u_t.t(), adapters.a)
    return dx, u_t


def _adapter_grads(grads, x2d: torch.Tensor, t: torch.Tensor, u_t: torch.Tensor, projections, adapters: _Adapters):
    """[dA, dB] per projection (None for one without adapter): dA = uᵀ x, dB = s · dyᵀ t."""
    if not u_t.shape[0]:  # no projection has an adapter
        return [None] * (2 * len(projections))
    d_lora_a = torch.matmul(u_t, x2d)
    adapter_grads = []
    for dy, p, rows in zip(grads, projections, adapters.slices, strict=True):
        if p.rank:
            adapter_grads += [d_lora_a[rows], torch.addmm(_unread(dy), dy.t(), t[:, rows], beta=0, alpha=p.scale)]
        else:
            adapter_grads += [None, None]
    return adapter_grads


def _adapter_args(projections):
    return [tensor for p in projections for tensor in (p.lora_a, p.lora_b)]


class LoRAProjectionsFunction(torch.autograd.Function):
    """Several projections of one input (q, k, v; or o alone): one saved input, one dx accumulation."""

    @staticmethod
    def forward(ctx, x, projections, output_needed, kept, record_into, *adapter_weights):
        x2d = x.reshape(-1, x.shape[-1])
        adapters = _Adapters(projections, x2d.dtype)
        if kept is not None:  # the values of an earlier call on the same x: only t is formed
            outputs = [y.reshape(x2d.shape[0], p.out_features) for y, p in zip(kept, projections, strict=True)]
            t = adapters.rank_products(x2d)
        else:
            into = _buffers_for(record_into, x2d, projections)
            outputs, t = _project_all(x2d, projections, adapters, output_needed, out=into)
        ctx.projections, ctx.adapters = projections, adapters
        ctx.input_shape = x.shape
        ctx.save_for_backward(x2d, t)
        return tuple(y.view(*x.shape[:-1], p.out_features) for y, p in zip(outputs, projections, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        x2d, t = ctx.saved_tensors
        grads = [dy.reshape(-1, p.out_features) for dy, p in zip(grads, ctx.projections, strict=True)]
        dx, adapter_grads = _project_all_backward(grads, x2d, t, ctx.projections, ctx.adapters)
        return (dx.view(ctx.input_shape), None, None, None, None, *adapter_grads)


def _buffers_for(buffers, x2d: torch.Tensor, projections):
    """`buffers` (one per projection) as `[N, out_features]` views where each is contiguous and of the products'
    own dtype and row count (under autocast an fp32 x computes in bf16), else None."""
    if buffers is None or not all(
        b.dtype == x2d.dtype and b.is_contiguous() and b.numel() == x2d.shape[0] * p.out_features
        for b, p in zip(buffers, projections, strict=True)
    ):
        return None
    return [b.view(x2d.shape[0], p.out_features) for b, p in zip(buffers, projections, strict=True)]


# Elements of one [rows, intermediate] buffer of the row-blocked MLP backward (2^27: 256 MiB in bf16). One
# block covers Qwen3-8B's batch 4 x 2048 and Qwen3.5-27B's 2048 tokens; 32k tokens of the 27B take five.
MLP_BLOCK_ELEMENTS = 2**27


def mlp_row_blocks(n_rows: int, intermediate: int) -> list[slice]:
    """Row blocks of the recomputation path's MLP backward: as few as keep each under MLP_BLOCK_ELEMENTS
    elements, of equal size rounded up to a multiple of 256 rows."""
    blocks = max(1, -(-n_rows * intermediate // MLP_BLOCK_ELEMENTS))
    rows = -(-n_rows // blocks)
    rows = -(-rows // 256) * 256 if blocks > 1 else n_rows
    return [slice(start, min(start + rows, n_rows)) for start in range(0, n_rows, rows)]


def _mlp_backward(dout2d, x2d, g, u, t_gate_up, t_down, projections, adapters, dx=None):
    """dx (accumulated into `dx` when given) and the adapters' gradients of the MLP on rows x2d, from its
    pre-activations g and u (overwritten) and rank-r products (t_down formed here from h where None)."""
    gate, up, down = projections
    gate_up, down_adapters = adapters
    # dh = dout W_d + s (dout B_d) A_d reads neither h nor t_d; the SwiGLU backward then writes h over dh (dead
    # once read), which the down adapter's gradients read: no pass of its own over g and u to form h
    dh, u_down = _input_grad([dout2d], (down,), down_adapters)
    dg, du = _swiglu_grads(dh, g, u, out=(g, u), h_out=dh)  # g and u are dead from here on
    h = dh
    if t_down is None:
        t_down = down_adapters.rank_products(h)
    down_grads = _adapter_grads([dout2d], h, t_down, u_down, (down,), down_adapters)
    dx, gate_up_grads = _project_all_backward([dg, du], x2d, t_gate_up, (gate, up), gate_up, dx=dx)
    return dx, gate_up_grads + down_grads


def _mlp_backward_by_row_blocks(dout2d, x2d, projections, adapters):
    """The recomputation path's backward: the MLP's forward and backward over each row block in turn."""
    gate, up, down = projections
    gate_up, down_adapters = adapters

    def block_backward(rows, dx=None):
        (g, u), t_gate_up = _project_all(x2d[rows], (gate, up), gate_up)
        return _mlp_backward(dout2d[rows], x2d[rows], g, u, t_gate_up, None, projections, adapters, dx=dx)

    blocks = mlp_row_blocks(x2d.shape[0], gate.out_features)
    if len(blocks) == 1:
        return block_backward(blocks[0])
    dx = torch.zeros_like(x2d)
    total = None
    for rows in blocks:
        _, grads = block_backward(rows, dx[rows])
        grads = [None if d is None else d.float() for d in grads]  # summed in fp32 (autograd casts them back)
        total = grads if total is None else [a if b is None else a.add_(b) for a, b in zip(total, grads, strict=True)]
    return dx, total


class LoRAMLPFunction(torch.autograd.Function):
    """down(silu(gate(x)) ⊙ up(x)), each projection with its adapter."""

    @staticmethod
    def forward(ctx, x, projections, output_needed, preactivations, record, record_into, *adapter_weights):
        gate, up, down = projections
        x2d = x.reshape(-1, x.shape[-1])
        adapters = (_Adapters((gate, up), x2d.dtype), _Adapters((down,), x2d.dtype))
        ctx.projections, ctx.adapters, ctx.input_shape = projections, adapters, x.shape
        ctx.by_row_blocks = not output_needed and preactivations is None
        if ctx.by_row_blocks:
            ctx.save_for_backward(x2d)
            return x2d.new_empty((*x.shape[:-1], down.out_features))
        recorded = (record is not None and preactivations is None
                    and len(mlp_row_blocks(x2d.shape[0], gate.out_features)) == 1)
        if preactivations is not None:
            g, u = preactivations
            t_gate_up = adapters[0].rank_products(x2d)
        else:
            into = _buffers_for(record_into if recorded else None, x2d, (gate, up))
            (g, u), t_gate_up = _project_all(x2d, (gate, up), adapters[0], out=into)
        if output_needed:
            (out,), t_down = _project_all(_swiglu(g, u), (down,), adapters[1])
        else:
            out, t_down = x2d.new_empty((x2d.shape[0], down.out_features)), None  # t_down formed in the backward
        ctx.save_for_backward(x2d, g, u, t_gate_up, t_down)
        if recorded:
            record.append((g, u))
        return out.view(*x.shape[:-1], down.out_features)

    @staticmethod
    def backward(ctx, dout):
        if getattr(ctx, "buffers_reused", False):
            raise RuntimeError("the LoRA MLP backward reuses its saved activations and cannot run twice")
        ctx.buffers_reused = True
        dout2d = dout.reshape(-1, ctx.projections[2].out_features)
        if ctx.by_row_blocks:
            (x2d,) = ctx.saved_tensors
            dx, grads = _mlp_backward_by_row_blocks(dout2d, x2d, ctx.projections, ctx.adapters)
        else:
            dx, grads = _mlp_backward(dout2d, *ctx.saved_tensors, ctx.projections, ctx.adapters)
        return (dx.view(ctx.input_shape), None, None, None, None, None, *grads)


class FrozenLinearFunction(torch.autograd.Function):
    """x Wᵀ + b over a frozen base W. W comes from the shared scratch buffer, which the next dequantisation
    overwrites, so autograd must not keep it: the backward dequantises W again, as the LoRA functions do."""

    @staticmethod
    def forward(ctx, x, base, bias):
        x2d = x.reshape(-1, x.shape[-1])
        weight = dense_weight(base.weight, x2d.dtype)
        y = _linear(x2d, weight, bias)
        ctx.base, ctx.input_shape = base, x.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = d_bias = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy2d, dense_weight(ctx.base.weight, dy2d.dtype)).view(ctx.input_shape)
        if ctx.needs_input_grad[2]:
            d_bias = dy2d.sum(0).to(ctx.bias_dtype)
        return dx, None, d_bias


@dataclasses.dataclass
class _FrozenBase:
    """Keeps the base out of autograd's view of the arguments (a `Params4bit` is a tensor subclass)."""

    weight: torch.Tensor


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x Wᵀ + b` in x's dtype for a frozen W, dense or NF4 (dequantised on the fly, by the kernel on CUDA and
    under the interpreter, by its PyTorch reference otherwise); gradients for x and b."""
    return FrozenLinearFunction.apply(x, _FrozenBase(weight), bias)


def lora_projections(
    x: torch.Tensor, projections: tuple[LoRAProjection, ...], output_needed: bool = True,
    kept: tuple[torch.Tensor, ...] | None = None, record_into: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """`x Wᵢᵀ + bᵢ + sᵢ (x Aᵢᵀ) Bᵢᵀ` for each projection; gradients for x and every A, B.
    `output_needed=False` skips the products and returns uninitialised memory of the outputs' shapes (as
    `lora_mlp`'s). A checkpoint may keep the outputs instead of recomputing them: a later call on the same x
    with them as `kept` returns their values (the backward reads x and the rank-r products, which it forms, never
    the outputs) without the products or their dequantisation. `record_into`: a buffer per projection that its
    output is computed in (a CUDA-graphed checkpoint's static ones)."""
    return LoRAProjectionsFunction.apply(x, projections, output_needed, kept, record_into, *_adapter_args(projections))


def lora_mlp(
    x: torch.Tensor, gate: LoRAProjection, up: LoRAProjection, down: LoRAProjection, output_needed: bool = True,
    record: list | None = None, preactivations: tuple[torch.Tensor, torch.Tensor] | None = None,
    record_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The SwiGLU MLP with LoRA on all three projections; gradients for x and every A, B.
    `output_needed=False` (for a caller that back-propagates into the result but never reads it, as a
    checkpoint's recomputation) skips the down projection and returns uninitialised memory of its shape.

    A checkpoint may keep the pre-activations instead of recomputing them: `record`, a list, receives
    (gate(x), up(x)) `[tokens, intermediate]` of this forward where its backward would run as one row block
    (`mlp_row_blocks`, so keeping them costs the backward no memory it would not allocate anyway); a later
    call on the same x with them as `preactivations` skips the gate and up products (and their
    dequantisation) and forms only the rank-r products; its backward writes the gradients over them.
    `record_into`: two `[tokens, intermediate]` buffers that the recorded gate(x) and up(x) are computed in
    (a CUDA-graphed checkpoint's static ones: no copy into them afterwards)."""
    projections = (gate, up, down)
    return LoRAMLPFunction.apply(x, projections, output_needed, preactivations, record, record_into,
                                 *_adapter_args(projections))
