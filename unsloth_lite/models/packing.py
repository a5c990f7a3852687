"""Packed (padding-free) batches in the patched models: document boundaries from the position ids, and
attention that keeps each document to itself.

Convention (Hugging Face's padding-free one, as `transformers.DataCollatorWithFlattening` produces): batch
dimension 1, documents concatenated along the sequence, `position_ids` restarting at 0 at each document, no
attention mask. `packed_sequence_kwargs` turns the position ids into the keyword arguments transformers'
flash-attention path names (`cu_seq_lens_q/k`, int32 `[N + 1]` document offsets, and `max_length_q/k`);
`causal_lm_forward` computes them once per forward and the decoder layers hand them to every token mixer:
the attention layers (`attend`) run `varlen_attention`, Qwen3.5's Gated DeltaNet layers pass
`cu_seq_lens_q` to the conv1d and delta-rule kernels, so no state crosses a document boundary either.
"""

from __future__ import annotations

import functools
import inspect

import torch

# Static packed shapes reserve a document slot per this many tokens: W4's instruction records (median 214
# tokens) put 30-40 documents in 8,192 tokens, so its rows share one count (64) and one CUDA graph pair; with
# a power of two of the actual count instead, rows crossed 32 and each new count cost a capture (4-5 s at
# Qwen3-8B, measured on the H200).
MIN_TOKENS_PER_DOCUMENT_SLOT = 128


def packed_sequence_kwargs(position_ids: torch.Tensor | None, static_shapes: bool | None = None) -> dict | None:
    """`cu_seq_lens_q/k` and `max_length_q/k` of a packed row, or None where `position_ids` do not describe
    one (no position ids, a batch of several rows, a row that does not start at 0, or a single document).

    Costs one host sync: the row's position ids are copied to the host (8 bytes a token), where the offsets
    and the longest document are found; the offsets go back to the device without blocking. Every layer then
    reuses them, and `varlen_attn` needs the longest length as a Python int anyway.

    `static_shapes` (default: on CUDA) gives every row of one length the same shapes and arguments whatever
    its documents: the offsets are padded to a power-of-two count with empty documents at the row's end, at
    least one slot per MIN_TOKENS_PER_DOCUMENT_SLOT tokens, and the longest length is the row's. CUDA-graphed
    layers key their graphs on those (`checkpointing.py`), so packed rows of a fixed token budget replay one
    graph pair (a second only for rows of unusually many short documents) instead of capturing a new pair for
    every row; the attention's extra blocks of empty documents exit at once."""
    if position_ids is None:
        return None
    if position_ids.dim() == 3:  # Qwen3.5's multimodal rotary positions: [text, t, h, w] or [t, h, w] first
        position_ids = position_ids[0]
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    positions = position_ids[0].cpu()
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() < 2 or int(starts[0]) != 0:
        return None
    length = positions.numel()
    offsets = torch.cat([starts, torch.tensor([length])]).to(torch.int32)
    longest = int((offsets[1:] - offsets[:-1]).max())
    if position_ids.is_cuda if static_shapes is None else static_shapes:
        documents = starts.numel()
        capacity = 1 << (max(documents, length // MIN_TOKENS_PER_DOCUMENT_SLOT) - 1).bit_length()
        offsets = torch.nn.functional.pad(offsets, (0, capacity - documents), value=length)
        longest = length
    cu_seqlens = offsets.to(position_ids.device, non_blocking=True)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": longest,
            "max_length_k": longest}


@functools.cache
def _varlen_attn():
    """torch's `varlen_attn` (FlashAttention over packed documents, torch >= 2.10) and how to ask it for
    causal masking and grouped KV heads, read from its signature: the keywords moved between releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:  # torch >= 2.11: causal is a window of (everything before, nothing after)
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        return None
    # torch 2.13 asks for grouped KV heads explicitly; without the keyword, 2.11's kernel takes them natively
    # and 2.10's is given repeated heads (`repeat_kv`).
    gqa = {"enable_gqa": True} if "enable_gqa" in parameters else {}
    repeat_kv = not gqa and "window_size" not in parameters
    return varlen_attn, causal, gqa, repeat_kv


def _uses_varlen_attn(query: torch.Tensor, dropout: float) -> bool:
    """Flash attention's domain: CUDA, half precision, no dropout, a head size that is a multiple of 8 up to 256."""
    head_dim = query.shape[-1]
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0 \
        and head_dim % 8 == 0 and head_dim <= 256 and _varlen_attn() is not None


def varlen_attention(query, key, value, packed: dict, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of each packed document over itself only. `query [1, Hq, T, D]`, `key` and
    `value [1, Hkv, T, D]` (Hq a multiple of Hkv), `packed` from `packed_sequence_kwargs`; returns
    `[1, T, Hq, D]`, the layout of transformers' attention functions.

    On CUDA in half precision (head size a multiple of 8, at most 256): torch's `varlen_attn`, reading q/k/v
    as `[T, H, D]` views (the projections' own storage) and the KV heads without copies where it takes grouped
    heads. Elsewhere (CPU, float32, dropout, other head sizes, torch without it): SDPA with a block-diagonal
    causal mask and native GQA, which holds a `[T, T]` boolean mask: the reference path, exact but not fast."""
    cu_seqlens, longest = packed["cu_seq_lens_q"], packed["max_length_q"]
    if _uses_varlen_attn(query, dropout):
        varlen_attn, causal, gqa, repeat_kv = _varlen_attn()
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        if repeat_kv and k.shape[1] != q.shape[1]:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **causal, **gqa)
        return out.unsqueeze(0)
    length = query.shape[2]
    mask = block_diagonal_causal_mask(cu_seqlens.to(query.device), length)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2)


def block_diagonal_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """`[T, T]` boolean, True where query i may attend key j: same document, j <= i."""
    boundaries = torch.zeros(length + 1, dtype=torch.int32, device=cu_seqlens.device)
    boundaries[cu_seqlens[1:-1].long()] = 1  # each document after the first starts a new index (empty
    boundaries = boundaries[:length]  # documents at the end of padded offsets start at `length`: dropped)
    document = boundaries.cumsum(0)
    same_document = document[:, None] == document[None, :]
    return same_document.tril_()
