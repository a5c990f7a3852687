"""Gradient checkpointing of the decoder layers, lighter on the host than `torch.utils.checkpoint`'s
non-reentrant form, with the saved layer inputs optionally kept in pinned CPU memory and the layers
optionally replayed as CUDA graphs.

A checkpointed layer runs its forward under `no_grad` (no autograd graph is built, no saved-tensor hooks
run) and keeps only its input hidden states. Its backward restores them, runs the layer again with
gradients on, and back-propagates through that recomputation: the reentrant scheme, whose forward costs
the host only the layer's own ops. The recomputation runs under `recomputation_for_backward()`, which lets
the patched layers skip what only the layer's output needs (the MLP's down projection), and under the
autocast settings of the forward. Where the model has dropout, CPU and CUDA random states are restored
for the recomputation, so dropout draws the same masks twice.

`keep_residual=True` (the default with the offload) also keeps the residual stream after attention, the input
of each layer's post-attention norm, recorded by a forward pre-hook on that norm. The recomputation takes it
in place of residual + attention output (the gradient still flows into both), so the attention's output
projection is left uncomputed too, under `recomputation_for_backward(attention_output_unused=True)`: the
backward reads only its input and rank-r product. It costs one more `[batch, seq, hidden]` tensor a layer,
in CPU memory with the offload, and saves the recomputation the output projection's dequantisation and
`[tokens, hidden] x [hidden, hidden]` product.

`offload_to_cpu=True` keeps those tensors (the input, one `[batch, seq, hidden]` tensor a layer, is 2.25 GiB
for 36 layers of Qwen3-8B at 4 x 2048 tokens in bf16; the residual as much again) in pinned CPU memory
instead of on the GPU. Copies run on a side
stream: device to host right after each layer's forward, host to device one layer ahead in the backward
(while layer i back-propagates, layer i-1's tensors come back), so they overlap the layers' compute. Stream
safety: the GPU input is marked as used by the side stream until its copy is done, and the side stream's
copy back is awaited (an event) before the layer uses it.

`keep_mlp_preactivations=True` also keeps each layer's MLP pre-activations, gate(x) and up(x) (`[tokens,
intermediate]` each, recorded by the fused MLP in the forward, in CPU memory with the offload), where the MLP's
backward runs as one row block (it would allocate them anyway then). The recomputation's MLP takes them
(`mlp_preactivations`) and computes only its rank-r products: the gate and up projections, the largest of a
layer's recomputed products, and their dequantisation, leave the recomputation. The price is their copies: at
Qwen3.5-27B's 2,048 tokens 142 MB a layer each way, which the H200's 55 GB/s host link carries in about the
time of a layer's forward. So they can be kept in some of the layers only (`keep_mlp_preactivations=N`, spread
evenly), and some of those can keep them on the GPU despite the offload (`mlp_preactivations_on_gpu=M`).

`keep_projection_outputs=True` also keeps the outputs of each layer's token-mixer input projections (`project`: q,
k and v; the Gated DeltaNet's qkv, z, b and a), always in GPU memory: the recomputation takes them and forms only
the rank-r products, leaving out the products and their dequantisation. The backward reads x and the rank-r
products of a projection, never its output; the recomputation's output is the input of what follows (the
convolution, the attention). Their bytes buy the same time as the MLP pre-activations' (one product of the input's
width for two bytes of output), so where the offload fills the host link they are worth the GPU memory a run has
to spare: at Qwen3.5-27B's 2,048 tokens 67 MB a Gated DeltaNet layer and 59 MB a full-attention one, for about
half a millisecond of an H100's products each. A number instead of true keeps them in that many of the
checkpointed layers, spread evenly. With `cuda_graphs` they live in buffers of the layer's own for each graphed
input shape (no copies; `layer_graphs.py`), held as long as the graphs: a run of several shapes holds them once
per shape.

`cuda_graphs=True` replays each layer's forward, and its recomputation with the backward, as CUDA graphs
(`layer_graphs.py`), which removes the host's launch cost that bounds small batches.

Enabled with `enable_gradient_checkpointing(model, offload_to_cpu=..., cuda_graphs=...)`; every layer that
Hugging Face's gradient checkpointing covers (`GradientCheckpointingLayer`) then goes through
`checkpoint_layer`, except the last `uncheckpointed_layers`, which keep their activations and skip the
recomputation (memory traded for speed where a run has it to spare). The inputs that need gradients must be
positional (as in Hugging Face's decoder loops) and at least one must require grad (the Trainer makes the
embeddings' output require grad); otherwise the layer falls back to `torch.utils.checkpoint`'s non-reentrant
form.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading

import torch
import torch.utils.checkpoint

from unsloth_lite.models.decoder_layer import residual_fused_forward, takes_fused_residuals
from unsloth_lite.models.layers import mlp_preactivations, projection_outputs, recomputation_for_backward
from unsloth_lite.training.layer_context import (
    _autocast,
    _autocast_states,
    _recording_residual,
    _residual_hook,
    _side_stream,
    _substituting_residual,
)
from unsloth_lite.training.layer_graphs import _KeptSet, _LayerGraphs

# The keyword options of `enable_gradient_checkpointing` that a Trainer and a recipe pass on.
CHECKPOINTING_OPTIONS = (
    "offload_to_cpu", "cuda_graphs", "uncheckpointed_layers", "keep_mlp_preactivations", "mlp_preactivations_on_gpu",
    "keep_projection_outputs",
)

# Offloaded checkpoints whose copies may still be running (to the host in the forward, back in the backward)
# while the host queues more work. The device memory a copy reads or writes is freed when the host drops it but
# reused only once the GPU has passed it: a host that ran the whole pass ahead of the GPU would leave every
# layer's copies reserved at once. So the host waits for the copies (forward) or the layers' use (backward)
# of MAX_PENDING_OFFLOADS checkpoints back before it queues another.
MAX_PENDING_OFFLOADS = 2


class _BoundedLead:
    """Events of the last MAX_PENDING_OFFLOADS offloads of a pass; the host waits for the oldest before a new one."""

    def __init__(self):
        self.events = collections.deque()

    def push(self, event: torch.cuda.Event) -> None:
        if len(self.events) == MAX_PENDING_OFFLOADS:
            self.events.popleft().synchronize()
        self.events.append(event)


_LEAD = threading.local()


def _lead(direction: str) -> _BoundedLead:
    if not hasattr(_LEAD, direction):
        setattr(_LEAD, direction, _BoundedLead())
    return getattr(_LEAD, direction)

_LAST_OFFLOADED = threading.local()  # the previous offloaded layer of the forward pass being recorded


class _OffloadedTensors:
    """A checkpoint's tensors held in pinned CPU memory, fetched back to their device when its backward needs
    them."""

    def __init__(self, tensors: list[torch.Tensor], previous: _OffloadedTensors | None, kept: _KeptSet | None = None):
        """`kept`: the kept set of a graphed layer (`layer_graphs._KeptSet`), whose buffers among `tensors` are
        copied to the host straight from the set (the set read until then) and fetched straight back into it."""
        self.device = tensors[0].device
        self.stream = _side_stream(self.device.index or 0)
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensors are computed
        with torch.cuda.stream(self.stream):
            for host, tensor in zip(self.host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
        for tensor in tensors:
            tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
        copied = torch.cuda.Event()
        copied.record(self.stream)
        self.kept = kept
        self.buffers = [t if kept is not None and kept.holds(t) else None for t in tensors]
        if any(b is not None for b in self.buffers):
            kept.read_until(copied)
        _lead("forward").push(copied)
        self.previous = previous  # the checkpoint before, whose tensors the backward fetches next
        self.fetched: list[torch.Tensor] | None = None
        self.ready: torch.cuda.Event | None = None

    def prefetch(self, in_use: _KeptSet | None = None) -> None:
        """Starts fetching the tensors: those of the kept set straight into its buffers once their last read is
        done, unless the set is `in_use` (the layer back-propagating now holds its tensors there; they then come
        back in new memory, which the layer's graphs copy in)."""
        if self.fetched is not None or self.host is None:
            return
        into_set = self.kept is not None and self.kept is not in_use
        with torch.cuda.stream(self.stream):
            if into_set:
                self.kept.wait_until_free(self.stream)
            self.fetched = [
                buffer.copy_(host, non_blocking=True) if into_set and buffer is not None
                else host.to(self.device, non_blocking=True)
                for host, buffer in zip(self.host, self.buffers, strict=True)
            ]
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def take(self) -> list[torch.Tensor]:
        """The tensors back on their device, usable on the current stream; starts fetching the checkpoint
        before."""
        self.prefetch()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        tensors = self.fetched
        for tensor in tensors:
            tensor.record_stream(current)
        taken = torch.cuda.Event()
        taken.record(current)  # the layer's backward, queued next, is what the host must not run far ahead of
        _lead("backward").push(taken)
        self.fetched = self.host = self.ready = self.buffers = None
        if self.previous is not None:
            self.previous.prefetch(in_use=self.kept)
            self.previous = None
        return tensors


def _save_inputs(ctx, tensors, offload: list[bool], kept: _KeptSet | None = None) -> None:
    """Keeps a checkpoint's tensors for its backward: on their device, or (those `offload` marks, on one GPU)
    in pinned CPU memory, as one group linked to the previous offloaded checkpoint of the pass (`kept`: the kept
    set of a graphed layer, see `_OffloadedTensors`)."""
    device = next((t.device for t, moved in zip(tensors, offload, strict=True) if moved), None)
    ctx.offloaded = [moved and t.device == device for t, moved in zip(tensors, offload, strict=True)]
    ctx.offload_group = None
    if any(ctx.offloaded):
        previous = getattr(_LAST_OFFLOADED, "value", None)
        moved = [t for t, flag in zip(tensors, ctx.offloaded, strict=True) if flag]
        ctx.offload_group = _LAST_OFFLOADED.value = _OffloadedTensors(moved, previous, kept)
    ctx.save_for_backward(*[t for t, flag in zip(tensors, ctx.offloaded, strict=True) if not flag])


def _saved_inputs(ctx) -> list[torch.Tensor]:
    fetched = iter(ctx.offload_group.take() if ctx.offload_group is not None else ())
    kept = iter(ctx.saved_tensors)
    return [next(fetched) if flag else next(kept) for flag in ctx.offloaded]


def _offload_flags(inputs, kept, mlp_pairs: int, offload: tuple[bool, bool], on_device: int = 0) -> list[bool]:
    """Which of a checkpoint's saved tensors go to CPU memory, `offload` = (the inputs and residual's, the MLP
    pre-activations'): the inputs that need gradients (others, like masks, are small or shared), the residual,
    the MLPs' pre-activations (the `2 * mlp_pairs` of `kept` before its last `on_device`, the projections'
    outputs, which stay on the device)."""
    offload_to_cpu, offload_preactivations = offload
    others = len(kept) - on_device - 2 * mlp_pairs
    return [offload_to_cpu and _offloadable(t) and t.requires_grad for t in inputs] + [
        (offload_to_cpu if i < others else offload_preactivations) and _offloadable(t)
        for i, t in enumerate(kept[: len(kept) - on_device])
    ] + [False] * on_device


def _offloadable(t: torch.Tensor) -> bool:
    """Whether the offload moves `t` (GPU tensors only; the tests stand in for it off CUDA)."""
    return t.is_cuda


def _kept_tensors(residual, preactivations, projections=()) -> list[torch.Tensor]:
    """What a checkpoint keeps beside its inputs: the residual (or nothing), the MLPs' (gate, up) pairs, then the
    projections' outputs (a tuple per `project` call)."""
    groups = [*preactivations, *projections]
    return ([] if residual is None else [residual]) + [t for group in groups for t in group]


def _split_kept(saved: list[torch.Tensor], has_residual: bool, mlp_pairs: int, projection_sizes=()):
    """(inputs, residual or None, [(gate, up), ...], [projections' outputs, ...]) from `_saved_inputs` of what
    `_kept_tensors` appended; `projection_sizes`: the number of outputs of each projection call."""
    sizes = [2] * mlp_pairs + list(projection_sizes)
    end = len(saved) - sum(sizes)
    inputs = saved[: end - has_residual]
    residual = saved[len(inputs)] if has_residual else None
    groups = []
    for size in sizes:
        groups.append(tuple(saved[end: end + size]))
        end += size
    return inputs, residual, groups[:mlp_pairs], groups[mlp_pairs:]


class _CheckpointedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, options, *args):
        offload, preserve_rng_state, keep_residual, keep_mlp, keep_projections = options
        ctx.run = run
        ctx.rng = None
        if preserve_rng_state:
            ctx.rng = torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in _cuda_devices(args)]
        ctx.autocast = _autocast_states()
        with (
            torch.no_grad(),
            _recording_residual(keep_residual) as residuals,
            mlp_preactivations(record=keep_mlp) as preactivations,
            projection_outputs(record=keep_projections) as projections,
        ):
            outputs = run(*args)
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        inputs = [args[i] for i in ctx.tensor_positions]
        residual = residuals[0] if len(residuals) == 1 else None
        ctx.has_residual, ctx.mlp_pairs = residual is not None, len(preactivations)
        ctx.projection_sizes = [len(group) for group in projections]
        kept = _kept_tensors(residual, preactivations, projections)
        flags = _offload_flags(inputs, kept, ctx.mlp_pairs, offload, sum(ctx.projection_sizes))
        _save_inputs(ctx, inputs + kept, flags)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        saved, residual, preactivations, projections = _split_kept(
            _saved_inputs(ctx), ctx.has_residual, ctx.mlp_pairs, ctx.projection_sizes)
        for i, tensor in zip(ctx.tensor_positions, saved, strict=True):
            args[i] = tensor.detach().requires_grad_(ctx.needs_input_grad[2 + i])
        with contextlib.ExitStack() as stack:
            stack.enter_context(recomputation_for_backward(attention_output_unused=ctx.has_residual))
            stack.enter_context(_substituting_residual(residual))
            stack.enter_context(mlp_preactivations(kept=preactivations))
            stack.enter_context(projection_outputs(kept=projections))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_autocast(ctx.autocast))  # the backward runs outside autocast
            if ctx.rng is not None:
                cpu_state, cuda_states = ctx.rng
                stack.enter_context(torch.random.fork_rng(devices=[d for d, _ in cuda_states]))
                torch.set_rng_state(cpu_state)
                for device, state in cuda_states:
                    torch.cuda.set_rng_state(state, device)
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


def checkpoint_layer(
    run, *args, offload_to_cpu: bool = False, cuda_graphs: bool = False, preserve_rng_state: bool = True,
    keep_residual: bool = False, keep_mlp_preactivations: bool = False, offload_mlp_preactivations: bool | None = None,
    keep_projection_outputs: bool = False,
):
    """`run(*args)` checkpointed (module docstring): the signature of Hugging Face's
    `_gradient_checkpointing_func(function, *args)`. `preserve_rng_state=False` skips saving and restoring
    the random states, for layers that draw no random numbers. `keep_residual=True` also keeps what the
    layer's post-attention norm receives, where `enable_gradient_checkpointing` hooked it;
    `keep_mlp_preactivations=True` the layer's MLP pre-activations (module docstring), in CPU memory where
    `offload_mlp_preactivations` (default: `offload_to_cpu`); `keep_projection_outputs=True` the outputs of its
    token mixer's input projections, on the device (module docstring)."""
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
    run = _fused_run(run, args)
    offload = (offload_to_cpu, offload_to_cpu if offload_mlp_preactivations is None else offload_mlp_preactivations)
    if cuda_graphs:
        graphs = _LayerGraphs.for_call(run, args, keep_residual, keep_mlp_preactivations, keep_projection_outputs)
        if graphs is not None:
            return _GraphedLayer.apply(graphs, run, offload, args[0], *graphs.params)
    options = (offload, preserve_rng_state, keep_residual, keep_mlp_preactivations, keep_projection_outputs)
    return _CheckpointedLayer.apply(run, options, *args)


def _fused_run(run, args):
    """`run` as the layer's `residual_fused_forward` (its keywords bound) where it is the layer class's own forward
    (transformers 5.2x and later checkpoint that, which the patched instance's forward does not replace) and the
    call takes the fused form (`decoder_layer.py`). Earlier releases hand over the module's `__call__`, which
    reaches the patched forward itself, hooks included."""
    layer = run.args[0] if isinstance(run, functools.partial) and len(run.args) == 1 else None
    if not isinstance(layer, torch.nn.Module) or not args:
        return run
    if not takes_fused_residuals(layer, args[0], args[1:], run.keywords):
        return run
    return functools.partial(residual_fused_forward, layer, **run.keywords)


class _GraphedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs, run, offload, hidden, *params):
        ctx.graphs = graphs
        # offloaded kept tensors are copied to the host straight from the graphs' buffers
        in_place = tuple(moved and _offloadable(hidden) for moved in offload)
        output, residual, preactivations, projections = graphs.forward(run, hidden, in_place)
        ctx.has_residual, ctx.mlp_pairs = residual is not None, len(preactivations)
        ctx.projection_sizes = [len(group) for group in projections]
        kept = _kept_tensors(residual, preactivations, projections)
        flags = _offload_flags([hidden], kept, ctx.mlp_pairs, offload, sum(ctx.projection_sizes))
        # a buffer of the set kept on the GPU would be overwritten by the next layers
        assert all(moved or not graphs.kept.holds(t) for t, moved in zip(kept, flags[1:], strict=True))
        _save_inputs(ctx, [hidden] + kept, flags, graphs.kept)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (hidden,), residual, preactivations, projections = _split_kept(
            _saved_inputs(ctx), ctx.has_residual, ctx.mlp_pairs, ctx.projection_sizes)
        grad_hidden, *grad_params = ctx.graphs.backward(hidden, residual, preactivations, projections, grad_output)
        return (None, None, None, grad_hidden, *grad_params)


def _draws_random_numbers(module) -> bool:
    if isinstance(module, torch.nn.Dropout):
        return module.p > 0
    dropout = getattr(module, "attention_dropout", 0.0)
    return isinstance(dropout, float) and dropout > 0


def start_forward_pass() -> None:
    """Forgets the previous pass's last offloaded layer, so that layers of two passes are never linked."""
    _LAST_OFFLOADED.value = None


def _base_model(model) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def checkpointing_layers(model) -> list[torch.nn.Module]:
    """The decoder layers that Hugging Face's gradient checkpointing covers, of a model PEFT-wrapped or not."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in _base_model(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def check_checkpointing_options(
    model, cuda_graphs: bool = False, uncheckpointed_layers: int = 0, keep_mlp_preactivations: bool | int = False,
    mlp_preactivations_on_gpu: int = 0, keep_projection_outputs: bool | int = False, **_,
) -> list[str]:
    """Raises ValueError for options the model can't take (offloading suits every model; CUDA graphs don't
    suit dropout; no more uncheckpointed layers than it has, no more layers keeping their MLP pre-activations or
    their projections' outputs than it checkpoints, no more of those on the GPU than keep them); returns the
    names of its modules with dropout. Other options (`offload_to_cpu`) suit every model."""
    base = _base_model(model)
    layers = checkpointing_layers(model)
    if not layers:
        raise ValueError(f"{type(base).__name__} has no decoder layers that support gradient checkpointing")
    _check_count("uncheckpointed_layers", uncheckpointed_layers, len(layers), "the model's decoder layers")
    checkpointed = len(layers) - uncheckpointed_layers
    for name, value in (("keep_mlp_preactivations", keep_mlp_preactivations),
                        ("keep_projection_outputs", keep_projection_outputs)):
        if not isinstance(value, bool):
            _check_count(name, value, checkpointed, "the checkpointed decoder layers; or true, or false")
    keeping = _kept_layer_count(keep_mlp_preactivations, checkpointed)
    _check_count("mlp_preactivations_on_gpu", mlp_preactivations_on_gpu, keeping,
                 "the layers that keep their MLP pre-activations")
    random = [name for name, m in base.named_modules() if _draws_random_numbers(m)]
    if cuda_graphs and random:
        raise ValueError(f"cuda_graphs=True needs layers without dropout; {random[0]} has p > 0")
    return random


def _check_count(name: str, value, most: int, of_what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError(f"{name}: expected a whole number from 0 to {most} ({of_what}), got {value!r}")


def _kept_layer_count(keep: bool | int, checkpointed: int) -> int:
    """How many of the checkpointed layers a `keep_...` option (true, false or a number) names."""
    if isinstance(keep, bool):
        return checkpointed if keep else 0
    return keep


def spread(count: int, total: int) -> list[bool]:
    """`count` of `total` places chosen evenly apart (the last always among them when count > 0)."""
    return [(i + 1) * count // total > i * count // total for i in range(total)]


def enable_gradient_checkpointing(
    model, offload_to_cpu: bool = False, cuda_graphs: bool = False, keep_residual: bool | None = None,
    uncheckpointed_layers: int = 0, keep_mlp_preactivations: bool | int = False, mlp_preactivations_on_gpu: int = 0,
    keep_projection_outputs: bool | int = False,
):
    """Turns on gradient checkpointing of the decoder layers of a Hugging Face model (PEFT-wrapped or not)
    through `checkpoint_layer`; returns the model. Frozen embeddings get an output that requires grad, so
    that the first layer's input carries gradients into the checkpointed layers. `unsloth_lite.Trainer` does
    this itself when `TrainingArguments.gradient_checkpointing` is on (options: its `checkpointing=`).
    `keep_residual` (default: `offload_to_cpu`) keeps each layer's residual stream after attention with its
    input (module docstring). `uncheckpointed_layers`: the last that many layers are not checkpointed: they
    keep their activations on the GPU and their backward runs without recomputing their forward (the products
    of a recomputation are most of a third of a layer's training cost), for the memory of those activations;
    where a run has memory to spare, it buys speed. `keep_mlp_preactivations`: each checkpoint also keeps its
    MLP's gate and up outputs (offloaded with the input where `offload_to_cpu`), and the recomputation skips
    their products (module docstring); a number N instead of true: N of the checkpointed layers keep them,
    spread evenly (with the offload, the host link carries a layer's pre-activations in about the time of
    its forward: fewer layers keeping them leave the forward less bound by the copies).
    `mlp_preactivations_on_gpu`: with `offload_to_cpu`, that many of the layers that keep them (spread evenly)
    keep them in GPU memory instead: no copies, for their memory. `keep_projection_outputs` (true, or a number
    of the checkpointed layers, spread evenly): those checkpoints also keep the outputs of their token mixer's
    input projections (q, k, v; the Gated DeltaNet's qkv, z, b, a), always in GPU memory (the offload's host link
    is what the MLP pre-activations fill), and the recomputation skips those products (module docstring)."""
    random = check_checkpointing_options(
        model, cuda_graphs=cuda_graphs, uncheckpointed_layers=uncheckpointed_layers,
        keep_mlp_preactivations=keep_mlp_preactivations, mlp_preactivations_on_gpu=mlp_preactivations_on_gpu,
        keep_projection_outputs=keep_projection_outputs,
    )
    layers = checkpointing_layers(model)
    keep_residual = offload_to_cpu if keep_residual is None else keep_residual
    base = _base_model(model)
    checkpointed_count = len(layers) - uncheckpointed_layers
    keeping_count = _kept_layer_count(keep_mlp_preactivations, checkpointed_count)
    keeps = spread(keeping_count, checkpointed_count) + [False] * uncheckpointed_layers
    keeps_projections = spread(_kept_layer_count(keep_projection_outputs, checkpointed_count), checkpointed_count)
    on_gpu = iter(spread(mlp_preactivations_on_gpu, keeping_count))
    for index, layer in enumerate(layers):
        checkpointed = index < checkpointed_count
        layer.gradient_checkpointing = checkpointed
        layer._gradient_checkpointing_func = functools.partial(
            checkpoint_layer, offload_to_cpu=offload_to_cpu, cuda_graphs=cuda_graphs, preserve_rng_state=bool(random),
            keep_residual=keep_residual, keep_mlp_preactivations=keeps[index],
            offload_mlp_preactivations=offload_to_cpu and not (keeps[index] and next(on_gpu)),
            keep_projection_outputs=checkpointed and keeps_projections[index],
        )
        handle = layer.__dict__.pop("_unsloth_lite_residual_hook", None)
        if handle is not None:
            handle.remove()
        norm = getattr(layer, "post_attention_layernorm", None)
        if checkpointed and keep_residual and isinstance(norm, torch.nn.Module):
            layer._unsloth_lite_residual_hook = norm.register_forward_pre_hook(_residual_hook)
    if not getattr(base, "_unsloth_lite_pass_hook", False):
        base.register_forward_pre_hook(lambda module, args: start_forward_pass())
        base._unsloth_lite_pass_hook = True
    base.enable_input_require_grads()
    if hasattr(base, "config"):
        base.config.use_cache = False
    return model
