"""The decoder layer of Qwen2, Qwen3 and Qwen3.5 at a decoding step: Hugging Face's order of norms, token mixer
and MLP, with fewer launches around them.

Hugging Face's layer runs, around its token mixer and MLP, two RMSNorms and two adds of the residual stream; with
adapters, the projections after each norm start with a launch of their first products x Aᵀ. At one token a step
each of those is a launch of almost no work. Over a cache, with decoding rows:

* `decode.RESIDUAL_IN_PRODUCTS`: the residual joins the token mixer's and the MLP's output projections in their
  epilogues (`decode.residual_for_output`, `nf4_matvec`'s `residual`), rounded once;
* `decode.NORM_FIRST_PRODUCTS`: each norm and the first products of the adapters of the projections that read
  its output are one launch (`rms_norm_lora_down_rows`), handed on to those projections
  (`decode.first_products_of`).

Anything else (training, a prompt, a module off the fused path) runs Hugging Face's forward, or the step's own
adds and launches where a part cannot take the fused form.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from unsloth_lite.kernels import nf4_matvec
from unsloth_lite.kernels.lora_down import MAX_ADAPTERS_PER_LAUNCH, rms_norm_lora_down_rows
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
    fused = decode.RESIDUAL_IN_PRODUCTS or decode.NORM_FIRST_PRODUCTS
    if args or cache is None or not fused or not decode.is_decode_rows(hidden_states):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if getattr(self, "block_type", None) == "linear_attention":
        mixer_name = "linear_attn"
        mixer_kwargs = _linear_attention_kwargs(self.linear_attn, kwargs, cache)
    else:
        mixer_name, mixer_kwargs = "self_attn", kwargs
    mixer = getattr(self, mixer_name)
    normed, products = _normed(self.input_layernorm, hidden_states, mixer, INPUT_PROJECTIONS[mixer_name])
    with products, _residual(hidden_states) as pending:
        mixed = mixer(hidden_states=normed, **mixer_kwargs)
    mixed = mixed[0] if isinstance(mixed, tuple) else mixed
    hidden_states = mixed if pending["taken"] else hidden_states + mixed
    normed, products = _normed(self.post_attention_layernorm, hidden_states, self.mlp, INPUT_PROJECTIONS["mlp"])
    with products, _residual(hidden_states) as pending:
        out = self.mlp(normed)
    return out if pending["taken"] else hidden_states + out


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


def _residual(residual: torch.Tensor):
    """`decode.residual_for_output` where `RESIDUAL_IN_PRODUCTS` is on, else nothing to take."""
    if decode.RESIDUAL_IN_PRODUCTS:
        return decode.residual_for_output(residual)
    return contextlib.nullcontext({"taken": False})


def _normed(norm, x: torch.Tensor, consumer, names) -> tuple[torch.Tensor, contextlib.AbstractContextManager]:
    """(norm(x), the context in which the consumer's projections `names` take their adapters' first products):
    with `NORM_FIRST_PRODUCTS`, where the norm runs a fused forward on the kernels' device, one
    `rms_norm_lora_down_rows` launch with the first products of the projections' adapters over NF4 bases (or the
    norm alone from it where there are none); else the norm's own forward and no context."""
    offset = NORM_OFFSETS.get(getattr(norm.forward, "__func__", None))
    if not decode.NORM_FIRST_PRODUCTS or offset is None or not use_kernels(x) or x.dtype == torch.float64:
        return norm(x), contextlib.nullcontext()
    lora_as = []  # with FIRST_PRODUCTS_IN_LAUNCH the projections' launch takes them itself
    if not nf4_matvec.FIRST_PRODUCTS_IN_LAUNCH:
        lora_as = [p.lora_a for p in _lora_projections(consumer, names, x) or ()
                   if p.rank and getattr(p.base, "quant_state", None) is not None]
    if len(lora_as) > MAX_ADAPTERS_PER_LAUNCH:
        return norm(x), contextlib.nullcontext()
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    y, t = rms_norm_lora_down_rows(x.reshape(-1, x.shape[-1]), norm.weight, eps, offset, lora_as)
    y = y.view(x.shape)
    return y, decode.first_products_of(y, lora_as, t) if lora_as else contextlib.nullcontext()
