"""The input embedding and the lm_head `[V, H]` stored in bitsandbytes NF4 (double quantisation, block 64).

At Qwen3.5-27B's vocabulary (V = 248,320, H = 5,120) each of the two matrices is 2.5 GB in bf16 and 0.66 GB in
NF4 (0.5 byte an element, plus 1 byte of nested absmax per 64 and 4 bytes per 16,384): about 3.9x smaller. Both
are frozen, as they are in QLoRA anyway. The dense matrices are never formed again:

* The embedding becomes an `NF4Embedding`, whose lookup dequantises only the looked-up rows
  (`dequantize_nf4_rows`). It is a module of its own rather than an `nn.Embedding` holding packed bytes, so that
  nothing can silently read the codes as embeddings; `get_input_embeddings()` returns it, its output is a
  fresh tensor (so `enable_input_require_grads`' hook can make it require grad for checkpointing), and
  Hugging Face's `generate` and PEFT's LoRA injection (which leaves embeddings alone) work unchanged.
* The lm_head becomes a bitsandbytes `Linear4bit` (NF4). The patched causal-LM forward passes its `Params4bit`
  weight to `fused_linear_cross_entropy`, which dequantises a block of vocabulary rows at a time; logits without
  labels (generation) come from `nf4_linear`, block by block too.

Tied embeddings (one matrix for both) are quantised once and the two modules share the `Params4bit`.
"""

from __future__ import annotations

import torch

from unsloth_lite.kernels.dequantize_nf4 import (
    dequantize_nf4_reference,
    dequantize_nf4_row_range,
    dequantize_nf4_rows,
    dequantize_nf4_rows_reference,
)
from unsloth_lite.kernels.utils import INTERPRET, empty
from unsloth_lite.models.host_embeddings import HostEmbedding

NF4_BLOCKSIZE = 64

# Vocabulary rows dequantised at a time for logits (as the fused cross-entropy's NF4 path does).
LOGITS_VOCAB_BLOCK = 4096


def _kernels_on(t: torch.Tensor) -> bool:
    return t.is_cuda or INTERPRET


class NF4Embedding(torch.nn.Module):
    """A frozen embedding table `[num_embeddings, embedding_dim]` held as a bitsandbytes NF4 `Params4bit`; a
    lookup dequantises only the rows it reads (the Triton gather kernel, or its PyTorch reference on a CPU
    without the interpreter)."""

    def __init__(self, weight, padding_idx: int | None = None):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = (int(n) for n in weight.quant_state.shape)
        self.padding_idx = padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if _kernels_on(self.weight):
            return dequantize_nf4_rows(self.weight, input_ids)
        return dequantize_nf4_rows_reference(self.weight.data, self.weight.quant_state, input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, nf4" + (
            f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        )


def is_nf4_linear(module) -> bool:
    """Whether `module` is a bitsandbytes `Linear4bit` holding an NF4 weight (checked without importing it)."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    return type(module).__name__ == "Linear4bit" and state is not None and state.quant_type == "nf4"


def nf4_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ Wᵀ (+ bias)` for an NF4 weight `[V, H]` (the logits of an NF4 lm_head), dequantised a block of
    `LOGITS_VOCAB_BLOCK` rows at a time into one buffer; computed in the weight's dtype, returned in x's."""
    qs = weight.quant_state
    n_out, n_in = (int(n) for n in qs.shape)
    rows = x.reshape(-1, n_in).to(qs.dtype)
    if not _kernels_on(weight) or n_in % qs.blocksize:
        dense = dequantize_nf4_reference(weight.data, qs)
        return torch.nn.functional.linear(rows, dense, bias).to(x.dtype).reshape(*x.shape[:-1], n_out)
    out = empty((rows.shape[0], n_out), x.dtype, x.device)
    block = empty((min(n_out, LOGITS_VOCAB_BLOCK), n_in), qs.dtype, x.device)
    for first in range(0, n_out, block.shape[0]):
        count = min(block.shape[0], n_out - first)
        w = dequantize_nf4_row_range(weight, first, block[:count])
        logits = rows @ w.t()
        if bias is not None:
            logits += bias[first:first + count]
        out[:, first:first + count] = logits
    return out.reshape(*x.shape[:-1], n_out)


def _quantized(dense: torch.Tensor):
    import bitsandbytes as bnb

    weight = bnb.nn.Params4bit(
        dense.detach(), requires_grad=False, quant_type="nf4", compress_statistics=True,
        blocksize=NF4_BLOCKSIZE, quant_storage=torch.uint8,
    )
    return weight.to(dense.device)  # quantises on the weight's device


def _nf4_linear_module(weight, bias: torch.Tensor | None, dtype: torch.dtype):
    import bitsandbytes as bnb

    n_out, n_in = (int(n) for n in weight.quant_state.shape)
    # On the meta device: no dense [V, H] placeholder is allocated before the quantised weight replaces it.
    head = bnb.nn.Linear4bit(
        n_in, n_out, bias=bias is not None, compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
        quant_storage=torch.uint8, device="meta",
    )
    head.weight = weight
    weight.module = head  # bitsandbytes restores a lost quant_state from the module (FSDP)
    if bias is not None:
        head.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
    return head


def quantize_embeddings_nf4(model: torch.nn.Module) -> torch.nn.Module:
    """Stores `model`'s input embedding and its lm_head as NF4 (bitsandbytes `Params4bit`, double quantisation,
    block 64), in place, freeing the dense weights (when nothing else holds them); returns `model`. Works on a
    Hugging Face causal LM, plain or PEFT-wrapped, patched or not (the fused path needs `patch_model`). Both
    become frozen. Modules already quantised, and an embedding kept on the host (`offload_embeddings_to_host`),
    are left as they are."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings = base.get_input_embeddings()
    head = base.get_output_embeddings()
    if head is not None and not (type(head) is torch.nn.Linear or is_nf4_linear(head)):
        raise ValueError(f"quantize_embeddings_nf4: the lm_head is a {type(head).__name__}, not a Linear")
    if not isinstance(embeddings, (torch.nn.Embedding, NF4Embedding, HostEmbedding)):
        raise ValueError(f"quantize_embeddings_nf4: the input embedding is a {type(embeddings).__name__}")
    if type(embeddings) is torch.nn.Embedding and embeddings.max_norm is not None:
        raise ValueError("quantize_embeddings_nf4: an embedding with max_norm renormalises its rows; not supported")
    tied = head is not None and head.weight is embeddings.weight
    if type(embeddings) is torch.nn.Embedding:
        dense = embeddings.weight
        weight = _quantized(dense)
        base.set_input_embeddings(NF4Embedding(weight, embeddings.padding_idx))
        if tied:
            base.set_output_embeddings(_nf4_linear_module(weight, head.bias, dense.dtype))
    if head is not None and type(head) is torch.nn.Linear and not tied:
        base.set_output_embeddings(_nf4_linear_module(_quantized(head.weight), head.bias, head.weight.dtype))
    return model
