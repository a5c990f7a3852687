"""The Gated DeltaNet's token step after its convolution in one launch (decoding): the gates, the delta-rule step
and the gated RMSNorm of the output, per value head.

For value head h (key head h // G), the new token's convolved q, k `[Dk]` and v `[Dv]`, its gate inputs a, b,
the per-head A_log, dt_bias, the state S `[Dk, Dv]` (fp32, updated in place), z `[Dv]` and the norm's weight w:

    g = -exp(A_log) · softplus(a + dt_bias)        β = σ(b)  (rounded to b's dtype)      (`deltanet_gates`)
    S ← exp(g) S;   S ← S + k̂ ⊗ β (v − Sᵀ k̂);   o = Sᵀ (scale · q̂)                    (`delta_rule_step`)
    y = o · rsqrt(mean(o²) + eps) · w · silu(z)   (o rounded to v's dtype first)       (`gated_rms_norm`)

with q̂, k̂ L2-normalised where asked. Each term is computed as the named op computes it, so y equals the three
launches it replaces up to the order of the norm's fp32 sum. One program owns a whole head (its state read and
written once, the norm's sum over its Dv outputs on chip); three launches a DeltaNet layer become one.
Inference only (no autograd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from unsloth_lite.kernels.deltanet_decode import _query_key, _state_load, _state_step
from unsloth_lite.kernels.deltanet_gates import SOFTPLUS_THRESHOLD, _softplus_and_slope
from unsloth_lite.kernels.utils import check_kernel_device, empty, pdl_launch


@triton.jit
def _delta_rule_gated_step_kernel(
    q_ptr, q_batch_stride, q_head_stride,
    k_ptr, k_batch_stride, k_head_stride,
    v_ptr, v_batch_stride, v_head_stride,
    a_ptr, a_batch_stride, a_head_stride, b_ptr, b_batch_stride, b_head_stride, a_log_ptr, dt_bias_ptr,
    state_ptr, state_batch_stride, state_head_stride, state_k_stride,
    z_ptr, z_batch_stride, z_head_stride, norm_weight_ptr, eps,
    out_ptr, n_v_heads, group, key_dim, value_dim, scale,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2: tl.constexpr, THRESHOLD: tl.constexpr, PDL: tl.constexpr,
):
    """PDL: the state (written by this kernel alone, a step before) and the per-head parameters are read before
    `gdc_wait`, the token's inputs after it."""
    batch_head = tl.program_id(0)
    batch, head = (batch_head // n_v_heads).to(tl.int64), batch_head % n_v_heads
    dk = tl.arange(0, BLOCK_K)
    dv = tl.arange(0, BLOCK_V)
    mask_k, mask_v = dk < key_dim, dv < value_dim
    state_tile = state_ptr + batch * state_batch_stride + head * state_head_stride + dk[:, None] * state_k_stride
    state = _state_load(state_tile, dv, mask_k, mask_v)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    neg_rate = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    weight = tl.load(norm_weight_ptr + dv, mask=mask_v, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    q, k = _query_key(q_ptr, q_batch_stride, q_head_stride, k_ptr, k_batch_stride, k_head_stride, batch,
                      head // group, dk, mask_k, scale, L2)
    v = tl.load(v_ptr + batch * v_batch_stride + head * v_head_stride + dv, mask=mask_v, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + batch * a_batch_stride + head * a_head_stride).to(tl.float32)
    b = tl.load(b_ptr + batch * b_batch_stride + head * b_head_stride).to(tl.float32)
    z = tl.load(z_ptr + batch * z_batch_stride + head * z_head_stride + dv, mask=mask_v, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    softplus, _ = _softplus_and_slope(a + dt_bias, THRESHOLD)
    g = neg_rate * softplus
    beta = tl.sigmoid(b).to(b_ptr.dtype.element_ty).to(tl.float32)  # as the gates write it

    o = _state_step(state, state_tile, dv, mask_k, mask_v, q, k, v, g, beta)
    o = o.to(v_ptr.dtype.element_ty).to(tl.float32)  # as the step writes it
    r = tl.rsqrt(tl.sum(o * o, axis=0) / value_dim + eps)
    y = o * r * weight * (z * tl.sigmoid(z))
    tl.store(out_ptr + batch_head * value_dim + dv, y.to(out_ptr.dtype.element_ty), mask=mask_v)


def delta_rule_gated_step(
    q, k, v, a, b, A_log, dt_bias, state, z, norm_weight, eps: float = 1e-6, scale=None,  # noqa: N803
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token of a Gated DeltaNet head after its convolution (module docstring): q, k `[B, Hk, Dk]`, v and z
    `[B, Hv, Dv]`, a, b `[B, Hv]`, all of any strides along B and H with unit stride along D; A_log, dt_bias
    `[Hv]`; `state` `[B, Hv, Dk, Dv]` (contiguous in Dv) updated in place; norm_weight `[Dv]`. Returns y
    `[B, Hv, Dv]` in v's dtype."""
    batch, n_k_heads, key_dim = k.shape
    n_v_heads, value_dim = v.shape[-2:]
    if tuple(state.shape) != (batch, n_v_heads, key_dim, value_dim) or n_v_heads % n_k_heads:
        raise ValueError(f"state {tuple(state.shape)} does not fit k {tuple(k.shape)} and v {tuple(v.shape)}")
    if tuple(z.shape) != tuple(v.shape) or tuple(a.shape) != (batch, n_v_heads) or tuple(b.shape) != tuple(a.shape):
        raise ValueError(f"z {tuple(z.shape)}, a {tuple(a.shape)} and b {tuple(b.shape)} do not fit v {tuple(v.shape)}")
    if any(tuple(t.shape) != (n_v_heads,) for t in (A_log, dt_bias)) or tuple(norm_weight.shape) != (value_dim,):
        raise ValueError(f"A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)} and norm_weight "
                         f"{tuple(norm_weight.shape)} do not fit {n_v_heads} heads of {value_dim}")
    for name, t in (("q", q), ("k", k), ("v", v), ("z", z), ("state", state)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")
    check_kernel_device("v", v)
    scale = key_dim**-0.5 if scale is None else scale
    out = empty((batch, n_v_heads, value_dim), v.dtype, v.device)
    block_k, block_v = triton.next_power_of_2(key_dim), triton.next_power_of_2(value_dim)
    _delta_rule_gated_step_kernel[(batch * n_v_heads,)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), A_log.contiguous(), dt_bias.contiguous(),
        state, state.stride(0), state.stride(1), state.stride(2),
        z, z.stride(0), z.stride(1), norm_weight, float(eps),
        out, n_v_heads, n_v_heads // n_k_heads, key_dim, value_dim, float(scale),
        BLOCK_K=block_k, BLOCK_V=block_v, L2=bool(use_qk_l2norm), THRESHOLD=SOFTPLUS_THRESHOLD,
        num_warps=8 if block_k * block_v >= 128 * 128 else 4, **pdl_launch(v.device),
    )
    return out
