"""Generation with a trained adapter: load a base (NF4 by default) and, optionally, the LoRA adapter of a training
run, unmerged, patched; generate through the patched model's `generate` (Hugging Face's API, the patched
model's decoding loop: `models/decode_loop.py`; greedy unless a temperature is given), streaming the text as it
comes; time the first token and the decoding.

`unsloth-lite-generate` (`unsloth_lite.cli`) is a thin shell over `load_for_generation`, `generate` and
`chat`, and the trainer's answer-accuracy evaluation (`tiny.answer_accuracy`) goes through `generate` too.

A training run's directory holds its adapter (`adapter_config.json`, `adapter_model.safetensors`) and tokenizer
at its top once training has finished, and in `checkpoint-<step>/` before; `resolve_adapter` takes either, or a
plain PEFT adapter directory. The adapter's tensor shapes are checked against the base's modules (built
weightless from its config) before any weight loads, so an adapter of another base is reported in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import sys
import time
from collections.abc import Callable, Iterable

import torch
from transformers import TextStreamer

from unsloth_lite.errors import InputError, one_line
from unsloth_lite.models.decode_loop import release_cache
from unsloth_lite.recipe_checks import HUB_MODEL_NAME, SUPPORTED_MODEL_TYPES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's key of a LoRA matrix in its saved state dict: the wrapped module's name, then lora_A or lora_B.
_LORA_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def _is_adapter_dir(path: pathlib.Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and any((path / name).is_file() for name in ADAPTER_WEIGHTS)


def resolve_adapter(path: str | os.PathLike) -> pathlib.Path:
    """The directory of the adapter to load: `path` itself when it holds one (a finished run, or any PEFT
    adapter), else the run's latest `checkpoint-<step>` holding one (a run stopped early)."""
    path = pathlib.Path(path).expanduser()
    if not path.is_dir():
        raise InputError(f"adapter {path}: {'is a file, not a' if path.exists() else 'no such'} directory")
    if _is_adapter_dir(path):
        return path
    checkpoints = sorted(
        (p for p in path.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and _is_adapter_dir(p)),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    if checkpoints:
        return checkpoints[-1]
    raise InputError(
        f"adapter {path}: no {ADAPTER_CONFIG} with {' or '.join(ADAPTER_WEIGHTS)}, here or in a checkpoint-* "
        "directory (give a training run's output_dir or a PEFT adapter directory)"
    )


def check_model_path(model: str | os.PathLike) -> str:
    """A local checkpoint directory with a supported config.json, or a hub name (left to the loader)."""
    path = os.path.expanduser(os.fspath(model))
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        try:
            with open(config_path, encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
        except FileNotFoundError:
            raise InputError(f"model {path}: no config.json (not a Hugging Face checkpoint)") from None
        except (OSError, ValueError, AttributeError) as e:
            raise InputError(f"model {path}: cannot read {config_path}: {one_line(e)}") from None
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise InputError(f"model {path}: a {model_type!r} checkpoint; supported: {supported}")
        return path
    if os.path.exists(path):
        raise InputError(f"model {path}: a file, not a checkpoint directory")
    if not HUB_MODEL_NAME.fullmatch(path):
        raise InputError(f"model {path}: no such directory (nor a hub name like 'Qwen/Qwen3-8B')")
    return path


def _weightless_model(path: str):
    """The base built on the meta device from its config (module names and shapes, no weights), or None where
    this transformers cannot build it so."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # a config out of reach or not buildable without weights: the loaded model is checked
        return None


def check_adapter_fits(adapter_dir: pathlib.Path, model: torch.nn.Module, model_name: str) -> None:
    """Every LoRA matrix of the adapter wraps a module of `model` with matching input and output sizes."""
    from safetensors import safe_open

    weights = adapter_dir / ADAPTER_WEIGHTS[0]
    if not weights.is_file():
        return  # a pickled adapter: PEFT's loader reports what does not fit
    modules = dict(model.named_modules())
    with safe_open(weights, framework="pt") as f:
        for key in f.keys():
            match = _LORA_KEY.fullmatch(key)
            if match is None:
                continue
            name, matrix = match.groups()
            module = modules.get(name)
            if module is None or not hasattr(module, "in_features"):
                raise InputError(
                    f"adapter {weights}: adapts {name}, which model {model_name} has no linear layer of "
                    "(an adapter of another base?)"
                )
            shape = f.get_slice(key).get_shape()
            size, expected, side = (shape[1], module.in_features, "input") if matrix == "A" else (
                shape[0], module.out_features, "output")
            if size != expected:
                raise InputError(
                    f"adapter {weights}: {name} has {side} size {size} in the adapter but {expected} in model "
                    f"{model_name} (an adapter of another base)"
                )


def load_for_generation(
    model: str | os.PathLike,
    adapter: str | os.PathLike | None = None,
    load_in_4bit: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    **kwargs,
):
    """`(model, tokenizer)`: the base loaded by `load_model` (NF4 decoder linears with `load_in_4bit`) with the
    adapter of `adapter` (see `resolve_adapter`) on top, unmerged, patched, in eval mode. The tokenizer is the
    adapter's when it ships one (a run saves its own, chat template included), else the base's. Other keyword
    arguments go to `load_model`. Bad paths and an adapter of another base raise `InputError`."""
    from unsloth_lite.models import load_model, patch_model

    path = check_model_path(model)
    adapter_dir = resolve_adapter(adapter) if adapter is not None else None
    weightless = _weightless_model(path) if adapter_dir is not None else None
    if weightless is not None:
        check_adapter_fits(adapter_dir, weightless, path)
    if not torch.cuda.is_available():
        kwargs.setdefault("device_map", "cpu")
    try:
        base, tokenizer = load_model(path, load_in_4bit=load_in_4bit, dtype=dtype, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        raise InputError(f"model {path}: cannot load: {one_line(e)}") from None
    if adapter_dir is not None:
        from peft import PeftModel
        from transformers import AutoTokenizer

        if weightless is None:
            check_adapter_fits(adapter_dir, base, path)
        try:
            base = patch_model(PeftModel.from_pretrained(base, adapter_dir))
        except (OSError, ValueError, RuntimeError) as e:
            raise InputError(f"adapter {adapter_dir}: cannot load onto model {path}: {one_line(e)}") from None
        if any((adapter_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    if tokenizer is None:
        nor = f", nor does adapter {adapter_dir}" if adapter_dir is not None else ""
        raise InputError(f"model {path}: ships no tokenizer{nor}")
    return base.eval(), tokenizer


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the tokenizer's chat template, ending with the assistant's turn opened."""
    if not tokenizer.chat_template:
        raise InputError(f"tokenizer {tokenizer.name_or_path}: no chat template, which chat needs")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class _TimedStreamer(TextStreamer):
    """`generate` calls `put` with the prompt, then with each new token once it is on the host (the patched
    model's loop reads a token two steps after it is chosen, so the GPU never waits for the host): the times of
    those calls time the first token and the decoding. Text goes to `on_text` as it is decoded, when given."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.on_text = on_text
        self.token_times: list[float] = []

    def put(self, value):
        if not self.next_tokens_are_prompt:
            self.token_times.append(time.perf_counter())
        if self.on_text is not None:
            super().put(value)
        self.next_tokens_are_prompt = False

    def end(self):
        if self.on_text is not None:
            super().end()

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.on_text(text + ("\n" if stream_end else ""))


@dataclasses.dataclass
class GenerationResult:
    prompt_tokens: int
    new_token_ids: list[int]
    text: str  # the new tokens decoded, special tokens left out
    time_to_first_token_s: float  # from the call to the first new token: the prompt's forward and one step
    decode_tokens_per_s: float | None  # new tokens after the first over the time they took; None for one token

    def stats(self) -> str:
        rate = f"{self.decode_tokens_per_s:.1f} tokens/s" if self.decode_tokens_per_s else "- tokens/s"
        return (f"{len(self.new_token_ids)} new tokens, decode {rate}, first token after "
                f"{1e3 * self.time_to_first_token_s:.0f} ms ({self.prompt_tokens} prompt tokens)")


@torch.no_grad()
def generate(
    model,
    tokenizer,
    input_ids: list[int] | torch.Tensor,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """One prompt (batch 1) through `model.generate`: greedy with `temperature` 0, else sampled with
    `temperature` and `top_p`; stops at the tokenizer's end-of-sequence token or after `max_new_tokens`.
    `on_text` receives the text as it is decoded."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    if device.type == "cuda":  # the decode step replayed as a CUDA graph needs a static cache
        sampling["cache_implementation"] = "static"
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    streamer = _TimedStreamer(tokenizer, on_text)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        output = model.generate(
            input_ids=input_ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad_token_id, streamer=streamer, **sampling,
        )
    finally:
        model.train(was_training)
        if was_training:  # an evaluation during training: the decoding cache would hold memory the steps need
            release_cache(model)
    new_ids = output[0, input_ids.shape[1]:].tolist()
    times = streamer.token_times
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return GenerationResult(
        prompt_tokens=input_ids.shape[1], new_token_ids=new_ids,
        text=tokenizer.decode(new_ids, skip_special_tokens=True),
        time_to_first_token_s=(times[0] if times else time.perf_counter()) - start,
        decode_tokens_per_s=(len(times) - 1) / decode_s if decode_s > 0 else None,
    )


def print_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def chat(model, tokenizer, lines: Iterable[str], on_text: Callable[[str], None] = print_text,
         on_stats: Callable[[str], None] | None = None, **generate_kwargs) -> list[dict]:
    """A conversation: each non-empty line of `lines` is the user's next message, answered in the tokenizer's
    chat template with the whole conversation so far; returns the messages. `on_stats` receives each answer's
    timing line."""
    messages: list[dict] = []
    for line in lines:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        result = generate(model, tokenizer, encode_chat(tokenizer, messages), on_text=on_text, **generate_kwargs)
        messages.append({"role": "assistant", "content": result.text})
        if on_stats is not None:
            on_stats(result.stats())
    return messages
