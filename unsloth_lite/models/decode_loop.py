"""The patched model's `generate`: a decoding loop that never makes the GPU wait for the host.

Hugging Face's `generate` synchronises the host with the GPU once a token (its stopping test and streamer read the
new token) and then builds the next step's inputs in Python (positions, a 4-D mask, the cache's bookkeeping). At
batch 1 a decode step is a CUDA graph replay of a few milliseconds (`decode_graph.py`), so the GPU idles through
all of that host work every token: measured on the H200 at the Qwen3-8B shape, 4.4 ms of host gap against a
5.7 ms step.

This loop keeps every input of a step on the device: the chosen token (argmax, or a multinomial sample of the
warped scores) is written into the next step's input buffer, the position and the attention mask `[B, 1, 1, S]`
advance in place, and the cache (a `StaticCache` the loop keeps on the model and resets between calls) counts its
own length. The host only launches: each step's tokens and "all finished" flag are copied to pinned memory
asynchronously, and the host reads them `IN_FLIGHT` steps later, so that many steps are queued behind the one
running. With `GREEDY_TOKEN_KERNEL`, a greedy request without logits processors (but the minimum-new-tokens one)
chooses each token and does that bookkeeping in one launch (`kernels/greedy_token.py`) instead of a dozen. When
the read shows every sequence finished, the steps queued after it are dropped: their tokens are not returned nor
streamed, and what they wrote to the cache is reset by the next call.

The result is Hugging Face's: the same logits processing, by its own processors in its order (the repetition
penalty, the minimum-new-tokens mask, the caller's processors, then temperature, top-k, top-p and min-p when
sampling), scores in fp32, finished sequences padded, the same output length, tokens streamed in order (later, in
bursts). Sampling consumes the random generator for the dropped steps too. Requests outside that (beam search,
other penalties and constraints, stop strings, a cache passed in, left padding or pad tokens in the prompt,
returned scores, another attention implementation, sliding windows...) go to Hugging Face's `generate`
unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import types

import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from unsloth_lite.kernels.greedy_token import MAX_EOS, greedy_token
from unsloth_lite.kernels.nf4_matvec_state import release_flat_absmax
from unsloth_lite.models.decode import INT8_HEAD_ATTRIBUTE, greedy_logits
from unsloth_lite.models.decode_graph import GRAPHS_ATTRIBUTE
from unsloth_lite.models.layers import use_kernels

# Steps queued behind the one whose tokens the host reads. Two keep the GPU busy through a host hiccup; each is a
# step run for nothing after the last sequence finishes.
IN_FLIGHT = 2
# A greedy step without logits processors (but the minimum-new-tokens one) chooses its token and does its
# bookkeeping in one launch (`greedy_token`) instead of a dozen small ones. On since measured with
# `decode.NORM_ROPE_IN_ATTENTION` and `decode.SCREENED_LM_HEAD` (docs/benchmarks.md, "W3 with the one-launch greedy
# step"; an H100, Qwen3-8B shape): the loop's work between two replays 76 -> 13 us a token.
GREEDY_TOKEN_KERNEL = True
# The reused cache's length is rounded up to this, so that calls of nearby lengths share it (and the captured
# decode step, whose mask has the cache's length). Masked positions cost a few keys of attention, nothing else.
CACHE_ROUNDING = 256
CACHE_ATTRIBUTE = "_unsloth_lite_decode_cache"

# Generation settings the loop implements; every other setting must keep its default.
HANDLED_SETTINGS = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "repetition_penalty", "do_sample", "temperature", "top_k",
    "top_p", "min_p", "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id",
    "cache_implementation", "use_cache", "disable_compile", "compile_config", "transformers_version",
})
# Arguments of `generate` that are not settings: those the loop takes, and those it leaves to Hugging Face unless
# they are None.
HANDLED_ARGUMENTS = ("attention_mask", "streamer", "logits_processor")
OTHER_ARGUMENTS = (
    "generation_config", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
    "negative_prompt_ids", "negative_prompt_attention_mask", "use_model_defaults", "custom_generate", "tokenizer",
)
# Caches it serves: the default and the static one (its own). Another one asked for by name is Hugging Face's.
CACHE_IMPLEMENTATIONS = (None, "static")
# Layer types whose decode masks it builds: the full attention's, and none for the linear attention's.
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclasses.dataclass
class Request:
    input_ids: torch.Tensor  # [B, L]
    max_new_tokens: int
    eos: torch.Tensor | None  # end-of-sequence ids, on the device
    pad: int | None
    processors: LogitsProcessorList  # applied to the fp32 scores of each step, in Hugging Face's order
    min_new_tokens: int  # steps whose end-of-sequence ids are kept from being chosen (one of the processors)
    do_sample: bool
    streamer: object | None
    attention_mask: torch.Tensor | None  # the caller's 2-D mask (all ones), for the prefill


def bind_generate(model: torch.nn.Module) -> None:
    """Route `model.generate` through `generate` below (bound on the instance, as the patched forwards are)."""
    model.generate = types.MethodType(generate, model)


def generate(self, *args, **kwargs):
    """Hugging Face's `generate`, through `decode` where the request is one it implements (`plan`)."""
    request = plan(self, args, kwargs)
    if request is None:
        return type(self).generate(self, *args, **kwargs)
    with torch.no_grad():
        return decode(self, request)


def _eos_ids(value) -> list[int]:
    """The end-of-sequence ids of a setting that holds none, one, or a list (or tensor) of them."""
    if value is None:
        return []
    if torch.is_tensor(value):
        value = value.tolist()
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _settings_outside_loop(config) -> list[str]:
    """Settings of `config` that differ from Hugging Face's defaults, other than those the loop implements (None,
    and False where the default is None, say "off")."""
    defaults = config._get_default_generation_params()
    return [
        name for name, value in vars(config).items()
        if not name.startswith("_") and name not in HANDLED_SETTINGS and value is not None
        and value != defaults.get(name) and not (value is False and defaults.get(name) is None)
    ]


def _warpers(config) -> list:
    """Hugging Face's sampling warpers for `config`, in its order."""
    warpers = []
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return warpers


def plan(model, args, kwargs) -> Request | None:
    """The request of a `generate(*args, **kwargs)` call when the loop implements it, else None."""
    input_ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if len(args) > 1 or not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        return None
    if input_ids.is_floating_point() or input_ids.device != model.device:
        return None
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return None  # layers over several devices: the cache and masks would have to follow them
    arguments = {k: v for k, v in kwargs.items() if k not in ("inputs", "input_ids")}
    if any(arguments.get(name) is not None for name in OTHER_ARGUMENTS):
        return None
    settings = {k: v for k, v in arguments.items() if k not in HANDLED_ARGUMENTS + OTHER_ARGUMENTS}
    try:
        config, unknown = model._prepare_generation_config(None, **settings)
    except Exception:  # a setting Hugging Face rejects: its generate reports it
        return None
    if unknown or _settings_outside_loop(config):
        return None
    if config.cache_implementation not in CACHE_IMPLEMENTATIONS or config.use_cache is False:
        return None
    if config.max_new_tokens is None or config.max_new_tokens < 1 or config.num_beams not in (None, 1):
        return None
    if config.do_sample and not (config.temperature is None or config.temperature > 0):
        return None
    text_config = model.config.get_text_config(decoder=True)
    if text_config._attn_implementation not in ("sdpa", "eager"):
        return None
    if any(t not in LAYER_TYPES for t in getattr(text_config, "layer_types", None) or ()):
        return None
    if getattr(text_config, "sliding_window", None) is not None and getattr(text_config, "use_sliding_window", False):
        return None
    mask = arguments.get("attention_mask")
    if mask is not None and (tuple(mask.shape) != tuple(input_ids.shape) or not bool(mask.bool().all())):
        return None  # padding: Hugging Face's loop handles its positions
    eos = _eos_ids(config.eos_token_id)
    if mask is None and config.pad_token_id is not None and config.pad_token_id not in eos:
        if bool((input_ids == config.pad_token_id).any()):
            return None  # Hugging Face reads pad tokens in a prompt as padding, masked
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    eos_ids = torch.tensor(eos, device=input_ids.device) if eos else None
    processors = LogitsProcessorList()
    if config.repetition_penalty not in (None, 1.0):
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=float(config.repetition_penalty)))
    min_new_tokens = int(config.min_new_tokens) if eos and config.min_new_tokens else 0
    if min_new_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(input_ids.shape[1], min_new_tokens, eos_ids,
                                                            device=input_ids.device))
    processors.extend(arguments.get("logits_processor") or [])
    if config.do_sample:
        processors.extend(_warpers(config))
    return Request(
        input_ids=input_ids, max_new_tokens=int(config.max_new_tokens), eos=eos_ids, pad=pad, processors=processors,
        min_new_tokens=min_new_tokens, do_sample=bool(config.do_sample), streamer=arguments.get("streamer"),
        attention_mask=mask,
    )


def release_cache(model: torch.nn.Module) -> None:
    """Frees what decoding keeps on `model` for the next call, as training resumes after an evaluation: the
    cache, the captured decode steps (`decode_graph.py`), the lm_head's int8 copy (`decode.SCREENED_LM_HEAD`),
    and then the fp32 absmax of its NF4 weights that those read (`nf4_matvec_state.flat_absmax`)."""
    quant_states = []
    for module in model.modules():
        for attribute in (CACHE_ATTRIBUTE, GRAPHS_ATTRIBUTE, INT8_HEAD_ATTRIBUTE):
            module.__dict__.pop(attribute, None)
        quant_state = getattr(getattr(module, "weight", None), "quant_state", None)
        if getattr(quant_state, "nested", False):
            quant_states.append(quant_state)
    release_flat_absmax(quant_states)


def _cache_keyword(model) -> str:
    """The name the model's forward gives its cache: `cache` from transformers 5.2x, `past_key_values` before."""
    inner = getattr(model, "model", model)
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def _static_cache(model, batch: int, length: int, device, dtype):
    """The model's decoding cache for `batch` sequences of up to `length` tokens, and its length (`length` rounded
    up): the one kept from the last call, reset, where it has that batch, length, dtype and device; else a new
    one (kept in its place)."""
    size = -(-length // CACHE_ROUNDING) * CACHE_ROUNDING
    key = (batch, size, device, dtype)
    kept = model.__dict__.get(CACHE_ATTRIBUTE)
    if kept is not None and kept[0] == key:
        kept[1].reset()
        return kept[1], size
    model.__dict__.pop(CACHE_ATTRIBUTE, None)  # the old cache's memory goes before the new one's comes
    cache = StaticCache(config=model.config, max_cache_len=size)
    model.__dict__[CACHE_ATTRIBUTE] = (key, cache)
    return cache, size


class _HostReads:
    """Each step's record `[B + 1]` (its tokens, then 1 where every sequence has finished), on the host once the
    GPU has it: on CUDA copied into pinned memory behind the step and read when its event has passed; elsewhere
    read at once."""

    def __init__(self, batch: int, steps: int, device: torch.device):
        self.asynchronous = device.type == "cuda"
        self.batch = batch
        self.records = torch.empty((steps, batch + 1), dtype=torch.long, pin_memory=self.asynchronous)
        self.events: collections.deque = collections.deque()

    def push(self, step: int, record: torch.Tensor) -> None:
        self.records[step].copy_(record, non_blocking=self.asynchronous)
        event = None
        if self.asynchronous:
            event = torch.cuda.Event()
            event.record()
        self.events.append((step, event))

    def tokens(self, step: int) -> torch.Tensor:
        return self.records[step, : self.batch]

    def finished(self, step: int) -> bool:
        return bool(self.records[step, self.batch])

    def pending(self) -> int:
        return len(self.events)

    def pop(self) -> int:
        """The oldest step not yet read, waiting for its copies."""
        step, event = self.events.popleft()
        if event is not None:
            event.synchronize()
        return step


def _decode_mask(model, batch: int, size: int, prompt: int, device):
    """The full-attention mask of a decode step `[B, 1, 1, S]` as Hugging Face's attention implementation reads it
    (boolean for SDPA: True attends; additive for eager), open over the prompt and the first new token; and the
    value that opens one more position."""
    dtype = model.dtype
    if model.config.get_text_config(decoder=True)._attn_implementation == "sdpa":
        mask, opened = torch.zeros((batch, 1, 1, size), dtype=torch.bool, device=device), True
    else:
        mask, opened = torch.full((batch, 1, 1, size), torch.finfo(dtype).min, dtype=dtype, device=device), 0.0
    mask[..., : prompt + 1] = opened
    return mask, opened


def _choose(logits: torch.Tensor, ids: torch.Tensor, request: Request) -> torch.Tensor:
    """The next token of each sequence from the step's logits `[B, V]` after `ids` `[B, L + step]`, as Hugging
    Face chooses it."""
    scores = logits.to(dtype=torch.float32, copy=True)
    scores = request.processors(ids, scores) if request.processors else scores
    if request.do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)


def decode(model, request: Request) -> torch.Tensor:
    """`[B, L + n]`: the prompt and its n new tokens, n the steps up to the one where every sequence has ended
    (or `max_new_tokens`)."""
    prompt = request.input_ids
    batch, length = prompt.shape
    device, new = prompt.device, request.max_new_tokens
    cache, size = _static_cache(model, batch, length + new, device, model.dtype)
    cache_keyword = _cache_keyword(model)
    if request.streamer is not None:
        request.streamer.put(prompt.cpu())
    ids = torch.empty((batch, length + new), dtype=torch.long, device=device)
    ids[:, :length] = prompt
    one_launch = GREEDY_TOKEN_KERNEL and _one_launch_choice(request) and use_kernels(prompt)
    # only the argmax of each step's logits is read: the lm_head may screen them (`decode.SCREENED_LM_HEAD`)
    forwards = functools.partial(greedy_logits, request.eos) if one_launch else contextlib.nullcontext
    with forwards():
        output = model(input_ids=prompt, attention_mask=request.attention_mask, use_cache=True, logits_to_keep=1,
                       **{cache_keyword: cache})
    logits = output.logits[:, -1]
    del output
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    token_input = torch.empty((batch, 1), dtype=torch.long, device=device)
    position = torch.full((batch, 1), length, dtype=torch.long, device=device)
    mask, opened = _decode_mask(model, batch, size, length, device)
    masks = {layer_type: mask if layer_type == "full_attention" else None for layer_type in LAYER_TYPES}
    reads = _HostReads(batch, new, device)
    steps = new
    for step in range(new):
        if one_launch:  # the choice, the ids, the next input, and the last forward's position and mask
            reads.push(step, greedy_token(
                logits, ids, length + step, token_input, unfinished if request.eos is not None else None,
                request.eos, request.pad, position, mask, opened, advance=step > 0,
                suppress_eos=step < request.min_new_tokens))
        else:
            token = _choose(logits, ids[:, : length + step], request)
            if request.eos is not None:
                token = torch.where(unfinished, token, request.pad)
                unfinished &= ~torch.isin(token, request.eos)
            ids[:, length + step] = token
            reads.push(step, torch.cat([token, (~unfinished.any()).long()[None]]))
        last = step == new - 1
        stopped = _read(reads, request, keep=0 if last else IN_FLIGHT)
        if stopped is not None or last:
            steps = stopped or new
            break
        if not one_launch:
            token_input.copy_(token[:, None])
        with forwards():
            logits = model(input_ids=token_input, attention_mask=masks, position_ids=position, use_cache=True,
                           **{cache_keyword: cache}).logits[:, -1]
        if not one_launch:
            position += 1
            mask.index_fill_(3, position[0], opened)
    while reads.pending():  # steps queued past the end: their copies land before the buffers go
        reads.pop()
    if request.streamer is not None:
        request.streamer.end()
    return ids[:, : length + steps]


def _one_launch_choice(request: Request) -> bool:
    """Whether `greedy_token` makes the request's choice: greedy, at most MAX_EOS end-of-sequence ids, and no logits
    processor but the minimum-new-tokens one (which it applies itself)."""
    processors = len(request.processors) - (1 if request.min_new_tokens else 0)
    eos = 0 if request.eos is None else request.eos.numel()
    return not request.do_sample and processors == 0 and eos <= MAX_EOS


def _read(reads: _HostReads, request: Request, keep: int) -> int | None:
    """Reads the oldest steps until `keep` are left unread, streaming their tokens; once a read step has
    finished every sequence, the number of steps up to it (the rest are dropped unread), else None."""
    while reads.pending() > keep:
        done = reads.pop()
        if request.streamer is not None:
            request.streamer.put(reads.tokens(done).clone())
        if request.eos is not None and reads.finished(done):
            return done + 1
    return None
