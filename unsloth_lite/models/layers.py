"""Fused forwards for the Hugging Face modules that Qwen2, Qwen3 and Qwen3.5 share, bound by `patch_model`.

Each is written against the module's own attributes (checked by the architecture tables when patching) and
keeps the module's call signature, so the rest of the Hugging Face model (caches, masks, the attention
implementation it was loaded with, PEFT's LoRA layers) is untouched. The causal-LM head is in `causal_lm.py`;
the decoder layer keeps Hugging Face's forward but at a decoding step (`decoder_layer.py`).

Kernels run on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1`; a model on the CPU otherwise uses
the plain-PyTorch references, which compute the same functions. The LoRA projections take the fused path on
every device, and bitsandbytes' 4-bit layers outside it take `linear4bit_forward`: NF4 weights are always
dequantised by our own code, never by bitsandbytes' CPU kernels (which misplace absmax blocks in rows that
split a block, and whose eval-mode inference path repacks the weights into a layout with no autograd).
Forwards without gradients over at most 8 rows (decoding) take `decode.py`'s matrix-vector projections and
grouped attention.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import typing
import warnings

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from unsloth_lite.kernels.lora import LoRAProjection, frozen_linear, frozen_projection, lora_mlp, lora_projections
from unsloth_lite.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from unsloth_lite.kernels.rms_norm import rms_norm, rms_norm_reference
from unsloth_lite.kernels.rope import apply_rope, apply_rope_reference
from unsloth_lite.kernels.swiglu import sigmoid_gate, sigmoid_gate_reference, swiglu, swiglu_reference
from unsloth_lite.kernels.utils import INTERPRET
from unsloth_lite.models import decode
from unsloth_lite.models.decode import (
    fused_attention,
    fused_attention_layer,
    grouped_attention,
    grouped_attention_applies,
    is_decode_rows,
    mlp_rows,
    output_rows,
    project_rows,
)
from unsloth_lite.models.packing import varlen_attention


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda or INTERPRET


_RECOMPUTATION = threading.local()


@contextlib.contextmanager
def recomputation_for_backward(attention_output_unused: bool = False):
    """Marks a decoder layer's forward as the recomputation of a gradient checkpoint (in this thread): its
    outputs are then only the roots of a backward, which needs their gradients, not their values. The MLP's
    output, which a decoder layer only adds to the residual stream, is then left uncomputed (the down
    projection is the one product of the layer's forward whose result its backward never reads).
    `attention_output_unused=True` (the checkpoint kept the residual stream after attention, so the
    recomputation takes that instead of residual + attention output) leaves the attention's output
    projection uncomputed too."""
    previous = getattr(_RECOMPUTATION, "active", False), getattr(_RECOMPUTATION, "attention_output_unused", False)
    _RECOMPUTATION.active, _RECOMPUTATION.attention_output_unused = True, attention_output_unused
    try:
        yield
    finally:
        _RECOMPUTATION.active, _RECOMPUTATION.attention_output_unused = previous


def in_recomputation() -> bool:
    """Whether a checkpoint's recomputation is running in this thread (`recomputation_for_backward`)."""
    return getattr(_RECOMPUTATION, "active", False)


class KeptOutputs:
    """Outputs of one kind of fused module that a checkpoint keeps rather than recomputes (in this thread).

    Under `channel(record=True)` each such module that runs inside appends its outputs (a tuple) to the yielded
    list, computed in the buffers of `into` (one tuple per module, in order) where given; under
    `channel(kept=...)` (such a list, of the same layer's forward) the modules that run inside take those in
    order instead of computing them, so the recomputation leaves their products out."""

    def __init__(self):
        self._local = threading.local()

    @contextlib.contextmanager
    def __call__(self, record: bool = False, kept: list | None = None, into: list | None = None):
        sink = [] if record else None
        current = {"sink": sink, "kept": list(kept) if kept else None, "into": list(into) if record and into else None}
        previous = {name: getattr(self._local, name, None) for name in current}
        self._local.__dict__.update(current)
        try:
            yield sink if record else []
        finally:
            self._local.__dict__.update(previous)

    def sink(self) -> list | None:
        """The list the module records its outputs into, or None (not recording)."""
        return getattr(self._local, "sink", None)

    def take(self, name: str):
        """The next kept outputs (`name` "kept") or recording buffers ("into"), or None where there are none."""
        queue = getattr(self._local, name, None)
        return queue.pop(0) if queue else None


# The fused SwiGLU MLPs' (gate(x), up(x)) (`lora_mlp`'s `record`, where its backward runs as one row block): the
# recomputation then skips the gate and up products and forms only the rank-r products.
mlp_preactivations = KeptOutputs()
# The residual stream after a decoder layer's token mixer (the input of its post-attention norm): recorded in the
# checkpoint's forward, taken by the recomputation in place of residual + mixer output (which it then leaves
# uncomputed). The fused decoder layer (`decoder_layer.py`) computes it in the buffer of `into`, where given.
residual_streams = KeptOutputs()
# The token mixers' input projections' outputs (`project`: q, k, v; the Gated DeltaNet's qkv, z, b, a): the
# recomputation then skips those products and their dequantisation, and forms only the rank-r products.
projection_outputs = KeptOutputs()


_WARNED: set[str] = set()


class UnreadSum(torch.autograd.Function):
    """a + b where only the sum's gradient is needed, never its value (a recomputation's layer output, the root
    of its backward): uninitialised memory of the sum's shape, gradient g to both."""

    @staticmethod
    def forward(ctx, a, b):
        return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def quantized_weight(layer) -> torch.Tensor:
    """`layer.weight`, carrying its bitsandbytes quantisation state where the layer holds one. Sharded by FSDP2,
    a `Linear4bit`'s forward sees in place of its `Params4bit` a plain tensor all-gathered from the shards of
    the packed storage; the state (absmax, nested absmax, code tables: about 3% of the packed bytes with double
    quantisation) is not sharded but stays, whole on every rank, on the layer (`layer.quant_state`, which
    bitsandbytes sets when it quantises). The gathered tensor is then returned as an alias that carries it,
    without touching the module's parameters, which FSDP2 manages."""
    weight = layer.weight
    quant_state = getattr(layer, "quant_state", None)
    if quant_state is None or getattr(weight, "quant_state", None) is not None:
        return weight
    alias = weight.detach()
    alias.quant_state = quant_state
    return alias


def _frozen_linear(layer) -> LoRAProjection | None:
    """A frozen `nn.Linear` or bitsandbytes NF4 `Linear4bit` without adapter, as a projection of rank 0."""
    if type(layer) is not torch.nn.Linear and type(layer).__name__ != "Linear4bit":
        return None
    weight, bias = quantized_weight(layer), layer.bias
    quant_state = getattr(weight, "quant_state", None)
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return None
    if quant_state is None and type(layer) is not torch.nn.Linear:
        return None  # not yet quantised
    if quant_state is not None and quant_state.quant_type != "nf4":
        return None
    return frozen_projection(weight, bias)


def _lora_projection(layer) -> LoRAProjection | None:
    """The fused path's view of a PEFT LoRA layer over a frozen dense or NF4 base, or of a frozen linear layer
    without adapter; None where the layer must keep its own forward."""
    if not hasattr(layer, "lora_A") or not hasattr(layer, "base_layer"):
        return _frozen_linear(layer)
    adapters = list(layer.active_adapters)
    if len(adapters) != 1 or layer.merged or layer.disable_adapters or adapters[0] not in layer.lora_A:
        return None
    name = adapters[0]
    if layer.use_dora.get(name, False):
        _warn_once("unsloth_lite: DoRA adapters run on PEFT's (unfused) path")
        return None
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, torch.nn.Identity) and dropout.p > 0:
        _warn_once("unsloth_lite: LoRA dropout > 0 runs on PEFT's (unfused) path; use lora_dropout=0 for speed")
        return None
    base = layer.base_layer
    weight = quantized_weight(base)
    quant_state = getattr(weight, "quant_state", None)
    if weight.requires_grad or (quant_state is not None and quant_state.quant_type != "nf4"):
        return None
    if getattr(quant_state, "packing_format_for_cpu", False):
        return None  # repacked before patching; the base layer's own forward (linear4bit_forward) unpacks it
    bias = base.bias
    if bias is not None and bias.requires_grad:
        return None
    return LoRAProjection(weight, bias, layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name])


def _lora_projections(module, names, x) -> tuple[LoRAProjection, ...] | None:
    """All of `names` as fused LoRA projections, or None (then each projection runs its own forward). On every
    device: on the CPU the fused functions dequantise through the PyTorch reference, where PEFT's path would
    run bitsandbytes' CPU matmuls."""
    projections = tuple(_lora_projection(getattr(module, name)) for name in names)
    return None if any(p is None for p in projections) else projections


def linear4bit_forward(self, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' NF4 `Linear4bit`, x Wᵀ + b in x's dtype (as the fused LoRA path computes its base
    product), W dequantised by our kernel or its reference. Used for every 4-bit layer the fused path does not
    cover: no adapter, an adapter PEFT keeps on its own path (dropout, DoRA), a base layer PEFT calls."""
    weight = quantized_weight(self)
    if getattr(weight, "quant_state", None) is None:
        # The weight lost its state in a conversion (`.to`); bitsandbytes restores it from the module.
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

        fix_4bit_weight_quant_state_from_module(self)
        weight = self.weight
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        _unpack_cpu_inference_layout(self)
        weight = self.weight
    return frozen_linear(x, weight, self.bias)


def _unpack_cpu_inference_layout(module) -> None:
    """A weight bitsandbytes repacked for its CPU inference kernel (an eval-mode forward before patching)
    back in NF4 rows. bitsandbytes' inverse re-quantises the absmax it had rounded to bfloat16, so the base
    differs slightly from the loaded one: said once."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    _warn_once(
        "unsloth_lite: a 4-bit weight was repacked by bitsandbytes' CPU inference path before patching; "
        "unpacked with its scales rounded to bfloat16 (patch the model before any eval-mode forward)"
    )
    weight = module.weight
    weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
    module.quant_state = weight.quant_state


def is_nf4_linear4bit(module) -> str | None:
    """bitsandbytes' own `Linear4bit` (not PEFT's LoRA layer of the same name, which wraps one as its base
    layer) with an NF4 weight; FP4 keeps bitsandbytes' forward."""
    import bitsandbytes as bnb

    if not isinstance(module, bnb.nn.Linear4bit):
        return f"{type(module).__module__}.{type(module).__name__} is not bitsandbytes' Linear4bit"
    if getattr(module.weight, "quant_type", None) != "nf4":
        return f"4-bit weight of type {getattr(module.weight, 'quant_type', None)!r}, not NF4"
    return None


def disable_cpu_repacking(module) -> None:
    """bitsandbytes repacks a CPU weight for its inference kernel in an eval-mode forward without grad, in
    place, and keeps it so: every later product, training included, then runs `gemv_4bit`, which has no
    autograd. That forward is replaced by `linear4bit_forward`; clearing the flag it tests keeps the weight in
    NF4 rows even if bitsandbytes' forward is called directly."""
    module.support_avx512bf16_for_cpu = False


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    norm = rms_norm if use_kernels(hidden_states) else rms_norm_reference
    return norm(hidden_states, self.weight, self.variance_epsilon)


def zero_centred_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's RMSNorm: weights stored around 0, applied as (1 + weight)."""
    norm = rms_norm if use_kernels(hidden_states) else rms_norm_reference
    return norm(hidden_states, self.weight, self.eps, offset=1.0)


def swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    projections = _lora_projections(self, ("gate_proj", "up_proj", "down_proj"), x)
    if projections is not None and is_decode_rows(x):
        return mlp_rows(projections, x)
    if projections is not None:
        return lora_mlp(
            x, *projections, output_needed=not in_recomputation(),
            record=mlp_preactivations.sink(), preactivations=mlp_preactivations.take("kept"),
            record_into=mlp_preactivations.take("into"),
        )
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj((swiglu if use_kernels(gate) else swiglu_reference)(gate, up))


def mlp_uses_silu(module) -> str | None:
    act = getattr(module.config, "hidden_act", None)
    return None if act in ("silu", "swish") else f"activation {act!r} is not SiLU"


def project(self, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The projections `names` of one input: fused (one saved input, one dx) where each is a LoRA layer or a
    frozen linear layer, else each through its own forward. Fused, they record their outputs or take kept ones
    under `projection_outputs`."""
    projections = _lora_projections(self, names, x)
    if projections is not None and is_decode_rows(x):
        return project_rows(projections, x)
    if projections is not None:
        kept = projection_outputs.take("kept")
        outputs = lora_projections(x, projections, kept=kept,
                                   record_into=None if kept is not None else projection_outputs.take("into"))
        sink = projection_outputs.sink()
        if sink is not None:
            sink.append(outputs)
        return outputs
    return tuple(getattr(self, name)(x) for name in names)


def _projected_heads(self, hidden_states: torch.Tensor):
    """q, k, v as `[B, H, S, D]` transposed views of the projections' `[B, S, H, D]` outputs."""
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    outputs = project(self, ("q_proj", "k_proj", "v_proj"), hidden_states)
    return tuple(y.view(hidden_shape).transpose(1, 2) for y in outputs)


_UPDATE_TAKES_KWARGS: dict[type, bool] = {}


def _update_cache(cache, key, value, layer_idx, kwargs):
    """`cache.update`, passing the call's kwargs where the cache class takes them (newer transformers)."""
    cls = type(cache)
    if cls not in _UPDATE_TAKES_KWARGS:
        params = inspect.signature(cache.update).parameters
        _UPDATE_TAKES_KWARGS[cls] = "kwargs" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if _UPDATE_TAKES_KWARGS[cls]:
        return cache.update(key, value, layer_idx, kwargs=kwargs)
    return cache.update(key, value, layer_idx)


class QKNormRoPE(typing.NamedTuple):
    """Qwen3's and Qwen3.5's per-head q/k RMSNorm and RoPE, held by `attend` until it knows whether the decoding
    attention applies them in its own launch (`decode.NORM_ROPE_IN_ATTENTION`); the tuple `decode_attention`
    takes as `norm_rope`."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    eps: float
    offset: float

    def apply(self, query, key):
        """`qk_norm_rope` of query and key (its reference off the kernels' devices)."""
        if use_kernels(query):  # Hugging Face's rotary embeddings build cos/sin as cat(freqs, freqs)
            return qk_norm_rope(query, key, self.q_weight, self.k_weight, self.cos, self.sin, self.eps,
                                offset=self.offset, duplicated_halves=True)
        return qk_norm_rope_reference(query, key, self.q_weight, self.k_weight, self.cos, self.sin, self.eps,
                                      self.offset)


def attend(self, query, key, value, attention_mask, cache, kwargs, input_shape, gate=None, norm_rope=None):
    """The rest of Hugging Face's attention forward, unchanged: q/k norm and RoPE where `norm_rope` holds them
    (`QKNormRoPE`), cache, the configured attention implementation (SDPA by default; it passes GQA to SDPA
    without repeating KV heads when there is no mask), the output times sigmoid(gate) where the architecture
    gates it (gate `[B, T, Hq, D]`), output projection. A packed batch (`cu_seq_lens_q` among the kwargs, from
    `causal_lm_forward`) without cache or sliding window attends document by document through
    `varlen_attention` instead, whatever the implementation; the block-diagonal mask Hugging Face built from the
    position ids is then not read. One new token per sequence over a cache (decoding) takes
    `grouped_attention`, which never repeats the KV heads, even under a mask, or over a static cache
    `fused_attention` (`decode.DECODE_ATTENTION`), which with `decode.NORM_ROPE_IN_ATTENTION` applies the norm
    and RoPE itself."""
    dropout = 0.0 if not self.training else self.attention_dropout
    sliding_window = getattr(self, "sliding_window", None)
    packed = cache is None and sliding_window is None and kwargs.get("cu_seq_lens_q") is not None
    grouped = not packed and grouped_attention_applies(self, query, attention_mask, cache)  # decoding
    layer = fused_attention_layer(cache, self.layer_idx, query, key, attention_mask) if grouped else None
    if norm_rope is not None and (layer is None or not decode.NORM_ROPE_IN_ATTENTION):
        query, key = norm_rope.apply(query, key)
        norm_rope = None
    if packed:
        attn_output, attn_weights = varlen_attention(query, key, value, kwargs, self.scaling, dropout), None
    elif grouped:  # decoding: KV heads never repeated
        attn_weights = None
        if layer is not None:  # the cache's update, the attention and the gate in one launch
            attn_output = fused_attention(layer, query, key, value, attention_mask, self.scaling, gate, norm_rope)
            gate = None
        else:
            key, value = _update_cache(cache, key, value, self.layer_idx, kwargs)
            attn_output = grouped_attention(query, key, value, attention_mask, self.scaling)
    else:
        if cache is not None:
            key, value = _update_cache(cache, key, value, self.layer_idx, kwargs)
        eager = sys.modules[type(self).__module__].eager_attention_forward
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        attn_output, attn_weights = interface(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
            sliding_window=sliding_window, **kwargs,
        )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate is not None:  # gate stays a strided view of q_proj's output: no copy
        gated = sigmoid_gate if use_kernels(gate) else sigmoid_gate_reference
        attn_output = gated(attn_output.view(gate.shape), gate).view(attn_output.shape)
    return output_projection(self, "o_proj", attn_output), attn_weights


def output_projection(self, name: str, x: torch.Tensor) -> torch.Tensor:
    """A token mixer's output projection, whose product a checkpoint's recomputation that kept the residual
    stream after it leaves uncomputed."""
    projection = _lora_projections(self, (name,), x)
    if projection is not None and is_decode_rows(x):
        return output_rows(projection[0], x)
    if projection is not None:
        output_needed = not getattr(_RECOMPUTATION, "attention_output_unused", False)
        return lora_projections(x, projection, output_needed=output_needed)[0]
    return getattr(self, name)(x)




def pop_cache(args, kwargs):
    # The cache argument is `past_key_values` up to transformers 5.2x and `cache` after.
    if args:
        return args[0]
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


def rope_attention_forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
    """Qwen2 attention: projections, fused RoPE, attention."""
    cache = pop_cache(args, kwargs)
    query, key, value = _projected_heads(self, hidden_states)
    cos, sin = position_embeddings
    if use_kernels(query):  # Hugging Face's rotary embeddings build cos/sin as cat(freqs, freqs)
        query, key = apply_rope(query, key, cos, sin, duplicated_halves=True)
    else:
        query, key = apply_rope_reference(query, key, cos, sin)
    return attend(self, query, key, value, attention_mask, cache, kwargs, hidden_states.shape[:-1])


def qk_norm_rope_attention_forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
    """Qwen3 attention: projections, per-head q/k RMSNorm and RoPE in one kernel, attention."""
    cache = pop_cache(args, kwargs)
    query, key, value = _projected_heads(self, hidden_states)
    norm_rope = QKNormRoPE(self.q_norm.weight, self.k_norm.weight, *position_embeddings,
                           self.q_norm.variance_epsilon, 0.0)
    return attend(self, query, key, value, attention_mask, cache, kwargs, hidden_states.shape[:-1],
                  norm_rope=norm_rope)
