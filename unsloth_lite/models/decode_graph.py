"""The decode step of a static cache as a CUDA graph: one replay launches every kernel of a one-token forward
(hundreds of launches at batch 1, where the host, not the GPU, would otherwise set the pace).

Hugging Face's `generate` with `cache_implementation="static"` calls the model once per new token with inputs of
the same shapes (`input_ids [B, 1]`, a mask of the cache's full length) and a cache whose tensors keep their
addresses (updated in place, the position counter included). Per batch size the first such step runs eagerly
(Triton compiles its kernels), the next one is captured, and every later one copies its inputs into the
captured buffers and replays. A step whose inputs differ in kind (other shapes, another cache or cache
tensors at other addresses) runs eagerly and is captured anew on the following step. If capturing fails (an
operation that synchronises with the host), the step runs eagerly and that batch size stays eager, said once.

CUDA only, never under Triton's interpreter; the dynamic cache (whose tensors grow) always runs eagerly.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from unsloth_lite.kernels.lora_down import MAX_ROWS
from unsloth_lite.kernels.utils import INTERPRET
from unsloth_lite.models.decode import screens_logits

GRAPHS_ATTRIBUTE = "_unsloth_lite_decode_graphs"


@dataclasses.dataclass
class _Step:
    key: tuple
    graph: torch.cuda.CUDAGraph | None = None
    inputs: dict | None = None  # the captured input buffers, by name
    output: object = None  # the captured forward's output (its tensors are overwritten by each replay)
    eager_only: bool = False


def _cache_addresses(cache) -> tuple | None:
    """The addresses of every tensor of a static cache's layers, or None where the cache has no layers list."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    addresses = []
    for layer in layers:
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else (value,)
            addresses.extend(t.data_ptr() for t in tensors if torch.is_tensor(t))
    return tuple(addresses)


def _flat_inputs(kwargs) -> dict | None:
    """The step's tensor inputs by name (a mask mapping flattened), or None where an input can't be graphed."""
    flat = {}
    for name, value in kwargs.items():
        if isinstance(value, dict):
            for key, item in value.items():
                if item is not None and not torch.is_tensor(item):
                    return None
                flat[f"{name}.{key}"] = item
        elif torch.is_tensor(value) or value is None:
            flat[name] = value
    return flat


def _step_key(cache, inputs: dict, kwargs) -> tuple | None:
    addresses = _cache_addresses(cache)
    if addresses is None:
        return None
    tensors = tuple(
        (name, None if t is None else (tuple(t.shape), t.dtype, t.device)) for name, t in sorted(inputs.items())
    )
    try:
        others = tuple(sorted((n, v) for n, v in kwargs.items() if not isinstance(v, dict) and not torch.is_tensor(v)
                              and v is not cache and v is not None))
        hash(others)
    except TypeError:
        return None
    return (id(cache), addresses, tensors, others, screens_logits())  # screened logits: another graph


def decode_graph_applies(input_ids, labels, cache) -> bool:
    return (
        torch.is_tensor(input_ids) and input_ids.is_cuda and not INTERPRET and labels is None
        and input_ids.dim() == 2 and input_ids.shape[1] == 1 and input_ids.shape[0] <= MAX_ROWS
        and not torch.is_grad_enabled() and cache is not None and getattr(cache, "is_compileable", False)
    )


def _rebuild(kwargs, inputs: dict) -> dict:
    """`kwargs` with each tensor input (masks inside a mapping included) replaced by `inputs`' buffer."""
    rebuilt = {}
    for name, value in kwargs.items():
        if isinstance(value, dict):
            rebuilt[name] = {key: inputs[f"{name}.{key}"] for key in value}
        elif torch.is_tensor(value):
            rebuilt[name] = inputs[name]
        else:
            rebuilt[name] = value
    return rebuilt


def graphed_decode_step(model, forward, cache, kwargs):
    """`forward(model, **kwargs)` for one decode step, through the batch size's CUDA graph where there is one."""
    inputs = _flat_inputs(kwargs)
    key = None if inputs is None else _step_key(cache, inputs, kwargs)
    if key is None:
        return forward(model, **kwargs)
    steps = model.__dict__.setdefault(GRAPHS_ATTRIBUTE, {})
    batch = kwargs["input_ids"].shape[0]
    step = steps.get(batch)
    if step is None or step.key != key:
        steps[batch] = _Step(key)  # this step warms up (compiles) eagerly; the next is captured
        return forward(model, **kwargs)
    if step.eager_only:
        return forward(model, **kwargs)
    if step.graph is None:
        step.inputs = {name: None if t is None else t.clone() for name, t in inputs.items()}
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                step.output = forward(model, **_rebuild(kwargs, step.inputs))
        except Exception as error:  # an operation that can't be captured: this batch size runs eagerly
            step.eager_only, step.inputs, step.output = True, None, None
            warnings.warn(f"unsloth_lite: the decode step runs without a CUDA graph ({error})", stacklevel=3)
            return forward(model, **kwargs)
        step.graph = graph
    else:
        for name, t in inputs.items():
            if t is not None:
                step.inputs[name].copy_(t)
    step.graph.replay()
    fields = dict(step.output.items())
    fields["logits"] = fields["logits"].clone()  # the next replay overwrites the captured logits
    return type(step.output)(**fields)
