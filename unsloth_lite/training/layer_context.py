"""What a checkpointed layer's forward records and its recomputation restores (the autocast settings, the
residual stream after attention), and the side stream that offload copies and graph captures run on."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """The stream for offload copies and graph captures of a device."""
    return torch.cuda.Stream(device=device_index)


def _autocast_states() -> list[tuple]:
    """The autocast settings in force, to recompute a layer under the ones its forward ran with."""
    cache_enabled = torch.is_autocast_cache_enabled()
    return [
        (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), cache_enabled)
        for device_type in ("cuda", "cpu")
    ]


@contextlib.contextmanager
def _autocast(states: list[tuple], cache_enabled: bool | None = None):
    """Autocast as `states` (from `_autocast_states`) had it; `cache_enabled` overrides their cast caching."""
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype, cached in states:
            cached = cached if cache_enabled is None else cache_enabled
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cached))
        yield


_RESIDUAL = threading.local()  # the residual stream after attention: `sink` records it, `value` replaces it


@contextlib.contextmanager
def _recording_residual(enabled: bool):
    """Collects the inputs of the post-attention norms that run inside (one per decoder layer)."""
    previous = getattr(_RESIDUAL, "sink", None)
    _RESIDUAL.sink = sink = [] if enabled else None
    try:
        yield sink if enabled else []
    finally:
        _RESIDUAL.sink = previous


@contextlib.contextmanager
def _substituting_residual(value: torch.Tensor | None):
    previous = getattr(_RESIDUAL, "value", None)
    _RESIDUAL.value = value
    try:
        yield
    finally:
        _RESIDUAL.value = previous


class _Substituted(torch.autograd.Function):
    """`saved` in place of `computed`, which it equals, with the gradient going to `computed`."""

    @staticmethod
    def forward(ctx, computed, saved):
        return saved.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _residual_hook(module, args):
    """Forward pre-hook of a decoder layer's post-attention norm (see `enable_gradient_checkpointing`)."""
    if not args:  # called with keywords only: nothing recorded, so nothing is substituted either
        return None
    sink = getattr(_RESIDUAL, "sink", None)
    if sink is not None:
        sink.append(args[0])
        return None
    saved = getattr(_RESIDUAL, "value", None)
    if saved is not None:
        return (_Substituted.apply(args[0], saved), *args[1:])
    return None
