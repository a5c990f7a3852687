"""Training recipes: a short YAML file (model, lora, data, training, checkpointing, seed) validated before anything
heavy loads.

A recipe reads like this (see `recipe_files/` for complete ones)::

    model:    {name_or_path: Qwen/Qwen3-8B, load_in_4bit: true, dtype: bfloat16, max_seq_length: 2048}
    lora:     {r: 16, alpha: 16, dropout: 0.0, target_modules: all-linear}
    data:     {path: yahma/alpaca-cleaned, format: alpaca}
    training: {output_dir: runs/qwen3_8b, learning_rate: 2.0e-4, num_train_epochs: 1}   # TrainingArguments fields
    checkpointing: {offload_to_cpu: true}   # options of the gradient checkpointing (training.gradient_checkpointing)
    seed: 42

`load_recipe(path, overrides)` parses it with `yaml.safe_load`, applies command-line overrides such as
`lora.r=8` or `training.learning_rate=2e-5`, and checks every key and type (here), range, choice and path
(`recipe_checks`), raising a one-line `RecipeError` that names the offending key. Nothing is downloaded and no
model is loaded here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import pathlib
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from unsloth_lite.errors import RecipeError
from unsloth_lite.recipe_checks import (  # noqa: F401  (constants re-exported)
    ATTN_IMPLEMENTATIONS,
    BUILTIN_DATASETS,
    BUILTIN_MODELS,
    DATA_FILE_SUFFIXES,
    DATA_FORMATS,
    DTYPES,
    SUPPORTED_MODEL_TYPES,
    check_checkpointing,
    check_choice,
    check_data,
    check_fsdp,
    check_lora,
    check_model,
    check_packing,
    check_report_to,
    check_training_values,
)
from unsloth_lite.recipe_types import TypeMismatch, check_type, describe_value, typed

RECIPE_DIR = pathlib.Path(__file__).resolve().parent / "recipe_files"
TOP_LEVEL_KEYS = ("model", "lora", "data", "training", "checkpointing", "seed")

@dataclass
class ModelSection:
    name_or_path: str
    load_in_4bit: bool = True
    quantize_embeddings: bool = False  # input embedding and lm_head in NF4 too (frozen)
    offload_embeddings: bool = False  # input embedding in host memory (frozen)
    dtype: str = "bfloat16"
    max_seq_length: int = 2048
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False


@dataclass
class LoRASection:
    r: int = 16
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"


@dataclass
class DataSection:
    path: str
    format: str
    split: str = "train"
    eval_fraction: float = 0.0
    chat_template: str | None = None
    train_on_responses_only: bool = True
    text_field: str = "text"
    pad_to_multiple_of: int = 1
    # Documents packed into rows of `packing_tokens` (padding-free, `unsloth_lite.training.packing`); null:
    # on for the instruction formats (alpaca, chat), off for text and tokenized. false: padded batches.
    packing: bool | None = None
    packing_tokens: int = 8192


@dataclass
class CheckpointingSection:
    """Options of `unsloth_lite.training.checkpointing` for the layers `training.gradient_checkpointing`
    checkpoints: the saved layer inputs in pinned CPU memory; each layer replayed as CUDA graphs (pays off
    where batch shapes repeat, as `data.pad_to_multiple_of` makes them; a new shape is captured on its second
    use, up to `unsloth_lite.training.layer_graphs.MAX_GRAPHED_SHAPES` shapes); the last
    `uncheckpointed_layers` decoder layers not checkpointed (their activations kept on the GPU, no
    recomputation: faster, for their memory); each checkpoint keeping its MLP's gate and up outputs
    (`keep_mlp_preactivations`, in CPU memory with `offload_to_cpu`: the recomputation skips their products; a
    number N instead of true: N of the checkpointed layers, spread evenly); of those, `mlp_preactivations_on_gpu`
    layers keeping them in GPU memory even with `offload_to_cpu` (no copies over the host link, for their
    memory); each checkpoint keeping the outputs of its token mixer's input projections in GPU memory
    (`keep_projection_outputs`: the recomputation skips those products; true, or a number of the checkpointed
    layers, spread evenly)."""

    offload_to_cpu: bool = False
    cuda_graphs: bool = False
    uncheckpointed_layers: int = 0
    keep_mlp_preactivations: bool | int = False
    mlp_preactivations_on_gpu: int = 0
    keep_projection_outputs: bool | int = False


@dataclass
class Recipe:
    model: ModelSection
    lora: LoRASection
    data: DataSection
    training: dict
    checkpointing: CheckpointingSection = dataclasses.field(default_factory=CheckpointingSection)
    seed: int = 42


SECTIONS = {"model": ModelSection, "lora": LoRASection, "data": DataSection, "checkpointing": CheckpointingSection}


def _unknown_key(known: Sequence[str], dotted: str) -> RecipeError:
    return RecipeError(f"unknown key '{dotted}' (expected one of: {', '.join(known)})")


# ----------------------------------------------------------------------------------------------------------------
# transformers.TrainingArguments fields
# ----------------------------------------------------------------------------------------------------------------

# Keys whose accepted types differ from the TrainingArguments annotation.
_TRAINING_TYPE_OVERRIDES = {
    "resume_from_checkpoint": bool | str | None,  # the CLI reads `true` as "the last checkpoint in output_dir"
    "output_dir": str,
}
# Keys set elsewhere in the recipe.
_TRAINING_FORBIDDEN = {"seed": "set the top-level 'seed' instead"}


@functools.lru_cache(maxsize=1)
def _training_fields() -> dict[str, Any]:
    from transformers import TrainingArguments

    fields = {f.name: f.type for f in dataclasses.fields(TrainingArguments) if f.init}
    if any(isinstance(tp, str) for tp in fields.values()):  # postponed annotations (older versions)
        try:
            hints = typing.get_type_hints(TrainingArguments)
            fields = {name: hints.get(name, tp) for name, tp in fields.items()}
        except Exception:  # unresolvable names: those keys are accepted unchecked
            pass
    fields.update(_TRAINING_TYPE_OVERRIDES)
    return fields


def _unknown_training_key(key: Any) -> RecipeError:
    close = difflib.get_close_matches(str(key), list(_training_fields()), n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return RecipeError(f"unknown key 'training.{key}' (not a transformers.TrainingArguments field{hint})")


def _validate_training(raw: Any) -> dict:
    if not isinstance(raw, dict):
        raise RecipeError(f"training: expected a mapping of TrainingArguments fields, got {describe_value(raw)}")
    fields = _training_fields()
    out = {}
    for key, value in raw.items():
        dotted = f"training.{key}"
        if key in _TRAINING_FORBIDDEN:
            raise RecipeError(f"{dotted}: {_TRAINING_FORBIDDEN[key]}")
        if key not in fields:
            raise _unknown_training_key(key)
        out[key] = typed(dotted, value, fields[key])
        check_choice(dotted, out[key], fields[key])
    if "report_to" in out:
        check_report_to(out["report_to"])
    if out.get("output_dir") in (None, ""):
        raise RecipeError("training.output_dir: required (the directory for checkpoints and logs)")
    return out


# ----------------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------------


def _build_section(name: str, raw: Any):
    cls = SECTIONS[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{name}: expected a mapping, got {describe_value(raw)}")
    fields = dataclasses.fields(cls)
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields]
    for key in raw:
        if key not in known:
            raise _unknown_key(known, f"{name}.{key}")
    missing = [
        f"{name}.{f.name}"
        for f in fields
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise RecipeError(f"missing required key(s): {', '.join(missing)}")
    values = {key: typed(f"{name}.{key}", value, hints[key]) for key, value in raw.items()}
    for f in fields:
        if hints[f.name] is float and f.name in values:
            values[f.name] = float(values[f.name])
    return cls(**values)


def _not_a_recipe(source, raw: Any) -> RecipeError:
    return RecipeError(f"{source}: expected a mapping with keys {', '.join(TOP_LEVEL_KEYS)}, got {describe_value(raw)}")


def _build_recipe(raw: Any, source: str) -> Recipe:
    if not isinstance(raw, dict):
        raise _not_a_recipe(source, raw)
    for key in raw:
        if key not in TOP_LEVEL_KEYS:
            raise _unknown_key(TOP_LEVEL_KEYS, str(key))
    missing = [key for key in ("model", "data", "training") if key not in raw]
    if missing:
        raise RecipeError(f"{source}: missing required section(s): {', '.join(missing)}")
    model = _build_section("model", raw["model"])
    lora = _build_section("lora", raw.get("lora"))
    data = _build_section("data", raw["data"])
    seed = typed("seed", raw.get("seed", 42), int)
    if not 0 <= seed < 2**32:
        raise RecipeError(f"seed: must be in [0, 2**32), got {seed}")
    check_model(model)
    check_lora(lora)
    check_data(data)
    check_packing(data, model)
    training = _validate_training(raw["training"])
    check_training_values(training, data.eval_fraction)
    checkpointing = _build_section("checkpointing", raw.get("checkpointing"))
    check_checkpointing(checkpointing)
    checkpointed = training.get("gradient_checkpointing") or training.get("activation_checkpointing")
    if dataclasses.asdict(checkpointing) != dataclasses.asdict(CheckpointingSection()) and not checkpointed:
        raise RecipeError("checkpointing: its options need training.gradient_checkpointing: true")
    check_fsdp(training, model, checkpointing)
    return Recipe(model=model, lora=lora, data=data, training=training, checkpointing=checkpointing, seed=seed)


# ----------------------------------------------------------------------------------------------------------------
# Overrides
# ----------------------------------------------------------------------------------------------------------------


def _apply_override(raw: dict, override: str) -> None:
    if not isinstance(override, str) or "=" not in override:
        raise RecipeError(f"override {override!r} must look like section.key=value")
    dotted, _, text = override.partition("=")
    keys = dotted.strip().split(".")
    if any(not k for k in keys):
        raise RecipeError(f"override {override!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeError(f"override {override!r}: value is not valid YAML: {problem}") from None
    section = keys[0]
    if section not in TOP_LEVEL_KEYS:
        raise _unknown_key(TOP_LEVEL_KEYS, dotted)
    if section == "seed":
        if len(keys) != 1:
            raise RecipeError(f"override {override!r}: seed has no sub-keys")
        raw["seed"] = value
        return
    if len(keys) == 1:
        raise RecipeError(f"override {override!r} must look like section.key=value")
    if section in SECTIONS:
        known = [f.name for f in dataclasses.fields(SECTIONS[section])]
        if keys[1] not in known or len(keys) > 2:
            if keys[1] in known:
                raise RecipeError(f"override {override!r}: {section}.{keys[1]} has no sub-keys")
            raise _unknown_key(known, f"{section}.{keys[1]}")
    elif keys[1] not in _training_fields() and keys[1] not in _TRAINING_FORBIDDEN:
        raise _unknown_training_key(keys[1])
    node = raw.get(section)
    if node is None:
        node = raw[section] = {}
    for i, key in enumerate(keys[1:-1], start=1):
        if not isinstance(node, dict):
            raise RecipeError(f"override {override!r}: {'.'.join(keys[:i])} is not a mapping")
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    if not isinstance(node, dict):
        raise RecipeError(f"override {override!r}: {'.'.join(keys[:-1])} is not a mapping")
    node[keys[-1]] = _as_text_where_expected(value, text.strip(), _override_type(section, keys))


def _override_type(section: str, keys: list[str]) -> Any:
    """The annotation of the key an override sets (Any below the top level of a field)."""
    if len(keys) != 2:
        return Any
    if section in SECTIONS:
        return typing.get_type_hints(SECTIONS[section]).get(keys[1], Any)
    return _training_fields().get(keys[1], Any)


def _as_text_where_expected(value: Any, text: str, tp: Any) -> Any:
    """YAML reads `no`, `off` or `1e-3` as a bool or a number; where the key takes text and not what YAML
    made of it (`training.save_strategy=no`), the text as written."""
    if isinstance(value, str) or value is None:
        return value
    try:
        check_type(value, tp)
        return value
    except TypeMismatch:
        pass
    try:
        check_type(text, tp)
        return text
    except TypeMismatch:
        return value  # reported, with the key and the expected type, when the section is checked


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def available_recipes() -> list[str]:
    """Names of the packaged recipes (usable as `resolve_recipe_path(name)`)."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def resolve_recipe_path(name: str | os.PathLike) -> pathlib.Path:
    """An existing file as given; else a bare name (with or without .yaml) among the packaged recipes."""
    text = os.fspath(name)
    path = pathlib.Path(text).expanduser()
    if path.is_file():
        return path
    bare = pathlib.PurePath(text).name
    if bare == text:
        stem = re.sub(r"\.ya?ml$", "", bare)
        packaged = RECIPE_DIR / f"{stem}.yaml"
        if packaged.is_file():
            return packaged
    what = "is a directory" if path.is_dir() else "does not exist"
    raise RecipeError(f"recipe {text} {what}; packaged recipes: {', '.join(available_recipes()) or '(none)'}")


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Recipe:
    """Reads a recipe file (a path, or a packaged recipe's name), applies `overrides` ("section.key=value",
    values parsed as YAML) and validates everything; raises `RecipeError` naming the first problem."""
    resolved = resolve_recipe_path(path)
    try:
        text = resolved.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"cannot read recipe {resolved}: {e}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{resolved}:{mark.line + 1}" if mark is not None else str(resolved)
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeError(f"{where}: invalid YAML: {problem}") from None
    if isinstance(overrides, str):
        overrides = [overrides]
    if overrides and not isinstance(raw, dict):
        raise _not_a_recipe(resolved, raw)
    raw = copy.deepcopy(raw)
    for override in overrides:
        _apply_override(raw, override)
    return _build_recipe(raw, str(resolved))


def recipe_to_dict(recipe: Recipe) -> dict:
    """A plain dict (yaml.safe_dump-able) that `load_recipe` reads back to an equal Recipe."""
    return {
        "model": dataclasses.asdict(recipe.model),
        "lora": dataclasses.asdict(recipe.lora),
        "data": dataclasses.asdict(recipe.data),
        "training": copy.deepcopy(dict(recipe.training)),
        "checkpointing": dataclasses.asdict(recipe.checkpointing),
        "seed": recipe.seed,
    }


def torch_dtype(name: str):
    """The torch dtype for 'float32', 'bfloat16' or 'float16'."""
    import torch

    if name not in DTYPES:
        raise RecipeError(f"model.dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)
