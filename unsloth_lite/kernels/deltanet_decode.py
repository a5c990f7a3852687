"""Qwen3.5's Gated DeltaNet at one new token (decoding): the conv-state update and one step of the gated delta
rule, each one Triton launch that updates its cached state in place (static addresses, as a CUDA graph needs).

Conv-state update, per channel c with kernel width K, the state s `[B, C, K]` holding the last K inputs of the
depthwise convolution (transformers' layout), x `[B, C]` the new token's input:

    s ← (s[1], …, s[K-1], x)                   (shift the new token in)
    y = act(bias + Σ_j w[c, j] · s[j])         (act: SiLU or none)

Delta-rule step, per value head h (key head h // G, G = Hv / Hk, read in place: no repeated copies), the state S
`[B, Hv, Dk, Dv]` in fp32, q, k L2-normalised first when asked (x̂ = x · (Σx² + 1e-6)^-½, as the chunked kernel):

    S ← exp(g) S;    S ← S + k ⊗ β (v − Sᵀ k);    o = Sᵀ (scale · q)

Each program owns BLOCK_V columns of one head's state: it reads them once, writes them once. Inference only
(no autograd): the training path's `chunk_gated_delta_rule` has the gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from unsloth_lite.kernels.utils import check_kernel_device, empty, pdl_launch

BLOCK_CHANNELS = 256
BLOCK_V = 32


@triton.jit
def _conv_state_update_kernel(
    x_ptr, x_batch_stride, x_chan_stride,
    state_ptr, state_batch_stride, state_chan_stride, state_pos_stride,
    weight_ptr, weight_chan_stride, weight_pos_stride, bias_ptr,
    out_ptr, n_channels, kernel_width,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
):
    """PDL: the state (written by this kernel alone, a step before), the weight and the bias are read before
    `gdc_wait`; x after it."""
    batch = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, BLOCK_W)
    mask_channels = channels < n_channels
    mask_taps = taps < kernel_width
    state = state_ptr + batch * state_batch_stride + channels[:, None] * state_chan_stride
    # window[j] = s[j + 1] for j < K - 1, then the new input
    shifted = tl.load(
        state + (taps[None, :] + 1) * state_pos_stride,
        mask=mask_channels[:, None] & (taps[None, :] + 1 < kernel_width), other=0.0,
    )
    weight = tl.load(
        weight_ptr + channels[:, None] * weight_chan_stride + taps[None, :] * weight_pos_stride,
        mask=mask_channels[:, None] & mask_taps[None, :], other=0.0,
    ).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + channels, mask=mask_channels, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + batch * x_batch_stride + channels * x_chan_stride, mask=mask_channels, other=0.0)
    if PDL:
        gdc_launch_dependents()
    window = tl.where(taps[None, :] == kernel_width - 1, x[:, None].to(shifted.dtype), shifted)
    y = tl.sum(weight * window.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += bias
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(state + taps[None, :] * state_pos_stride, window, mask=mask_channels[:, None] & mask_taps[None, :])
    tl.store(out_ptr + batch * n_channels + channels, y.to(out_ptr.dtype.element_ty), mask=mask_channels)


@triton.jit
def _l2_normalised(x, use_l2: tl.constexpr):
    if use_l2:
        return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)
    return x


@triton.jit
def _delta_rule_step_kernel(
    q_ptr, q_batch_stride, q_head_stride,
    k_ptr, k_batch_stride, k_head_stride,
    v_ptr, v_batch_stride, v_head_stride,
    g_ptr, g_batch_stride, g_head_stride, beta_ptr, beta_batch_stride, beta_head_stride,
    state_ptr, state_batch_stride, state_head_stride, state_k_stride,
    out_ptr, n_v_heads, group, key_dim, value_dim, scale,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2: tl.constexpr, PDL: tl.constexpr,
):
    """PDL: the state (written by this kernel alone, a step before) is read before `gdc_wait`, the token's
    inputs after it."""
    batch_head = tl.program_id(0)
    batch, head = (batch_head // n_v_heads).to(tl.int64), batch_head % n_v_heads
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = dk < key_dim, dv < value_dim
    state_tile = state_ptr + batch * state_batch_stride + head * state_head_stride + dk[:, None] * state_k_stride
    state = _state_load(state_tile, dv, mask_k, mask_v)
    if PDL:
        gdc_wait()
    q, k = _query_key(q_ptr, q_batch_stride, q_head_stride, k_ptr, k_batch_stride, k_head_stride, batch,
                      head // group, dk, mask_k, scale, L2)
    v = tl.load(v_ptr + batch * v_batch_stride + head * v_head_stride + dv, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + batch * g_batch_stride + head * g_head_stride).to(tl.float32)
    beta = tl.load(beta_ptr + batch * beta_batch_stride + head * beta_head_stride).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    o = _state_step(state, state_tile, dv, mask_k, mask_v, q, k, v, g, beta)
    tl.store(out_ptr + batch_head * value_dim + dv, o.to(out_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _query_key(q_ptr, q_batch_stride, q_head_stride, k_ptr, k_batch_stride, k_head_stride, batch, key_head, dk,
               mask_k, scale, L2: tl.constexpr):
    """(scale · q̂, k̂) of one key head in fp32, L2-normalised where asked."""
    q = tl.load(q_ptr + batch * q_batch_stride + key_head * q_head_stride + dk, mask=mask_k, other=0.0)
    k = tl.load(k_ptr + batch * k_batch_stride + key_head * k_head_stride + dk, mask=mask_k, other=0.0)
    return _l2_normalised(q.to(tl.float32), L2) * scale, _l2_normalised(k.to(tl.float32), L2)


@triton.jit
def _state_load(state_tile, dv, mask_k, mask_v):
    """The state's columns `dv` (rows `state_tile` `[Dk, 1]` pointers) in fp32."""
    return tl.load(state_tile + dv[None, :], mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(tl.float32)


@triton.jit
def _state_step(state, state_tile, dv, mask_k, mask_v, q, k, v, g, beta):
    """One delta-rule step of the state's columns `dv` (`_state_load`), stored in place: S ← exp(g) S;
    S ← S + k ⊗ β (v − Sᵀ k). Returns o = Sᵀ q in fp32."""
    mask_state = mask_k[:, None] & mask_v[None, :]
    state = state * tl.exp(g)
    delta = beta * (v - tl.sum(state * k[:, None], axis=0))
    state += k[:, None] * delta[None, :]
    tl.store(state_tile + dv[None, :], state.to(state_tile.dtype.element_ty), mask=mask_state)
    return tl.sum(state * q[:, None], axis=0)


def conv_state_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias=None, activation="silu"
) -> torch.Tensor:
    """One token through the depthwise causal convolution: x `[B, C]` (any strides), conv_state `[B, C, K]`
    updated in place (the new token shifted in), weight `[C, K]`; returns `[B, C]` in x's dtype."""
    batch, channels = x.shape
    width = weight.shape[-1]
    if tuple(conv_state.shape) != (batch, channels, width) or tuple(weight.shape) != (channels, width):
        raise ValueError(
            f"conv_state {tuple(conv_state.shape)} and weight {tuple(weight.shape)} do not fit x {tuple(x.shape)}"
        )
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation {activation!r}: expected 'silu' or None")
    check_kernel_device("x", x)
    out = empty((batch, channels), x.dtype, x.device)
    _conv_state_update_kernel[(batch, triton.cdiv(channels, BLOCK_CHANNELS))](
        x, x.stride(0), x.stride(1),
        conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight, weight.stride(0), weight.stride(1), bias if bias is not None else weight,
        out, channels, width,
        BLOCK_C=BLOCK_CHANNELS, BLOCK_W=max(2, triton.next_power_of_2(width)), HAS_BIAS=bias is not None,
        SILU=activation is not None, **pdl_launch(x.device),
    )
    return out


def conv_state_update_reference(x, conv_state, weight, bias=None, activation="silu"):
    """Plain-PyTorch `conv_state_update` (same in-place update of `conv_state`), fp32 math."""
    window = torch.cat([conv_state[:, :, 1:], x[:, :, None].to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window)
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype)


def delta_rule_step(q, k, v, g, beta, state, scale=None, use_qk_l2norm=True) -> torch.Tensor:
    """One token of the gated delta rule: q, k `[B, Hk, Dk]`, v `[B, Hv, Dv]`, g (log decay) and beta `[B, Hv]`,
    all of any strides along B and H with unit stride along D; `state` `[B, Hv, Dk, Dv]` (contiguous in Dv)
    updated in place. Returns o `[B, Hv, Dv]` in v's dtype."""
    batch, n_k_heads, key_dim = k.shape
    n_v_heads, value_dim = v.shape[-2:]
    if tuple(state.shape) != (batch, n_v_heads, key_dim, value_dim) or n_v_heads % n_k_heads:
        raise ValueError(f"state {tuple(state.shape)} does not fit k {tuple(k.shape)} and v {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")
    check_kernel_device("v", v)
    scale = key_dim**-0.5 if scale is None else scale
    out = empty((batch, n_v_heads, value_dim), v.dtype, v.device)
    _delta_rule_step_kernel[(batch * n_v_heads, triton.cdiv(value_dim, BLOCK_V))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        g, g.stride(0), g.stride(1), beta, beta.stride(0), beta.stride(1),
        state, state.stride(0), state.stride(1), state.stride(2),
        out, n_v_heads, n_v_heads // n_k_heads, key_dim, value_dim, float(scale),
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=BLOCK_V, L2=bool(use_qk_l2norm), **pdl_launch(v.device),
    )
    return out


def delta_rule_step_reference(q, k, v, g, beta, state, scale=None, use_qk_l2norm=True) -> torch.Tensor:
    """Plain-PyTorch `delta_rule_step` (same in-place update of `state`), fp32 math (float64 for float64)."""
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    group = v.shape[1] // k.shape[1]
    q, k = (t.to(acc).repeat_interleave(group, dim=1) for t in (q, k))
    if use_qk_l2norm:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = state.to(acc) * g.to(acc).exp()[..., None, None]
    delta = beta.to(acc)[..., None] * (v.to(acc) - (s * k[..., None]).sum(-2))
    s = s + k[..., None] * delta[..., None, :]
    state.copy_(s)
    return (s * (scale * q)[..., None]).sum(-2).to(v.dtype)
