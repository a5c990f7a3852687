"""The gated delta rule in plain PyTorch: the chunked form of `gated_delta_rule.py` (C = 64) and the token-by-token
recurrence that defines it, both differentiable by autograd. They are the tests' references, the CPU path outside
Triton's interpreter, and the path of float64 models (a test dtype the kernels do not take)."""

from __future__ import annotations

import torch

from unsloth_lite.kernels.gated_delta_rule import CHUNK


def _heads_first(q, k, v, g, beta, use_l2, acc):
    """[B, H, T, ...] in `acc`, q and k repeated to the value heads and normalised when asked."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.to(acc).repeat_interleave(group, dim=2).transpose(1, 2) for x in (q, k))
    if use_l2:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    v = v.to(acc).transpose(1, 2)
    g, beta = (x.to(acc).transpose(1, 2) for x in (g, beta))
    return q, k, v, g, beta


def _chunked_sequences(q, k, v, g, beta, scale, state):
    """The chunked form above in PyTorch, [B, H, T, ...] tensors in one float dtype; differentiable."""
    outs = []
    seq = q.shape[2]
    for s in range(0, seq, CHUNK):
        Q, K, V = (x[:, :, s : s + CHUNK] for x in (q, k, v))
        gam = g[:, :, s : s + CHUNK].cumsum(-1)
        bt = beta[:, :, s : s + CHUNK]
        size = gam.shape[-1]
        lower_incl = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower_incl, gam[..., :, None] - gam[..., None, :], float("-inf")).exp()
        a = (bt[..., :, None] * (K @ K.transpose(-1, -2)) * decay).tril(-1)
        system = a + torch.eye(size, dtype=q.dtype, device=q.device)
        rhs = torch.cat([bt[..., None] * V, (bt * gam.exp())[..., None] * K], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = solved[..., : V.shape[-1]], solved[..., V.shape[-1] :]
        v_new = u - w @ state
        m = scale * (Q @ K.transpose(-1, -2)) * decay
        outs.append(scale * (Q * gam.exp()[..., None]) @ state + m @ v_new)
        last = gam[..., -1:]
        state = state * last.exp()[..., None] + (K * (last - gam).exp()[..., None]).transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2), state


def _recurrent_sequences(q, k, v, g, beta, scale, state):
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = beta[:, :, t, None] * (v[:, :, t] - (state * k_t[..., None]).sum(-2))
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * (scale * q[:, :, t])[..., None]).sum(-2))
    return torch.stack(outs, dim=2), state


def _reference(form, q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    batch, seq, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    qh, kh, vh, gh, bh = _heads_first(q, k, v, g, beta, use_l2, acc)
    if cu_seqlens is None:
        bounds, rows = [(0, seq)] * batch, list(range(batch))
    else:
        cu = cu_seqlens.tolist()
        bounds, rows = list(zip(cu[:-1], cu[1:], strict=True)), [0] * (len(cu) - 1)
    outs, finals = [], []
    for n, ((bos, eos), b) in enumerate(zip(bounds, rows, strict=True)):
        state = (
            initial_state[n : n + 1].to(acc)
            if initial_state is not None
            else torch.zeros(1, hv, dk, dv, dtype=acc, device=q.device)
        )
        sl = (slice(b, b + 1), slice(None), slice(bos, eos))
        o, state = form(qh[sl], kh[sl], vh[sl], gh[sl], bh[sl], scale, state)
        outs.append(o)
        finals.append(state)
    o = torch.cat(outs, dim=2 if cu_seqlens is not None else 0).transpose(1, 2).to(v.dtype)
    return o, (torch.cat(finals, 0) if output_final_state else None)


def chunk_gated_delta_rule_reference(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None,
):
    """`chunk_gated_delta_rule` in plain PyTorch, chunked (C = 64), fp32 math (float64 for float64 inputs);
    differentiable by autograd. Final state in the math dtype."""
    return _reference(
        _chunked_sequences, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens,
    )


def recurrent_gated_delta_rule_reference(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None,
):
    """The token-by-token recurrence (the definition), same signature and dtypes as the chunked reference."""
    return _reference(
        _recurrent_sequences, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens,
    )
