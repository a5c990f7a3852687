"""The decoder layer of Qwen2, Qwen3 and Qwen3.5 at a decoding step: Hugging Face's order of norms, token mixer
and MLP, with fewer launches around them.

Hugging Face's layer runs, around its token mixer and MLP, two RMSNorms and two adds of the residual stream; with
adapters, the projections after each norm start with a launch of their first products x Aᵀ. At one token a step
each of those is a launch of almost no work. Over a cache, with decoding rows:

* `decode.RESIDUAL_IN_PRODUCTS`: the residual joins the token mixer's and the MLP's output projections in their
  epilogues (`decode.residual_for_output`, `nf4_matvec`'s `residual`), rounded once;
* `decode.NORM_FIRST_PRODUCTS`: each norm and the first products of the adapters of the projections that read
  its output are one launch (`rms_norm_lora_down_rows`), handed on to those projections
  (`decode.first_products_of`);
* `decode.SECOND_PRODUCTS_IN_NORMS`: an output projection's adapter takes its first product from the projection's
  own launch and leaves its second product to the norm after it (`rms_norm_addend_lora_down_rows`): the same
  layer's second norm for the token mixer's, the next layer's first norm for the MLP's (not the last layer's,
  whose output the model's final norm reads).

Anything else (training, a prompt, a module off the fused path) runs Hugging Face's forward, or the step's own
adds and launches where a part cannot take the fused form.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch

from unsloth_lite.kernels.lora_down import (
    MAX_ADAPTERS_PER_LAUNCH,
    rms_norm_addend_lora_down_rows,
    rms_norm_lora_down_rows,
)
from unsloth_lite.models import decode
from unsloth_lite.models.layers import _lora_projections, rms_norm_forward, use_kernels, zero_centred_rms_norm_forward
from unsloth_lite.models.qwen3_5_layers import DELTANET_PROJECTIONS

# The projections that read a norm's output, by the module that holds them.
INPUT_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj"),
    "linear_attn": DELTANET_PROJECTIONS,
    "mlp": ("gate_proj", "up_proj"),
}
# The fused norms' offsets (`rms_norm`'s `offset`): Qwen3.5's weights are stored around 0.
NORM_OFFSETS = {rms_norm_forward: 0.0, zero_centred_rms_norm_forward: 1.0}


def decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """Hugging Face's decoder layer; over a cache with decoding rows and `decode.RESIDUAL_IN_PRODUCTS` or
    `decode.NORM_FIRST_PRODUCTS` on, the same computation in fewer launches (module docstring)."""
    cache = next((kwargs[name] for name in ("cache", "past_key_values") if kwargs.get(name) is not None), None)
    addend = _take_layer_addend(hidden_states)  # the MLP's of the layer before (SECOND_PRODUCTS_IN_NORMS)
    fused = decode.RESIDUAL_IN_PRODUCTS or decode.NORM_FIRST_PRODUCTS
    if args or cache is None or not fused or not decode.is_decode_rows(hidden_states):
        if addend is not None:
            hidden_states = decode.add_second_product(hidden_states, addend)
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if getattr(self, "block_type", None) == "linear_attention":
        mixer_name = "linear_attn"
        mixer_kwargs = _linear_attention_kwargs(self.linear_attn, kwargs, cache)
    else:
        mixer_name, mixer_kwargs = "self_attn", kwargs
    mixer = getattr(self, mixer_name)
    normed, products, hidden_states = _normed(self.input_layernorm, hidden_states, mixer,
                                              INPUT_PROJECTIONS[mixer_name], addend)
    defer = decode.SECOND_PRODUCTS_IN_NORMS
    with products, _residual(hidden_states, defer) as pending:
        mixed = mixer(hidden_states=normed, **mixer_kwargs)
    mixed = mixed[0] if isinstance(mixed, tuple) else mixed
    hidden_states = mixed if pending["taken"] else hidden_states + mixed
    normed, products, hidden_states = _normed(self.post_attention_layernorm, hidden_states, self.mlp,
                                              INPUT_PROJECTIONS["mlp"], pending["addend"])
    with products, _residual(hidden_states, defer and not _last_layer(mixer, cache)) as pending:
        out = self.mlp(normed)
    out = out if pending["taken"] else hidden_states + out
    if pending["addend"] is not None:  # the next layer's first norm adds it
        _LAYER_ADDEND.pending = (out, pending["addend"])
    return out


_LAYER_ADDEND = threading.local()


def _take_layer_addend(hidden_states: torch.Tensor):
    """The MLP second product the layer before left for exactly this tensor (then forgotten), else None."""
    pending = getattr(_LAYER_ADDEND, "pending", None)
    _LAYER_ADDEND.pending = None
    return pending[1] if pending is not None and pending[0] is hidden_states else None


def _last_layer(mixer, cache) -> bool:
    """Whether this is the model's last decoder layer (its output goes to the final norm), by the token mixer's
    index among the cache's layers; True where either is unknown."""
    index, layers = getattr(mixer, "layer_idx", None), getattr(cache, "layers", None)
    return index is None or layers is None or index >= len(layers) - 1


_CACHE_NAMES = ("cache", "cache_params", "past_key_values")


@functools.cache
def _cache_keyword(mixer_class) -> str:
    """The name under which the Gated DeltaNet's forward takes the cache (`cache_params` in transformers 5.1x,
    `cache` after), read once a class."""
    parameters = inspect.signature(mixer_class.forward).parameters
    return next((name for name in _CACHE_NAMES if name in parameters), "cache")


def _linear_attention_kwargs(mixer, kwargs: dict, cache) -> dict:
    """The layer's keywords as Hugging Face's Qwen3.5 layer hands them to its Gated DeltaNet: no positions, the
    cache under the name its forward takes."""
    mixer_kwargs = {k: v for k, v in kwargs.items() if k not in ("position_embeddings", "position_ids", *_CACHE_NAMES)}
    mixer_kwargs[_cache_keyword(type(mixer))] = cache
    return mixer_kwargs


def _residual(residual: torch.Tensor, defer_second_product: bool):
    """`decode.residual_for_output` where `RESIDUAL_IN_PRODUCTS` is on, else nothing to take."""
    if decode.RESIDUAL_IN_PRODUCTS:
        return decode.residual_for_output(residual, defer_second_product)
    return contextlib.nullcontext({"taken": False, "addend": None})


def _normed(norm, x: torch.Tensor, consumer, names, addend=None):
    """(norm(x'), the context in which the consumer's projections `names` take their adapters' first products,
    x'), x' = x plus `addend` (an output projection's adapter's second product, `decode.residual_for_output`)
    where there is one, else x: with `NORM_FIRST_PRODUCTS`, where the norm runs a fused forward on the kernels'
    device, one `rms_norm_lora_down_rows` launch (`rms_norm_addend_lora_down_rows` with an addend) with the first
    products of the projections' adapters over NF4 bases (or the norm alone from it where there are none); else
    the addend added in PyTorch, the norm's own forward and no context."""
    offset = NORM_OFFSETS.get(getattr(norm.forward, "__func__", None))
    fused = decode.NORM_FIRST_PRODUCTS and offset is not None and use_kernels(x) and x.dtype != torch.float64
    projections = _lora_projections(consumer, names, x) if fused else None
    lora_as = [p.lora_a for p in projections or ()
               if p.rank and getattr(p.base, "quant_state", None) is not None]
    if not fused or len(lora_as) > MAX_ADAPTERS_PER_LAUNCH:
        x = decode.add_second_product(x, addend) if addend is not None else x
        return norm(x), contextlib.nullcontext(), x
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    rows = x.reshape(-1, x.shape[-1])
    if addend is not None:
        summed, y, t = rms_norm_addend_lora_down_rows(rows, addend, norm.weight, eps, offset, lora_as)
        x = summed.view(x.shape)
    else:
        y, t = rms_norm_lora_down_rows(rows, norm.weight, eps, offset, lora_as)
    y = y.view(x.shape)
    return y, decode.first_products_of(y, lora_as, t) if lora_as else contextlib.nullcontext(), x
