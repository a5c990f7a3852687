"""The decoder layer of Qwen2, Qwen3 and Qwen3.5: Hugging Face's order of norms, token mixer and MLP, with fewer
launches and passes over the residual stream around them.

Without a cache (training, and a checkpoint's recomputation through `checkpoint_layer`), on the kernels'
device, `residual_fused_forward` folds the residual stream's adds into the norms (`add_rms_norm`): the add
before the post-attention norm runs in the norm's pass, and in the backward each norm adds the gradient its
input receives along the residual stream, so neither gradient sum is a launch of its own. A recomputation that
takes the kept residual stream (`residual_streams`) computes no add, and its layer output, whose value nothing
reads, is not computed either (`UnreadSum`). Where transformers checkpoints the class's forward,
`checkpoint_layer` runs `residual_fused_forward` in its place (`CHECKPOINTS_CLASS_FORWARD`).

Hugging Face's layer runs, around its token mixer and MLP, two RMSNorms and two adds of the residual stream; with
adapters, the projections after each norm start with a launch of their first products x Aᵀ. At one token a step
each of those is a launch of almost no work. Over a cache, with decoding rows:

* `decode.RESIDUAL_IN_PRODUCTS`: the residual joins the token mixer's and the MLP's output projections in their
  epilogues (`decode.residual_for_output`, `nf4_matvec`'s `residual`), rounded once;
* `decode.NORM_FIRST_PRODUCTS`: each norm and the first products of the adapters of the projections that read
  its output are one launch (`rms_norm_lora_down_rows`), handed on to those projections
  (`decode.first_products_of`).

Anything else (a prompt over a cache, a module off the fused path, Hugging Face's own gradient checkpointing) runs
Hugging Face's forward, or the step's own adds and launches where a part cannot take the fused form.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from unsloth_lite.kernels import nf4_matvec
from unsloth_lite.kernels.lora_down import MAX_ADAPTERS_PER_LAUNCH, rms_norm_lora_down_rows
from unsloth_lite.kernels.rms_norm import add_rms_norm
from unsloth_lite.models import decode
from unsloth_lite.models.layers import (
    UnreadSum,
    _lora_projections,
    in_recomputation,
    residual_streams,
    rms_norm_forward,
    use_kernels,
    zero_centred_rms_norm_forward,
)
from unsloth_lite.models.qwen3_5_layers import DELTANET_PROJECTIONS

# The projections that read a norm's output, by the module that holds them.
INPUT_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj"),
    "linear_attn": DELTANET_PROJECTIONS,
    "mlp": ("gate_proj", "up_proj"),
}
# Transformers 5.2x and later checkpoint a decoder layer by wrapping its class's forward, which a patched
# instance's forward does not replace (the layer's module hooks stay outside the checkpoint); earlier releases by
# overriding `__call__`, whose checkpoint calls the module, hooks and patched forward included.
CHECKPOINTS_CLASS_FORWARD = "__call__" not in vars(GradientCheckpointingLayer)
# Whether decoder layers without a cache fold the residual stream's adds into their norms
# (`residual_fused_forward`); off, they run Hugging Face's forward.
FUSED_RESIDUALS = True
# The fused norms' offsets (`rms_norm`'s `offset`): Qwen3.5's weights are stored around 0.
NORM_OFFSETS = {rms_norm_forward: 0.0, zero_centred_rms_norm_forward: 1.0}


def decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """Hugging Face's decoder layer; over a cache with decoding rows and `decode.RESIDUAL_IN_PRODUCTS` or
    `decode.NORM_FIRST_PRODUCTS` on, the same computation in fewer launches (module docstring)."""
    cache = _cache_of(kwargs)
    fused = decode.RESIDUAL_IN_PRODUCTS or decode.NORM_FIRST_PRODUCTS
    # where the class's forward checkpoints, a checkpointed call goes through it (`checkpoint_layer` then runs
    # `residual_fused_forward` itself)
    checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
    checkpointed = checkpointed and CHECKPOINTS_CLASS_FORWARD
    if cache is None and not checkpointed and takes_fused_residuals(self, hidden_states, args, kwargs):
        return residual_fused_forward(self, hidden_states, **kwargs)
    if args or cache is None or not fused or not decode.is_decode_rows(hidden_states):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    mixer_name, mixer_kwargs = _mixer_call(self, kwargs, cache)
    mixer = getattr(self, mixer_name)
    normed, products = _normed(self.input_layernorm, hidden_states, mixer, INPUT_PROJECTIONS[mixer_name])
    with products, _residual(hidden_states) as pending:
        mixed = mixer(hidden_states=normed, **mixer_kwargs)
    mixed = mixed[0] if isinstance(mixed, tuple) else mixed
    hidden_states = mixed if pending["taken"] else hidden_states + mixed
    normed, products = _normed(self.post_attention_layernorm, hidden_states, self.mlp, INPUT_PROJECTIONS["mlp"],
                               down_shares=True)
    with products, _residual(hidden_states) as pending:
        out = self.mlp(normed)
    return out if pending["taken"] else hidden_states + out


def takes_fused_residuals(layer, hidden_states, args, kwargs) -> bool:
    """Whether `residual_fused_forward` computes this call of a decoder layer: patched, no cache, no positional
    arguments beyond the hidden states, both norms on the fused path, the kernels' device."""
    if not FUSED_RESIDUALS or getattr(getattr(layer, "forward", None), "__func__", None) is not decoder_layer_forward:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        not args and _cache_of(kwargs) is None and use_kernels(hidden_states)
        and all(getattr(norm.forward, "__func__", None) in NORM_OFFSETS for norm in norms)
    )


def residual_fused_forward(self, hidden_states, **kwargs):
    """Hugging Face's decoder layer without a cache, the residual stream's adds folded into the norms (module
    docstring). The residual stream after the token mixer is recorded into or taken from `residual_streams`."""
    mixer_name, mixer_kwargs = _mixer_call(self, kwargs, None)
    residual, normed = _add_norm(self.input_layernorm, hidden_states, None)
    mixed = getattr(self, mixer_name)(hidden_states=normed, **mixer_kwargs)
    mixed = mixed[0] if isinstance(mixed, tuple) else mixed
    kept, into = residual_streams.take("kept"), residual_streams.take("into")
    if mixed.dtype != residual.dtype:  # a mixer under autocast: the add promotes, as Hugging Face's does
        residual, mixed = residual + mixed, None
    residual, normed = _add_norm(self.post_attention_layernorm, residual, mixed, kept, into)
    sink = residual_streams.sink()
    if sink is not None:
        sink.append(residual)
    out = self.mlp(normed)
    return UnreadSum.apply(residual, out) if in_recomputation() else residual + out


def _add_norm(norm, x, delta, kept_sum=None, sum_into=None):
    """`add_rms_norm` with a fused norm module's weight, epsilon and offset."""
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    offset = NORM_OFFSETS[norm.forward.__func__]
    into = sum_into if delta is not None and sum_into is not None and sum_into.dtype == x.dtype else None
    return add_rms_norm(x, delta, norm.weight, eps, offset, kept_sum=kept_sum, sum_into=into)


def _cache_of(kwargs: dict):
    return next((kwargs[name] for name in ("cache", "past_key_values") if kwargs.get(name) is not None), None)


def _mixer_call(layer, kwargs: dict, cache) -> tuple[str, dict]:
    """(the token mixer's attribute name, its keywords), as Hugging Face's layer calls it."""
    if getattr(layer, "block_type", None) == "linear_attention":
        return "linear_attn", _linear_attention_kwargs(layer.linear_attn, kwargs, cache)
    return "self_attn", kwargs


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


def _normed(norm, x: torch.Tensor, consumer, names,
            down_shares: bool = False) -> tuple[torch.Tensor, contextlib.AbstractContextManager]:
    """(norm(x), the context in which the consumer's projections `names` take their adapters' first products):
    with `NORM_FIRST_PRODUCTS`, where the norm runs a fused forward on the kernels' device, one
    `rms_norm_lora_down_rows` launch with the first products of the projections' adapters over NF4 bases (or the
    norm alone from it where there are none); else the norm's own forward and no context. `down_shares` (the
    MLP's norm), with `decode.MLP_SHARES` and an adapted NF4 down projection: the launch also zeroes the stripes
    the MLP's gate-and-up launch adds the down adapter's first product into (`decode.zeroed_stripes_for`)."""
    offset = NORM_OFFSETS.get(getattr(norm.forward, "__func__", None))
    if not decode.NORM_FIRST_PRODUCTS or offset is None or not use_kernels(x) or x.dtype == torch.float64:
        return norm(x), contextlib.nullcontext()
    lora_as = []  # with FIRST_PRODUCTS_IN_LAUNCH the projections' launch takes them itself
    if not nf4_matvec.FIRST_PRODUCTS_IN_LAUNCH:
        lora_as = [p.lora_a for p in _lora_projections(consumer, names, x) or () if _adapted_nf4(p)]
    if len(lora_as) > MAX_ADAPTERS_PER_LAUNCH:
        return norm(x), contextlib.nullcontext()
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    stripes = _down_share_stripes(consumer, x) if down_shares else None
    y, t = rms_norm_lora_down_rows(x.reshape(-1, x.shape[-1]), norm.weight, eps, offset, lora_as,
                                   **({"zeroed": stripes} if stripes is not None else {}))
    y = y.view(x.shape)
    return y, _pending_for(y, lora_as, t, stripes)


def _down_share_stripes(mlp, x: torch.Tensor) -> torch.Tensor | None:
    """Stripes for the down adapter's shares (`decode.mlp_rows`), fp32 `[DOWN_SHARE_STRIPES, rows, r]`, where
    `decode.MLP_SHARES` is on and the MLP's down projection is adapted over an NF4 base; else None."""
    down = (_lora_projections(mlp, ("down_proj",), x) or (None,))[0] if decode.MLP_SHARES else None
    if down is None or not _adapted_nf4(down):
        return None
    rows = x.numel() // x.shape[-1]
    return torch.empty((decode.DOWN_SHARE_STRIPES, rows, down.rank), dtype=torch.float32, device=x.device)


@contextlib.contextmanager
def _pending_for(y: torch.Tensor, lora_as: list[torch.Tensor], t, stripes):
    """The norm's products for its consumer: the first products `t` of `lora_as` on y, and zeroed stripes."""
    with contextlib.ExitStack() as stack:
        if lora_as:
            stack.enter_context(decode.first_products_of(y, lora_as, t))
        if stripes is not None:
            stack.enter_context(decode.zeroed_stripes_for(y, stripes))
        yield


def _adapted_nf4(projection) -> bool:
    """Whether a fused LoRA projection has an adapter over an NF4 base (whose first products the kernels take)."""
    return bool(projection.rank) and getattr(projection.base, "quant_state", None) is not None
