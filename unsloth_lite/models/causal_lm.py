"""The causal-LM head on the fused path: the loss from the final hidden states through the fused linear
cross-entropy (the logits never materialised), the kept positions' logits otherwise, packed batches attending
document by document, and the decode step of a static cache replayed as a CUDA graph (`decode_graph.py`)."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from unsloth_lite.kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from unsloth_lite.models.decode import screened_head_logits
from unsloth_lite.models.decode_graph import decode_graph_applies, graphed_decode_step
from unsloth_lite.models.layers import use_kernels
from unsloth_lite.models.packing import packed_sequence_kwargs
from unsloth_lite.models.quantized_embeddings import is_nf4_linear, nf4_linear

IGNORE_INDEX = -100

# The cache field of model outputs is `past_key_values` up to transformers 5.2x and `cache` after.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM target: the next token, ignore_index after the last one."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(hidden_states, lm_head, labels, num_items_in_batch=None, shift_labels=None):
    """Hugging Face's `ForCausalLMLoss` from the final hidden states, the logits never materialised: the sum
    of token losses over non-ignored targets, divided by `num_items_in_batch` when given (gradient
    accumulation), else by the number of non-ignored targets."""
    targets = shift_labels if shift_labels is not None else _shifted_labels(labels)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    loss_fn = fused_linear_cross_entropy if use_kernels(hidden) else fused_linear_cross_entropy_reference
    if num_items_in_batch is None:
        return loss_fn(hidden, lm_head.weight, targets, IGNORE_INDEX, "mean", lm_head.bias)
    total = loss_fn(hidden, lm_head.weight, targets, IGNORE_INDEX, "sum", lm_head.bias)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def lm_head_is_plain_linear(module) -> str | None:
    """A plain Linear, or a bitsandbytes NF4 `Linear4bit` (`quantize_embeddings_nf4`), whose frozen
    `Params4bit` weight the fused cross-entropy dequantises block by block."""
    head = module.lm_head
    if is_nf4_linear(head):
        state = head.weight.quant_state
        if state.shape[1] % state.blocksize:
            return f"the NF4 lm_head's rows of {state.shape[1]} are not whole quantisation blocks of {state.blocksize}"
        return None
    if type(head) is not torch.nn.Linear:
        return f"lm_head is a {type(head).__name__}, not a plain Linear or an NF4 Linear4bit"
    return None


def _lm_head_logits(lm_head, hidden_states):
    screened = screened_head_logits(lm_head, hidden_states)  # a greedy decoding step (`decode.SCREENED_LM_HEAD`)
    if screened is not None:
        return screened
    if is_nf4_linear(lm_head):  # never bitsandbytes' forward, which may repack the weight on a CPU
        return nf4_linear(hidden_states, lm_head.weight, lm_head.bias)
    return lm_head(hidden_states)


def _causal_suffices(attention_mask, targets, position_ids, kwargs) -> bool:
    """Whether causal attention alone gives the same loss as `attention_mask`: a 2-D mask of right padding
    (each row's ones before its zeros) whose pad positions all have ignored targets, positions counted from
    0, no cache. Real tokens then only ever see real keys, and pad positions only feed pad positions, whose
    losses are ignored; without a mask, SDPA runs its causal kernels with GQA and no KV head is repeated.
    (One host sync: the check.)"""
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2 or position_ids is not None:
        return False
    if any(kwargs.get(name) is not None for name in ("past_key_values", "cache", "inputs_embeds")):
        return False
    mask = attention_mask.bool()
    if targets.shape != mask.shape:
        return False
    right_padded = (mask[:, 1:] <= mask[:, :-1]).all() & mask[:, 0].all()
    return bool(right_padded & (mask | (targets.to(mask.device) == IGNORE_INDEX)).all())


def _without_cache(kwargs) -> bool:
    """No cache given, nor asked for explicitly (the config's default does not count: a packed forward,
    training or scoring, has no use for one)."""
    return kwargs.get("use_cache") is not True and all(
        kwargs.get(name) is None for name in ("past_key_values", "cache")
    )


def causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
    """Causal-LM head. With labels the loss comes from the hidden states through the fused linear
    cross-entropy and no logits are formed, unless `return_logits=True`; without labels, logits as usual.
    A decode step over a static cache on CUDA replays a CUDA graph (`decode_graph.py`)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if decode_graph_applies(input_ids, labels, cache):
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return graphed_decode_step(self, _causal_lm_forward, cache, inputs)
    return _causal_lm_forward(self, input_ids, attention_mask, position_ids, labels, **kwargs)


def _causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    labels=None,
    logits_to_keep=0,
    return_logits=None,
    **kwargs,
):
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    targets = None
    if labels is not None or shift_labels is not None:
        targets = shift_labels if shift_labels is not None else _shifted_labels(labels)
        if not return_logits and _causal_suffices(attention_mask, targets, position_ids, kwargs):
            attention_mask = None
        if all(kwargs.get(name) is None for name in ("use_cache", "past_key_values", "cache")):
            # A loss needs no cache: Hugging Face would otherwise build one from the config's use_cache and
            # fill it with every layer's keys, values and recurrent states, which training then drops.
            kwargs["use_cache"] = False
    if attention_mask is None and kwargs.get("cu_seq_lens_q") is None and _without_cache(kwargs):
        # A packed row (positions restarting at 0 at each document): its document offsets, found once here,
        # keep every token mixer of every layer within each document.
        packed = packed_sequence_kwargs(position_ids)
        if packed is not None:
            kwargs.update(packed, use_cache=False)
    elif kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is None:
        cu_seqlens = kwargs["cu_seq_lens_q"]  # given by the caller without lengths: one host sync
        kwargs["max_length_q"] = kwargs["max_length_k"] = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden_states = outputs.last_hidden_state
    loss = logits = None
    if targets is not None:
        loss = causal_lm_loss(hidden_states, self.lm_head, labels, num_items_in_batch, shift_labels=targets)
    if targets is None or return_logits:
        if isinstance(logits_to_keep, int):
            kept = hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
        else:
            kept = hidden_states[:, logits_to_keep, :]
        logits = _lm_head_logits(self.lm_head, kept)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD, None)},
    )
