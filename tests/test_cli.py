"""The training CLI end to end on the embedded tiny recipe (CPU, a few steps): outputs, merge, resume after a
kill, and one-line errors with exit code 2 for bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_close

ROOT = Path(__file__).resolve().parents[1]
# The CLI on a CPU without the interpreter runs the plain-PyTorch references: fast, and the same math.
ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "UNSLOTH_LITE_POISON_OUTPUTS")}
ENV.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
# 20 held-out records (every evaluation greedily answers each of them, up to 64): the evaluations run and are
# logged, without taking most of a short run.
QUICK = ["training.eval_steps=4", "training.save_steps=4", "training.logging_steps=1", "data.eval_fraction=0.005"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU end-to-end runs; GPU runs use the recipes")


def command(*args):
    return [sys.executable, "scripts/train.py", "--recipe", "tiny_qwen", *args]


def run(*args, timeout=600):
    return subprocess.run(command(*args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def losses(output_dir):
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


@pytest.fixture(scope="module")
def merged_run(tmp_path_factory):
    """One run of the tiny recipe (8 steps) with --merge, logging to both integrations: its directory (the wandb
    logs in its `wandb` folder)."""
    out = tmp_path_factory.mktemp("merged_run")
    env = dict(ENV, WANDB_MODE="offline", WANDB_DIR=str(out), WANDB_SILENT="true")
    result = subprocess.run(
        command(f"training.output_dir={out}", "training.max_steps=8", *QUICK, "training.report_to=[tensorboard,wandb]",
                "--merge"),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_tiny_recipe_trains_saves_and_merges(merged_run):
    out = merged_run
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "trainer_state.json",
                 "loss.png", "recipe.yaml", "train_summary.json", "merged/config.json", "merged/model.safetensors"):
        assert (out / name).exists(), name
    assert len(losses(out)) == 8
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["train_tokens"] > 8 and summary["tokens_per_s"] > 0, summary

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from unsloth_lite import load_model

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert merged.dtype == torch.bfloat16  # 16-bit, from the float32 recipe
    # the model as trained: the base in NF4 (what the recipe loads) with the adapter
    base, _ = load_model(str(out / "base_model"), load_in_4bit=True, dtype=torch.float32, device_map="cpu")
    trained = PeftModel.from_pretrained(base, out).train()  # bitsandbytes repacks odd CPU shapes in eval mode
    input_ids = torch.randint(0, merged.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = trained(input_ids=input_ids).logits
        assert_close(merged.float()(input_ids=input_ids).logits, expected, 1e-2, "merged logits")


def test_logs_go_to_report_to(merged_run):
    """Both integrations in one run: each writes its own logs."""
    assert list(merged_run.rglob("events.out.tfevents.*"))
    assert list((merged_run / "wandb").glob("offline-run-*"))


def test_resume_after_kill_continues_like_an_uninterrupted_run(tmp_path):
    # A full-precision base: bitsandbytes repacks 4-bit CPU weights the first time they run in eval mode, which
    # changes the summation order of later steps in the uninterrupted run but not in the resumed one.
    settings = ["training.max_steps=8", "training.save_total_limit=5", "model.load_in_4bit=false", *QUICK]
    whole = tmp_path / "whole"
    assert run(f"training.output_dir={whole}", *settings).returncode == 0

    cut = tmp_path / "cut"
    process = subprocess.Popen(command(f"training.output_dir={cut}", *settings), cwd=ROOT, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (cut / "checkpoint-4" / "trainer_state.json").exists() and time.time() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    for checkpoint in cut.glob("checkpoint-*"):  # only complete checkpoints carry the checkpoint name
        assert (checkpoint / "trainer_state.json").exists(), checkpoint
    if (cut / "checkpoint-8").exists():  # if the kill came late, resume from checkpoint-4 anyway
        import shutil

        shutil.rmtree(cut / "checkpoint-8")

    resumed = run(f"training.output_dir={cut}", *settings, "training.resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = losses(whole), losses(cut)
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


def write_llama_checkpoint(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["lora.rank=8"], "lora.rank"),
        (["lora.r=abc"], "lora.r"),
        (["training.learning_rate=fast"], "training.learning_rate"),
        (["data.path=/no/such/file.jsonl"], "data.path"),
        (["model.name_or_path=/no/such/model"], "model.name_or_path"),
        (["model.name_or_path={llama}"], "llama"),
        (["seed"], "section.key=value"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    llama = write_llama_checkpoint(tmp_path / "llama")
    args = [a.replace("{llama}", str(llama)) for a in args]
    result = run(f"training.output_dir={tmp_path / 'out'}", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unsloth-lite-train: error:") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_tokenizer_without_chat_template_is_exit_2(tmp_path):
    from unsloth_lite.training.tiny import build_tiny_qwen3, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_qwen3(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "model")
    result = run(f"training.output_dir={tmp_path / 'out'}", f"model.name_or_path={tmp_path / 'model'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.chat_template" in lines[0] and "no chat template" in lines[0], result.stderr


def test_tiny_recipe_trains_packed(tmp_path):
    """data.packing=true: the conversations packed into rows of 128 tokens, 4 rows a micro-batch."""
    out = tmp_path / "run"
    result = run(f"training.output_dir={out}", "training.max_steps=4", *QUICK, "data.packing=true",
                 "data.packing_tokens=128", "training.per_device_train_batch_size=4",
                 "training.per_device_eval_batch_size=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rows of 128 tokens" in result.stdout
    assert len(losses(out)) == 4 and all(0 < loss < 20 for loss in losses(out).values())


def test_qwen3_5_recipe_loads_and_trains(tmp_path):
    """The flagship recipe on a tiny Qwen3.5 (Gated DeltaNet + full attention layers) built from a config."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from unsloth_lite.training.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=128, tie_word_embeddings=False,
    )
    Qwen3_5ForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    records = [dict(instruction=f"add {a} and {b}", input="", output=str(a + b)) for a in range(6) for b in range(6)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--recipe", "qlora_qwen27b.yaml",
         f"model.name_or_path={tmp_path / 'model'}", f"data.path={tmp_path / 'data.jsonl'}", "model.dtype=float32",
         "training.bf16=false", "model.max_seq_length=64", "training.max_steps=2", "training.logging_steps=1",
         "training.gradient_accumulation_steps=2", "data.packing_tokens=256",  # packed (the recipe's default)
         "training.save_strategy=no", "training.report_to=none", f"training.output_dir={out}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(out)) == 2 and all(loss == loss for loss in losses(out).values())  # finite, not NaN
    assert (out / "adapter_model.safetensors").exists()


def test_missing_recipe_file_is_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "scripts/train.py", "--recipe", str(tmp_path / "nope.yaml")],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "nope.yaml" in result.stderr and "Traceback" not in result.stderr

