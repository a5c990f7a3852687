"""Qwen3.5's Gated DeltaNet with a cache (generation): the conv and recurrent states kept between forwards.

Two cache interfaces are read, as transformers releases expose them:

* per-layer accessors (`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`;
  transformers ≥ 5.2x, DynamicCache and StaticCache alike), with a conv state `[B, C, K]` of the last K inputs
  of the convolution and a recurrent state `[B, Hv, Dk, Dv]`;
* per-layer lists (`conv_states[i]`, `recurrent_states[i]`; the hybrid caches of earlier releases), same shapes.

Prefill (no previous state) runs the training path's fused kernels and stores the states it ends with; a new
token over a previous state runs `conv_state_update` and `delta_rule_step`, which update the cached tensors in
place (their addresses never change, as a CUDA graph needs). What neither covers (several tokens after a
previous state, a cache recording its past for a rollback) keeps Hugging Face's forward.
"""

from __future__ import annotations

import enum

import torch


class CacheStep(enum.Enum):
    PREFILL = "prefill"  # no previous state: the states are written from this forward's inputs
    DECODE = "decode"  # one new token over a previous state
    UNSUPPORTED = "unsupported"


def _uses_accessors(cache) -> bool:
    return hasattr(cache, "get_conv_state") and hasattr(cache, "update_recurrent_state")


def cache_step(cache, layer_idx: int, seq_len: int) -> CacheStep:
    if _uses_accessors(cache):
        if cache.is_recording_past(layer_idx):
            return CacheStep.UNSUPPORTED
        previous = cache.get_conv_state(layer_idx) is not None and cache.get_recurrent_state(layer_idx) is not None
    elif hasattr(cache, "conv_states") and hasattr(cache, "recurrent_states"):
        previous = cache.conv_states[layer_idx] is not None and cache.recurrent_states[layer_idx] is not None
    else:
        return CacheStep.UNSUPPORTED
    if not previous:
        return CacheStep.PREFILL
    return CacheStep.DECODE if seq_len == 1 else CacheStep.UNSUPPORTED


def cached_states(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (conv, recurrent) states of a layer with a previous state: the cache's own tensors."""
    if _uses_accessors(cache):
        return cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)
    return cache.conv_states[layer_idx], cache.recurrent_states[layer_idx]


def store_prefill_states(cache, layer_idx: int, conv_input: torch.Tensor, kernel_size: int, state: torch.Tensor):
    """After a prefill: the last `kernel_size` inputs of the convolution (`conv_input` `[B, C, T]`, zeros before
    the first when T is shorter) and the final recurrent state."""
    if _uses_accessors(cache):
        cache.update_conv_state(conv_input, layer_idx, conv_kernel_size=kernel_size)
        cache.update_recurrent_state(state, layer_idx)
        return
    cache.conv_states[layer_idx] = torch.nn.functional.pad(conv_input, (kernel_size - conv_input.shape[-1], 0))
    cache.recurrent_states[layer_idx] = state
