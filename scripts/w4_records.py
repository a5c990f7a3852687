"""W4's records (`../shared/BENCHMARKS.md`) and the micro-batches each stack trains them in, for
`bench_packing.py`: lengths `clip(round(exp(N(ln 220, 0.8))), 32, 2048)` from `numpy.random.default_rng(0)`,
random token ids from `default_rng(1)`, the loss on the last two thirds of each record."""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
W4_RECORDS = dict(count=4096, median=220, sigma=0.8, shortest=32, longest=2048)
TINY_RECORDS = dict(count=8, median=6, sigma=0.8, shortest=3, longest=16)
SPECIAL_IDS = 3  # the last ids of the vocabulary: bench_train_setup.py's stand-in tokenizer's special tokens


def record_lengths(count: int, median: float, sigma: float, shortest: int, longest: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(np.round(np.exp(rng.normal(np.log(median), sigma, count))), shortest, longest).astype(int)


def make_records(spec: dict, vocab: int) -> list[dict]:
    """The records (module docstring): `input_ids`, and `labels` with the prompt's ignored."""
    rng = np.random.default_rng(1)
    records = []
    for length in record_lengths(**spec):
        ids = rng.integers(0, vocab - SPECIAL_IDS, length).tolist()
        prompt = length // 3
        records.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return records


def _padded(values: list[int], length: int, pad: int) -> list[int]:
    return values + [pad] * (length - len(values))


def padded_batches(records: list[dict], batch: int, pad_id: int) -> list[dict]:
    """Consecutive groups of `batch` records padded on the right to the longest, padding's labels ignored."""
    batches = []
    for start in range(0, len(records), batch):
        group = records[start:start + batch]
        longest = max(len(r["input_ids"]) for r in group)
        batches.append({
            "input_ids": torch.tensor([_padded(r["input_ids"], longest, pad_id) for r in group]),
            "attention_mask": torch.tensor([_padded([1] * len(r["input_ids"]), longest, 0) for r in group]),
            "labels": torch.tensor([_padded(r["labels"], longest, IGNORE_INDEX) for r in group]),
        })
    return batches


def token_budget_groups(records: list[dict], budget: int) -> list[list[dict]]:
    """Consecutive records, each group at most `budget` tokens (a longer record alone)."""
    groups, tokens = [[]], 0
    for record in records:
        if groups[-1] and tokens + len(record["input_ids"]) > budget:
            groups.append([])
            tokens = 0
        groups[-1].append(record)
        tokens += len(record["input_ids"])
    return groups


def flattened_batches(records: list[dict], budget: int, boundary_kwargs: bool) -> list[dict]:
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=boundary_kwargs)
    return [collator(group) for group in token_budget_groups(records, budget)]


def packed_batches(records: list[dict], packing_tokens: int, rows: int, pad_id: int) -> list[dict]:
    import datasets

    from unsloth_lite.training.packing import PackingCollator, pack_dataset

    packed = pack_dataset(datasets.Dataset.from_list(records), packing_tokens).to_list()
    collator = PackingCollator(pad_id, packing_tokens)
    return [collator(packed[start:start + rows]) for start in range(0, len(packed), rows)]


def token_counts(batch: dict, pad_id: int) -> dict:
    """Real (not padding), all, and trained-target tokens of a micro-batch."""
    ids = batch["input_ids"]
    return dict(real_tokens=int((ids != pad_id).sum()), tokens=ids.numel(),
                target_tokens=int((batch["labels"][..., 1:] != IGNORE_INDEX).sum()))
