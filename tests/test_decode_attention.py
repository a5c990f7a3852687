"""`decode_attention` (one new token over a static cache, the cache's update and the output gate in one launch)
against its reference and against float64 attention, over several tokens in a row: the cache written in place,
its length advanced on the device, every split of the positions and every mask form."""

import pytest
import torch
from helpers import TOLERANCE, assert_close, dtype_id

from unsloth_lite.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    decode_splits,
    position_block,
)
from unsloth_lite.kernels.qk_norm_rope import qk_norm_rope


def _inputs(batch, q_heads, kv_heads, head_dim, cache_len, filled, dtype, device):
    query = torch.randn(batch, 1, q_heads, head_dim, device=device, dtype=dtype).transpose(1, 2)  # as the model
    key = torch.randn(batch, 1, kv_heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    value = torch.randn(batch, 1, kv_heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    key_cache = torch.randn(batch, kv_heads, cache_len, head_dim, device=device, dtype=dtype)
    value_cache = torch.randn(batch, kv_heads, cache_len, head_dim, device=device, dtype=dtype)
    return query, key, value, key_cache, value_cache, torch.tensor(filled, device=device)


def _mask(kind, batch, cache_len, device, dtype):
    if kind is None:
        return None
    allowed = torch.ones(batch, 1, 1, cache_len + 3, dtype=torch.bool, device=device)
    allowed[0, ..., :3] = False  # left padding of the first sequence
    allowed[-1, ..., 5] = False
    if kind == "boolean":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def _exact(query, key_cache, value_cache, length, mask, scale, gate):
    """float64 softmax attention over positions [0, length) of the (already updated) cache."""
    batch, q_heads, _, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    keys = key_cache[:, :, :length].double().repeat_interleave(q_heads // kv_heads, dim=1)
    values = value_cache[:, :, :length].double().repeat_interleave(q_heads // kv_heads, dim=1)
    scores = query.double() @ keys.transpose(-1, -2) * scale
    if mask is not None:
        rows = mask[:, :, -1:, :length]
        scores = scores.masked_fill(~rows, float("-inf")) if rows.dtype == torch.bool else scores + rows.double()
    out = (torch.softmax(scores, dim=-1) @ values).transpose(1, 2)
    return out * torch.sigmoid(gate.double()) if gate is not None else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 32), (6, 1, 24)])
@pytest.mark.parametrize("mask_kind,gated", [(None, False), ("boolean", True), ("additive", False)])
def test_decode_attention_steps(q_heads, kv_heads, head_dim, mask_kind, gated, dtype, device):
    block = position_block(head_dim)  # the last split first empty, then reading positions past 2 blocks
    batch, cache_len, first = 2, 2 * block + 8, 2 * block - 1
    assert decode_splits(batch, kv_heads, cache_len, head_dim, torch.device(device))[0] > 1
    query, key, value, key_cache, value_cache, length = _inputs(
        batch, q_heads, kv_heads, head_dim, cache_len, first, dtype, device)
    ref_key_cache, ref_value_cache, ref_length = key_cache.clone(), value_cache.clone(), length.clone()
    mask = _mask(mask_kind, batch, cache_len, device, dtype)
    scale = 0.3
    for step in range(3):
        gate = torch.randn(batch, 1, q_heads, head_dim, device=device, dtype=dtype) if gated else None
        out = decode_attention(query, key, value, key_cache, value_cache, length, mask, scale, gate)
        ref = decode_attention_reference(query, key, value, ref_key_cache, ref_value_cache, ref_length, mask,
                                         scale, gate)
        assert int(length) == first + step + 1, "the cache's length advanced by one"
        assert torch.equal(key_cache, ref_key_cache) and torch.equal(value_cache, ref_value_cache), "cache"
        exact = _exact(query, key_cache, value_cache, first + step + 1, mask, scale, gate)
        assert out.shape == (batch, 1, q_heads, head_dim) and out.dtype == dtype
        assert_close(out, exact, TOLERANCE[dtype], f"output at step {step}")
        assert_close(ref, exact, TOLERANCE[dtype], f"reference output at step {step}")
        query, key, value = (torch.randn_like(t) for t in (query, key, value))


def test_decode_attention_single_split_and_last_position(device):
    """A cache short enough for one split, filled up to its last position."""
    batch, q_heads, kv_heads, head_dim, cache_len = 1, 2, 2, 16, 12
    assert decode_splits(batch, kv_heads, cache_len, head_dim, torch.device(device))[0] == 1
    query, key, value, key_cache, value_cache, length = _inputs(
        batch, q_heads, kv_heads, head_dim, cache_len, cache_len - 1, torch.float32, device)
    out = decode_attention(query, key, value, key_cache, value_cache, length)
    assert int(length) == cache_len
    assert torch.equal(key_cache[:, :, -1], key[:, :, 0]) and torch.equal(value_cache[:, :, -1], value[:, :, 0])
    exact = _exact(query, key_cache, value_cache, cache_len, None, head_dim ** -0.5, None)
    assert_close(out, exact, TOLERANCE[torch.float32], "output")
    # one token more than the cache holds: nothing written or read past its end, the new token attended from
    # registers
    kept = key_cache.clone(), value_cache.clone()
    out = decode_attention(query, 2 * key, value, key_cache, value_cache, length)
    assert torch.equal(key_cache, kept[0]) and torch.equal(value_cache, kept[1])
    keys = torch.cat([key_cache, 2 * key], dim=2)
    values = torch.cat([value_cache, value], dim=2)
    assert_close(out, _exact(query, keys, values, cache_len + 1, None, head_dim ** -0.5, None),
                 TOLERANCE[torch.float32], "output past the cache's end")


def _norm_rope(batch, head_dim, rotary, offset, device, dtype):
    """(q_weight, k_weight, cos, sin `[B, 1, R]` as Hugging Face's rotary embedding builds them, eps, offset)."""
    angles = torch.rand(batch, 1, rotary // 2, device=device) * 6.0
    angles = torch.cat([angles, angles], dim=-1)
    weights = [(torch.randn(head_dim, device=device) * 0.3 + 1.0 - offset).to(dtype) for _ in range(2)]
    return (*weights, angles.cos().to(dtype), angles.sin().to(dtype), 1e-6, offset)


def _normed_heads(query, key, norm_rope):
    """`qk_norm_rope` (the separate launch) of the projections' query and key."""
    q_weight, k_weight, cos, sin, eps, offset = norm_rope
    return qk_norm_rope(query, key, q_weight, k_weight, cos, sin, eps, offset=offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,rotary,offset",
                         [(4, 2, 32, 32, 0.0), (6, 1, 24, 8, 1.0)], ids=["full_rotary", "partial_rotary"])
def test_decode_attention_norm_rope(q_heads, kv_heads, head_dim, rotary, offset, dtype, device):
    """q/k norm and RoPE inside the launch against `qk_norm_rope`'s launch before it: the same cache (the new key
    normed and rotated), the same output, over steps that cross splits; and against the float64 reference."""
    block = position_block(head_dim)
    batch, cache_len, first = 2, 2 * block + 8, 2 * block - 1
    query, key, value, key_cache, value_cache, length = _inputs(
        batch, q_heads, kv_heads, head_dim, cache_len, first, dtype, device)
    two_launch = key_cache.clone(), value_cache.clone(), length.clone()
    mask = _mask("boolean", batch, cache_len, device, dtype)
    for step in range(2):
        norm_rope = _norm_rope(batch, head_dim, rotary, offset, device, dtype)
        out = decode_attention(query, key, value, key_cache, value_cache, length, mask, 0.3, None, norm_rope)
        normed_q, normed_k = _normed_heads(query, key, norm_rope)
        expected = decode_attention(normed_q, normed_k, value, *two_launch, mask, 0.3)
        position = first + step
        assert_close(key_cache[:, :, position], two_launch[0][:, :, position], TOLERANCE[dtype], "the new key")
        assert torch.equal(value_cache, two_launch[1])
        assert_close(out, expected, TOLERANCE[dtype], f"output at step {step}")
        q64, k64 = _normed_heads(query.double(), key.double(), tuple(
            t.double() if torch.is_tensor(t) else t for t in norm_rope))
        exact = _exact(q64, torch.cat([key_cache[:, :, :position].double(), k64], dim=2), value_cache.double(),
                       position + 1, mask, 0.3, None)
        assert_close(out, exact, TOLERANCE[dtype], f"output against float64 at step {step}")
        query, key, value = (torch.randn_like(t) for t in (query, key, value))


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(32, 8, 128), (24, 4, 256)], ids=["qwen3_8b", "qwen3_5_27b"])
@pytest.mark.parametrize("batch,cache_len", [(1, 256), (2, 4160)])
def test_decode_attention_model_shapes(q_heads, kv_heads, head_dim, batch, cache_len):
    """bf16 at the W3 models' attention shapes, compiled: one split and many, a boolean mask and the gate."""
    dtype = torch.bfloat16
    first = cache_len - 2
    query, key, value, key_cache, value_cache, length = _inputs(
        batch, q_heads, kv_heads, head_dim, cache_len, first, dtype, "cuda")
    mask = _mask("boolean", batch, cache_len, "cuda", dtype)
    gate = torch.randn(batch, 1, q_heads, head_dim, device="cuda", dtype=dtype)
    for step in range(2):
        out = decode_attention(query, key, value, key_cache, value_cache, length, mask, head_dim ** -0.5, gate)
        exact = _exact(query, key_cache, value_cache, first + step + 1, mask, head_dim ** -0.5, gate)
        assert_close(out, exact, TOLERANCE[dtype], f"output at step {step}")
    assert int(length) == cache_len


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,rotary,offset,gated",
                         [(32, 8, 128, 128, 0.0, False), (24, 4, 256, 64, 1.0, True)], ids=["qwen3_8b", "qwen3_5_27b"])
@pytest.mark.parametrize("batch,cache_len", [(1, 256), (2, 4160)])
def test_decode_attention_norm_rope_model_shapes(q_heads, kv_heads, head_dim, rotary, offset, gated, batch,
                                                 cache_len):
    """bf16, compiled, at the W3 models' shapes: q/k norm and RoPE in the launch against `qk_norm_rope` before it."""
    dtype = torch.bfloat16
    first = cache_len - 2
    query, key, value, key_cache, value_cache, length = _inputs(
        batch, q_heads, kv_heads, head_dim, cache_len, first, dtype, "cuda")
    two_launch = key_cache.clone(), value_cache.clone(), length.clone()
    mask = _mask("boolean", batch, cache_len, "cuda", dtype)
    gate = torch.randn(batch, 1, q_heads, head_dim, device="cuda", dtype=dtype) if gated else None
    for step in range(2):
        norm_rope = _norm_rope(batch, head_dim, rotary, offset, "cuda", dtype)
        out = decode_attention(query, key, value, key_cache, value_cache, length, mask, head_dim ** -0.5, gate,
                               norm_rope)
        expected = decode_attention(*_normed_heads(query, key, norm_rope), value, *two_launch, mask,
                                    head_dim ** -0.5, gate)
        assert_close(key_cache, two_launch[0], TOLERANCE[dtype], f"cache at step {step}")
        assert_close(out, expected, TOLERANCE[dtype], f"output at step {step}")
    assert int(length) == cache_len


@pytest.mark.parametrize("change,message", [
    (dict(query=(1, 4, 2, 16)), "one new token"),
    (dict(key=(1, 2, 1, 8)), "key has shape"),
    (dict(query=(1, 3, 1, 16)), "not a multiple"),
    (dict(mask=(1, 1, 1, 5)), "mask has shape"),
    (dict(gate=(1, 1, 4, 8)), "gate has shape"),
])
def test_decode_attention_refuses_bad_shapes(change, message, device):
    shapes = dict(query=(1, 4, 1, 16), key=(1, 2, 1, 16), mask=None, gate=None) | change
    query = torch.randn(*shapes["query"], device=device)
    key = torch.randn(*shapes["key"], device=device)
    caches = [torch.randn(1, 2, 8, 16, device=device) for _ in range(2)]
    mask = None if shapes["mask"] is None else torch.ones(*shapes["mask"], dtype=torch.bool, device=device)
    gate = None if shapes["gate"] is None else torch.randn(*shapes["gate"], device=device)
    with pytest.raises(ValueError, match=message):
        decode_attention(query, key, key.clone(), *caches, torch.tensor(3, device=device), mask, None, gate)
