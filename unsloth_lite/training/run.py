"""Running a recipe, callable from Python: `run_recipe(recipe, merge=False)` takes the steps a person would take
(read the data, load the base, add LoRA, tokenise and batch, train, save, plot, merge), each a function here.

Every input is checked before anything heavy loads where it can be (the data records, the TrainingArguments,
the model's config and its module names, from the config alone); bad input is a `RecipeError` or `DataError`
naming the key, file, line or record (`unsloth_lite.cli` prints it in one line).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable

import torch
import yaml

from unsloth_lite.errors import RecipeError, one_line
from unsloth_lite.recipe_checks import check_checkpointed_layers, check_max_seq_length
from unsloth_lite.recipes import Recipe, recipe_to_dict, torch_dtype


def _chat_template(value: str) -> str:
    return pathlib.Path(value).read_text() if os.path.isfile(value) else value


def _check_chat_template(path: str, data_format: str, trust_remote_code: bool) -> None:
    """Fails before the (long) model load if the instruction formats would find no chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return  # no loadable tokenizer: load_model's own error names the path
    if not tokenizer.chat_template:
        raise RecipeError(
            f"data.chat_template: the tokenizer of {path} has no chat template, which the {data_format} format "
            "needs; give one (a Jinja template or a .jinja file)"
        )


def prepare_base(recipe: Recipe, output_dir: pathlib.Path) -> pathlib.Path | str:
    """The base model's path. The built-in tiny model is first written to `output_dir/base_model`, so the
    adapter saved later points at a base that can be loaded again (for `--merge`, or by PEFT)."""
    from transformers.utils import logging as transformers_logging

    from unsloth_lite.training.tiny import TINY_MODEL, build_tiny_qwen3, build_tiny_tokenizer

    path = recipe.model.name_or_path
    if path == TINY_MODEL:
        path = output_dir / "base_model"
        if not (path / "config.json").exists():
            tokenizer = build_tiny_tokenizer()
            model = build_tiny_qwen3(tokenizer, torch_dtype(recipe.model.dtype), seed=recipe.seed)
            bars = transformers_logging.is_progress_bar_enabled()
            transformers_logging.disable_progress_bar()  # one shard of a tiny model: no bar
            try:
                model.save_pretrained(path)
            finally:
                if bars:
                    transformers_logging.enable_progress_bar()
            tokenizer.save_pretrained(path)
    return path


def targetable_modules(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(names of the modules LoRA can wrap, the distinct last parts of the linear ones' names)."""
    names, linear = [], []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d)) and name:
            names.append(name)
            short = name.rsplit(".", 1)[-1]
            if isinstance(module, torch.nn.Linear) and short not in linear:
                linear.append(short)
    return names, linear


def check_target_modules(model: torch.nn.Module, targets) -> None:
    """Each of `lora.target_modules` must match a module of the model as PEFT matches them (a name, or the
    end of a dotted name; a single string other than all-linear is a regular expression)."""
    if targets == "all-linear":
        return
    names, linear = targetable_modules(model)
    if isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, name) for name in names) else [targets]
    else:
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise RecipeError(
            f"lora.target_modules: {', '.join(missing)} matches no module of the model; its linear modules are "
            f"{', '.join(linear)} (or give all-linear)"
        )


def check_model_config(recipe: Recipe, path) -> bool:
    """model.max_seq_length against the config's positions and the LoRA targets against the modules of a
    weightless (meta) model built from the config; nothing is loaded. False where the config could not be
    read or built (a hub model out of reach): then the loaded model is checked."""
    import transformers

    spec = recipe.model
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=spec.trust_remote_code)
    except Exception:  # unreachable hub name, remote code: the model load reports it, naming the path
        return False
    text_config = config.get_text_config()
    check_max_seq_length(spec.max_seq_length, getattr(text_config, "max_position_embeddings", None),
                         f"the config of {spec.name_or_path}")
    check_checkpointed_layers(recipe.checkpointing, getattr(text_config, "num_hidden_layers", None),
                              f"the config of {spec.name_or_path}")
    if recipe.lora.target_modules == "all-linear":
        return True
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=spec.trust_remote_code)
    except Exception:  # a config this transformers cannot build without weights: checked after loading
        return False
    check_target_modules(model, recipe.lora.target_modules)
    return True


def load_base(recipe: Recipe, path) -> tuple:
    """(patched model, tokenizer) from the prepared base path; a failure to load is a RecipeError naming
    model.name_or_path."""
    from unsloth_lite.models import load_model
    from unsloth_lite.training.distributed import quant_storage

    spec = recipe.model
    if recipe.data.format in ("alpaca", "chat") and not recipe.data.chat_template:
        _check_chat_template(str(path), recipe.data.format, spec.trust_remote_code)
    device_map = "cpu" if recipe.training.get("use_cpu") or not torch.cuda.is_available() else None
    kwargs = {"device_map": device_map} if device_map else {}
    if spec.trust_remote_code:
        kwargs["trust_remote_code"] = True
    try:
        model, tokenizer = load_model(
            str(path), load_in_4bit=spec.load_in_4bit, dtype=torch_dtype(spec.dtype),
            max_seq_length=spec.max_seq_length, quantize_embeddings=spec.quantize_embeddings,
            offload_embeddings=spec.offload_embeddings,
            attn_implementation=spec.attn_implementation,
            quant_storage=quant_storage(recipe.training, torch_dtype(spec.dtype)), **kwargs,
        )
    except (OSError, ValueError, ImportError) as e:
        raise RecipeError(f"model.name_or_path: cannot load {spec.name_or_path}: {one_line(e)}") from None
    if tokenizer is None:
        raise RecipeError(f"model.name_or_path: {spec.name_or_path} ships no tokenizer")
    if recipe.data.chat_template:
        tokenizer.chat_template = _chat_template(recipe.data.chat_template)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_raw_data(recipe: Recipe):
    """(training records, held-out records or None), every record checked for its format's fields."""
    from unsloth_lite.training.data import load_records, split_records

    data = recipe.data
    raw = load_records(data.path, data.split, seed=recipe.seed, data_format=data.format,
                       text_field=data.text_field, responses_only=data.train_on_responses_only)
    return split_records(raw, data.eval_fraction, seed=recipe.seed)


def tokenize_data(recipe: Recipe, tokenizer, raw, held_out):
    from unsloth_lite.training.data import tokenize_dataset

    data = recipe.data

    def tokenize(dataset):
        return tokenize_dataset(
            dataset, tokenizer, data.format, recipe.model.max_seq_length, data.train_on_responses_only,
            data.text_field,
        )

    return tokenize(raw), (tokenize(held_out) if held_out is not None else None)


def batching(recipe: Recipe, tokenizer, train_set, eval_set, log: Callable[[str], None] = print):
    """(train set, eval set, collator): with data.packing the documents packed into rows of
    data.packing_tokens and laid out padding-free, else the documents padded per batch."""
    from unsloth_lite.training.data import PaddingCollator
    from unsloth_lite.training.packing import PackingCollator, pack_dataset

    data = recipe.data
    if not data.packing:
        return train_set, eval_set, PaddingCollator(tokenizer.pad_token_id, data.pad_to_multiple_of)
    documents = len(train_set)
    train_set = pack_dataset(train_set, data.packing_tokens, seed=recipe.seed)
    if eval_set is not None:
        eval_set = pack_dataset(eval_set, data.packing_tokens, seed=recipe.seed)
    log(f"packed {documents:,} documents into {len(train_set):,} rows of {data.packing_tokens:,} tokens "
         "(data.packing=false for padded batches)")
    return train_set, eval_set, PackingCollator(tokenizer.pad_token_id, data.packing_tokens)


def training_arguments(recipe: Recipe, training: dict, evaluates: bool):
    """TrainingArguments, built before the model loads; what it rejects is a RecipeError."""
    import transformers

    if not evaluates and training.get("eval_strategy", "no") != "no":
        training["eval_strategy"] = "no"
    training.setdefault("include_num_input_tokens_seen", "non_padding")  # for the throughput summary
    try:
        return transformers.TrainingArguments(**training, seed=recipe.seed)
    except (ValueError, TypeError, ImportError) as e:
        raise RecipeError(f"training: {one_line(e)}") from None


def answer_accuracy_callback(tokenizer, records, limit: int = 64):
    """With each evaluation, the held-out chat records' greedy answers checked against the references."""
    import transformers

    from unsloth_lite.training.tiny import answer_accuracy

    records = [records[i] for i in range(min(limit, len(records)))]

    class AnswerAccuracy(transformers.TrainerCallback):
        # The Trainer logs an evaluation's metrics (on_log) before on_evaluate runs, and this callback's on_log
        # runs before the progress callback's, which prints: computed here, the accuracy is printed on the
        # eval_loss line and kept in the same log_history entry (and in the metrics evaluate() returns).
        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if logs is None or "eval_loss" not in logs:
                return
            accuracy = answer_accuracy(model, tokenizer, records)
            logs["eval_answer_accuracy"] = accuracy
            if state.log_history and state.log_history[-1].get("eval_loss") == logs["eval_loss"]:
                state.log_history[-1]["eval_answer_accuracy"] = accuracy
            else:
                state.log_history.append({"eval_answer_accuracy": accuracy, "step": state.global_step})

    return AnswerAccuracy()


def throughput_summary(tokens_seen: int, metrics: dict) -> dict:
    """Tokens trained (padding excluded, all processes) per second of this run's training loop, and peak GPU
    memory (the largest of the processes', and each one's when there are several)."""
    from unsloth_lite.training.distributed import gathered_peak_memory_gib, is_distributed

    runtime = metrics.get("train_runtime") or float("nan")
    summary = {"train_tokens": int(tokens_seen), "train_runtime_s": round(runtime, 1),
               "tokens_per_s": round(tokens_seen / runtime, 1)}
    peaks = gathered_peak_memory_gib()  # every process takes part
    if is_distributed():
        summary["processes"] = len(peaks)
    if torch.cuda.is_available():
        summary["peak_gpu_gib"] = max(peaks)
        if len(peaks) > 1:
            summary["peak_gpu_gib_per_process"] = peaks
    return summary



@dataclasses.dataclass
class RunResult:
    """What a run wrote and measured."""

    output_dir: pathlib.Path  # the adapter (PEFT format), tokenizer, trainer_state.json, loss.png
    base_path: pathlib.Path | str  # the base the adapter applies to
    summary: dict  # throughput_summary's figures, also in output_dir/train_summary.json
    final_metrics: dict | None  # the last evaluation's, when data was held out
    merged_dir: pathlib.Path | None  # the merged 16-bit model, with merge=True


def prepare_output_dir(recipe: Recipe, training: dict) -> pathlib.Path:
    """Creates training.output_dir and writes the recipe (overrides applied) into it (the main process)."""
    from unsloth_lite.training.distributed import is_main_process

    output_dir = pathlib.Path(training["output_dir"]).expanduser()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"training.output_dir: cannot create {output_dir}: {one_line(e)}") from None
    if is_main_process():
        (output_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    return output_dir


def load_model_with_lora(recipe: Recipe, base_path, log: Callable[[str], None]) -> tuple:
    """(patched PEFT model with fresh LoRA adapters, tokenizer); the config is checked before the weights load."""
    import transformers

    from unsloth_lite.models import add_lora

    checked = check_model_config(recipe, base_path)
    transformers.set_seed(recipe.seed)
    model, tokenizer = load_base(recipe, base_path)
    if not checked:
        check_target_modules(model, recipe.lora.target_modules)
    lora = recipe.lora
    model = add_lora(
        model, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules
    )
    trainable, total = model.get_nb_trainable_parameters()
    log(f"LoRA r={lora.r}: {trainable:,} trainable of {total:,} parameters")
    return model, tokenizer


def build_trainer(recipe: Recipe, args, model, tokenizer, train_set, eval_set, collator, held_out):
    """The Trainer, with the answer-accuracy evaluation on the built-in arithmetic data's held-out records."""
    from unsloth_lite.training import Trainer
    from unsloth_lite.training.tiny import ARITHMETIC_DATA

    callbacks = []
    if recipe.data.path == ARITHMETIC_DATA and held_out is not None:
        callbacks.append(answer_accuracy_callback(tokenizer, held_out))
    try:
        return Trainer(
            model=model, args=args, train_dataset=train_set, eval_dataset=eval_set, data_collator=collator,
            processing_class=tokenizer, callbacks=callbacks,
            checkpointing=dataclasses.asdict(recipe.checkpointing) if args.gradient_checkpointing else None,
        )
    except (ValueError, ImportError) as e:  # TrainingArguments values only the Trainer (or accelerate) rejects
        raise RecipeError(f"training: {one_line(e)}") from None


def train_and_evaluate(trainer, resume, output_dir: pathlib.Path, evaluates: bool, log) -> tuple[dict, dict | None]:
    """(throughput summary, final evaluation's metrics or None); the summary is also written to
    output_dir/train_summary.json."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train(resume_from_checkpoint=resume)
    summary = throughput_summary(trainer.state.num_input_tokens_seen, result.metrics)
    if trainer.is_world_process_zero():
        log(", ".join(f"{key} {value}" for key, value in summary.items()))
        (output_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not evaluates:
        return summary, None
    # The progress callback prints no logs once training has ended: the final evaluation is printed here.
    final = trainer.evaluate()
    log(", ".join(f"{key} {final[key]:.4g}" for key in ("eval_loss", "eval_answer_accuracy") if key in final))
    return summary, final


def save_run(trainer, output_dir: pathlib.Path, log) -> None:
    """The adapter (PEFT format), the tokenizer, trainer_state.json and the loss plot."""
    from unsloth_lite.training.plots import plot_losses

    trainer.save_model(str(output_dir))
    trainer.save_state()
    if not trainer.is_world_process_zero():
        return
    plot_losses(trainer.state.log_history, output_dir / "loss.png")
    log(f"adapter, tokenizer, trainer_state.json and loss.png written to {output_dir}")


def run_recipe(recipe: Recipe, merge: bool = False, log: Callable[[str], None] = print) -> RunResult:
    """Fine-tunes recipe's base with LoRA on its data and saves the run to training.output_dir; with `merge`,
    also a merged 16-bit model to output_dir/merged. `log` receives one line per step."""
    from unsloth_lite.training.distributed import is_main_process, main_process_first

    training = dict(recipe.training)
    resume = training.pop("resume_from_checkpoint", None)
    log(f"loading data {recipe.data.path}")
    raw, held_out = load_raw_data(recipe)
    args = training_arguments(recipe, training, evaluates=held_out is not None)
    log(f"{len(raw):,} training records" + (f", {len(held_out):,} held out" if held_out is not None else ""))
    output_dir = prepare_output_dir(recipe, training)

    log(f"loading {recipe.model.name_or_path}")
    with main_process_first():  # under torchrun the main process writes the built-in base, the others read it
        base_path = prepare_base(recipe, output_dir)
    model, tokenizer = load_model_with_lora(recipe, base_path, log)
    train_set, eval_set = tokenize_data(recipe, tokenizer, raw, held_out)
    train_set, eval_set, collator = batching(recipe, tokenizer, train_set, eval_set, log)

    trainer = build_trainer(recipe, args, model, tokenizer, train_set, eval_set, collator, held_out)
    summary, final = train_and_evaluate(trainer, resume, output_dir, eval_set is not None, log)
    save_run(trainer, output_dir, log)
    merged_dir = None
    if merge and is_main_process():
        from unsloth_lite.training.merging import merge_and_save

        merged_dir = output_dir / "merged"
        merge_and_save(recipe, base_path, output_dir, merged_dir)
        tokenizer.save_pretrained(merged_dir)
        log(f"merged model written to {merged_dir}")
    return RunResult(output_dir, base_path, summary, final, merged_dir)
