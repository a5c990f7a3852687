"""Range, choice and path checks of a recipe's sections, once their keys and types are known (`recipes.py`
checks those): model, LoRA, data and the values of the TrainingArguments fields, each failure a one-line
`RecipeError` naming the key. Pure Python: nothing heavy is imported and no model or data is loaded."""

from __future__ import annotations

import difflib
import enum
import glob
import json
import math
import os
import re
import typing
from collections.abc import Sequence
from typing import Any

from unsloth_lite.errors import RecipeError

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DATA_FORMATS = ("alpaca", "chat", "text", "tokenized")
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_5", "qwen3_5_text")
BUILTIN_MODELS = ("builtin:tiny-qwen3",)
BUILTIN_DATASETS = ("builtin:arithmetic",)
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt")

# A hub repository id: "org/name" (models) or, for datasets, also a bare legacy "name".
HUB_MODEL_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_DATASET_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

def _choice(key: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise RecipeError(f"{key}: expected one of {', '.join(allowed)}, got {value!r}")


def _looks_local(path: str) -> bool:
    """A path the user meant as local (as opposed to a hub id like 'org/name')."""
    if path.startswith(("/", "./", "../", "~", ".\\", "..\\")) or path in (".", ".."):
        return True
    if re.match(r"[A-Za-z]:[\\/]", path):  # a Windows drive
        return True
    parts = re.split(r"[\\/]", path)
    if len(parts) > 2:  # hub ids have a single slash
        return True
    return len(parts) > 1 and os.path.exists(parts[0])


def check_model(model) -> None:
    _choice("model.dtype", model.dtype, DTYPES)
    _choice("model.attn_implementation", model.attn_implementation, ATTN_IMPLEMENTATIONS)
    if model.max_seq_length < 1:
        raise RecipeError(f"model.max_seq_length: must be >= 1, got {model.max_seq_length}")
    name = model.name_or_path
    if name.startswith("builtin:"):
        _choice("model.name_or_path", name, BUILTIN_MODELS)
        return
    model.name_or_path = name = os.path.expanduser(name)
    if os.path.isdir(name):
        config_path = os.path.join(name, "config.json")
        if not os.path.isfile(config_path):
            raise RecipeError(f"model.name_or_path: {name} has no config.json (not a Hugging Face checkpoint)")
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            model_type = config.get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            raise RecipeError(f"model.name_or_path: cannot read {config_path}: {e}") from None
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise RecipeError(
                f"model.name_or_path: {name} is a {model_type!r} checkpoint; "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        check_max_seq_length(model.max_seq_length, text_config.get("max_position_embeddings"), config_path)
        return
    if os.path.exists(name):
        raise RecipeError(f"model.name_or_path: {name} is a file, not a checkpoint directory")
    if _looks_local(name):
        raise RecipeError(f"model.name_or_path: {name} does not exist")
    if not HUB_MODEL_NAME.fullmatch(name):
        raise RecipeError(
            f"model.name_or_path: {name!r} is neither a local checkpoint directory nor a hub name like 'Qwen/Qwen3-8B'"
        )


def check_lora(lora) -> None:
    if lora.r < 1:
        raise RecipeError(f"lora.r: must be >= 1, got {lora.r}")
    if lora.alpha < 1:
        raise RecipeError(f"lora.alpha: must be >= 1, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise RecipeError(f"lora.dropout: must be in [0, 1), got {lora.dropout}")
    targets = lora.target_modules
    if isinstance(targets, str):
        if not targets.strip():
            raise RecipeError("lora.target_modules: must not be empty")
    elif not targets or any(not t.strip() for t in targets):
        raise RecipeError(f"lora.target_modules: expected 'all-linear' or a non-empty list of names, got {targets!r}")


def check_data(data) -> None:
    _choice("data.format", data.format, DATA_FORMATS)
    if not 0.0 <= data.eval_fraction < 1.0:
        raise RecipeError(f"data.eval_fraction: must be in [0, 1), got {data.eval_fraction}")
    for key in ("split", "text_field"):
        if not getattr(data, key):
            raise RecipeError(f"data.{key}: must not be empty")
    if data.pad_to_multiple_of < 1:
        raise RecipeError(f"data.pad_to_multiple_of: must be >= 1, got {data.pad_to_multiple_of}")
    path = data.path
    if path.startswith("builtin:"):
        _choice("data.path", path, BUILTIN_DATASETS)
    else:
        data.path = path = os.path.expanduser(path)
        if os.path.isfile(path):
            if not path.endswith(DATA_FILE_SUFFIXES):
                raise RecipeError(f"data.path: {path} is not one of {', '.join(DATA_FILE_SUFFIXES)}")
        elif os.path.isdir(path):
            pass
        elif _looks_local(path) or path.endswith(DATA_FILE_SUFFIXES):
            raise RecipeError(f"data.path: {path} does not exist")
        elif not _HUB_DATASET_RE.fullmatch(path):
            raise RecipeError(
                f"data.path: {path!r} is neither a local file or directory nor a hub dataset name like 'org/name'"
            )
    template = data.chat_template
    if template is not None:
        if not template.strip():
            raise RecipeError("data.chat_template: must not be empty (use null for the tokenizer's template)")
        is_template = "{{" in template or "{%" in template
        if not is_template:
            template_path = os.path.expanduser(template)
            if not os.path.isfile(template_path):
                raise RecipeError(
                    f"data.chat_template: {template} is neither a Jinja template nor an existing .jinja file"
                )
            data.chat_template = template_path


PACKED_BY_DEFAULT = ("alpaca", "chat")


def check_packing(data, model) -> None:
    """data.packing (null resolved per format: on for the instruction formats) and its budget, which must
    hold the longest document, model.max_seq_length tokens."""
    if data.packing is None:
        data.packing = data.format in PACKED_BY_DEFAULT
    if data.packing_tokens < 1:
        raise RecipeError(f"data.packing_tokens: must be >= 1, got {data.packing_tokens}")
    if data.packing and data.packing_tokens < model.max_seq_length:
        raise RecipeError(
            f"data.packing_tokens: {data.packing_tokens} cannot hold a document of model.max_seq_length "
            f"{model.max_seq_length} tokens; expected at least {model.max_seq_length} (or data.packing=false)"
        )


def check_checkpointing(checkpointing) -> None:
    """checkpointing's layer counts against nothing but their signs (the model's layer count is checked with
    its config)."""
    keep = checkpointing.keep_mlp_preactivations
    counts = dict(uncheckpointed_layers=checkpointing.uncheckpointed_layers,
                  mlp_preactivations_on_gpu=checkpointing.mlp_preactivations_on_gpu)
    for name in ("keep_mlp_preactivations", "keep_projection_outputs"):
        if not isinstance(getattr(checkpointing, name), bool):
            counts[name] = getattr(checkpointing, name)
    for name, value in counts.items():
        if value < 0:
            raise RecipeError(f"checkpointing.{name}: must be >= 0, got {value}")
    if checkpointing.mlp_preactivations_on_gpu and keep is False:
        raise RecipeError("checkpointing.mlp_preactivations_on_gpu: needs checkpointing.keep_mlp_preactivations "
                          "(true, or a number of layers)")


def check_checkpointed_layers(checkpointing, layers: Any, source: str) -> None:
    """checkpointing's layer counts against the model's decoder layers (`num_hidden_layers`)."""
    if not isinstance(layers, int):
        return
    uncheckpointed = checkpointing.uncheckpointed_layers
    if uncheckpointed > layers:
        raise RecipeError(f"checkpointing.uncheckpointed_layers: {uncheckpointed} is more than the {layers} decoder "
                          f"layers of {source}; expected at most {layers}")
    checkpointed = layers - uncheckpointed
    counts = {}
    for name in ("keep_mlp_preactivations", "keep_projection_outputs"):
        keep = getattr(checkpointing, name)
        counts[name] = count = (checkpointed if keep else 0) if isinstance(keep, bool) else keep
        if count > checkpointed:
            raise RecipeError(f"checkpointing.{name}: {count} layers, more than the {checkpointed} checkpointed "
                              f"decoder layers of {source}; expected at most {checkpointed} (or true)")
    keeping = counts["keep_mlp_preactivations"]
    if checkpointing.mlp_preactivations_on_gpu > keeping:
        raise RecipeError(f"checkpointing.mlp_preactivations_on_gpu: {checkpointing.mlp_preactivations_on_gpu} "
                          f"layers, more than the {keeping} that keep their MLP pre-activations")


def check_fsdp(training: dict, model, checkpointing) -> None:
    """training.fsdp (TrainingArguments' and accelerate's spelling): FSDP2 only (FSDP1 flattens the parameters
    into one buffer, where a 4-bit weight loses its quantisation state), and not with what it cannot shard:
    CUDA-graphed layers (graphs would keep storage FSDP frees) and NF4 or host-held embeddings."""
    value = training.get("fsdp")
    if not value or value in ("", [], "no", "false"):
        return
    config = training.get("fsdp_config") or {}
    version = config.get("version", 2) if isinstance(config, dict) else 2  # a JSON file: TrainingArguments reads it
    if str(version) != "2":
        raise RecipeError(f"training.fsdp_config.version: expected 2 (FSDP2 shards the NF4 weights), got {version!r}")
    if checkpointing.cuda_graphs:
        raise RecipeError("checkpointing.cuda_graphs: not with training.fsdp (FSDP frees and re-gathers the weights "
                          "the graphs would replay); set it to false")
    for key in ("quantize_embeddings", "offload_embeddings"):
        if getattr(model, key):
            raise RecipeError(f"model.{key}: not with training.fsdp (the embeddings it makes are not sharded); "
                              "set it to false")


def check_max_seq_length(max_seq_length: int, positions: Any, config_path: str) -> None:
    """model.max_seq_length against the model's positions (`max_position_embeddings` of its config)."""
    if isinstance(positions, int) and not isinstance(positions, bool) and max_seq_length > positions:
        raise RecipeError(
            f"model.max_seq_length: {max_seq_length} exceeds the model's {positions} positions "
            f"(max_position_embeddings in {config_path}); expected at most {positions}"
        )


def _at_least(training: dict, key: str, low: float, strict: bool = False, why: str = "") -> None:
    value = training.get(key)
    if value is None:
        return
    if value < low or (strict and value == low):
        sign = ">" if strict else ">="
        raise RecipeError(f"training.{key}: must be {sign} {low:g}{why}, got {value}")


def _in_unit(training: dict, key: str, closed: bool = False) -> None:
    value = training.get(key)
    if value is not None and not (0 <= value <= 1 if closed else 0 <= value < 1):
        raise RecipeError(f"training.{key}: must be in [0, 1{']' if closed else ')'}, got {value}")


def _steps(training: dict, key: str, strategy_key: str, default_strategy: str) -> None:
    """A logging/eval/save interval where its strategy is "steps": > 0, a whole number when >= 1 (below 1 it
    is a fraction of the training steps)."""
    if str(training.get(strategy_key, default_strategy)) != "steps" or training.get(key) is None:
        return
    value = training[key]
    if value <= 0:
        raise RecipeError(f"training.{key}: must be > 0 where training.{strategy_key} is 'steps', got {value}")
    if value >= 1 and value != int(value):
        raise RecipeError(f"training.{key}: must be a whole number of steps (or a fraction below 1), got {value}")


def check_training_values(training: dict, data_eval_fraction: float) -> None:
    """The ranges of the TrainingArguments values a fine-tuning run uses (their types are checked already),
    and the paths it reads: what torch's optimiser, the sampler or the Trainer would otherwise reject with a
    traceback once the model is loaded."""
    _at_least(training, "learning_rate", 0, strict=True)
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                "eval_accumulation_steps"):
        _at_least(training, key, 1)
    max_steps = training.get("max_steps", -1)
    if max_steps == 0 or max_steps < -1:
        raise RecipeError(f"training.max_steps: must be >= 1 (or -1 to train for num_train_epochs), got {max_steps}")
    if max_steps == -1:
        epochs = training.get("num_train_epochs", 3.0)
        if not (epochs > 0 and math.isfinite(epochs)):
            raise RecipeError(f"training.num_train_epochs: must be > 0 (or set training.max_steps), got {epochs}")
    _at_least(training, "warmup_steps", 0)
    _in_unit(training, "warmup_ratio", closed=True)
    for key in ("weight_decay", "max_grad_norm", "adam_epsilon", "dataloader_num_workers", "save_total_limit"):
        _at_least(training, key, 0)
    for key in ("adam_beta1", "adam_beta2", "label_smoothing_factor"):
        _in_unit(training, key)
    _steps(training, "logging_steps", "logging_strategy", "steps")
    _steps(training, "save_steps", "save_strategy", "steps")
    if data_eval_fraction > 0:
        _steps(training, "eval_steps", "eval_strategy", "no")
    _check_compile_backend(training.get("torch_compile_backend"))
    _check_paths(training)


def _check_compile_backend(backend: Any) -> None:
    """TrainingArguments takes any string; torch.compile would reject an unknown one only on the first step."""
    if backend is None:
        return
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise RecipeError(
            f"training.torch_compile_backend: unknown backend {backend!r}; expected one of "
            f"{', '.join(torch._dynamo.list_backends())}"
        )


def _check_paths(training: dict) -> None:
    output_dir = os.path.expanduser(str(training["output_dir"]))
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RecipeError(f"training.output_dir: {output_dir} is a file, not a directory")
    resume = training.get("resume_from_checkpoint")
    if resume is True:
        if not glob.glob(os.path.join(output_dir, "checkpoint-*")):
            raise RecipeError(
                f"training.resume_from_checkpoint: true, but {output_dir} holds no checkpoint-* directory to resume"
            )
    elif isinstance(resume, str):
        if not os.path.isdir(os.path.expanduser(resume)):
            raise RecipeError(f"training.resume_from_checkpoint: {resume} is not a checkpoint directory")


def check_choice(key: str, value: Any, tp: Any) -> None:
    """A string for a field annotated with an enum (optim, lr_scheduler_type, the strategies) must name one of
    its members."""
    enums = [a for a in (typing.get_args(tp) or (tp,)) if isinstance(a, type) and issubclass(a, enum.Enum)]
    if not enums or not isinstance(value, str):
        return
    allowed = [str(member.value) for cls in enums for member in cls]
    if value not in allowed:
        close = difflib.get_close_matches(value, allowed, n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise RecipeError(f"{key}: unknown value {value!r}; {hint}expected one of {', '.join(allowed)}")


def check_report_to(value: Any) -> None:
    """training.report_to: integrations transformers knows, and that are installed."""
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [value] if isinstance(value, str) else list(value or [])
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise RecipeError(
                f"training.report_to: unknown integration {name!r}; expected none, all or one of "
                f"{', '.join(INTEGRATION_TO_CALLBACK)}"
            )
        if name not in get_available_reporting_integrations():
            raise RecipeError(f"training.report_to: {name} is not installed (pip install {name})")
