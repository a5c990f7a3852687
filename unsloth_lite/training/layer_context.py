"""What a checkpointed layer's forward records and its recomputation restores (the autocast settings, the
residual stream after attention), and the side stream that offload copies and graph captures run on."""

from __future__ import annotations

import contextlib
import functools

import torch

from unsloth_lite.models.layers import residual_streams


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


def _recording_residual(enabled: bool, into: torch.Tensor | None = None):
    """Collects the residual streams after the token mixers of the decoder layers that run inside (one each);
    a fused decoder layer computes its own in `into`, where given."""
    return residual_streams(record=enabled, into=None if into is None else [into])


def _substituting_residual(value: torch.Tensor | None):
    """The next decoder layer that runs inside takes `value` as its residual stream after the token mixer."""
    return residual_streams(kept=None if value is None else [value])


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
    sink = residual_streams.sink()
    if sink is not None:
        sink.append(args[0])
        return None
    saved = residual_streams.take("kept")
    if saved is not None:
        return (_Substituted.apply(args[0], saved), *args[1:])
    return None
