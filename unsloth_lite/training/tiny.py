"""The embedded default: a tiny Qwen3 built from a config, a character-level tokenizer and a learnable
arithmetic dataset, all made on the spot (no download), so that training runs on a CPU in minutes."""

from __future__ import annotations

import random
import string

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

TINY_MODEL = "builtin:tiny-qwen3"
ARITHMETIC_DATA = "builtin:arithmetic"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's ChatML layout, as the Qwen tokenizers' templates produce it for plain messages.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus ChatML's special tokens."""
    characters = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *characters, "<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_qwen3(tokenizer, dtype: torch.dtype = torch.float32, seed: int = 0) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 (hidden 128, GQA 4/2 heads of 32) with random weights."""
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        # LoRA leaves lm_head frozen at its initial weights. At the usual std of 0.02 its rows have norm ~0.23,
        # and the final norm holds hidden states at norm ~sqrt(hidden), which caps every logit near 2.6: no
        # answer could reach much more than 10% probability, so the loss plateaus far from zero and training
        # crawls. Rows of norm ~1 leave the adapters room to make the answers confident.
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, config.hidden_size**-0.5)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype)


def arithmetic_question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def arithmetic_records(n: int = 4000, seed: int = 0, max_operand: int = 19) -> list[dict]:
    """Chat records `{"messages": [user question, assistant answer]}` of sums whose answers can be checked."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        records.append({"messages": [
            {"role": "user", "content": arithmetic_question(a, b)},
            {"role": "assistant", "content": str(a + b)},
        ]})
    return records


def answer_accuracy(model, tokenizer, records: list[dict], max_new_tokens: int = 4) -> float:
    """Fraction of records whose greedy answer equals the reference answer (the last assistant message), each
    generated as `unsloth-lite-generate` does (`generation.generate`)."""
    from unsloth_lite.training.generation import encode_chat, generate

    correct = 0
    for record in records:
        prompt = encode_chat(tokenizer, record["messages"][:-1])
        answer = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens).text.strip()
        correct += answer == record["messages"][-1]["content"]
    return correct / max(1, len(records))
