"""Decoding: the projections and the attention of a forward over a few rows (one new token per sequence), as
Hugging Face's `generate` runs them after the prompt.

A forward without gradients over at most `MAX_ROWS` rows reads every weight once for a handful of products,
so its speed is the bytes read and the kernels launched: each NF4 base goes through `nf4_matvec` (packed weight
read once, dequantised in registers, LoRA unmerged), never dequantised to a dense copy first, and the first
products x Aᵀ of the adapters on one input (q, k and v; gate and up) come from one `lora_down_rows` launch.
Attention of one new token over the cache groups the query heads that share a KV head (`[B, Hkv, G, D]`: the G
heads take the place of query positions), so the KV heads are never repeated; over a static cache's layer it can
be one `decode_attention` launch with the cache's update and the output gate (`DECODE_ATTENTION`). The norms, RoPE
and gates stay on their fused kernels, which take one token as they take many.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers.cache_utils import StaticLayer

from unsloth_lite.kernels.decode_attention import decode_attention
from unsloth_lite.kernels.lora import LoRAProjection
from unsloth_lite.kernels.lora_down import MAX_ROWS, lora_down_rows
from unsloth_lite.kernels.nf4_gated_matvec import gated_matvec_supported, nf4_gated_matvec
from unsloth_lite.kernels.nf4_grouped_matvec import grouped_matvec_supported, nf4_grouped_matvec
from unsloth_lite.kernels.nf4_matvec import nf4_matvec
from unsloth_lite.kernels.nf4_matvec_reference import nf4_matvec_reference
from unsloth_lite.kernels.screened_logits import MAX_EXEMPT, int8_rows, screened_logits
from unsloth_lite.kernels.swiglu import swiglu, swiglu_reference
from unsloth_lite.kernels.utils import INTERPRET

# Five fused decoding launches, on together since measured as a set (docs/benchmarks.md, "W3 with the fused
# decoding launches"; an H100, 2026-12-05, Qwen3-8B shape without adapters): 212.5 -> 287.9 tokens/s, the captured
# step 4.63 -> 3.39 ms, with `kernels.utils.DECODE_PDL`. Their GPU tests (32 bf16 greedy tokens through the captured
# step, each alone and all at once, Qwen3 and Qwen3.5) passed on the same machine.
# The MLP's gate and up projections and its SwiGLU in one launch (`nf4_gated_matvec`) where both are NF4: the same
# bits as the three launches, x read once for both weights, on the word kernel's walk where
# `nf4_matvec.WORD_KERNEL` is on.
GATED_MATVEC = True
# The projections of one input (q, k, v; the DeltaNet's qkv, z, b, a) in one launch (`nf4_grouped_matvec`) where
# all are NF4: each the bits of its own product at the widest one's tile, the small ones beside the large.
GROUPED_MATVEC = True
# One new token's attention over a static cache's layer in one launch (`decode_attention`): the cache's update
# (Hugging Face's two `index_copy_` and the position's arithmetic), the attention over the positions filled so
# far (SDPA reads the cache's whole length, with its mask) and Qwen3.5's output gate.
DECODE_ATTENTION = True
# The residual stream's two adds of each decoder layer in a decoding step (Hugging Face's `residual + ...`) done in
# the epilogues of the token mixer's and the MLP's output projections (`decoder_layer.py`): two launches fewer a
# layer, the sum rounded once.
RESIDUAL_IN_PRODUCTS = True
# A decoder layer's two RMSNorms each in one launch with the first products x Aᵀ of the adapters of the
# projections that read its output (q/k/v or the DeltaNet's four; gate and up: `rms_norm_lora_down_rows`), instead
# of a norm and a `lora_down_rows` launch; without adapters the same kernel's norm alone, which, unlike the
# training path's, can be a programmatic dependent launch (`decoder_layer.py`); measured in the set above
# without adapters (with them: one launch instead of two, tested, not yet timed). The output projections' first
# products from the attention and gate-and-up launches (their programs' shares summed in the launch) were measured
# slower than their own `lora_down_rows` launches and removed (docs/design.md).
NORM_FIRST_PRODUCTS = True
# A full-attention layer's q/k norm and RoPE (Qwen3, Qwen3.5) inside its `decode_attention` launch (the query and
# the new key normed and rotated as they are read) instead of a `qk_norm_rope` launch before it. On since measured
# with `SCREENED_LM_HEAD` and the loop's one-launch greedy step (docs/benchmarks.md, "W3 with the one-launch greedy
# step"; an H100, Qwen3-8B shape): the two take the captured step 3.356 -> 3.266 ms, 291 -> 305 tokens/s with it.
NORM_ROPE_IN_ATTENTION = True
# A greedy step's logits from the dense lm_head screened by an int8 copy of it (`screened_logits`: the head read at
# half the bytes, exact products only where the argmax can lie), where the decoding loop takes only their argmax
# (`greedy_logits`). The copy is kept on the head (0.62 GB at the Qwen3-8B shape) until the decoding cache is
# released. On since measured with `NORM_ROPE_IN_ATTENTION` (above).
SCREENED_LM_HEAD = True
# The MLP's down projection's adapter takes its first product t = h Aᵀ from the gate-and-up launch, which writes h:
# each program adds its features' share into one of DOWN_SHARE_STRIPES fp32 stripes (`nf4_gated_matvec`'s
# `down_shares`), which the norm's launch before it sets to 0 (`rms_norm_lora_down_rows`' `zeroed`), and the down
# projection sums the stripes in its epilogue, instead of a `lora_down_rows` launch between the two (4.2 us a
# layer at the Qwen3-8B shape). The adds are relaxed fp32 atomics: t's last bits follow the programs' order.
# Measured on an H100 (docs/benchmarks.md, "The output projections' first products as shares"): the Qwen3-8B
# shape's step with adapters 3.619 -> 3.538 ms, the 27B's 9.699 -> 9.668: on. The same for o_proj, each KV head's
# share written by the attention's launch, took the 8B's to 3.713 ms (the attention is on the step's critical
# path with 8 programs a token, the `lora_down` launch it replaced spreads over 16 x 4) and was removed.
MLP_SHARES = True
# Stripes of the down shares: program i adds into stripe i mod S, so that ~100 programs (not 1,536) add into an
# address, and the down projection's epilogue reads S parts of t.
DOWN_SHARE_STRIPES = 16
# A Gated DeltaNet layer's token step after its convolution in one launch (`delta_rule_gated_step`: the gates,
# the delta-rule step and the gated RMSNorm of each head), instead of three. Correct on the GPU (the tests above;
# on in that run, where the Qwen3-8B shape has no DeltaNet layer); 1.5% slower at the Qwen3.5-27B shape (H100,
# docs/benchmarks.md): off.
GATED_DELTANET_STEP = False
# Attention implementations whose mask (None, or 4-D boolean or additive) SDPA reads as they do.
GROUPED_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


_GREEDY_LOGITS = threading.local()
INT8_HEAD_ATTRIBUTE = "_unsloth_lite_int8_rows"


@contextlib.contextmanager
def greedy_logits(end_ids: torch.Tensor | None = None):
    """Within: the forwards' logits feed only a greedy argmax (the decoding loop's `greedy_token`), which may mask
    `end_ids` (1-D int64, the end-of-sequence ids, within `min_new_tokens`), so that with `SCREENED_LM_HEAD` they
    may be `screened_logits` with those rows exempt (at most `MAX_EXEMPT` of them)."""
    previous = getattr(_GREEDY_LOGITS, "state", None)
    _GREEDY_LOGITS.state = (end_ids,) if end_ids is None or end_ids.numel() <= MAX_EXEMPT else None
    try:
        yield
    finally:
        _GREEDY_LOGITS.state = previous


def screens_logits() -> bool:
    """Whether the forwards now running may return `screened_logits` (`greedy_logits` and `SCREENED_LM_HEAD`)."""
    return SCREENED_LM_HEAD and getattr(_GREEDY_LOGITS, "state", None) is not None


def screened_head_logits(lm_head, hidden: torch.Tensor) -> torch.Tensor | None:
    """`screened_logits` of the rows `hidden` through a dense `lm_head` without bias where `screens_logits()` and
    the rows are decoding rows on the kernels' device, else None. The head's int8 copy is made once and kept on
    it (`INT8_HEAD_ATTRIBUTE`, dropped with the decoding cache) while its weight is unchanged, with a buffer of
    the exempt ids that a captured step reads: each forward outside a capture (a request's prompt comes first)
    copies `greedy_logits`' end ids into it."""
    weight = getattr(lm_head, "weight", None)
    if not screens_logits() or type(lm_head) is not torch.nn.Linear or lm_head.bias is not None:
        return None
    if not is_decode_rows(hidden) or not (hidden.is_cuda or INTERPRET) or hidden.dtype != weight.dtype:
        return None
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not weight.is_contiguous():
        return None
    key = (weight.data_ptr(), weight._version)
    kept = lm_head.__dict__.get(INT8_HEAD_ATTRIBUTE)
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if kept is None or kept[0] != key:
        if capturing:
            return None  # made outside a capture, on the step before
        exempt = torch.empty(MAX_EXEMPT, dtype=torch.int64, device=weight.device)
        kept = lm_head.__dict__[INT8_HEAD_ATTRIBUTE] = (key, *int8_rows(weight), exempt)
    exempt = kept[4]
    if not capturing:
        end_ids = _GREEDY_LOGITS.state[0]
        exempt.fill_(-1)
        if end_ids is not None:
            exempt[: end_ids.numel()].copy_(end_ids.reshape(-1))
    return screened_logits(hidden, weight, kept[1], kept[2], exempt, error_norm=kept[3])


def is_decode_rows(x: torch.Tensor) -> bool:
    """A forward without gradients over 1 to MAX_ROWS rows (tokens of all sequences together)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return not torch.is_grad_enabled() and 1 <= rows <= MAX_ROWS


def project_rows(projections: tuple[LoRAProjection, ...], x: torch.Tensor, residual=None) -> tuple[torch.Tensor, ...]:
    """`x Wᵀ + b + s (x Aᵀ) Bᵀ` for each projection of the rows `x`: NF4 bases through `nf4_matvec` (its
    PyTorch reference off the kernels' devices, and for float64), or all in one `nf4_grouped_matvec` launch with
    `GROUPED_MATVEC` where it takes them; dense bases through one product each. `residual` (one projection):
    added to its result, in `nf4_matvec`'s epilogue for an NF4 base."""
    kernels = (x.is_cuda or INTERPRET) and x.dtype != torch.float64
    quantized = [getattr(p.base, "quant_state", None) is not None for p in projections]
    if residual is not None:
        if len(projections) != 1:
            raise ValueError("a residual joins the result of one projection")
        residual = residual.reshape(*x.shape[:-1], -1)
    # Unless a norm's launch computed them already, the adapters' first products are left to the launch of their
    # projections (`nf4_grouped_matvec`, `nf4_matvec`: in that launch where it can, else one launch before it).
    pending = first_products_pending(x)
    grouped = GROUPED_MATVEC and kernels and all(quantized) and residual is None
    if grouped:
        bases, biases = [p.base for p in projections], [p.bias for p in projections]
        loras = [(p.lora_b, p.scale) if p.rank else None for p in projections]
        grouped = grouped_matvec_supported(x, bases, biases, loras)
    if grouped and not pending:
        return tuple(nf4_grouped_matvec(x, bases, biases, loras, None, [p.lora_a for p in projections if p.rank]))
    own = len(projections) == 1 and not pending
    t, products = first_products(projections, x, [kernels and q and not own for q in quantized])
    if grouped:
        return tuple(nf4_grouped_matvec(x, bases, biases, loras, t))
    outputs = []
    for i, p in enumerate(projections):
        if quantized[i] and kernels:
            lora = {} if not p.rank else (dict(lora_b=p.lora_b, lora_t=products[i]) if i in products
                                          else dict(lora_a=p.lora_a, lora_b=p.lora_b))
            outputs.append(nf4_matvec(x, p.base, p.bias, scale=p.scale, residual=residual, **lora))
            continue
        if quantized[i]:
            adapter = (p.lora_a, p.lora_b) if p.rank else (None, None)
            outputs.append(nf4_matvec_reference(x, p.base, p.bias, *adapter, scale=p.scale, residual=residual))
            continue
        weight = p.base if p.base.dtype == x.dtype else p.base.to(x.dtype)
        y = torch.nn.functional.linear(x, weight, None if p.bias is None else p.bias.to(x.dtype))
        if p.rank:
            y = y + p.scale * torch.nn.functional.linear(
                torch.nn.functional.linear(x, p.lora_a.to(x.dtype)), p.lora_b.to(x.dtype)
            )
        outputs.append(y if residual is None else residual + y)
    return tuple(outputs)


_PENDING_RESIDUAL = threading.local()


@contextlib.contextmanager
def residual_for_output(residual: torch.Tensor):
    """Within: the next output projection of decoding rows (`output_rows`) returns `residual +` its result, and
    marks it taken (`yield`s {"taken": bool}); a nested use holds its own."""
    previous = getattr(_PENDING_RESIDUAL, "pending", None)
    pending = _PENDING_RESIDUAL.pending = {"residual": residual, "taken": False}
    try:
        yield pending
    finally:
        _PENDING_RESIDUAL.pending = previous


def output_rows(projection: LoRAProjection, x: torch.Tensor) -> torch.Tensor:
    """`project_rows` of a token mixer's or an MLP's output projection, joined by the pending residual
    (`residual_for_output`) where there is one not yet taken."""
    pending = getattr(_PENDING_RESIDUAL, "pending", None)
    if pending is None or pending["taken"]:
        return project_rows((projection,), x)[0]
    pending["taken"] = True
    return project_rows((projection,), x, residual=pending["residual"])[0]


_PENDING_PRODUCTS = threading.local()


@contextlib.contextmanager
def first_products_of(x: torch.Tensor, lora_as: list[torch.Tensor], t: torch.Tensor):
    """Within: `first_products` of exactly the adapters `lora_as` (the same tensors, in order) on exactly the
    tensor `x` takes t = x [A_1; ...]ᵀ, computed already (`rms_norm_lora_down_rows`), instead of a launch."""
    previous = getattr(_PENDING_PRODUCTS, "pending", None)
    _PENDING_PRODUCTS.pending = (x, lora_as, t)
    try:
        yield
    finally:
        _PENDING_PRODUCTS.pending = previous


def first_products_pending(x: torch.Tensor) -> bool:
    """Whether `first_products_of` holds first products computed for exactly the tensor `x`."""
    pending = getattr(_PENDING_PRODUCTS, "pending", None)
    return pending is not None and pending[0] is x


def first_products(projections, x: torch.Tensor, on_kernels: list[bool]):
    """(t, {i: t_i}): x Aᵀ of every adapted projection i with `on_kernels[i]` from one `lora_down_rows` launch (or
    as `first_products_of` holds it), side by side in t, and each one's columns (t None and no columns where none
    is adapted)."""
    adapted = [i for i, p in enumerate(projections) if on_kernels[i] and p.rank]
    if not adapted:
        return None, {}
    lora_as = [projections[i].lora_a for i in adapted]
    pending = getattr(_PENDING_PRODUCTS, "pending", None)
    if (pending is not None and pending[0] is x and len(pending[1]) == len(lora_as)
            and all(a is b for a, b in zip(pending[1], lora_as, strict=True))):
        t = pending[2]
    else:
        t = lora_down_rows(x.reshape(-1, x.shape[-1]), lora_as)
    if t.dim() == 3:  # one adapter's t in parts (the gate-and-up launch's stripes)
        return t, {adapted[0]: t}
    return t, dict(zip(adapted, t.split([projections[i].rank for i in adapted], dim=1), strict=True))


_PENDING_STRIPES = threading.local()


@contextlib.contextmanager
def zeroed_stripes_for(x: torch.Tensor, stripes: torch.Tensor):
    """Within: the MLP of exactly the rows `x` (`mlp_rows`) may add its down projection's shares into `stripes`
    (fp32 `[DOWN_SHARE_STRIPES, rows, r]`), set to 0 by the launch that wrote x."""
    previous = getattr(_PENDING_STRIPES, "pending", None)
    _PENDING_STRIPES.pending = (x, stripes)
    try:
        yield
    finally:
        _PENDING_STRIPES.pending = previous


def mlp_rows(projections: tuple[LoRAProjection, LoRAProjection, LoRAProjection], x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) · up(x)) of the rows `x` (`gated_rows`, then `output_rows`); with `MLP_SHARES`, zeroed
    stripes for x (`zeroed_stripes_for`: made only for an adapted NF4 down projection) and the gate-and-up
    launch, that launch also writes the down adapter's first product in shares, which the down projection
    takes."""
    gate, up, down = projections
    pending = getattr(_PENDING_STRIPES, "pending", None)
    stripes = pending[1] if MLP_SHARES and pending is not None and pending[0] is x else None
    if stripes is None or not (GATED_MATVEC and gated_matvec_supported(x, gate.base, up.base)):
        return output_rows(down, gated_rows((gate, up), x))
    h = gated_rows((gate, up), x, down_shares=(down.lora_a, stripes))
    with first_products_of(h, [down.lora_a], stripes):
        return output_rows(down, h)


def gated_rows(projections: tuple[LoRAProjection, LoRAProjection], x: torch.Tensor, down_shares=None) -> torch.Tensor:
    """silu(gate(x)) · up(x) of the rows `x` for the MLP's gate and up projections: one `nf4_gated_matvec`
    launch with `GATED_MATVEC` where it takes them (both NF4, `gated_matvec_supported`; `down_shares` given to
    it), else their products (`project_rows`) and `swiglu`."""
    gate, up = projections
    if GATED_MATVEC and gated_matvec_supported(x, gate.base, up.base):
        if first_products_pending(x):
            _, products = first_products(projections, x, [True, True])
            loras = [(p.lora_b, products[i], p.scale) if p.rank else None for i, p in enumerate(projections)]
            return nf4_gated_matvec(x, gate.base, up.base, gate.bias, up.bias, *loras, down_shares=down_shares)
        # the first products left to the launch (in it where it can, else one launch before it)
        loras = [(p.lora_b, None, p.scale) if p.rank else None for p in projections]
        return nf4_gated_matvec(x, gate.base, up.base, gate.bias, up.bias, *loras,
                                lora_as=[p.lora_a for p in projections if p.rank], down_shares=down_shares)
    g, u = project_rows(projections, x)
    return (swiglu if g.is_cuda or INTERPRET else swiglu_reference)(g, u)


def grouped_attention_applies(module, query: torch.Tensor, attention_mask, cache) -> bool:
    """One new token per sequence over a cache, full attention, a mask SDPA reads as the model's
    implementation does: the grouped form below. Anything else keeps the model's attention function."""
    if cache is None or query.shape[2] != 1 or torch.is_grad_enabled():
        return False
    if getattr(module, "sliding_window", None) is not None:
        return False
    if module.config._attn_implementation not in GROUPED_ATTENTION_IMPLEMENTATIONS:
        return False
    return attention_mask is None or (torch.is_tensor(attention_mask) and attention_mask.dim() == 4)


def grouped_attention(query, key, value, attention_mask, scaling: float) -> torch.Tensor:
    """Attention of one token: query `[B, Hq, 1, D]`, key and value `[B, Hkv, L, D]` (the cache, not repeated),
    mask None or `[B, 1, 1, ≥L]` (boolean: True attends; or additive). Query head h reads KV head h // G, as
    Hugging Face's `repeat_kv` pairs them. Returns `[B, 1, Hq, D]`, the layout the output projection reads."""
    batch, n_q_heads, _, head_dim = query.shape
    n_kv_heads = key.shape[1]
    grouped = query.reshape(batch, n_kv_heads, n_q_heads // n_kv_heads, head_dim)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, -1:, : key.shape[-2]]
        if attention_mask.dtype not in (torch.bool, query.dtype):
            attention_mask = attention_mask.to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, 1, n_q_heads, head_dim)


def fused_attention_layer(cache, layer_idx: int, query: torch.Tensor, key: torch.Tensor, attention_mask):
    """The cache's `StaticLayer` for `layer_idx` where `decode_attention` takes this step (`DECODE_ATTENTION`, the
    kernels' device, a layer already filled by the prompt with the key's batch, heads, head size and dtype, a mask
    over its whole length), else None (`grouped_attention` after Hugging Face's update)."""
    if not DECODE_ATTENTION or not (query.is_cuda or INTERPRET) or query.dtype == torch.float64:
        return None
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if type(layer) is not StaticLayer or not layer.is_initialized:
        return None
    batch, heads, _, head_dim = key.shape
    keys, values = layer.keys, layer.values
    if keys.shape[:2] != (batch, heads) or keys.shape[-1] != head_dim or keys.dtype != key.dtype:
        return None
    if values.shape != keys.shape or values.dtype != keys.dtype or query.shape[1] % heads:
        return None
    if attention_mask is not None and (attention_mask.shape[0] not in (1, batch) or attention_mask.shape[1] != 1
                                       or attention_mask.shape[-1] < keys.shape[2]):
        return None
    return layer


def fused_attention(layer, query, key, value, attention_mask, scaling: float, gate=None,
                    norm_rope=None) -> torch.Tensor:
    """`decode_attention` over `layer` (`fused_attention_layer`): `[B, 1, Hq, D]`, gated where `gate` is given,
    query and key normed and rotated first where `norm_rope` is given (`decode_attention`'s tuple)."""
    return decode_attention(query, key, value, layer.keys, layer.values, layer.cumulative_length, attention_mask,
                            scaling, gate, norm_rope)
