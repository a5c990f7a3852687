"""Qwen3.5's own token mixers on the fused path: the Gated DeltaNet layer and the gated full attention.

Gated DeltaNet, per layer (x the normed hidden states `[B, T, hidden]`):

    qkv, z, b, a = x W_qkvᵀ, x W_zᵀ, x W_bᵀ, x W_aᵀ           one fused LoRA/NF4 call, one saved input
    q, k, v = split(silu(causal_conv1d(qkv)))                  `causal_conv1d`, views of one output, no copies
    g, β = -exp(A_log) · softplus(a + dt_bias), sigmoid(b)     `deltanet_gates`
    o = gated delta rule(l2norm(q), l2norm(k), v, g, β)        `chunk_gated_delta_rule` (value heads read their
                                                               key head, never a repeated copy)
    out = out_proj(rmsnorm(o) · w · silu(z))                   `gated_rms_norm`, then the output projection

Gated attention: q_proj yields each head's query and output gate side by side (`[.., H, 2D]`); the query
half and k go through q/k-norm + partial RoPE in one kernel (read in place, as strided views), SDPA runs with
native GQA, and the attention output is gated by sigmoid(gate) before o_proj.

With a cache (generation) the prompt runs as above and the DeltaNet layers store their conv and recurrent
states; each new token then runs the decoding kernels (`qwen3_5_decode.py`, `decode.py`; with
`decode.GATED_DELTANET_STEP`, the gates, the step and the gated norm in one `delta_rule_gated_step` launch).
Off the kernels' devices (CPU without the interpreter) the plain-PyTorch references compute the same
functions.
"""

from __future__ import annotations

import torch

from unsloth_lite.kernels.causal_conv1d import causal_conv1d, causal_conv1d_reference
from unsloth_lite.kernels.deltanet_decode import (
    conv_state_update,
    conv_state_update_reference,
    delta_rule_step,
    delta_rule_step_reference,
)
from unsloth_lite.kernels.deltanet_decode_gated import delta_rule_gated_step
from unsloth_lite.kernels.deltanet_gates import deltanet_gates, deltanet_gates_reference
from unsloth_lite.kernels.gated_delta_rule import chunk_gated_delta_rule
from unsloth_lite.kernels.gated_delta_rule_reference import chunk_gated_delta_rule_reference
from unsloth_lite.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
from unsloth_lite.models import decode
from unsloth_lite.models.layers import QKNormRoPE, attend, output_projection, pop_cache, project, use_kernels
from unsloth_lite.models.qwen3_5_decode import CacheStep, cache_step, cached_states, store_prefill_states

DELTANET_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _original_forward(self, *args, **kwargs):
    """Hugging Face's forward of the module's class (ours is bound on the instance only)."""
    return type(self).forward(self, *args, **kwargs)


def _cache_argument(kwargs):
    # The cache keyword is `cache_params` up to transformers 5.2x and `cache` after.
    for name in ("cache", "cache_params", "past_key_values"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def gated_deltanet_forward(self, hidden_states, *args, attention_mask=None, **kwargs):
    """Qwen3.5's Gated DeltaNet token mixer: training and prefill fused, a new token over a cache on the
    decoding kernels (`qwen3_5_decode.py`)."""
    cache = args[0] if args else _cache_argument(kwargs)
    step = None if cache is None else cache_step(cache, self.layer_idx, hidden_states.shape[1])
    if step is CacheStep.UNSUPPORTED or len(args) > 1:
        return _original_forward(self, hidden_states, *args, attention_mask=attention_mask, **kwargs)
    for name in ("cache", "cache_params", "past_key_values"):
        kwargs.pop(name, None)
    if attention_mask is not None:  # a 2-D padding mask: pad tokens must not write into the state
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    if step is CacheStep.DECODE:
        return _deltanet_decode(self, hidden_states, cache)
    kernels = use_kernels(hidden_states)
    batch, seq_len, _ = hidden_states.shape
    mixed_qkv, z, b, a = project(self, DELTANET_PROJECTIONS, hidden_states)
    cu_seqlens = kwargs.get("cu_seq_lens_q")

    conv = causal_conv1d if kernels else causal_conv1d_reference
    conv_weight = self.conv1d.weight.squeeze(1)
    conv_input = mixed_qkv.transpose(1, 2)
    mixed_qkv = conv(conv_input, conv_weight, self.conv1d.bias, activation=self.activation, cu_seqlens=cu_seqlens)
    query, key, value = _split_heads(self, mixed_qkv.transpose(1, 2))

    gates = deltanet_gates if kernels else deltanet_gates_reference
    g, beta = gates(a, b, self.A_log, self.dt_bias)
    # The chunked kernel has no float64 (a test dtype): such models take the reference recurrence.
    fused_rule = kernels and value.dtype != torch.float64
    delta_rule = chunk_gated_delta_rule if fused_rule else chunk_gated_delta_rule_reference
    core, final_state = delta_rule(
        query, key, value, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
        output_final_state=cache is not None,
    )
    if cache is not None:
        store_prefill_states(cache, self.layer_idx, conv_input, conv_weight.shape[-1], final_state)
    return _gated_output(self, core, z, kernels)


def _split_heads(self, mixed_qkv):
    """q, k `[.., Hk, Dk]` and v `[.., Hv, Dv]`: views of the convolution's output, no copies."""
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    return (
        query.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
        key.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
        value.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
    )


def _gated_output(self, core, z, kernels):
    """out_proj(rmsnorm(core) · w · silu(z)) of the core output `[B, T, Hv, Dv]`."""
    norm = gated_rms_norm if kernels else gated_rms_norm_reference
    z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
    core = norm(core, self.norm.weight, z, eps=self.norm.variance_epsilon)
    return output_projection(self, "out_proj", core.flatten(-2))


def _deltanet_decode(self, hidden_states, cache):
    """One new token per sequence: the conv state and the recurrent state updated in place by one kernel each."""
    kernels = use_kernels(hidden_states) and hidden_states.dtype != torch.float64
    mixed_qkv, z, b, a = project(self, DELTANET_PROJECTIONS, hidden_states)
    conv_state, recurrent_state = cached_states(cache, self.layer_idx)
    conv = conv_state_update if kernels else conv_state_update_reference
    mixed_qkv = conv(mixed_qkv[:, 0], conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.activation)
    query, key, value = _split_heads(self, mixed_qkv)
    if kernels and decode.GATED_DELTANET_STEP:  # gates, step and gated norm in one launch
        z = z[:, 0].unflatten(-1, (self.num_v_heads, self.head_v_dim))
        core = delta_rule_gated_step(query, key, value, a[:, 0], b[:, 0], self.A_log, self.dt_bias,
                                     recurrent_state, z, self.norm.weight, eps=self.norm.variance_epsilon)
        return output_projection(self, "out_proj", core.flatten(-2)[:, None])
    gates = deltanet_gates if kernels else deltanet_gates_reference
    g, beta = gates(a[:, 0], b[:, 0], self.A_log, self.dt_bias)
    step = delta_rule_step if kernels else delta_rule_step_reference
    core = step(query, key, value, g, beta, recurrent_state, use_qk_l2norm=True)
    return _gated_output(self, core[:, None], z, kernels)


def deltanet_checks(module) -> str | None:
    if module.activation not in ("silu", "swish"):
        return f"activation {module.activation!r} is not SiLU"
    if module.num_v_heads % module.num_k_heads:
        return f"{module.num_v_heads} value heads are not a multiple of {module.num_k_heads} key heads"
    return None


def gated_attention_forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
    """Qwen3.5's gated full attention: projections, q/k-norm + partial RoPE in one kernel, attention, sigmoid
    output gate, output projection."""
    cache = pop_cache(args, kwargs)
    input_shape = hidden_states.shape[:-1]
    query_and_gate, key, value = project(self, ("q_proj", "k_proj", "v_proj"), hidden_states)
    query_and_gate = query_and_gate.view(*input_shape, -1, 2 * self.head_dim)
    query, gate = query_and_gate[..., : self.head_dim], query_and_gate[..., self.head_dim :]
    query = query.transpose(1, 2)
    key = key.view(*input_shape, -1, self.head_dim).transpose(1, 2)
    value = value.view(*input_shape, -1, self.head_dim).transpose(1, 2)
    norm_rope = QKNormRoPE(self.q_norm.weight, self.k_norm.weight, *position_embeddings, self.q_norm.eps, 1.0)
    return attend(self, query, key, value, attention_mask, cache, kwargs, input_shape, gate=gate,
                  norm_rope=norm_rope)
