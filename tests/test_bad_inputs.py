"""Bad input through the CLI: each case (an override, a recipe file, a data file or record, a model config, a LoRA
target) fails before training starts with exit code 2 and ONE line naming the key, file, line or field, and
no traceback. The table runs in-process (`cli.main(argv)`); a few cases also run as a real subprocess, to see
that nothing else reaches the terminal."""

import json
import subprocess
import sys

import pytest
import torch
from test_cli import ENV, ROOT

from unsloth_lite import cli
from unsloth_lite.errors import InputError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs of the tiny recipe")

PREFIX = "unsloth-lite-train: error:"


def jsonl(tmp_path, name, *lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def data(path, data_format):
    return [f"data.path={path}", f"data.format={data_format}", "data.eval_fraction=0"]


def alpaca(**fields):
    return json.dumps({"instruction": "add 1 and 2", "input": "", "output": "3", **fields})


def chat(*messages):
    return json.dumps({"messages": list(messages)})


USER, ASSISTANT = {"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "3"}


def recipe_file(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return ["--recipe", str(path)]


def qwen3_config_dir(tmp_path, **config):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return path


# case: (tmp_path -> arguments after the tiny recipe and its quick settings, words the error line must contain).
# Arguments starting with "--recipe" replace the recipe.
CASES = {
    # TrainingArguments values
    "learning rate": (lambda t: ["training.learning_rate=-1"], ["training.learning_rate", "> 0"]),
    "compile backend": (lambda t: ["training.torch_compile_backend=turbo"],
                        ["training.torch_compile_backend", "turbo", "inductor"]),
    "zero learning rate": (lambda t: ["training.learning_rate=0"], ["training.learning_rate"]),
    "train batch size": (lambda t: ["training.per_device_train_batch_size=0"], ["per_device_train_batch_size", ">= 1"]),
    "eval batch size": (lambda t: ["training.per_device_eval_batch_size=0"], ["per_device_eval_batch_size"]),
    "accumulation": (lambda t: ["training.gradient_accumulation_steps=0"], ["gradient_accumulation_steps"]),
    "max_steps": (lambda t: ["training.max_steps=0"], ["training.max_steps", "-1"]),
    "epochs": (lambda t: ["training.max_steps=-1", "training.num_train_epochs=0"], ["training.num_train_epochs"]),
    "warmup": (lambda t: ["training.warmup_steps=-5"], ["training.warmup_steps", ">= 0"]),
    "logging_steps": (lambda t: ["training.logging_steps=0"], ["training.logging_steps", "> 0"]),
    "save_steps": (lambda t: ["training.save_steps=-1"], ["training.save_steps"]),
    "eval_steps": (lambda t: ["training.eval_steps=0"], ["training.eval_steps"]),
    "fractional steps": (lambda t: ["training.logging_steps=2.5"], ["training.logging_steps", "whole number"]),
    "adam beta": (lambda t: ["training.adam_beta1=1.5"], ["training.adam_beta1", "[0, 1)"]),
    "weight decay": (lambda t: ["training.weight_decay=-0.1"], ["training.weight_decay"]),
    "optimiser": (lambda t: ["training.optim=adamw_foo"], ["training.optim", "adamw_foo", "adamw_torch"]),
    "scheduler": (lambda t: ["training.lr_scheduler_type=cosinus"], ["training.lr_scheduler_type", "'cosine'"]),
    "strategy": (lambda t: ["training.eval_strategy=sometimes"], ["training.eval_strategy", "steps"]),
    "report_to": (lambda t: ["training.report_to=nosuchlogger"], ["training.report_to", "nosuchlogger"]),
    "resume without checkpoint": (
        lambda t: ["training.resume_from_checkpoint=true"], ["training.resume_from_checkpoint", "checkpoint-*"]
    ),
    "output_dir is a file": (
        lambda t: [f"training.output_dir={jsonl(t, 'taken', 'x')}"], ["training.output_dir", "taken", "is a file"]
    ),
    # recipe sections
    "eval_fraction": (lambda t: ["data.eval_fraction=1.0"], ["data.eval_fraction", "[0, 1)"]),
    "packing not a bool": (lambda t: ["data.packing=sometimes"], ["data.packing", "bool", "'sometimes'"]),
    "packing budget below max_seq_length": (
        lambda t: ["data.packing=true", "data.packing_tokens=64"],
        ["data.packing_tokens", "64", "model.max_seq_length 128", "data.packing=false"],
    ),
    "uncheckpointed layers negative": (
        lambda t: ["training.gradient_checkpointing=true", "checkpointing.uncheckpointed_layers=-1"],
        ["checkpointing.uncheckpointed_layers", ">= 0", "-1"],
    ),
    "uncheckpointed layers beyond the model's": (
        lambda t: ["training.gradient_checkpointing=true", "checkpointing.uncheckpointed_layers=99"],
        ["checkpointing.uncheckpointed_layers", "99", "decoder layers", "at most"],
    ),
    "kept MLP layers beyond the model's": (
        lambda t: ["training.gradient_checkpointing=true", "checkpointing.keep_mlp_preactivations=99"],
        ["checkpointing.keep_mlp_preactivations", "99", "checkpointed decoder layers", "at most"],
    ),
    "kept projection layers beyond the model's": (
        lambda t: ["training.gradient_checkpointing=true", "checkpointing.keep_projection_outputs=99"],
        ["checkpointing.keep_projection_outputs", "99", "checkpointed decoder layers", "at most"],
    ),
    "MLP pre-activations on the GPU that nothing keeps": (
        lambda t: ["training.gradient_checkpointing=true", "checkpointing.mlp_preactivations_on_gpu=1"],
        ["checkpointing.mlp_preactivations_on_gpu", "needs checkpointing.keep_mlp_preactivations"],
    ),
    "lora r": (lambda t: ["lora.r=0"], ["lora.r", ">= 1"]),
    "lora alpha": (lambda t: ["lora.alpha=0"], ["lora.alpha"]),
    "lora dropout": (lambda t: ["lora.dropout=1.5"], ["lora.dropout", "[0, 1)"]),
    "max_seq_length zero": (lambda t: ["model.max_seq_length=0"], ["model.max_seq_length", ">= 1"]),
    "max_seq_length beyond positions": (lambda t: ["model.max_seq_length=100000"], ["model.max_seq_length", "256"]),
    "max_seq_length beyond a local config": (
        lambda t: [f"model.name_or_path={qwen3_config_dir(t, max_position_embeddings=64)}"],
        ["model.max_seq_length", "128", "64", "config.json"],
    ),
    "dtype": (lambda t: ["model.dtype=fp16"], ["model.dtype", "bfloat16"]),
    "target_modules": (
        lambda t: ["lora.target_modules=[q_proj, nonexistent_proj]"],
        ["lora.target_modules", "nonexistent_proj", "q_proj, k_proj", "down_proj"],
    ),
    "target_modules regex": (lambda t: ["lora.target_modules=.*nothing.*"], ["lora.target_modules", ".*nothing.*"]),
    "unknown section": (lambda t: ["optim.lr=1"], ["optim.lr"]),
    "override without =": (lambda t: ["seed"], ["'seed'", "section.key=value"]),
    # recipe files
    "recipe not found": (lambda t: ["--recipe", str(t / "nope.yaml")], ["nope.yaml", "does not exist"]),
    "bad yaml": (lambda t: recipe_file(t, "model:\n  name_or_path: [a\ndata: {}\n"), ["recipe.yaml:", "invalid YAML"]),
    "recipe not a mapping": (lambda t: recipe_file(t, "- 1\n- 2\n"), ["recipe.yaml", "expected a mapping"]),
    # data files and records
    "missing data file": (lambda t: data(t / "nope.jsonl", "alpaca"), ["data.path", "nope.jsonl", "does not exist"]),
    "data extension": (lambda t: data(jsonl(t, "data.xml", alpaca()), "alpaca"), ["data.path", "data.xml"]),
    "malformed json line": (
        lambda t: data(jsonl(t, "bad.jsonl", alpaca(), alpaca(), '{"instruction": "x", "output": }'), "alpaca"),
        ["bad.jsonl line 3", "invalid JSON"],
    ),
    "json line not an object": (
        lambda t: data(jsonl(t, "list.jsonl", alpaca(), "[1, 2]"), "alpaca"), ["list.jsonl line 2", "JSON object"]
    ),
    "malformed json array": (
        lambda t: data(jsonl(t, "array.json", "[", alpaca() + ",", "{oops}", "]"), "alpaca"),
        ["array.json line 3", "invalid JSON"],
    ),
    "alpaca fields": (
        lambda t: data(jsonl(t, "text.jsonl", json.dumps({"text": "hello"})), "alpaca"),
        ["text.jsonl line 1", "'instruction'", "'output'", "alpaca"],
    ),
    "alpaca field type": (
        lambda t: data(jsonl(t, "typed.jsonl", alpaca(), alpaca(output=3)), "alpaca"),
        ["typed.jsonl line 2", "'output'"],
    ),
    "chat message fields": (
        lambda t: data(jsonl(t, "chat.jsonl", chat(USER, ASSISTANT), chat({"from": "human", "value": "hi"})), "chat"),
        ["chat.jsonl line 2", "messages[0]", "role"],
    ),
    "chat messages missing": (
        lambda t: data(jsonl(t, "chat.jsonl", alpaca()), "chat"), ["chat.jsonl line 1", "'messages'"]
    ),
    "chat without assistant": (
        lambda t: data(jsonl(t, "chat.jsonl", chat(USER)), "chat"), ["chat.jsonl line 1", "assistant"]
    ),
    "text field": (
        lambda t: [*data(jsonl(t, "t.jsonl", json.dumps({"text": "a"}), json.dumps({"body": "b"})), "text")],
        ["t.jsonl line 2", "'text'", "data.text_field"],
    ),
    "tokenized ids": (
        lambda t: data(jsonl(t, "ids.jsonl", json.dumps({"input_ids": ["a", "b"]})), "tokenized"),
        ["ids.jsonl line 1", "input_ids"],
    ),
    "malformed csv": (
        lambda t: data(jsonl(t, "bad.csv", "instruction,output", "a,b", '"unterminated,c'), "alpaca"),
        ["data.path", "bad.csv", "ParserError"],
    ),
    "empty data file": (lambda t: data(jsonl(t, "empty.jsonl"), "alpaca"), ["data.path", "empty.jsonl", "no records"]),
    "eval split too small": (
        lambda t: [*data(jsonl(t, "one.jsonl", alpaca()), "alpaca"), "data.eval_fraction=0.1"],
        ["data.eval_fraction", "1 record"],
    ),
    "template rejects a record": (
        lambda t: [
            *data(jsonl(t, "c.jsonl", chat(USER, ASSISTANT)), "chat"),
            """data.chat_template='{{ raise_exception("no user turns here") }}'""",
        ],
        ["data.format chat", "record 1", "no user turns here"],
    ),
}

# The six, also run as real processes: nothing but the one line reaches the terminal.
THROUGH_A_PROCESS = ["learning rate", "max_seq_length beyond positions", "malformed json line", "alpaca fields",
                     "target_modules"]


def argv(case, tmp_path):
    args = CASES[case][0](tmp_path)
    recipe = ["--recipe", "tiny_qwen"]
    if args[:1] == ["--recipe"]:
        recipe, args = args[:2], args[2:]
    return [*recipe, f"training.output_dir={tmp_path / 'out'}", "training.max_steps=1", *args]


def check_one_line(case, code, stdout, stderr):
    assert code == 2, (code, stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(PREFIX)]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
    for word in CASES[case][1]:
        assert word in errors[0], (word, errors[0])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_in_process(case, tmp_path, capsys):
    try:
        code = cli.main(argv(case, tmp_path))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    check_one_line(case, code, captured.out, captured.err)
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("case", THROUGH_A_PROCESS)
def test_bad_input_through_a_process(case, tmp_path):
    result = subprocess.run([sys.executable, "-m", "unsloth_lite.cli", *argv(case, tmp_path)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    check_one_line(case, result.returncode, result.stdout, result.stderr)


def test_debug_reraises(tmp_path):
    with pytest.raises(InputError, match=r"^training\.learning_rate: must be > 0"):
        cli.main([*argv("learning rate", tmp_path), "--debug"])


def test_json_files_in_every_layout_still_load(tmp_path):
    """The checked reader takes what `datasets` took: a JSON array, a mapping of columns, JSON lines (in a .json
    file too, blank lines skipped)."""
    from unsloth_lite.training.data import load_records

    record = {"instruction": "add 1 and 2", "input": "", "output": "3"}
    layouts = {
        "array.json": json.dumps([record, record], indent=2),
        "columns.json": json.dumps({key: [value, value] for key, value in record.items()}),
        "lines.json": f"{json.dumps(record)}\n{json.dumps(record)}\n",
        "lines.jsonl": f"{json.dumps(record)}\n\n{json.dumps(record)}\n",
    }
    for name, text in layouts.items():
        (tmp_path / name).write_text(text)
        dataset = load_records(str(tmp_path / name), data_format="alpaca")
        assert dataset.to_list() == [record, record], name
