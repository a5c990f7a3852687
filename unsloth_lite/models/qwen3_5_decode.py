"""Qwen3.5's Gated DeltaNet with a cache (generation): the conv and recurrent states kept between forwards.

Three cache interfaces are read, as transformers releases expose them, each with a conv state `[B, C, K]` of
the last K inputs of the convolution and a recurrent state `[B, Hv, Dk, Dv]`:

* per-layer accessors on the cache (`get_conv_state`, `get_recurrent_state`, `is_recording_past`; transformers
  ≥ 5.2x, DynamicCache and StaticCache alike);
* state lists on the cache's layers (`cache.layers[i].conv_states[0]`, `.recurrent_states[0]`, `.record_past`,
  `cache.has_previous_state(i, state_idx=0)`; transformers 5.1x);
* per-layer lists on the cache (`conv_states[i]`, `recurrent_states[i]`; the hybrid caches of earlier releases).

The first two store a prefill's states through the cache's own `update_conv_state`/`update_recurrent_state`.

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


def _state_layer(cache, layer_idx: int):
    """The cache's layer `layer_idx` where it holds state lists (transformers 5.1x), else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers) or not hasattr(cache, "has_previous_state"):
        return None
    layer = layers[layer_idx]
    return layer if hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states") else None


def cache_step(cache, layer_idx: int, seq_len: int) -> CacheStep:
    if _uses_accessors(cache):
        if cache.is_recording_past(layer_idx):
            return CacheStep.UNSUPPORTED
        previous = cache.get_conv_state(layer_idx) is not None and cache.get_recurrent_state(layer_idx) is not None
    elif (layer := _state_layer(cache, layer_idx)) is not None:
        if getattr(layer, "record_past", False):
            return CacheStep.UNSUPPORTED
        previous = cache.has_previous_state(layer_idx, state_idx=0) and layer.recurrent_states[0] is not None
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
    if (layer := _state_layer(cache, layer_idx)) is not None:
        return layer.conv_states[0], layer.recurrent_states[0]
    return cache.conv_states[layer_idx], cache.recurrent_states[layer_idx]


def store_prefill_states(cache, layer_idx: int, conv_input: torch.Tensor, kernel_size: int, state: torch.Tensor):
    """After a prefill: the last `kernel_size` inputs of the convolution (`conv_input` `[B, C, T]`, zeros before
    the first when T is shorter) and the final recurrent state."""
    if _uses_accessors(cache) or _state_layer(cache, layer_idx) is not None:
        cache.update_conv_state(conv_input, layer_idx, conv_kernel_size=kernel_size)
        cache.update_recurrent_state(state, layer_idx)
        return
    cache.conv_states[layer_idx] = torch.nn.functional.pad(conv_input, (kernel_size - conv_input.shape[-1], 0))
    cache.recurrent_states[layer_idx] = state
