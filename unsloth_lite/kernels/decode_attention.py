"""Attention of one new token per sequence over a static KV cache (decoding), the cache's update and the output
gate in the same launch.

For query heads h reading KV head h // G (G = Hq / Hkv: the KV heads are never repeated), the new token's key and
value k, v `[B, Hkv, D]`, the cache K, V `[B, Hkv, S, D]` holding positions [0, p), and p its length, a device
counter (`StaticLayer.cumulative_length`) read by the kernel, so that a CUDA graph replays the step unchanged:

    K[:, :, p] = k;   V[:, :, p] = v;   p ← p + 1                   (as `StaticLayer.update`)
    s_j = scale · q_h · K_j  (+ mask[b, j] where additive)         j ≤ p, where mask[b, j] attends (boolean)
    o_h = Σ_j softmax_j(s) V_j  (· sigmoid(gate_h) where gated)      fp32 sums, written in q's dtype

With `norm_rope` (Qwen3's and Qwen3.5's q/k norms), the query and the new key arrive as the projections wrote
them and the kernel first applies what `qk_norm_rope` would, per head vector x of q and k, in fp32:

    n = x / sqrt(mean(x²) + eps) · (offset + w);   y_d = n_d c_d + n_{d+R/2} (−s_d)  for d < R/2,
    y_d = n_d c_d + n_{d−R/2} s_d  for R/2 ≤ d < R,   y_d = n_d  past the rotary width R

(cos c and sin s of the token's position, read in full width), each rounded to q's dtype as the separate launch
stores it. One launch fewer a full-attention layer.

It replaces, in each full-attention layer of a decoding step, the cache update (`index_copy_` twice, with the
position's arithmetic), SDPA over the whole cache length with its mask, and the gate's own launch: one launch
that reads only the positions up to p. Inference only (no autograd).

Programs (b, KV head, split): split i takes positions [i · CHUNK, (i + 1) · CHUNK) ∩ [0, p) of the cache for the
head's G queries, padded to 16 rows of a tensor-core product (s = Q Kᵀ, then P V), with the softmax online in base
2 (running maximum m, sum l, unnormalised output a). Split 0 also writes the new token into the cache and takes
its score from registers, so no program reads position p from memory while it is being written. With several
splits, each stores (m, l, a) to an fp32 scratch slot and counts itself on its head's arrival counter; the last
to arrive combines the slots in split order (the same bits whichever arrives last):

    M = max_i m_i,   o = Σ_i 2^(m_i − M) a_i / Σ_i 2^(m_i − M) l_i

Every program also counts itself on one counter of the launch; the last advances p, after every program has
read it. The counters are left at 0 for the next launch (no memset).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from unsloth_lite.kernels.matvec_epilogue import _arrival_counters
from unsloth_lite.kernels.qk_norm_rope import qk_norm_rope_reference
from unsloth_lite.kernels.utils import (
    INTERPRET,
    check_float,
    check_kernel_device,
    empty,
    multiprocessor_count,
    pdl_launch,
)

# Cache positions of one step of a program's loop: a tile of keys and values [BLOCK_L, D] read at once, half as
# many positions for heads over 128 wide (the same bytes a step).
BLOCK_L = 16 if INTERPRET else 64
# Query heads of one KV head as the rows of the tensor-core products: at least 16 (tl.dot's least M).
MIN_GROUP_ROWS = 16
# Splits of the cache positions: enough programs for two per SM (the interpreter: few programs, so that the
# tests' short caches still take several splits).
PROGRAMS_PER_SM = 2
MASK_NONE, MASK_BOOLEAN, MASK_ADDITIVE = 0, 1, 2


def position_block(head_dim: int) -> int:
    """Cache positions a step of a program's loop reads (`BLOCK_L`)."""
    return BLOCK_L if head_dim <= 128 or INTERPRET else BLOCK_L // 2


def decode_splits(batch: int, kv_heads: int, cache_len: int, head_dim: int, device: torch.device) -> tuple[int, int]:
    """(splits, positions a split) for a cache of `cache_len` positions: the cache's full length, not its
    current one, so that a captured step keeps its grid while the cache fills."""
    block = position_block(head_dim)
    blocks = triton.cdiv(cache_len, block)
    if device.type == "cuda" and not INTERPRET:
        wanted = triton.cdiv(PROGRAMS_PER_SM * multiprocessor_count(device.index or 0), batch * kv_heads)
    else:
        wanted = triton.cdiv(blocks, 2)
    splits = max(1, min(blocks, wanted))
    chunk = triton.cdiv(blocks, splits) * block
    return triton.cdiv(cache_len, chunk), chunk


@triton.jit
def _raised_maximum(m_i, candidate):
    """(m, m with -inf as 0, the factor 2^(m_old − m) of what was summed under m_old) once `candidate` `[G]` joins
    the running maximum: no -inf − -inf while every score so far is masked."""
    m_new = tl.maximum(m_i, candidate)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_safe, tl.exp2(m_i - m_safe)


@triton.jit
def _online_softmax_step(m_i, l_i, acc, scores, values, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """(m, l, a) after the scores `[G, L]` (base 2, -inf where a position is not attended) and the values
    `[L, D]` of a tile. An all-masked tile leaves them as they are (no -inf − -inf)."""
    m_new, m_safe, alpha = _raised_maximum(m_i, tl.max(scores, axis=1))
    probs = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(probs, axis=1)
    if DOT_F32:
        pv = tl.dot(probs, values.to(tl.float32), input_precision="ieee" if IEEE else "tf32")
    else:
        pv = tl.dot(probs.to(values.dtype), values)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _base2(additive):
    """An additive mask's values in the base-2 scores, Hugging Face's most negative float kept finite."""
    return tl.maximum(additive.to(tl.float32), -1e30) * 1.4426950408889634


@triton.jit
def _normed_rotated(rows_ptr, d, mask_rows, head_dim, weight_ptr, cos_ptr, sin_ptr, eps, offset, rotary):
    """`qk_norm_rope`'s forward of the head vectors at `rows_ptr` `[R, 1]` (elements `d` `[1, D]` along each), in
    fp32: the RMS norm with weight offset + w, then the rotation of the first `rotary` elements by the token's
    cos and sin `[rotary]` (the partner of element d, d ± rotary / 2, read as its own load)."""
    mask_d = d < head_dim
    x = tl.load(rows_ptr + d, mask=mask_rows & mask_d, other=0.0).to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / head_dim + eps)
    normed = x * inverse_rms[:, None] * (tl.load(weight_ptr + d, mask=mask_d, other=0.0).to(tl.float32) + offset)
    half = rotary // 2
    rotated = d < rotary
    partner = tl.where(d < half, d + half, d - half)
    partner_x = tl.load(rows_ptr + partner, mask=mask_rows & rotated, other=0.0).to(tl.float32)
    partner_w = tl.load(weight_ptr + partner, mask=rotated, other=0.0).to(tl.float32) + offset
    signed_partner = partner_x * inverse_rms[:, None] * partner_w
    signed_partner = tl.where(d < half, -signed_partner, signed_partner)
    c = tl.load(cos_ptr + d, mask=rotated, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + d, mask=rotated, other=0.0).to(tl.float32)
    return tl.where(rotated, normed * c + signed_partner * s, normed)


@triton.jit
def _decode_attention_kernel(
    q_ptr, q_batch_stride, q_head_stride,
    k_ptr, k_batch_stride, k_head_stride,
    v_ptr, v_batch_stride, v_head_stride,
    key_cache_ptr, kc_batch_stride, kc_head_stride, kc_pos_stride,
    value_cache_ptr, vc_batch_stride, vc_head_stride, vc_pos_stride,
    length_ptr, mask_ptr, mask_batch_stride, mask_pos_stride,
    gate_ptr, gate_batch_stride, gate_head_stride,
    out_ptr, out_batch_stride, out_head_stride,
    scratch_ptr, arrivals_ptr,
    q_weight_ptr, k_weight_ptr, cos_ptr, cos_batch_stride, sin_ptr, sin_batch_stride, eps, offset, rotary,
    n_kv_heads, group, cache_len, head_dim, scale_log2,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, CHUNK: tl.constexpr,
    SPLITS: tl.constexpr, MASK: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr, NORM_ROPE: tl.constexpr,
):
    """PDL: the cache's length (advanced by this kernel alone, a step before) is read before `gdc_wait`; the
    query, the new key and value, the mask and the gate after it. NORM_ROPE: q and the new key normed and
    rotated first (`_normed_rotated`), rounded to their dtypes."""
    program = tl.program_id(0)
    split = tl.program_id(1)
    batch = (program // n_kv_heads).to(tl.int64)
    kv_head = program % n_kv_heads
    position = tl.load(length_ptr)  # p: the cache's length before this token
    if PDL:
        gdc_wait()
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    mask_g = g < group
    mask_d = d < head_dim
    heads = kv_head * group + g
    if NORM_ROPE:
        q = _normed_rotated(q_ptr + batch * q_batch_stride + heads[:, None] * q_head_stride, d[None, :],
                            mask_g[:, None], head_dim, q_weight_ptr, cos_ptr + batch * cos_batch_stride,
                            sin_ptr + batch * sin_batch_stride, eps, offset, rotary).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + batch * q_batch_stride + heads[:, None] * q_head_stride + d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    key_cache = key_cache_ptr + batch * kc_batch_stride + kv_head * kc_head_stride
    value_cache = value_cache_ptr + batch * vc_batch_stride + kv_head * vc_head_stride
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * CHUNK
    end = tl.minimum(tl.minimum(start + CHUNK, position), cache_len)  # a full cache: never past its end
    for first in range(start, end, BLOCK_L):
        positions = first + tl.arange(0, BLOCK_L)
        valid = positions < end
        mask_tile = valid[:, None] & mask_d[None, :]
        keys = tl.load(key_cache + positions[:, None] * kc_pos_stride + d[None, :], mask=mask_tile, other=0.0)
        if DOT_F32:
            scores = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee" if IEEE else "tf32")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = scores * scale_log2
        attends = valid
        if MASK == 1:
            allowed = tl.load(mask_ptr + batch * mask_batch_stride + positions * mask_pos_stride, mask=valid, other=0)
            attends = attends & (allowed != 0)
        if MASK == 2:
            additive = tl.load(mask_ptr + batch * mask_batch_stride + positions * mask_pos_stride, mask=valid,
                               other=0.0)
            scores += _base2(additive)[None, :]
        scores = tl.where(attends[None, :], scores, float("-inf"))
        values = tl.load(value_cache + positions[:, None] * vc_pos_stride + d[None, :], mask=mask_tile, other=0.0)
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, scores, values, DOT_F32, IEEE)
    if split == 0:  # the new token: written into the cache, its score from registers
        if NORM_ROPE:
            new_key = tl.reshape(_normed_rotated(
                k_ptr + batch * k_batch_stride + kv_head * k_head_stride + tl.zeros([1, 1], tl.int32), d[None, :],
                tl.full([1, 1], True, tl.int1), head_dim, k_weight_ptr, cos_ptr + batch * cos_batch_stride,
                sin_ptr + batch * sin_batch_stride, eps, offset, rotary), (BLOCK_D,)).to(k_ptr.dtype.element_ty)
        else:
            new_key = tl.load(k_ptr + batch * k_batch_stride + kv_head * k_head_stride + d, mask=mask_d, other=0.0)
        new_value = tl.load(v_ptr + batch * v_batch_stride + kv_head * v_head_stride + d, mask=mask_d, other=0.0)
        inside = mask_d & ((d * 0 + position) < cache_len)  # a full cache keeps its last positions
        tl.store(key_cache + position * kc_pos_stride + d, new_key.to(key_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(value_cache + position * vc_pos_stride + d, new_value.to(value_cache_ptr.dtype.element_ty),
                 mask=inside)
        score = tl.sum(q.to(tl.float32) * new_key.to(tl.float32)[None, :], axis=1) * scale_log2
        in_cache = position < cache_len
        new_mask = mask_ptr + batch * mask_batch_stride + position * mask_pos_stride
        if MASK == 1:
            score = tl.where(tl.load(new_mask, mask=in_cache, other=1) != 0, score, float("-inf"))
        if MASK == 2:
            score += _base2(tl.load(new_mask, mask=in_cache, other=0.0))
        m_i, m_safe, alpha = _raised_maximum(m_i, score)
        prob = tl.exp2(score - m_safe)
        l_i = l_i * alpha + prob
        acc = acc * alpha[:, None] + prob[:, None] * new_value.to(tl.float32)[None, :]
    if PDL:
        gdc_launch_dependents()
    finish = True
    if SPLITS > 1:
        acc, l_i, finish = _combine_splits(acc, m_i, l_i, g, d, scratch_ptr, arrivals_ptr, program, split,
                                           BLOCK_G, BLOCK_D, SPLITS)
    if finish:
        out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
        mask_out = mask_g[:, None] & mask_d[None, :]
        if GATED:
            gate = tl.load(gate_ptr + batch * gate_batch_stride + heads[:, None] * gate_head_stride + d[None, :],
                           mask=mask_out, other=0.0).to(tl.float32)
            out = out * tl.sigmoid(gate)
        tl.store(out_ptr + batch * out_batch_stride + heads[:, None] * out_head_stride + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_out)
    _advance_length(length_ptr, position, arrivals_ptr + tl.num_programs(0))


@triton.jit
def _combine_splits(acc, m_i, l_i, g, d, scratch_ptr, arrivals_ptr, program, split,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """(a, l, whether this program finishes the head): each split's (m, l, a) stored in its scratch slot
    `[BLOCK_G, BLOCK_D + 2]`; the last of the head's splits to arrive combines them all in split order."""
    SLOT: tl.constexpr = BLOCK_G * (BLOCK_D + 2)
    slot = scratch_ptr + (program * SPLITS + split).to(tl.int64) * SLOT
    tl.store(slot + g[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(slot + BLOCK_G * BLOCK_D + g, m_i)
    tl.store(slot + BLOCK_G * (BLOCK_D + 1) + g, l_i)
    tl.debug_barrier()  # every thread's stores before the arrival (released at GPU scope by the atomic)
    arrived = tl.atomic_add(arrivals_ptr + program, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLITS - 1
    total = tl.zeros_like(acc)
    total_l = tl.zeros_like(l_i)
    if last:
        head = scratch_ptr + (program * SPLITS).to(tl.int64) * SLOT
        m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for s in range(0, SPLITS):  # .cg: from L2, where the other SMs' stores are
            m_max = tl.maximum(m_max, tl.load(head + s * SLOT + BLOCK_G * BLOCK_D + g, cache_modifier=".cg"))
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        for s in range(0, SPLITS):
            weight = tl.exp2(tl.load(head + s * SLOT + BLOCK_G * BLOCK_D + g, cache_modifier=".cg") - m_safe)
            total_l += weight * tl.load(head + s * SLOT + BLOCK_G * (BLOCK_D + 1) + g, cache_modifier=".cg")
            part = tl.load(head + s * SLOT + g[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
            total += weight[:, None] * part
        tl.atomic_xchg(arrivals_ptr + program, 0, sem="relaxed", scope="gpu")
    return total, total_l, last


@triton.jit
def _advance_length(length_ptr, position, counter_ptr):
    """p + 1 into the cache's length, by the last program of the launch to arrive: every program has read p."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(length_ptr, position + 1)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def _check_args(query, key, value, key_cache, value_cache, cache_length, mask, gate):
    for name, t in (("query", query), ("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        check_float(name, t)
        check_kernel_device(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D; got shape {tuple(t.shape)}")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    if query.dtype == torch.float64:
        raise ValueError("decode_attention computes in fp32; query has dtype float64 (use the reference)")
    if q_len != 1:
        raise ValueError(f"decode_attention takes one new token per sequence; query has {q_len}")
    expected = (batch, kv_heads, 1, head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {expected}")
    cache_shape = tuple(key_cache.shape)
    if tuple(value_cache.shape) != cache_shape or cache_shape[0] != batch or cache_shape[-1] != head_dim:
        raise ValueError(f"caches of shapes {tuple(key_cache.shape)} and {tuple(value_cache.shape)} do not fit "
                         f"a query {tuple(query.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if any(t.stride(-1) != 1 for t in (key_cache, value_cache)):
        raise ValueError("the caches' last dimension must be contiguous")
    if cache_length.dtype not in (torch.int64, torch.int32) or cache_length.numel() != 1:
        raise ValueError(f"cache_length must be one int32 or int64 element; got {cache_length.dtype} "
                         f"{tuple(cache_length.shape)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError("decode_attention is inference only (no autograd); run it under torch.no_grad()")
    if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[-1] < key_cache.shape[2]):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected [B or 1, 1, Q, ≥{key_cache.shape[2]}]")
    if gate is not None and tuple(gate.shape) != (batch, 1, q_heads, head_dim):
        raise ValueError(f"gate has shape {tuple(gate.shape)}; expected {(batch, 1, q_heads, head_dim)}")


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_length: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    gate: torch.Tensor | None = None,
    norm_rope: tuple | None = None,
) -> torch.Tensor:
    """Attention of query `[B, Hq, 1, D]` over the cache after writing key, value `[B, Hkv, 1, D]` at position
    `cache_length` (a one-element device tensor, then advanced by one) of key_cache, value_cache `[B, Hkv, S, D]`
    (updated in place); mask None (positions up to the new token's attend) or `[B or 1, 1, Q, ≥S]` as Hugging
    Face builds it (its last query row read: boolean, True attends, or additive); gate `[B, 1, Hq, D]`, where
    given, multiplies the output by its sigmoid; norm_rope, where given, (q_weight `[D]`, k_weight `[D]`, cos,
    sin `[B, 1, R]` or `[B, R]`, eps, offset): query and key normed and rotated first, as `qk_norm_rope` does.
    Returns `[B, 1, Hq, D]` in query's dtype."""
    _check_args(query, key, value, key_cache, value_cache, cache_length, mask, gate)
    if norm_rope is not None:
        norm_rope = _norm_rope_args(norm_rope, query)
    batch, q_heads, _, head_dim = query.shape
    kv_heads, cache_len = key_cache.shape[1], key_cache.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = empty((batch, 1, q_heads, head_dim), query.dtype, query.device)
    group = q_heads // kv_heads
    block_g = max(MIN_GROUP_ROWS, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits, chunk = decode_splits(batch, kv_heads, cache_len, head_dim, query.device)
    programs = batch * kv_heads
    arrivals = _arrival_counters(query.device, programs + 1)
    scratch = empty((programs, splits, block_g, block_d + 2), torch.float32, query.device) if splits > 1 else out
    mask_kind, mask_rows = MASK_NONE, out
    if mask is not None:
        mask_rows = mask[:, 0, -1].expand(batch, -1)
        if mask.dtype == torch.bool:
            mask_kind, mask_rows = MASK_BOOLEAN, mask_rows.view(torch.uint8)
        else:
            mask_kind = MASK_ADDITIVE
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    gate_arg = gate if gate is not None else out
    _decode_attention_kernel[(programs, splits)](
        query, query.stride(0), query.stride(1),
        key, key.stride(0), key.stride(1),
        value, value.stride(0), value.stride(1),
        key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        cache_length, mask_rows, mask_rows.stride(0) if mask is not None else 0,
        mask_rows.stride(-1) if mask is not None else 0,
        gate_arg, gate_arg.stride(0), gate_arg.stride(2),
        out, out.stride(0), out.stride(2),
        scratch, arrivals,
        *(norm_rope if norm_rope is not None else (out, out, out, 0, out, 0, 0.0, 0.0, 0)),
        kv_heads, group, cache_len, head_dim, scale * 1.4426950408889634,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_L=position_block(head_dim), CHUNK=chunk, SPLITS=splits, MASK=mask_kind,
        GATED=gate is not None, DOT_F32=INTERPRET or query.dtype == torch.float32,
        IEEE=query.dtype == torch.float32, NORM_ROPE=norm_rope is not None, num_warps=4, **pdl_launch(query.device),
    )
    return out


def _norm_rope_args(norm_rope, query: torch.Tensor) -> tuple:
    """The kernel's arguments for `norm_rope` = (q_weight, k_weight, cos, sin, eps, offset), checked against the
    query `[B, Hq, 1, D]`."""
    q_weight, k_weight, cos, sin, eps, offset = norm_rope
    batch, head_dim = query.shape[0], query.shape[-1]
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(weight.shape) != (head_dim,) or weight.device != query.device:
            raise ValueError(f"norm_rope's {name} must be [{head_dim}] on {query.device}; got {tuple(weight.shape)}")
    rotary = cos.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        rows = t.reshape(t.shape[0], -1) if t.dim() == 3 and t.shape[1] == 1 else t
        if rows.dim() != 2 or rows.shape != (batch, rotary) or rows.stride(-1) != 1 or t.device != query.device:
            raise ValueError(f"norm_rope's {name} must be [B, 1, R] or [B, R] for one token, contiguous, "
                             f"on {query.device}; got {tuple(t.shape)}")
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(f"the rotary width {rotary} must be even and at most the head size {head_dim}")
    cos, sin = (t.reshape(batch, rotary) for t in (cos, sin))
    return (q_weight, k_weight, cos, cos.stride(0), sin, sin.stride(0), float(eps), float(offset), rotary)


def decode_attention_reference(
    query, key, value, key_cache, value_cache, cache_length, mask=None, scale=None, gate=None, norm_rope=None,
) -> torch.Tensor:
    """Plain-PyTorch `decode_attention` (the same in-place updates; reads the length on the host): query and key
    normed and rotated (`qk_norm_rope_reference`) where `norm_rope` is given, the cache written at p, then softmax
    attention in fp32 (float64 for float64) over positions [0, p] under the mask."""
    if norm_rope is not None:
        q_weight, k_weight, cos, sin, eps, offset = norm_rope
        query, key = qk_norm_rope_reference(query, key, q_weight, k_weight, cos.reshape(cos.shape[0], 1, -1),
                                            sin.reshape(sin.shape[0], 1, -1), eps, offset)
    batch, q_heads, _, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    position = int(cache_length)
    key_cache[:, :, position] = key[:, :, 0]
    value_cache[:, :, position] = value[:, :, 0]
    cache_length += 1
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys = key_cache[:, :, : position + 1].to(compute)
    values = value_cache[:, :, : position + 1].to(compute)
    grouped = query.to(compute).reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = grouped @ keys.transpose(-1, -2) * scale  # [B, Hkv, G, p + 1]
    if mask is not None:
        rows = mask[:, 0, -1, : position + 1].expand(batch, -1)[:, None, None, :]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~rows, float("-inf"))
        else:
            scores = scores + rows.to(compute)
    out = (torch.softmax(scores, dim=-1) @ values).reshape(batch, 1, q_heads, head_dim)
    if gate is not None:
        out = out * torch.sigmoid(gate.to(compute))
    return out.to(query.dtype)
