"""Datasets for supervised fine-tuning: loading (local files, hub datasets, the built-in arithmetic set),
formatting (alpaca, chat messages, plain text, pre-tokenised), tokenisation with the chat template, masking
of everything but the responses, and padding."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

import datasets
import torch

from unsloth_lite.errors import DataError
from unsloth_lite.training.tiny import ARITHMETIC_DATA, arithmetic_records

__all__ = ["DataError", "IGNORE_INDEX", "PaddingCollator", "check_records", "load_records", "split_records",
           "tokenize_dataset"]

IGNORE_INDEX = -100
FILE_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _first_line(error: BaseException) -> str:
    """The error's type and first line, and those of its root cause (datasets wraps the parser's error)."""
    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")

    root = error
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__
    return line(error) if root is error else f"{line(error)} ({line(root)})"


def read_json_records(path: str) -> tuple[list[dict], list[str]]:
    """The records of a JSON array file or a JSON-lines file, and where each comes from ("line N" or
    "record N"); a line that is not valid JSON, or not an object, is a DataError naming the line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.path: cannot read {path}: {_first_line(e)}") from None
    stripped = text.lstrip()
    if path.lower().endswith(".json") and stripped.startswith(("[", "{")):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as e:
            if stripped.startswith("["):
                raise DataError(
                    f"data.path: {path} line {e.lineno}: invalid JSON ({e.msg}, column {e.colno})"
                ) from None
            document = None  # JSON lines in a .json file
        if isinstance(document, list):
            for i, record in enumerate(document):
                if not isinstance(record, dict):
                    raise DataError(f"data.path: {path} record {i + 1}: expected a JSON object, got "
                                    f"{type(record).__name__}")
            return document, [f"record {i + 1}" for i in range(len(document))]
        if isinstance(document, dict):
            columns = list(document.values())
            if columns and all(isinstance(c, list) for c in columns) and len({len(c) for c in columns}) == 1:
                records = [dict(zip(document, row, strict=True)) for row in zip(*columns, strict=True)]
            else:
                records = [document]
            return records, [f"record {i + 1}" for i in range(len(records))]
    records, where = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"data.path: {path} line {number}: invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"data.path: {path} line {number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
        where.append(f"line {number}")
    return records, where


def load_records(
    path: str, split: str = "train", seed: int = 0, data_format: str | None = None, text_field: str = "text",
    responses_only: bool = False,
) -> datasets.Dataset:
    """The raw dataset: the built-in arithmetic set, a local file or dataset directory, or a hub dataset. With
    `data_format`, every record is checked for the fields that format needs (`check_records`); failures are
    DataErrors naming the file, the line (JSON) or record, and the field."""
    if path == ARITHMETIC_DATA:
        return datasets.Dataset.from_list(arithmetic_records(seed=seed))
    extension = os.path.splitext(path)[1].lower()
    where = None
    if os.path.isfile(path) and extension in (".json", ".jsonl"):
        records, where = read_json_records(path)
        if data_format is not None:
            check_records(records, data_format, path, where, text_field, responses_only)
        try:
            dataset = datasets.Dataset.from_list(records)
        except Exception as e:  # pyarrow: a field whose type differs between records
            raise DataError(f"data.path: {path}: the records' fields do not have one type each ({_first_line(e)})") \
                from None
    else:
        dataset = _load_with_datasets(path, extension, split)
        if data_format is not None:
            check_records(dataset, data_format, path, None, text_field, responses_only)
    if len(dataset) == 0:
        raise DataError(f"data.path: {path} holds no records" + (f" in split {split!r}" if where is None else ""))
    return dataset


def _load_with_datasets(path: str, extension: str, split: str) -> datasets.Dataset:
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parser logs its traceback; ours is one line
    try:
        if os.path.isfile(path):
            if extension not in FILE_LOADERS:
                raise DataError(
                    f"data.path: {path} has an unsupported extension; expected one of {', '.join(FILE_LOADERS)}"
                )
            return datasets.load_dataset(FILE_LOADERS[extension], data_files=path, split="train")
        if os.path.isdir(path):
            try:
                return datasets.load_from_disk(path)
            except FileNotFoundError:
                pass
        dataset = datasets.load_dataset(path, split=split)
    except DataError:
        raise
    except Exception as e:  # datasets, pyarrow and the hub raise many types; each names its problem
        raise DataError(f"data.path: cannot load {path}: {_first_line(e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(f"data.split: {path} has splits {', '.join(dataset)}; name one")
    return dataset


def _field_problem(record: Mapping, data_format: str, text_field: str, responses_only: bool) -> str | None:
    """What `record` lacks for `data_format`, or None."""
    if data_format == "alpaca":
        missing = [key for key in ("instruction", "output") if record.get(key) is None]
        if missing:
            return f"lacks {', '.join(repr(k) for k in missing)}, which the alpaca format needs" + _has(record)
        for key in ("instruction", "output", "input"):
            if record.get(key) is not None and not isinstance(record[key], str):
                return f"field {key!r} must be a string, got {type(record[key]).__name__}"
    elif data_format == "chat":
        key = "messages" if record.get("messages") is not None else "conversations"
        messages = record.get(key)
        if messages is None:
            return "lacks 'messages' (a list of {role, content}), which the chat format needs" + _has(record)
        if not isinstance(messages, list) or not messages:
            return f"field {key!r} must be a non-empty list of {{role, content}}, got {messages!r:.60}"
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                return f"{key}[{i}] must be {{role: str, content: str}}, got {message!r:.80}"
        if responses_only and not any(m["role"] == "assistant" for m in messages):
            return (f"has no 'assistant' message in {key!r}, so data.train_on_responses_only leaves nothing to "
                    "learn")
    elif data_format == "text":
        if not isinstance(record.get(text_field), str):
            got = "lacks it" + _has(record) if record.get(text_field) is None else \
                f"got {type(record[text_field]).__name__}"
            return f"field {text_field!r} (data.text_field) must be a string; {got}"
    elif data_format == "tokenized":
        ids = record.get("input_ids")
        if not _int_list(ids) or not ids:
            return "field 'input_ids' must be a non-empty list of token ids" + ("" if ids is not None else _has(record))
        labels = record.get("labels")
        if labels is not None and (not _int_list(labels) or len(labels) != len(ids)):
            return f"field 'labels' must be a list of {len(ids)} ints (as long as input_ids)"
    return None


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _has(record: Mapping) -> str:
    return f" (it has: {', '.join(map(str, record)) or 'no fields'})"


def check_records(records, data_format: str, path: str, where: list[str] | None = None, text_field: str = "text",
                  responses_only: bool = False) -> None:
    """Raises a DataError for the first record that lacks a field `data_format` needs, naming the file, the
    record's line (`where`) or number, and the field."""
    for i, record in enumerate(records):
        problem = _field_problem(record, data_format, text_field, responses_only)
        if problem:
            place = where[i] if where is not None else f"record {i + 1}"
            raise DataError(f"data.format {data_format}: {path} {place} {problem}")


def split_records(dataset: datasets.Dataset, eval_fraction: float, seed: int = 0):
    """(train, held out or None): `eval_fraction` of the records held out, at least one on each side."""
    if eval_fraction <= 0:
        return dataset, None
    n = len(dataset)
    held = math.ceil(eval_fraction * n)
    if n - held < 1:
        raise DataError(
            f"data.eval_fraction: holding out {eval_fraction:g} of {n} record(s) leaves none to train on; "
            "give more records or a smaller data.eval_fraction (0 for no evaluation)"
        )
    parts = dataset.train_test_split(test_size=held, seed=seed)
    return parts["train"], parts["test"]


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
    """Rows of `input_ids` and `labels` (IGNORE_INDEX where no loss is taken). A record that cannot be
    tokenised (say, a chat template that rejects its roles) is a DataError naming its index."""
    if data_format == "tokenized":
        def encode(record):
            ids = list(record["input_ids"])[:max_length]
            labels = list(record.get("labels") or ids)[:max_length]
            return {"input_ids": ids, "labels": labels}
    elif data_format == "text":
        def encode(record):
            ids = tokenizer(record[text_field])["input_ids"][: max_length - 1] + [tokenizer.eos_token_id]
            return {"input_ids": ids, "labels": list(ids)}
    else:
        to_messages = alpaca_messages if data_format == "alpaca" else chat_messages

        def encode(record):
            return tokenize_messages(to_messages(record), tokenizer, max_length, responses_only)

    def encode_or_report(record, index):
        try:
            return encode(record)
        except Exception as e:  # the template's, the tokenizer's or a record's error, whichever type
            raise DataError(
                f"data.format {data_format}: record {index + 1} of the split cannot be tokenised: {_first_line(e)}"
            ) from None

    return dataset.map(encode_or_report, with_indices=True, remove_columns=dataset.column_names)


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
