"""Datasets for supervised fine-tuning: loading (local files, hub datasets, the built-in arithmetic set),
formatting (alpaca, chat messages, plain text, pre-tokenised), tokenisation with the chat template, masking
of everything but the responses, and padding."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import datasets
import torch

from unsloth_lite.training.tiny import ARITHMETIC_DATA, arithmetic_records

IGNORE_INDEX = -100
FILE_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_records(path: str, split: str = "train", seed: int = 0) -> datasets.Dataset:
    """The raw dataset: the built-in arithmetic set, a local file or dataset directory, or a hub dataset."""
    if path == ARITHMETIC_DATA:
        return datasets.Dataset.from_list(arithmetic_records(seed=seed))
    extension = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        if extension not in FILE_LOADERS:
            raise ValueError(f"data.path: {path} has an unsupported extension; expected one of {sorted(FILE_LOADERS)}")
        return datasets.load_dataset(FILE_LOADERS[extension], data_files=path, split="train")
    if os.path.isdir(path):
        try:
            return datasets.load_from_disk(path)
        except FileNotFoundError:
            return datasets.load_dataset(path, split=split)
    return datasets.load_dataset(path, split=split)


def alpaca_messages(record: Mapping) -> list[dict]:
    prompt = record["instruction"]
    if record.get("input"):
        prompt = f"{prompt}\n\n{record['input']}"
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]


def chat_messages(record: Mapping) -> list[dict]:
    messages = record.get("messages", record.get("conversations"))
    if messages is None:
        raise ValueError("data.format chat: records need a 'messages' (or 'conversations') list")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def tokenize_messages(messages, tokenizer, max_length: int, responses_only: bool) -> dict:
    """input_ids of the templated conversation; labels equal to them, or, with `responses_only`, ignored
    everywhere except the assistant turns (each turn's tokens are found as the growth of the templated
    prefix, so any template works whose rendering of a prefix is a prefix of the whole)."""
    input_ids = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
    if not responses_only:
        labels = list(input_ids)
    else:
        labels = [IGNORE_INDEX] * len(input_ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(_ids(tokenizer.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)))
            end = len(_ids(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)))
            labels[start:end] = input_ids[start:end]
    return {"input_ids": input_ids[:max_length], "labels": labels[:max_length]}


def tokenize_dataset(
    dataset: datasets.Dataset, tokenizer, data_format: str, max_length: int,
    responses_only: bool = True, text_field: str = "text",
) -> datasets.Dataset:
    """Rows of `input_ids` and `labels` (IGNORE_INDEX where no loss is taken)."""
    if data_format == "tokenized":
        def clip(record):
            ids = list(record["input_ids"])[:max_length]
            labels = list(record.get("labels") or ids)[:max_length]
            return {"input_ids": ids, "labels": labels}

        return dataset.map(clip, remove_columns=dataset.column_names)
    if data_format == "text":
        def encode_text(record):
            ids = tokenizer(record[text_field])["input_ids"][: max_length - 1] + [tokenizer.eos_token_id]
            return {"input_ids": ids, "labels": list(ids)}

        return dataset.map(encode_text, remove_columns=dataset.column_names)
    to_messages = alpaca_messages if data_format == "alpaca" else chat_messages

    def encode_chat(record):
        return tokenize_messages(to_messages(record), tokenizer, max_length, responses_only)

    return dataset.map(encode_chat, remove_columns=dataset.column_names)


@dataclasses.dataclass
class PaddingCollator:
    """Right-pads a batch: input_ids with the pad token, labels with IGNORE_INDEX, and an attention mask; to
    the batch's longest row rounded up to a multiple of `pad_to_multiple_of` (a few batch shapes that repeat,
    which CUDA-graphed layers need)."""

    pad_token_id: int
    pad_to_multiple_of: int = 1

    def __call__(self, features: list[Mapping]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": [], "labels": [], "attention_mask": []}
        for f in features:
            pad = length - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
