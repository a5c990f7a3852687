"""`unsloth-lite-generate` on the tiny Qwen3 (CPU, NF4 base) with a LoRA adapter saved as a training run saves
it: streamed text equal to `model.generate`'s, the adapter changing it, a conversation from piped stdin (once
through a real process), one-line errors with exit code 2 for bad input."""

import io
import subprocess
import sys

import pytest
import torch
from test_cli import ENV, ROOT

from unsloth_lite import cli
from unsloth_lite.errors import InputError
from unsloth_lite.training.generation import generate, load_for_generation, resolve_adapter

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs of the tiny model")

PROMPT = "What is 3 + 4?"
PREFIX = "unsloth-lite-generate: error:"


def save_adapter(model, path, tokenizer=None, seed=0):
    """A LoRA adapter on every linear of `model` with random B (PEFT starts B at zero: no effect), saved
    as a training run saves it (with the tokenizer, when given)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny base, a run directory with its adapter, and adapters of other bases."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    from unsloth_lite.training.tiny import build_tiny_qwen3, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("generate")
    tokenizer = build_tiny_tokenizer()
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    save_adapter(build_tiny_qwen3(tokenizer, seed=0), root / "run", tokenizer)
    narrower = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16))
    save_adapter(narrower, root / "narrower_adapter")
    hybrid = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]))
    save_adapter(hybrid, root / "qwen3_5_adapter")
    (root / "not_a_run").mkdir()
    (root / "no_config").mkdir()
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text('{"model_type": "llama"}')
    return root


def run_cli(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = cli.generate_main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def base_args(root, *more):
    return ["--model", str(root / "base"), "--dtype", "float32", "--max-new-tokens", "6", *more]


def test_prompt_streams_what_model_generate_returns(checkpoints, capsys):
    """The default: the base in NF4, the adapter unmerged on top."""
    code, out, err = run_cli(base_args(checkpoints, "--adapter", str(checkpoints / "run"), "--prompt", PROMPT),
                             capsys)
    assert code == 0, err
    stats = [line for line in err.splitlines() if line.startswith("unsloth-lite-generate:")]
    assert len(stats) == 1 and "6 new tokens, decode" in stats[0] and "tokens/s" in stats[0], err
    assert "first token after" in stats[0]

    model, tokenizer = load_for_generation(checkpoints / "base", checkpoints / "run", dtype=torch.float32)
    input_ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    output = model.generate(input_ids=input_ids, max_new_tokens=6, do_sample=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert expected and out == expected + "\n"


def test_the_adapter_changes_the_output(checkpoints, capsys):
    outputs = []
    for adapter in (["--adapter", str(checkpoints / "run")], []):
        code, out, err = run_cli(base_args(checkpoints, "--no-4bit", *adapter, "--prompt", PROMPT), capsys)
        assert code == 0, err
        outputs.append(out)
    assert outputs[0] != outputs[1]


def test_chat_reads_messages_from_stdin_and_answers_each(checkpoints, capsys, monkeypatch):
    code, out, err = run_cli(base_args(checkpoints, "--no-4bit", "--adapter", str(checkpoints / "run"), "--chat"),
                             capsys, stdin=f"{PROMPT}\n\nWhat is 1 + 1?\n", monkeypatch=monkeypatch)
    assert code == 0, err
    assert len([line for line in err.splitlines() if "tokens/s" in line]) == 2, err  # the blank line is skipped

    # the same conversation, turn by turn in the chat template, through the library
    model, tokenizer = load_for_generation(checkpoints / "base", checkpoints / "run", load_in_4bit=False,
                                           dtype=torch.float32)
    messages, expected = [], ""
    for question in (PROMPT, "What is 1 + 1?"):
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = generate(model, tokenizer, prompt, max_new_tokens=6).text
        messages.append({"role": "assistant", "content": answer})
        expected += answer + "\n"
    assert out == expected


def test_chat_through_a_process_with_piped_stdin(checkpoints):
    """Nothing but the answer on stdout, the timing line on stderr; the NF4 base without the interpreter (the
    plain-PyTorch references: the same math, faster)."""
    env = dict(ENV, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "scripts/generate.py", *base_args(checkpoints, "--adapter", str(checkpoints / "run"),
                                                           "--chat")],
        cwd=ROOT, env=env, input=f"{PROMPT}\n", capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout) > 1
    assert len([line for line in result.stderr.splitlines() if "tokens/s" in line]) == 1, result.stderr


def test_a_run_directory_stopped_early_resolves_to_its_latest_checkpoint(checkpoints, tmp_path):
    import shutil

    for step in (4, 12):
        shutil.copytree(checkpoints / "run", tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-8").mkdir()  # a checkpoint without an adapter is passed over
    assert resolve_adapter(tmp_path) == tmp_path / "checkpoint-12"
    assert resolve_adapter(checkpoints / "run") == checkpoints / "run"


# case: (root -> arguments, words the error line must contain)
CASES = {
    "missing model": (lambda r: ["--model", str(r / "nope"), "--prompt", "x"], ["model", "nope", "no such"]),
    "model without config": (
        lambda r: ["--model", str(r / "no_config"), "--prompt", "x"], ["no_config", "config.json"]
    ),
    "unsupported model": (lambda r: ["--model", str(r / "llama"), "--prompt", "x"], ["'llama'", "qwen3"]),
    "no --model": (lambda r: ["--prompt", "x"], ["--model", "required"]),
    "adapter without files": (
        lambda r: base_args(r, "--adapter", str(r / "not_a_run"), "--prompt", "x"),
        ["adapter", "not_a_run", "adapter_config.json"],
    ),
    "adapter missing": (lambda r: base_args(r, "--adapter", str(r / "gone"), "--prompt", "x"), ["adapter", "gone"]),
    "adapter of a narrower base": (
        lambda r: base_args(r, "--adapter", str(r / "narrower_adapter"), "--prompt", "x"),
        ["narrower_adapter", "adapter_model.safetensors", "mlp.down_proj has input size 128", "384", "another base"],
    ),
    "adapter of another architecture": (
        lambda r: base_args(r, "--adapter", str(r / "qwen3_5_adapter"), "--prompt", "x"),
        ["qwen3_5_adapter", "linear_attn", "another base"],
    ),
    "prompt and chat": (lambda r: base_args(r, "--prompt", "x", "--chat"), ["--chat", "not allowed", "--prompt"]),
    "neither prompt nor chat": (lambda r: base_args(r), ["--prompt", "--chat", "required"]),
    "zero new tokens": (lambda r: base_args(r, "--prompt", "x", "--max-new-tokens", "0"),
                        ["--max-new-tokens", ">= 1", "got 0"]),
    "negative new tokens": (lambda r: base_args(r, "--prompt", "x", "--max-new-tokens", "-3"), ["--max-new-tokens"]),
    "fractional new tokens": (lambda r: base_args(r, "--prompt", "x", "--max-new-tokens", "2.5"),
                              ["--max-new-tokens", "whole number"]),
    "top_p": (lambda r: base_args(r, "--prompt", "x", "--top-p", "0"), ["--top-p", "> 0.0"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, checkpoints, capsys):
    arguments, words = CASES[case]
    code, out, err = run_cli(arguments(checkpoints), capsys)
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_debug_reraises(checkpoints):
    with pytest.raises(InputError, match="adapter_config.json"):
        cli.generate_main(base_args(checkpoints, "--adapter", str(checkpoints / "not_a_run"), "--prompt", "x",
                                    "--debug"))
