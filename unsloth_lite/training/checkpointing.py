"""Gradient checkpointing of the decoder layers, lighter on the host than `torch.utils.checkpoint`'s
non-reentrant form, with the saved layer inputs optionally kept in pinned CPU memory.

A checkpointed layer runs its forward under `no_grad` (no autograd graph is built, no saved-tensor hooks
run) and keeps only its input hidden states. Its backward restores them, runs the layer again with
gradients on, and back-propagates through that recomputation: the reentrant scheme, whose forward costs
the host only the layer's own ops. CPU and CUDA random states are restored for the recomputation, so
dropout draws the same masks twice.

`offload_to_cpu=True` keeps those inputs (one `[batch, seq, hidden]` tensor a layer, 2.25 GiB for 36 layers
of Qwen3-8B at 4 x 2048 tokens in bf16) in pinned CPU memory instead of on the GPU. Copies run on a side
stream: device to host right after each layer's forward, host to device one layer ahead in the backward
(while layer i back-propagates, layer i-1's input comes back), so they overlap the layers' compute. Stream
safety: the GPU input is marked as used by the side stream until its copy is done, and the side stream's
copy back is awaited (an event) before the layer uses it.

Enabled with `enable_gradient_checkpointing(model, offload_to_cpu=...)`; every layer that Hugging Face's
gradient checkpointing covers (`GradientCheckpointingLayer`) then goes through `checkpoint_layer`. The
inputs that need gradients must be positional (as in Hugging Face's decoder loops) and at least one must
require grad (the Trainer makes the embeddings' output require grad); otherwise the layer falls back to
`torch.utils.checkpoint`'s non-reentrant form.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.utils.checkpoint

_LAST_OFFLOADED = threading.local()  # the previous offloaded layer of the forward pass being recorded


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


class _OffloadedInput:
    """A layer input held in pinned CPU memory, fetched back to its device when the backward needs it."""

    def __init__(self, tensor: torch.Tensor, previous: _OffloadedInput | None):
        self.device = tensor.device
        self.stream = _side_stream(tensor.device.index or 0)
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the input is computed
        with torch.cuda.stream(self.stream):
            self.host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
        self.previous = previous  # the layer before, whose input the backward fetches next
        self.fetched: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def prefetch(self) -> None:
        if self.fetched is not None or self.host is None:
            return
        with torch.cuda.stream(self.stream):
            self.fetched = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def take(self) -> torch.Tensor:
        """The input back on its device, usable on the current stream; starts fetching the layer before."""
        self.prefetch()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        tensor = self.fetched
        tensor.record_stream(current)
        self.fetched = self.host = self.ready = None
        if self.previous is not None:
            self.previous.prefetch()
            self.previous = None
        return tensor


class _CheckpointedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, offload_to_cpu, *args):
        ctx.run = run
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in _cuda_devices(args)]
        with torch.no_grad():
            outputs = run(*args)
        tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_positions = tensor_positions
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.offloaded = {}
        kept = []
        for i in tensor_positions:
            tensor = args[i]
            if offload_to_cpu and tensor.is_cuda and tensor.requires_grad:
                previous = getattr(_LAST_OFFLOADED, "value", None)
                ctx.offloaded[i] = _LAST_OFFLOADED.value = _OffloadedInput(tensor, previous)
            else:
                kept.append(tensor)
        ctx.save_for_backward(*kept)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        kept = iter(ctx.saved_tensors)
        args = list(ctx.others)
        for i in ctx.tensor_positions:
            tensor = ctx.offloaded[i].take() if i in ctx.offloaded else next(kept)
            args[i] = tensor.detach().requires_grad_(ctx.needs_input_grad[2 + i])
        with torch.random.fork_rng(devices=[d for d, _ in ctx.cuda_rng]):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in ctx.cuda_rng:
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                outputs = ctx.run(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (out, grad) for out, grad in zip(outputs, grads, strict=True)
            if torch.is_tensor(out) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [a.grad if torch.is_tensor(a) else None for a in args]
        return (None, None, *input_grads)


def _cuda_devices(args) -> list[int]:
    return sorted({a.device.index or 0 for a in args if torch.is_tensor(a) and a.is_cuda})


def checkpoint_layer(run, *args, offload_to_cpu: bool = False):
    """`run(*args)` checkpointed (module docstring): the signature of Hugging Face's
    `_gradient_checkpointing_func(function, *args)`."""
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
    return _CheckpointedLayer.apply(run, offload_to_cpu, *args)


def start_forward_pass() -> None:
    """Forgets the previous pass's last offloaded layer, so that layers of two passes are never linked."""
    _LAST_OFFLOADED.value = None


def enable_gradient_checkpointing(model, offload_to_cpu: bool = False):
    """Turns on gradient checkpointing of every decoder layer of a Hugging Face model (PEFT-wrapped or not)
    through `checkpoint_layer`; returns the model. Frozen embeddings get an output that requires grad, so
    that the first layer's input carries gradients into the checkpointed layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    function = functools.partial(checkpoint_layer, offload_to_cpu=offload_to_cpu)
    layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(base).__name__} has no decoder layers that support gradient checkpointing")
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = function
    if not getattr(base, "_unsloth_lite_pass_hook", False):
        base.register_forward_pre_hook(lambda module, args: start_forward_pass())
        base._unsloth_lite_pass_hook = True
    base.enable_input_require_grads()
    if hasattr(base, "config"):
        base.config.use_cache = False
    return model
