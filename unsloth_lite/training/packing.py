"""Padding-free packing: tokenised documents grouped into rows of a fixed token budget, and the collator that
lays those rows out in Hugging Face's padding-free convention.

`pack_dataset(dataset, max_tokens)` groups the documents (rows of `input_ids` and `labels`) into packed rows
of at most `max_tokens` tokens (best fit, longest documents first, so rows come out nearly full), each row
its documents concatenated with `position_ids` restarting at 0 at each one. The Trainer's sampler then
shuffles packed rows as it would shuffle documents.

`PackingCollator(pad_token_id, max_tokens)` turns a batch of such rows (a row without `position_ids` is one
document) into one sequence of batch dimension 1: each row padded up to `max_tokens`, so every micro-batch
of `B` rows has the same shape `[1, B * max_tokens]` (which CUDA-graphed layers need); the padding's
positions also restart at 0, so it is a document of its own that no real token attends to. Labels of each
document's first token are ignored, so no token is trained to predict the start of the next document, and
the padding's labels are ignored. The patched models read the document boundaries from the position ids
(`unsloth_lite.models.packing`).

Loss normalisation: the Trainer counts the batch's non-ignored targets as `labels[..., 1:] != -100` over
every micro-batch of an optimiser step (`num_items_in_batch`). With each document's first label ignored that
count is exactly the documents' targets, the same as for the same documents padded, so the loss of an
optimiser step is the mean over its real target tokens whichever way the documents are batched.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
from collections.abc import Mapping, Sequence

import datasets
import torch

IGNORE_INDEX = -100

__all__ = ["PackingCollator", "pack_dataset", "pack_documents"]


def pack_documents(lengths: Sequence[int], max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Indices of the documents of each packed row, every row's lengths summing to at most `max_tokens`.

    Best fit decreasing: documents taken longest first (ties in a shuffled order, from `seed`), each into
    the open row it fills most tightly, or a new row. A sorted list of (space left, row) finds that row by
    bisection. Rows come out in a shuffled order too."""
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        raise ValueError(
            f"document {too_long[0]} has {lengths[too_long[0]]} tokens, more than the packing budget of "
            f"{max_tokens} (truncate documents to at most the budget, or raise it)"
        )
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])  # stable: the shuffle orders equal lengths
    rows: list[list[int]] = []
    space_left: list[tuple[int, int]] = []  # (tokens left, row), sorted
    for index in order:
        length = lengths[index]
        if length == 0:
            continue
        slot = bisect.bisect_left(space_left, (length, -1))
        if slot == len(space_left):
            rows.append([index])
            left, row = max_tokens - length, len(rows) - 1
        else:
            left, row = space_left.pop(slot)
            rows[row].append(index)
            left -= length
        if left > 0:
            bisect.insort(space_left, (left, row))
    rng.shuffle(rows)
    return rows


def pack_dataset(dataset: datasets.Dataset, max_tokens: int, seed: int = 0) -> datasets.Dataset:
    """Rows of `input_ids`, `labels` and `position_ids`, each the concatenation of the documents that
    `pack_documents` groups (labels as given: `PackingCollator` ignores each document's first one)."""
    input_ids = dataset["input_ids"]
    labels = dataset["labels"] if "labels" in dataset.column_names else input_ids
    packed = {"input_ids": [], "labels": [], "position_ids": []}
    for row in pack_documents([len(ids) for ids in input_ids], max_tokens, seed):
        packed["input_ids"].append([t for i in row for t in input_ids[i]])
        packed["labels"].append([t for i in row for t in labels[i]])
        packed["position_ids"].append([p for i in row for p in range(len(input_ids[i]))])
    return datasets.Dataset.from_dict(packed)


@dataclasses.dataclass
class PackingCollator:
    """A batch of packed rows (or of single documents) as one padding-free sequence `[1, B * max_tokens]`:
    `input_ids`, `labels` (each document's first token and the padding ignored) and `position_ids`
    (restarting at 0 at each document and at the padding). No attention mask: the position ids carry the
    document boundaries."""

    pad_token_id: int
    max_tokens: int = 8192

    def __call__(self, features: list[Mapping]) -> dict[str, torch.Tensor]:
        input_ids, labels, positions = [], [], []
        for feature in features:
            ids = list(feature["input_ids"])
            row_labels = list(feature["labels"]) if feature.get("labels") is not None else list(ids)
            row_positions = list(feature["position_ids"]) if feature.get("position_ids") is not None \
                else list(range(len(ids)))
            if len(ids) > self.max_tokens:
                raise ValueError(f"a row of {len(ids)} tokens exceeds the packing budget of {self.max_tokens}; "
                                 "pack with pack_dataset(dataset, max_tokens) first")
            if not len(ids) == len(row_labels) == len(row_positions):
                raise ValueError(f"a row's input_ids, labels and position_ids differ in length "
                                 f"({len(ids)}, {len(row_labels)}, {len(row_positions)})")
            pad = self.max_tokens - len(ids)
            input_ids += ids + [self.pad_token_id] * pad
            # A document's first label would be the target of the previous document's last token.
            labels += [IGNORE_INDEX if p == 0 else t for p, t in zip(row_positions, row_labels, strict=True)]
            labels += [IGNORE_INDEX] * pad
            positions += row_positions + list(range(pad))
        return {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
        }
