"""Argument checks of `chunk_gated_delta_rule`: one-line errors naming the argument, its shape or dtype, before any
kernel runs."""

from __future__ import annotations

import torch

from unsloth_lite.kernels.utils import check_float, check_kernel_device, check_same_device

# The value-gradient kernels' registers and shared memory bound the head dims (Qwen3.5's heads are 128).
MAX_HEAD_DIM = 128
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_args(q, k, v, g, beta, initial_state, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; the kernels take float32, bfloat16 or float16")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, D], got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        name = "k" if k.dtype != q.dtype else "v"
        raise ValueError(f"{name} has dtype {(k if name == 'k' else v).dtype} but q has {q.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected q's shape {tuple(q.shape)}")
    batch, seq, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if v.shape[:2] != (batch, seq):
        raise ValueError(f"v has shape {tuple(v.shape)}; its batch and time dims must match q's {(batch, seq)}")
    if hv % hk != 0:
        raise ValueError(f"v has {hv} heads, not a multiple of k's {hk}")
    if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        name = "q" if dk > MAX_HEAD_DIM else "v"
        raise ValueError(f"{name}'s head dim {dk if name == 'q' else dv} exceeds the kernels' {MAX_HEAD_DIM}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (batch, seq, hv):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {(batch, seq, hv)} ([B, T, Hv])")
    n_seq = batch
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be an int32 or int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
        if batch != 1:
            raise ValueError(f"cu_seqlens needs q of batch 1 (documents packed along T), got batch {batch}")
        n_seq = cu_seqlens.numel() - 1
    if initial_state is not None:
        check_float("initial_state", initial_state)
        if tuple(initial_state.shape) != (n_seq, hv, dk, dv):
            raise ValueError(
                f"initial_state has shape {tuple(initial_state.shape)}; expected {(n_seq, hv, dk, dv)} "
                "([N, Hv, Dk, Dv], N the batch or the number of documents)"
            )
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    if initial_state is not None:
        named.append(("initial_state", initial_state))
    if cu_seqlens is not None:
        named.append(("cu_seqlens", cu_seqlens))
    check_same_device(named)
    check_kernel_device("q", q)
