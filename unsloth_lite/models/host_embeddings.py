"""The input embedding kept in host memory (`offload_embeddings_to_host`).

At Qwen3.5-27B's vocabulary the bf16 table `[248320, 5120]` is 2.5 GB of GPU memory, of which a step reads
the rows of its tokens: 20 MB for 2,048 tokens. A `HostEmbedding` keeps the table in (pinned) host memory,
and a lookup's rows land on the ids' device, exactly the table's. With `DEVICE_GATHER` (the default) a GPU reads
the rows of CUDA ids from the pinned table itself (`kernels.gather_rows`): no host round trip, nothing waits,
and the lookup can be captured in a CUDA graph (a decoding step's). Otherwise the host gathers them into a
pinned staging buffer and copies them over: the ids come to the host first, which waits for the GPU work
queued before them; that wait also orders the next batch's gather after the previous batch's copy out of the
staging buffer.

The table is frozen (as in QLoRA). It is held as a plain tensor, not a parameter, so that nothing that walks
the model's parameters moves, casts, shards or broadcasts it: it stays on the host in its dtype through `.to()`,
`.cuda()`, DDP and optimizers, and only rows travel. It is still the module's `weight` in `state_dict()` and
`load_state_dict()`. Without `DEVICE_GATHER`, a decode step that reads it cannot be captured in a CUDA graph
(it waits on the host), so generation with it runs eagerly.
"""

from __future__ import annotations

import torch

from unsloth_lite.kernels.gather_rows import gather_rows

# Lookups of CUDA ids gathered by the device from the pinned table (`gather_rows`) rather than on the host. At W2
# on the H200 it takes away the 4.6 ms a step the GPU waited for the host's gather, but the step's time stays
# within its spread (the forward waits on its copies to the host instead: docs/benchmarks.md); it is on for the
# host that no longer waits, and for decoding steps that can then be captured.
DEVICE_GATHER = True


class HostEmbedding(torch.nn.Module):
    """A frozen `[num_embeddings, embedding_dim]` table in host memory whose lookups land on the ids' device."""

    def __init__(self, weight: torch.Tensor, padding_idx: int | None = None):
        super().__init__()
        table = weight.detach().to("cpu")
        self.weight = table.pin_memory() if torch.cuda.is_available() else table  # not registered (docstring)
        self.num_embeddings, self.embedding_dim = table.shape
        self.padding_idx = padding_idx
        self._staging: torch.Tensor | None = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key in state_dict:
            with torch.no_grad():
                self.weight.copy_(state_dict[key])
        elif strict:
            missing_keys.append(key)
        super()._load_from_state_dict(
            {k: v for k, v in state_dict.items() if k != key}, prefix, local_metadata, strict, missing_keys,
            unexpected_keys, error_msgs,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if DEVICE_GATHER and input_ids.device.type == "cuda" and self.weight.is_pinned():
            return gather_rows(self.weight, input_ids)
        ids = input_ids.to("cpu").reshape(-1)
        if input_ids.device.type == "cpu":
            return torch.nn.functional.embedding(ids, self.weight).view(*input_ids.shape, self.embedding_dim)
        staging = self._staging
        if staging is None or staging.shape[0] < ids.numel():
            staging = torch.empty((ids.numel(), self.embedding_dim), dtype=self.weight.dtype, pin_memory=True)
            self._staging = staging
        rows = torch.index_select(self.weight, 0, ids, out=staging[: ids.numel()])
        return rows.to(input_ids.device, non_blocking=True).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        padding = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, host{padding}"


def offload_embeddings_to_host(model: torch.nn.Module) -> torch.nn.Module:
    """Moves `model`'s input embedding into host memory as a frozen `HostEmbedding` (module docstring), in
    place, freeing its device copy when nothing else holds it; returns `model`. Works on a Hugging Face causal
    LM, plain or PEFT-wrapped, patched or not. A table tied to the lm_head is refused (the lm_head reads all of
    it every step)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings = base.get_input_embeddings()
    if isinstance(embeddings, HostEmbedding):
        return model
    if type(embeddings) is not torch.nn.Embedding:
        raise ValueError(f"offload_embeddings: the input embedding is a {type(embeddings).__name__}, not an Embedding")
    if embeddings.max_norm is not None:
        raise ValueError("offload_embeddings: an embedding with max_norm renormalises its rows; not supported")
    head = base.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is embeddings.weight:
        raise ValueError("offload_embeddings: the input embedding is tied to the lm_head, which reads all of it "
                         "on the device every step")
    base.set_input_embeddings(HostEmbedding(embeddings.weight, embeddings.padding_idx))
    return model
