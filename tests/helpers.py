"""Comparison helpers for the kernel tests: relative-error asserts and a forward + backward check against a
plain-PyTorch reference computed in float64 from the same (dtype-rounded) input values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative error ||actual - reference|| / ||reference|| allowed per dtype of the kernel's inputs.
TOLERANCE = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-2,
    torch.float64: 1e-10,
}

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def bind_torch_delta_rule(set_attribute: Callable = setattr) -> None:
    """Binds Qwen3.5's Gated DeltaNet in Hugging Face's model module to PyTorch references, through
    `set_attribute` (pytest's `monkeypatch.setattr` to undo it). Where flash-linear-attention is installed,
    transformers binds its kernels to these names (wrapped) when the module is imported; they have no float64
    and no CPU path. Hugging Face's own PyTorch functions compute in float32 whatever they are given, so float64
    inputs go to `unsloth_lite`'s float64 references instead (tested against Hugging Face's at float32
    precision): a float64 model is then float64 throughout, a reference for the float32 kernels. `__wrapped__`
    of each bound function is Hugging Face's."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from unsloth_lite.kernels.gated_delta_rule_reference import (
        chunk_gated_delta_rule_reference,
        recurrent_gated_delta_rule_reference,
    )

    for name, exact in (("torch_chunk_gated_delta_rule", chunk_gated_delta_rule_reference),
                        ("torch_recurrent_gated_delta_rule", recurrent_gated_delta_rule_reference)):
        bound = getattr(modeling_qwen3_5, name)
        set_attribute(modeling_qwen3_5, name, _float64_to(exact, getattr(bound, "__wrapped__", bound)))


def _float64_to(exact: Callable, theirs: Callable) -> Callable:
    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        if query.dtype != torch.float64:
            return theirs(query, key, value, g=g, beta=beta, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          **kwargs)
        return exact(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    rule.__wrapped__ = theirs
    return rule


def dtype_id(dtype: torch.dtype) -> str:
    return DTYPE_IDS[dtype]


def _worst_mismatches(a: torch.Tensor, r: torch.Tensor, count: int = 5) -> str:
    diff = (a - r).abs()
    flat = diff.flatten()
    # NaNs would sort arbitrarily: rank them first.
    ranked = torch.where(torch.isnan(flat), torch.full_like(flat, float("inf")), flat)
    top = torch.topk(ranked, min(count, flat.numel()))
    lines = []
    for flat_index in top.indices.tolist():
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), a.shape))
        lines.append(
            f"    at {index}: actual={a[index].item():.6g} reference={r[index].item():.6g} "
            f"abs diff={diff[index].item():.3g}"
        )
    return "\n".join(lines)


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    a = actual.detach().to(torch.float64)
    r = reference.detach().to(device=a.device, dtype=torch.float64)
    denom = r.norm().item()
    num = (a - r).norm().item()
    return num / denom if denom > 0 else num


def assert_close(actual: torch.Tensor, reference: torch.Tensor, tol: float, name: str) -> None:
    """Fails on any non-finite element of `actual`, a shape mismatch, or ||a - r|| / ||r|| > tol (float64 math)."""
    assert isinstance(actual, torch.Tensor), f"{name}: expected a tensor, got {type(actual).__name__}"
    assert tuple(actual.shape) == tuple(reference.shape), (
        f"{name}: shape {tuple(actual.shape)} != reference shape {tuple(reference.shape)}"
    )
    a = actual.detach().to(torch.float64)
    r = reference.detach().to(device=a.device, dtype=torch.float64)
    finite = torch.isfinite(a)
    if not bool(finite.all()):
        bad = (~finite).nonzero()
        raise AssertionError(
            f"{name}: {bad.shape[0]} of {a.numel()} elements are NaN/inf (unwritten outputs are NaN-poisoned); "
            f"first at {[tuple(i) for i in bad[:5].tolist()]}\n{_worst_mismatches(a, r)}"
        )
    assert bool(torch.isfinite(r).all()), f"{name}: the reference itself has NaN/inf (test bug)"
    if a.numel() == 0:
        return
    denom = r.norm().item()
    num = (a - r).norm().item()
    err = num / denom if denom > 0 else num
    if not err <= tol:
        raise AssertionError(
            f"{name}: relative error {err:.3e} > tolerance {tol:.1e} "
            f"(||a-r||={num:.3e}, ||r||={denom:.3e}, shape {tuple(a.shape)}, dtype {actual.dtype})\n"
            f"  5 largest absolute mismatches:\n{_worst_mismatches(a, r)}"
        )


# ----------------------------------------------------------------------------------------------------------
# Inputs in a dtype, keeping the layout of views


def _cast_keeping_layout(t: torch.Tensor, dtype: torch.dtype, device, bases: dict) -> torch.Tensor:
    """`t` in `dtype` on `device` with the same sizes, strides and storage offset as `t`.

    A view (`x[:, ::2]`, `t.transpose(1, 2)`, `gate_up.chunk(2, -1)`, `expand`) is rebuilt as the same view of
    its base converted to `dtype` (views of one base share the converted base), because `view.to(dtype)`
    would give a contiguous copy. The result is a detached leaf.
    """
    base = t._base
    if base is not None:
        key = id(base)
        if key not in bases:
            new_base = base.detach().to(device=device, dtype=dtype)
            if new_base.stride() != base.stride() or new_base.storage_offset() != base.storage_offset():
                new_base = None  # base not dense: fall through to a plain copy below
            bases[key] = new_base
        new_base = bases[key]
        if new_base is not None:
            out = new_base.as_strided(t.shape, t.stride(), t.storage_offset())
            return out.detach()
    out = t.detach().to(device=device, dtype=dtype)
    if out.stride() != t.stride():
        # Not a view and not dense (an expanded tensor made with `as_strided`, say): rebuild its strides.
        out = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device).copy_(t)
    return out


def cast_inputs(inputs: Sequence, dtypes: Sequence, device) -> list:
    bases: dict = {}
    out = []
    for t, dtype in zip(inputs, dtypes, strict=True):
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        x = _cast_keeping_layout(t, dtype, device, bases)
        assert x.stride() == t.stride() or t.numel() <= 1, "layout of a test input was not kept"
        out.append(x.requires_grad_(t.requires_grad))
    return out


# ----------------------------------------------------------------------------------------------------------
# Upstream gradients


def randn_grad(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, device=out.device).to(out.dtype)


def transposed_randn_grad(out: torch.Tensor) -> torch.Tensor:
    """Random gradient of `out`'s shape whose strides run in reverse order (a permuted view)."""
    dims = list(range(out.dim()))[::-1]
    base = torch.randn([out.shape[d] for d in dims], device=out.device).to(out.dtype)
    grad = base.permute(*dims)
    assert grad.shape == out.shape
    return grad


def expanded_randn_grad(out: torch.Tensor) -> torch.Tensor:
    """Random gradient of `out`'s shape, broadcast along dim 0 (stride 0 there)."""
    base = torch.randn((1, *out.shape[1:]), device=out.device).to(out.dtype)
    return base.expand(out.shape)


# ----------------------------------------------------------------------------------------------------------


def check_op(
    fn: Callable,
    reference_fn: Callable,
    inputs: Sequence,
    dtype: torch.dtype,
    device=None,
    *,
    tol: float | None = None,
    names: Sequence[str] | None = None,
    input_dtypes: Sequence[torch.dtype | None] | None = None,
    make_grad: Callable[[torch.Tensor], torch.Tensor] | Sequence[Callable] = randn_grad,
    reference_dtype: torch.dtype = torch.float64,
):
    """Runs `fn` on `inputs` cast to `dtype` and `reference_fn` on `reference_dtype` copies of the same values.

    `inputs` are tensors built by the test (in any float dtype, views allowed: their layout is kept) whose
    `requires_grad` says which gradients to check; non-tensors are passed through. `input_dtypes[i]`, where
    given and not None, overrides `dtype` for input i (mixed-precision cases). The same random upstream
    gradients (`make_grad(output)`, per output; these may be non-contiguous) are backpropagated through both.
    Asserts every output and every input gradient within `tol` (default `TOLERANCE[dtype]`), output dtypes,
    and that inputs without `requires_grad` get no `.grad`.

    Returns a namespace with `outputs`, `inputs` (the leaves fn saw), `grads` (upstream), `ref_outputs`.
    """
    device = device or DEVICE
    tol = TOLERANCE[dtype] if tol is None else tol
    names = list(names) if names is not None else [f"input[{i}]" for i in range(len(inputs))]
    overrides = input_dtypes if input_dtypes is not None else [None] * len(inputs)
    dtypes = [dtype if override is None else override for override in overrides]

    xs = cast_inputs(inputs, dtypes, device)
    refs = [
        x.detach().to(reference_dtype).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in xs
    ]

    outputs = fn(*xs)
    ref_outputs = reference_fn(*refs)
    single = not isinstance(outputs, (tuple, list))
    if single:
        outputs, ref_outputs = (outputs,), (ref_outputs,)
    assert len(outputs) == len(ref_outputs)
    for i, (out, ref) in enumerate(zip(outputs, ref_outputs, strict=True)):
        label = "output" if single else f"output[{i}]"
        assert out.dtype == xs[0].dtype, f"{label} has dtype {out.dtype}, expected {xs[0].dtype}"
        assert out.device == xs[0].device
        assert_close(out, ref, tol, label)

    grads = []
    if any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs):
        makers = make_grad if isinstance(make_grad, (tuple, list)) else [make_grad] * len(outputs)
        grads = [maker(out) for maker, out in zip(makers, outputs, strict=True)]
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        ref_pairs = [(o, g.to(reference_dtype)) for o, g in zip(ref_outputs, grads, strict=True) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        torch.autograd.backward([o for o, _ in ref_pairs], [g for _, g in ref_pairs])

    for name, x, ref in zip(names, xs, refs, strict=True):
        if not isinstance(x, torch.Tensor):
            continue
        if not x.requires_grad:
            assert x.grad is None, f"{name} does not require grad but got a gradient"
            continue
        assert x.grad is not None, f"d{name}: no gradient reached {name}"
        assert ref.grad is not None, f"d{name}: the reference produced no gradient (test bug)"
        assert x.grad.dtype == x.dtype, f"d{name} has dtype {x.grad.dtype}, expected {x.dtype}"
        assert_close(x.grad, ref.grad, tol, f"d{name}")

    return SimpleNamespace(outputs=outputs, inputs=xs, grads=grads, ref_outputs=ref_outputs, ref_inputs=refs)


# ----------------------------------------------------------------------------------------------------------
# RoPE inputs


def make_qk(batch, n_q_heads, n_k_heads, seq, head_dim, layout="bshd", device="cpu", dtype=torch.float32):
    """q `[B, Hq, S, D]`, k `[B, Hkv, S, D]`: transposed views of `[B, S, H, D]` ("bshd") or contiguous ("bhsd")."""
    if layout == "bshd":
        q = torch.randn(batch, seq, n_q_heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(batch, seq, n_k_heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    elif layout == "bhsd":
        q = torch.randn(batch, n_q_heads, seq, head_dim, device=device, dtype=dtype)
        k = torch.randn(batch, n_k_heads, seq, head_dim, device=device, dtype=dtype)
    else:
        raise ValueError(layout)
    return q, k


COS_FORMS = ("bsr", "sr", "1sr", "expanded")


def make_cos_sin(batch, seq, rotary_dim, form="bsr", device="cpu", dtype=torch.float32):
    """Random cos/sin values (the kernels are linear in them; random values catch lo/hi mix-ups that real
    angles, whose two halves are equal, would hide) as [B,S,R], [S,R], [1,S,R] or [1,S,R] expanded to [B,S,R]."""
    if form == "bsr":
        shape = (batch, seq, rotary_dim)
    elif form == "sr":
        shape = (seq, rotary_dim)
    elif form in ("1sr", "expanded"):
        shape = (1, seq, rotary_dim)
    else:
        raise ValueError(form)
    cos = torch.randn(shape, device=device, dtype=dtype)
    sin = torch.randn(shape, device=device, dtype=dtype)
    if form == "expanded":
        cos, sin = cos.expand(batch, seq, rotary_dim), sin.expand(batch, seq, rotary_dim)
    return cos, sin


def first_halves_repeated(t):
    """cat(first half, first half) of a cos/sin table (what `duplicated_halves=True` declares), a batch-broadcast
    (stride 0) table kept so."""
    half = t[..., : t.shape[-1] // 2]
    repeated = torch.cat([half, half], dim=-1)
    if t.dim() == 3 and t.stride(0) == 0:
        repeated = repeated[:1].expand(t.shape)
    return repeated


def hf_cos_sin(seq, rotary_dim, base=10000.0, batch=1, device="cpu", dtype=torch.float32):
    """Real rotary angles as Hugging Face builds them: cos/sin of cat(freqs, freqs), shape [B, S, R]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float64) / rotary_dim))
    positions = torch.arange(seq, device=device, dtype=torch.float64)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(dtype)[None].expand(batch, seq, rotary_dim).contiguous()
    sin = emb.sin().to(dtype)[None].expand(batch, seq, rotary_dim).contiguous()
    return cos, sin


def assert_counters_settled(device=None) -> None:
    """The kernels' arrival counters and flags (`matvec_epilogue._arrival_counters`, on `device`'s type or every
    device) between launches: each launch leaves them at 0 for the next."""
    from unsloth_lite.kernels import matvec_epilogue

    for (flags_device, _, use), flags in matvec_epilogue._ARRIVALS.items():
        if device is None or flags_device.type == torch.device(device).type:
            assert not flags.any(), f"{use}: counters left at {flags.nonzero().flatten().tolist()}"
