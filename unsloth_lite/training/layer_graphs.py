"""CUDA-graph replay of checkpointed decoder layers (`checkpointing.py`).

`cuda_graphs=True` removes the host's launch cost, which bounds small batches: each layer's forward and its
recompute-and-backward are captured once per input shape and autocast setting as two CUDA graphs (both in the
forward of the second call with that shape; the first runs eagerly and compiles every kernel), then replayed.
The graphs read and write static buffers that all layers share: the input (copied in before each replay, from
the forward's argument or from the checkpoint, which is kept as without graphs, offloaded or not), the output and
the gradients (copied out right after). The kept residual and MLP pre-activations (the MLPs compute theirs in
them) live in one of KEPT_SETS sets of buffers, which consecutive layers take in turn (`_KeptSet`): where they are
kept on the GPU they are cloned out after the forward's replay and copied back in before the backward's; where
they are offloaded, the host copies read them straight from the set and the backward's fetch writes them straight
back into it, with no device copy, while the next layer computes in the other set. Events order the two: a
replay or a fetch that writes a set waits for the last copy or replay that read it. Kept projection outputs
(always on the GPU) are computed in buffers of the layer's own, which its backward's replay reads where the forward's
wrote them: no copies, for memory held as long as the layer's graphs. Tensors among the layer's
keyword arguments (cos/sin, position ids) are copied into the layer's static buffers before each forward replay.
Graphs of all layers share one memory pool: each graph's temporaries are dead once it has run, and what a graph
returns is copied out before the next replay, so any order of replays is safe. The parameters' gradients too
are copied, within the graph, into buffers that the layers of one parameter layout share, so that the pool does
not hold a layer's gradients for every layer. It needs layers without dropout
(a replayed recomputation could not repeat the forward's masks), shapes that repeat (a pair of graphs per shape
is kept, for the first MAX_GRAPHED_SHAPES shapes seen twice), and each forward's backward before the layer's
next forward (otherwise that call runs eagerly). Off CUDA the same code runs the functions eagerly.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from unsloth_lite.models.layers import mlp_preactivations, projection_outputs, recomputation_for_backward
from unsloth_lite.training.layer_context import (
    _autocast,
    _autocast_states,
    _recording_residual,
    _side_stream,
    _substituting_residual,
)

# Input shapes a layer keeps graphs for: each costs the static buffers of that shape (four `[batch, seq,
# hidden]` tensors shared by the layers, and the kept sets); other shapes run eagerly.
MAX_GRAPHED_SHAPES = 4
# Sets of kept-tensor buffers per shape, taken in turn by consecutive graphed layers. Two suffice: a fetch for the
# backward writes the set of the layer before the one back-propagating, and in the forward a layer's replay waits
# at most for the host copies of the layer two back, about the lead the offload allows the host anyway
# (`checkpointing.MAX_PENDING_OFFLOADS`); three or four were no faster at Qwen3.5-27B's W2 shape on an H200. Each
# more set costs a residual and a layer's pre-activations of GPU memory.
KEPT_SETS = 2


@functools.cache
def _graph_pool(device_index: int):
    """The memory pool every layer graph on a device is captured into."""
    with torch.cuda.device(device_index):
        return torch.cuda.graph_pool_handle()


_SIMPLE = (type(None), bool, int, float, str)


def _layer_of(run):
    module = run.args[0] if run.args else getattr(run.func, "__self__", None)
    return module if isinstance(module, torch.nn.Module) else None


class _Replayable:
    """A function of static buffers, captured as a CUDA graph (into `pool`) or, off CUDA, run as it is."""

    def __init__(self, function, device: torch.device, pool, stream):
        self.graph = None
        if device.type != "cuda":
            self.function = function
            return
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            function()  # warm-up on the capture stream: per-stream library state is set up outside the capture
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a data loader pinning memory) may keep calling CUDA during the capture
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.outputs = function()
        torch.cuda.current_stream(device).wait_stream(stream)

    def __call__(self):
        if self.graph is None:
            return self.function()
        self.graph.replay()
        return self.outputs


class _KeptSet:
    """Static buffers for a layer's kept residual and MLP (gate, up) pre-activations, which the layers that take
    this set share, and the event after which nothing reads them any more (module docstring)."""

    def __init__(self):
        self.residual: torch.Tensor | None = None
        self.preactivations: dict = {}  # (MLP index, 0 gate / 1 up, shape, dtype) -> buffer
        self.free: torch.cuda.Event | None = None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is one of the set's buffers (returned as they are, not cloned)."""
        return tensor is self.residual or any(tensor is t for t in self.preactivations.values())

    def wait_until_free(self, stream) -> None:
        """Makes `stream` wait for the last read of the buffers before it writes them."""
        if stream is not None and self.free is not None:
            stream.wait_event(self.free)

    def read_until(self, event: torch.cuda.Event) -> None:
        """The buffers are read until `event` (queued after every earlier read): the next write waits for it."""
        self.free = event

    def read_on(self, stream) -> None:
        """The buffers are read by what is queued on `stream` so far (None off CUDA, where all runs in order)."""
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self.read_until(event)


class _LayerGraphs:
    """One layer's two graphs for one call signature, with their static buffers (module docstring)."""

    # Buffers that every layer's graphs of one shape share: the input they read (the forward's, then the
    # recomputation's), the output and the input gradient they write (copied out right after each replay)
    # and the output gradient they read (copied in right before): one of each instead of one a layer.
    _SHARED: dict = {}
    _KEPT_SETS: dict = {}  # shape -> (the sets, how many layers took one)
    _GRADIENTS: dict = {}  # the parameters' (shape, dtype, device)s -> the gradient buffers of that layout

    @classmethod
    def for_call(cls, run, args, keep_residual: bool, keep_mlp: bool = False,
                 keep_projections: bool = False) -> _LayerGraphs | None:
        """The graphs of this call's layer and signature; None where the call must run eagerly (the first
        call of a signature, an unsupported argument, or a backward still pending)."""
        layer = _layer_of(run)
        if layer is None or len(args) != 1 or not torch.is_tensor(args[0]):
            return None
        kwargs = run.keywords
        for value in kwargs.values():
            tensors = value if _is_tensor_pair(value) else (value,) if torch.is_tensor(value) else ()
            if any(t.requires_grad for t in tensors) or not (tensors or isinstance(value, _SIMPLE)):
                return None
        signature = (
            _describe(args[0]), tuple(sorted((k, _describe(v)) for k, v in kwargs.items())), keep_residual,
            keep_mlp, keep_projections, tuple(_autocast_states()),
        )
        store = layer.__dict__.setdefault("_unsloth_lite_graphs", {})
        graphs = store.get(signature)
        if graphs is None:
            store[signature] = "seen"  # the first call runs eagerly: kernels compile, workspaces get allocated
            return None
        if graphs == "seen":
            if sum(isinstance(g, _LayerGraphs) for g in store.values()) >= MAX_GRAPHED_SHAPES:
                return None
            graphs = store[signature] = cls(layer, run, args[0], keep_residual, keep_mlp, keep_projections)
        return None if graphs.pending_backward else graphs

    def __init__(self, layer, run, hidden, keep_residual: bool, keep_mlp: bool = False, keep_projections: bool = False):
        self.device = hidden.device
        self.keep_residual, self.keep_mlp, self.keep_projections = keep_residual, keep_mlp, keep_projections
        self.preactivations = []  # static (gate, up) buffers of the MLPs whose pre-activations the forward kept
        self.projections = []  # the layer's own buffers of the projection calls whose outputs the forward kept
        self.autocast = _autocast_states()  # the forward's, part of the signature: both graphs run under it
        self.has_residual = False  # whether the layer's forward recorded the residual (known at capture)
        # (module, name) of each trainable parameter, in `layer.parameters()` order
        self.owners = [
            (module, name) for module in layer.modules() for name, p in module._parameters.items()
            if p is not None and p.requires_grad
        ]
        self.params = [module._parameters[name] for module, name in self.owners]
        self.static_kwargs = {k: _static_copy(v) for k, v in run.keywords.items()}
        self.function = functools.partial(run.func, *run.args, **self.static_kwargs)
        shared_key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        if shared_key not in self._SHARED:
            self._SHARED[shared_key] = tuple(torch.empty_like(hidden) for _ in range(4))
        self.hidden, self.output, self.grad_hidden, self.grad_output = self._SHARED[shared_key]
        self.kept = self._take_kept_set(shared_key, hidden)
        layout = tuple((tuple(p.shape), p.dtype, p.device) for p in self.params)
        if layout not in self._GRADIENTS:
            self._GRADIENTS[layout] = [torch.empty_like(p) for p in self.params]
        self.gradients = self._GRADIENTS[layout]
        self.forward_graph = self.backward_graph = None
        self.pending_backward = False
        self.pool = self.stream = None
        if self.device.type == "cuda":
            self.pool, self.stream = _graph_pool(self.device.index or 0), _side_stream(self.device.index or 0)

    @classmethod
    def _take_kept_set(cls, shared_key, like: torch.Tensor) -> _KeptSet:
        """The next of the shape's KEPT_SETS sets, in turn (layers are captured in order)."""
        sets, taken = cls._KEPT_SETS.get(shared_key) or ([_KeptSet() for _ in range(KEPT_SETS)], 0)
        cls._KEPT_SETS[shared_key] = (sets, taken + 1)
        kept = sets[taken % len(sets)]
        if kept.residual is None:
            kept.residual = torch.empty_like(like)
        return kept

    def forward(self, run, hidden, in_place: tuple[bool, bool] = (False, False)):
        """(output, the residual the layer's post-attention norm received or None, the MLPs' kept (gate, up), the
        kept projection outputs (the layer's own buffers)).
        `in_place` (residual, pre-activations): return those as the kept set's buffers instead of clones, for a
        caller that copies them to the host at once and marks the set read until then (`_KeptSet.read_until`)."""
        self.hidden.copy_(hidden)
        for name, value in run.keywords.items():
            _copy_static(self.static_kwargs[name], value)
        self.kept.wait_until_free(self._stream())
        if self.forward_graph is None:
            self._capture()
        self.forward_graph()
        self.pending_backward = True
        residual_in_place, preactivations_in_place = in_place
        residual = None
        if self.has_residual:
            residual = self.kept.residual if residual_in_place else self.kept.residual.clone()
        preactivations = [
            pair if preactivations_in_place else tuple(t.clone() for t in pair) for pair in self.preactivations
        ]
        return self.output.clone(), residual, preactivations, list(self.projections)

    def backward(self, hidden, residual, preactivations, projections, grad_output):
        """The input's and the parameters' gradients. The kept tensors may be the kept set's own buffers (fetched
        straight back into them); others are copied in."""
        self.hidden.copy_(hidden)
        self.kept.wait_until_free(self._stream())
        if residual is not None and residual is not self.kept.residual:
            self.kept.residual.copy_(residual)
        for static, kept in zip(self.preactivations, preactivations, strict=True):
            if static[0] is not kept[0]:
                _copy_group(static, kept)
        for static, kept in zip(self.projections, projections, strict=True):
            if static[0] is not kept[0]:
                _copy_group(static, kept)
        self.grad_output.copy_(grad_output)
        grad_params = self.backward_graph()
        self.kept.read_on(self._stream())
        self.pending_backward = False
        return [self.grad_hidden.clone()] + [None if g is None else g.clone() for g in grad_params]

    def _stream(self):
        """The current stream of the layer's device; None off CUDA."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _capture(self) -> None:
        """Captures both graphs here, in the forward: a capture of the autograd engine's work from inside a
        backward would make the caller's (legacy default) stream wait on the capturing one, which CUDA forbids."""
        # Both functions run under the forward's autocast settings, without its cast cache: a graph must not
        # read a cast that the cache made before the capture and frees when the autocast region ends.
        def layer_forward():
            with (
                torch.no_grad(),
                _autocast(self.autocast, cache_enabled=False),
                # a fused layer computes the residual in the set's buffer
                _recording_residual(self.keep_residual, into=self.kept.residual) as residuals,
                # the MLPs compute their pre-activations in the static buffers (known after the warm-up call)
                mlp_preactivations(record=self.keep_mlp, into=self.preactivations) as preactivations,
                projection_outputs(record=self.keep_projections, into=self.projections) as projections,
            ):
                self.output.copy_(self.function(self.hidden))
                self.has_residual = len(residuals) == 1
                if self.has_residual and residuals[0].data_ptr() != self.kept.residual.data_ptr():
                    self.kept.residual.copy_(residuals[0])
                if len(self.preactivations) != len(preactivations):  # the warm-up call, before the capture
                    self.preactivations = _static_groups(preactivations, self.kept.preactivations)
                if len(self.projections) != len(projections):
                    self.projections = _static_groups(projections, {})
                for static, group in zip(self.preactivations + self.projections, preactivations + projections,
                                         strict=True):
                    if static[0].data_ptr() != group[0].data_ptr():  # the warm-up call's, computed elsewhere
                        _copy_group(static, group)

        def recompute_and_backward():
            # The recomputation differentiates with respect to fresh leaves that alias the parameters: the
            # parameters' own gradient accumulators exist already (this forward's autograd node holds them),
            # bound to the stream they were created on, and gradients flowing into them from the capturing
            # stream would make that stream wait on the capture.
            aliases = [p.detach().requires_grad_() for p in self.params]
            residual = self.kept.residual if self.has_residual else None
            with (
                _swapped_parameters(self.owners, aliases),
                recomputation_for_backward(attention_output_unused=self.has_residual),
                _substituting_residual(residual),
                mlp_preactivations(kept=self.preactivations),
                projection_outputs(kept=self.projections),
                torch.enable_grad(),
                _autocast(self.autocast, cache_enabled=False),
            ):
                hidden = self.hidden.detach().requires_grad_()
                output = self.function(hidden)
                grads = torch.autograd.grad(output, [hidden, *aliases], self.grad_output, allow_unused=True)
            self.grad_hidden.copy_(grads[0])
            return [None if grad is None else buffer.copy_(grad) for buffer, grad in zip(self.gradients, grads[1:],
                                                                                       strict=True)]

        self.forward_graph = _Replayable(layer_forward, self.device, self.pool, self.stream)
        self.grad_output.zero_()  # what the capture's warm-up back-propagates; its results are discarded
        self.backward_graph = _Replayable(recompute_and_backward, self.device, self.pool, self.stream)


def _static_groups(groups, buffers: dict) -> list[tuple[torch.Tensor, ...]]:
    """Buffers from `buffers` (a kept set's or a layer's own, made on first use) for kept outputs shaped as
    `groups`: the forward writes them, the backward reads them."""
    static = []
    for i, group in enumerate(groups):
        taken = []
        for j, like in enumerate(group):
            key = (i, j, tuple(like.shape), like.dtype)
            if key not in buffers:
                buffers[key] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            taken.append(buffers[key])
        static.append(tuple(taken))
    return static


@contextlib.contextmanager
def _swapped_parameters(owners, replacements):
    """Modules' parameters `(module, name)` temporarily replaced by other tensors."""
    originals = [module._parameters[name] for module, name in owners]
    for (module, name), tensor in zip(owners, replacements, strict=True):
        module._parameters[name] = tensor
    try:
        yield
    finally:
        for (module, name), tensor in zip(owners, originals, strict=True):
            module._parameters[name] = tensor


def _is_tensor_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(torch.is_tensor(t) for t in value)


def _describe(value):
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
    if _is_tensor_pair(value):
        return tuple(_describe(t) for t in value)
    return (type(value).__name__, value)


def _static_copy(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if _is_tensor_pair(value):
        return tuple(t.detach().clone() for t in value)
    return value


def _copy_group(buffers, tensors) -> None:
    for buffer, tensor in zip(buffers, tensors, strict=True):
        buffer.copy_(tensor)


def _copy_static(static, value) -> None:
    if torch.is_tensor(static):
        static.copy_(value)
    elif _is_tensor_pair(static):
        for buffer, new in zip(static, value, strict=True):
            buffer.copy_(new)
