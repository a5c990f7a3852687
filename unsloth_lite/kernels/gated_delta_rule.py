"""Gated DeltaNet (Qwen3.5's linear attention): the chunked gated delta rule, forward and hand-written backward.

Per value head, with state S `[Dk, Dv]` (fp32), for each token t (q, k L2-normalised first when asked):

    S ← exp(g_t) S;    S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t);    o_t = Sᵀ (scale · q_t)

Value head h reads key head h // G (G = Hv / Hk) in place: nothing is repeated or copied.

Chunked form (chunk C = 64 tokens; S0 the state at the chunk's start; within the chunk γ = cumsum(g), Γ = exp(γ),
D_ij = exp(γ_i − γ_j), K̃ = K ⊙ exp(γ_C − γ), γ_C the last γ):

    A   = strictly-lower(β_i (k_i·k_j) D_ij)          T = (I + A)⁻¹        (by 16-row blocks, fp32)
    U   = T (β⊙V)      W = T (βΓ⊙K)                   V_new = U − W S0     (the δ_t = β_t(v_t − S̃ᵀk_t) of the chunk)
    M   = tril_incl(scale Q Kᵀ ⊙ D)
    O   = scale (Q⊙Γ) S0 + M V_new
    S_C = exp(γ_C) S0 + K̃ᵀ V_new

(δ solves δ_i = β_i v_i − β_i Γ_i k_iᵀS0 − Σ_{j<i} A_ij δ_j, i.e. (I + A) δ = β⊙V − (βΓ⊙K) S0.)

Backward, with dO of the chunk and dS_C the gradient of its end state (from later chunks, or the final state's):

    dV_new = Mᵀ dO + K̃ dS_C
    dS0    = scale (Q⊙Γ)ᵀ dO − Wᵀ dV_new + exp(γ_C) dS_C             (the reverse sequential pass)

and then, chunk-parallel, with dU = dV_new, dW = −dV_new S0ᵀ, and writing Ū = Tᵀ dV_new:

    dT = dU (β⊙V)ᵀ + dW (βΓ⊙K)ᵀ,   dA = −Tᵀ dT Tᵀ = −Ū Uᵀ − (Tᵀ dW) Wᵀ = −Ū Uᵀ + Ū (W S0)ᵀ = −Ū V_newᵀ
    dv     = β ⊙ Ū                          Tᵀ dW = −Ū S0ᵀ =: W̄
    dβ_i   = v_i·Ū_i + Γ_i k_i·W̄_i + Σ_j dA_ij (k_i·k_j) D_ij
    dk     = β Γ ⊙ W̄ + exp(γ_C − γ) ⊙ (V_new dS_Cᵀ) + scale (dM ⊙ D)ᵀ Q + (G + Gᵀ) K,
             dM = dO V_newᵀ (lower incl.),  G = β_i dA_ij D_ij (strictly lower)
    dq     = scale Γ ⊙ (dO S0ᵀ) + scale (dM ⊙ D) K
    dγ_i   = scale Γ_i q_i·(dO S0ᵀ)_i + β_iΓ_i k_i·W̄_i − k̃_i·(V_new dS_Cᵀ)_i
             + Σ_j (dM⊙M)_ij − Σ_j (dM⊙M)_ji + Σ_j (dA⊙A)_ij − Σ_j (dA⊙A)_ji
    dγ_C  += exp(γ_C) Σ S0⊙dS_C + Σ K̃ ⊙ (V_new dS_Cᵀ)
    dg     = reverse in-chunk cumsum of dγ   (the dγ_C terms reach every token of the chunk)

The row and column sums of a D_ij term cancel in that cumulative sum except where j < t <= i, so the kernel
sums each kind of term over the tokens it reaches instead (no cancellation of large partial sums):

    dg_t = Σ_{i>=t} Σ_{j<t} P_ij + Σ_{s>=t} (Γ terms)_s + Σ_{s<t} (K̃ terms)_s + (exp(γ_C) terms),
           P = dM⊙M + β_i dA⊙A  (a reverse cumulative sum of P down its columns, then row t summed over j < t)

and through the L2 norm x̂ = x r, r = (Σx² + 1e-6)^-½:  dx = r (dx̂ − x̂ (x̂·dx̂)). dq and dk of a key head are the
sums of its G value heads' shares, taken before the L2 norm's backward.

Kernels (`gated_delta_rule_kernels.py`, the backward's in `gated_delta_rule_backward_kernels.py`):

1. `_prepare_kernel`, chunk-parallel: T, W, U into fp32 scratch (and T itself for the backward); T's four
   diagonal 16×16 blocks by forward substitution, the rest as products of blocks.
2. `_forward_states_kernel`, sequential over the chunks of a sequence, one program per (Dv block, sequence, head):
   V_new and the state, storing the chunk-start states and V_new (which the backward reads); past WINDOW
   tokens the forward computes the output in it too, keeping no per-chunk states.
2b. `_output_kernel`, chunk-parallel: the output from the stored chunk-start states and V_new (up to WINDOW
   tokens: the sequential pass then carries no q or Q Kᵀ on its path).
3. `_backward_state_free_kernel`, chunk-parallel: the reverse pass's terms that do not depend on the state,
   Mᵀ dO and scale (Q⊙Γ)ᵀ dO, written where that pass stores dV_new and dS_C; then `_backward_states_kernel`,
   the reverse sequential pass: dS_C of every chunk, dV_new, d(initial state), two products a chunk.
4. `_backward_key_products_kernel`, one program per (chunk, key head): scale·Q Kᵀ and K Kᵀ, which all G value
   heads read; `_backward_values_kernel`, chunk-parallel, one program per (chunk, value head): dv, dg, dβ and
   the value head's share of dq, dk (fp32); then `_backward_keys_kernel`, one program per (chunk, key head):
   the sum of its G value heads' shares, in order (deterministic), through the L2 norm.

Saved for the backward: the inputs, and up to WINDOW tokens the forward's W, T, chunk-start states and V_new
when autograd will want them (fp32, ~9 times the bytes of a bf16 v; a layer checkpointed by
`unsloth_lite.training` runs its first forward under no_grad and keeps nothing); longer sequences' backward
recomputes them (scratch freed on return).
The sequential passes split the state's Dv columns over programs, 64 a program (`_value_block`: finer splits
were slower on an H200). Varlen (`cu_seqlens`): the chunk → document table is built on the device
(searchsorted over the documents' first chunks), with the grid sized by the bound cdiv(T, C) + N chunks; no host
sync. `cu_seqlens` must run from 0 to T without decreasing (not checked: that would need a sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from unsloth_lite.kernels.gated_delta_rule_backward_kernels import (
    _backward_key_products_kernel,
    _backward_keys_kernel,
    _backward_state_free_kernel,
    _backward_states_kernel,
    _backward_values_kernel,
)
from unsloth_lite.kernels.gated_delta_rule_checks import check_args
from unsloth_lite.kernels.gated_delta_rule_kernels import _forward_states_kernel, _output_kernel, _prepare_kernel
from unsloth_lite.kernels.gated_delta_rule_split_values_kernels import (
    _backward_chunk_pairs_kernel,
    _backward_state_products_kernel,
)
from unsloth_lite.kernels.utils import INTERPRET, empty

CHUNK = 64
# Tokens per window of a long fixed-length batch's backward (`_backward_by_windows`), a multiple of CHUNK:
# Qwen3.5-27B's W2 length takes the single pass.
WINDOW = 2048
# Warps of each kernel's launch (and the value-gradient kernel's value block), chosen on an H200 at W2's shapes
# (`scripts/bench_deltanet.py`); every combination shipped is the one the GPU tests run.
LAUNCH = dict(prepare_warps=4, states_warps=4, output_warps=4, free_warps=4, reverse_warps=8, values_warps=4,
              values_bv=64, keys_warps=8, values_split="wide_heads",
              state_products_warps=8, state_products_bv=32, chunk_pairs_warps=8, chunk_pairs_bv=64,
              precision=dict(prepare="bf16x3", states="tf32_rounded", output="bf16x3", free="bf16x3",
                             reverse="bf16x3", values="bf16x3"))
# `values_split`: the input gradients' value sums in two kernels (`gated_delta_rule_split_values_kernels.py`, each
# with its warps and value block) instead of one that spills (2,768 stack bytes a thread at its setting, against
# 400 and 224 in the two: triton 3.6 for sm_90, `scripts/kernel_resources.py`). True, False, or "wide_heads": two
# kernels from Dv = 2C on (Qwen3.5's 128, where their scratch is the reverse pass's own slots), the shapes the
# GPU tests run both forms at; one below. K2 on an H200 (2026-12-03): 1.805 ms a call split against 2.017 in one,
# every error the same to the third digit.
# `precision`, the products' for 16-bit inputs, one for every kernel or a dict by kernel (prepare, states,
# output, free, reverse, values). Measured on an H200 at W2's shape (K2, 2026-12-03; errors against the float64
# recurrence, the bf16 floor being 1.64-1.66e-3):
# - "bf16x3": three bf16 products of the operands' bf16 halves (`_dot_bf16x3`), fewer where an operand is a bf16
#   input's values (q, k and v as stored, their L2 norms and decays applied to the other operand or the result):
#   every error at the floor, equal to transformers' fp32 PyTorch path's. The default, but in the forward's
#   sequential pass, where "tf32_rounded" is 0.03 ms faster with the same errors: 2.01 ms a K2 call.
# - "tf32_rounded" (operands rounded to nearest, then tf32 products): 1.84 ms, errors 1.67-1.69e-3.
# - "tf32" (operands truncated as Hopper's tensor cores read fp32): about 1.4x that error, 5% faster.
# - "tf32x3" (Triton's three tf32 products): the floor at 2.4x the time.


# ----------------------------------------------------------------------------------------------------------
# Launch settings


def _values_split(dv: int) -> bool:
    """Whether the backward's value sums run as two kernels (`LAUNCH["values_split"]`)."""
    setting = LAUNCH["values_split"]
    return dv >= 2 * CHUNK if setting == "wide_heads" else bool(setting)


def _value_block(dv: int) -> int:
    """State columns per program of the sequential passes, the output and the state-free products: 64, the
    width every GPU test runs (a smaller Dv masks the block's columns past it); under the interpreter, whose cost
    is per element, no wider than Dv needs (down to 16).

    Measured on an H200 at W2's shape (B=1, Hv=48, Dk=Dv=128, T=8192, bf16): 64 columns (96 programs) ran the
    forward pass in 1.10 ms and the reverse pass in 2.17 ms; 32 columns (192 programs, more of the GPU busy) in
    1.34 / 3.20 ms and 128 columns (48 programs) in 1.94 / 2.97 ms. Each program reloads the chunk's q, k, W and
    recomputes Q Kᵀ, so splitting Dv finer costs more than the parallelism it buys. With bf16 products in every
    kernel, 32 columns in the sequential passes stopped on an H200 with an illegal memory access (2026-12-03, not
    explained): no launch narrower than 64 columns runs compiled."""
    if INTERPRET:
        return min(64, max(16, triton.next_power_of_2(dv)))
    return 64


def _dot_precision(dtype: torch.dtype, kernel: str) -> str:
    # fp32 inputs: exact fp32 products (tf32 would cost ~1e-3 over a long recurrence). 16-bit inputs: the
    # kernel's precision in `LAUNCH` (`_dot` in gated_delta_rule_kernels.py).
    if dtype == torch.float32:
        return "ieee"
    precision = LAUNCH["precision"]
    return precision if isinstance(precision, str) else precision[kernel]


def _products(dtype: torch.dtype, kernel: str, dk: int, dv: int) -> dict:
    """A launch's product settings: PREC (`_dot_precision`) and EXACT, whether the inputs' values are exact bf16
    operands (bf16 inputs: "bf16x3" then skips their low halves' products).

    Compiled, head dims of 32 or less (tiny models, never Qwen3.5's 128) take fp32 products whatever the inputs:
    on an H200 (triton 3.6) bf16 tensor-core products with a tile side of 32 stopped kernels with an illegal
    memory access (bf16 inputs at Dk=32, Dv=16; 32 state columns a program at Dk=Dv=128), where fp32 products at
    the same dims passed. The interpreter, which has no such fault, keeps the configured products at every dim,
    so that the CPU tests' small heads exercise them."""
    if min(dk, dv) <= 32 and not INTERPRET:
        return dict(PREC="ieee", EXACT=False)
    return dict(PREC=_dot_precision(dtype, kernel), EXACT=dtype == torch.bfloat16)


class _Layout:
    """Sequences and chunks of a batch: fixed length (sequence n = batch row n) or varlen documents."""

    def __init__(self, q: torch.Tensor, cu_seqlens: torch.Tensor | None):
        batch, seq = q.shape[:2]
        self.T = seq
        self.varlen = cu_seqlens is not None
        if self.varlen:
            self.n_seq = cu_seqlens.numel() - 1
            self.NC = 0
            self.NCH = triton.cdiv(seq, CHUNK) + self.n_seq  # bound on Σ cdiv(len_n, C)
            cu = cu_seqlens.to(torch.int64)
            n_chunks = torch.div(cu[1:] - cu[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor")
            self.chunk_first = F.pad(torch.cumsum(n_chunks, 0), (1, 0))
            chunk_ids = torch.arange(self.NCH, device=q.device)
            seq_of_chunk = torch.searchsorted(self.chunk_first, chunk_ids, right=True) - 1
            self.chunk_seq = seq_of_chunk.clamp_(0, self.n_seq - 1)
            self.cu = cu
        else:
            self.n_seq = batch
            self.NC = triton.cdiv(seq, CHUNK)
            self.NCH = batch * self.NC
            dummy = torch.zeros(1, dtype=torch.int64, device=q.device)
            self.chunk_first = self.chunk_seq = self.cu = dummy


def _strides(t: torch.Tensor):
    return tuple(t.stride())


def _prepare(q, k, v, g, beta, lay: _Layout, use_l2: bool, store_t: bool):
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    group = hv // k.shape[2]
    dev = q.device
    w = empty((hv, lay.NCH, CHUNK, dk), torch.float32, dev)
    u = empty((hv, lay.NCH, CHUNK, dv), torch.float32, dev)
    # T's own buffer where the backward keeps it or where a chunk's W slot is smaller than its [C, C] T
    tm = empty((hv, lay.NCH, CHUNK, CHUNK), torch.float32, dev) if store_t or dk < CHUNK else None
    scratch, scratch_row = (tm, CHUNK) if tm is not None else (w, dk)
    _prepare_kernel[(lay.NCH, hv)](
        k, *_strides(k), v, *_strides(v), g, *_strides(g), beta, *_strides(beta),
        w, u, scratch, scratch_row, lay.cu, lay.chunk_seq, lay.chunk_first,
        lay.T, lay.NC, lay.NCH, group, dk, dv,
        C=CHUNK, DK=max(16, triton.next_power_of_2(dk)), DV=max(16, triton.next_power_of_2(dv)),
        L2=use_l2, VARLEN=lay.varlen, **_products(q.dtype, "prepare", dk, dv),
        num_warps=LAUNCH["prepare_warps"],
    )
    return w, u, (tm if store_t else None)


def _forward_states(q, k, g, w, u, h0, lay, scale, use_l2, *, compute_o, store_final, store_states, v_dtype):
    batch, hv, dk, dv = q.shape[0], w.shape[0], k.shape[3], u.shape[3]
    group = hv // k.shape[2]
    dev = q.device
    bv = _value_block(dv)
    o = empty((batch, lay.T, hv, dv), v_dtype, dev) if compute_o else w
    ht = empty((lay.n_seq, hv, dk, dv), torch.float32, dev) if store_final else w
    hs = empty((hv, lay.NCH, dk, dv), torch.float32, dev) if store_states else w
    vn = empty((hv, lay.NCH, CHUNK, dv), torch.float32, dev) if store_states else w
    h0_arg = h0 if h0 is not None else w
    _forward_states_kernel[(triton.cdiv(dv, bv), lay.n_seq * hv)](
        q, *_strides(q), k, *_strides(k), g, *_strides(g),
        w, u,
        h0_arg, *(_strides(h0) if h0 is not None else (0, 0, 0, 0)),
        o, ht, hs, vn,
        lay.cu, lay.chunk_first,
        lay.T, lay.NC, lay.NCH, hv, group, dk, dv, scale,
        C=CHUNK, DK=max(16, triton.next_power_of_2(dk)), BV=bv,
        L2=use_l2, VARLEN=lay.varlen, HAS_H0=h0 is not None, STORE_HT=store_final,
        COMPUTE_O=compute_o, STORE_STATES=store_states, **_products(q.dtype, "states", dk, dv),
        num_warps=LAUNCH["states_warps"], num_stages=2,
    )
    return (o if compute_o else None), (ht if store_final else None), (hs if store_states else None), (
        vn if store_states else None
    )


def _output(q, k, g, hs, vn, lay, scale, use_l2, v_dtype, batch, dv):
    hv = hs.shape[0]
    o = empty((batch, lay.T, hv, dv), v_dtype, q.device)
    bv = _value_block(dv)  # 64: no spills in the sm_90 SASS (128: 76 a thread)
    _output_kernel[(lay.NCH, hv, triton.cdiv(dv, bv))](
        q, *_strides(q), k, *_strides(k), g, *_strides(g), hs, vn, o,
        lay.cu, lay.chunk_seq, lay.chunk_first,
        lay.T, lay.NC, lay.NCH, hv, hv // k.shape[2], k.shape[3], dv, scale,
        C=CHUNK, DK=max(16, triton.next_power_of_2(k.shape[3])), BV=bv,
        L2=use_l2, VARLEN=lay.varlen, **_products(q.dtype, "output", k.shape[3], dv),
        num_warps=LAUNCH["output_warps"], num_stages=1,
    )
    return o


def _backward_states(q, k, g, do, w, dht, lay, scale, use_l2, store_dh0):
    hv, dk, dv = w.shape[0], k.shape[3], do.shape[3]
    group = hv // k.shape[2]
    dev = q.device
    DK = max(16, triton.next_power_of_2(dk))
    dhs = empty((hv, lay.NCH, dk, dv), torch.float32, dev)
    dvn = empty((hv, lay.NCH, CHUNK, dv), torch.float32, dev)
    dh0 = empty((lay.n_seq, hv, dk, dv), torch.float32, dev) if store_dh0 else dhs
    free_bv = _value_block(dv)
    _backward_state_free_kernel[(lay.NCH, hv, triton.cdiv(dv, free_bv))](
        q, *_strides(q), k, *_strides(k), g, *_strides(g), do, *_strides(do),
        dhs, dvn, lay.cu, lay.chunk_seq, lay.chunk_first,
        lay.T, lay.NC, lay.NCH, hv, group, dk, dv, scale,
        C=CHUNK, DK=DK, BV=free_bv, L2=use_l2, VARLEN=lay.varlen, **_products(q.dtype, "free", dk, dv),
        num_warps=LAUNCH["free_warps"], num_stages=1,
    )
    bv = _value_block(dv)
    _backward_states_kernel[(triton.cdiv(dv, bv), lay.n_seq * hv)](
        k, *_strides(k), g, *_strides(g),
        w,
        dht if dht is not None else w, *(_strides(dht) if dht is not None else (0, 0, 0, 0)),
        dhs, dvn, dh0,
        lay.cu, lay.chunk_first,
        lay.T, lay.NC, lay.NCH, hv, group, dk, dv,
        C=CHUNK, DK=DK, BV=bv,
        L2=use_l2, VARLEN=lay.varlen, HAS_DHT=dht is not None, STORE_DH0=store_dh0,
        **_products(q.dtype, "reverse", dk, dv), num_warps=LAUNCH["reverse_warps"], num_stages=1,
    )
    return dhs, dvn, (dh0 if store_dh0 else None)


def _backward_inputs(q, k, v, g, beta, do, tm, hs, dhs, vn, dvn, lay, scale, use_l2):
    hk, hv, dk, dv = k.shape[2], v.shape[2], k.shape[3], v.shape[3]
    dev = q.device
    dq = empty(q.shape, q.dtype, dev)
    dkk = empty(k.shape, k.dtype, dev)
    dvv = empty(v.shape, v.dtype, dev)
    dg = empty(g.shape, g.dtype, dev)
    dbeta = empty(beta.shape, beta.dtype, dev)
    DK = max(16, triton.next_power_of_2(dk))
    # A program's [2, C, C] flip and [2, C, Dk] share of dq, dk fit in its own dV_new [C, Dv] and dS_C [Dk, Dv]
    # slots once Dv >= 2C (Qwen3.5's 128): no scratch beyond the reverse pass's then.
    if dv >= 2 * CHUNK:
        flip, flip_slot, share, share_slot = dvn, CHUNK * dv, dhs, dk * dv
    else:
        flip = empty((hv * lay.NCH * 2 * CHUNK * CHUNK,), torch.float32, dev)
        share = empty((hv * lay.NCH * 2 * CHUNK * dk,), torch.float32, dev)
        flip_slot, share_slot = 2 * CHUNK * CHUNK, 2 * CHUNK * dk
    key_products = empty((hk * lay.NCH * 2 * CHUNK * CHUNK,), torch.float32, dev)
    _backward_key_products_kernel[(lay.NCH, hk)](
        q, *_strides(q), k, *_strides(k), key_products, lay.cu, lay.chunk_seq, lay.chunk_first,
        lay.T, lay.NC, lay.NCH, dk, scale,
        C=CHUNK, DK=DK, L2=use_l2, VARLEN=lay.varlen, **_products(q.dtype, "values", dk, dv), num_warps=4,
    )
    shapes = (lay.cu, lay.chunk_seq, lay.chunk_first, lay.T, lay.NC, lay.NCH, hv, hv // hk, dk, dv, scale)
    meta = dict(C=CHUNK, DK=DK, L2=use_l2, VARLEN=lay.varlen, **_products(q.dtype, "values", dk, dv), num_stages=1)
    if _values_split(dv):
        terms = empty((hv * lay.NCH * 2 * CHUNK,), torch.float32, dev)  # dg's and dβ's state terms
        _backward_state_products_kernel[(lay.NCH, hv)](
            q, *_strides(q), k, *_strides(k), g, *_strides(g), beta, *_strides(beta), do, *_strides(do),
            tm, hs, dhs, dvn, vn, share, share_slot, terms, 2 * CHUNK, *shapes,
            BV=LAUNCH["state_products_bv"], num_warps=LAUNCH["state_products_warps"], **meta,
        )
        _backward_chunk_pairs_kernel[(lay.NCH, hv)](
            q, *_strides(q), k, *_strides(k), v, *_strides(v), g, *_strides(g), beta, *_strides(beta),
            do, *_strides(do), tm, vn, dvn, key_products, flip, flip_slot, share, share_slot, terms, 2 * CHUNK,
            dvv, dg, dbeta, *shapes, BV=LAUNCH["chunk_pairs_bv"], num_warps=LAUNCH["chunk_pairs_warps"], **meta,
        )
    else:
        _backward_values_kernel[(lay.NCH, hv)](
            q, *_strides(q), k, *_strides(k), v, *_strides(v), g, *_strides(g), beta, *_strides(beta),
            do, *_strides(do), tm, hs, dhs, vn, dvn, key_products, flip, flip_slot, share, share_slot,
            dvv, dg, dbeta, *shapes, BV=LAUNCH["values_bv"], num_warps=LAUNCH["values_warps"], **meta,
        )
    _backward_keys_kernel[(lay.NCH, hk)](
        q, *_strides(q), k, *_strides(k), share, share_slot, dq, dkk,
        lay.cu, lay.chunk_seq, lay.chunk_first,
        lay.T, lay.NC, lay.NCH, hk, hv // hk, dk, scale,
        C=CHUNK, DK=DK, L2=use_l2, VARLEN=lay.varlen, num_warps=LAUNCH["keys_warps"],
    )
    return dq, dkk, dvv, dg, dbeta


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_l2, cu_seqlens, keep):
        lay = _Layout(q, cu_seqlens)
        kept = (None,) * 4
        if q.shape[1] <= WINDOW:  # the sequential pass updates the states only; the output is chunk-parallel
            w, u, tm = _prepare(q, k, v, g, beta, lay, use_l2, store_t=keep)
            _, ht, hs, vn = _forward_states(
                q, k, g, w, u, initial_state, lay, scale, use_l2,
                compute_o=False, store_final=output_final_state, store_states=True, v_dtype=v.dtype,
            )
            del u
            o = _output(q, k, g, hs, vn, lay, scale, use_l2, v.dtype, q.shape[0], v.shape[3])
            if keep:
                kept = (w, tm, hs, vn)
        else:  # longer: no per-chunk states kept, the output computed in the sequential pass
            w, u, _ = _prepare(q, k, v, g, beta, lay, use_l2, store_t=False)
            o, ht, _, _ = _forward_states(
                q, k, g, w, u, initial_state, lay, scale, use_l2,
                compute_o=True, store_final=output_final_state, store_states=False, v_dtype=v.dtype,
            )
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *kept)
        ctx.scale, ctx.use_l2 = scale, use_l2
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, *kept = ctx.saved_tensors
        scale, use_l2 = ctx.scale, ctx.use_l2
        if do is None:
            do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        want_dh0 = initial_state is not None and ctx.needs_input_grad[6]
        if cu_seqlens is None and q.shape[1] > WINDOW:
            grads, dh0 = _backward_by_windows(q, k, v, g, beta, do, initial_state, dht, scale, use_l2, want_dh0)
        else:
            *grads, dh0 = _backward(
                q, k, v, g, beta, do, initial_state, dht, cu_seqlens, scale, use_l2, want_dh0,
                kept=kept if kept[0] is not None else None,
            )
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        need = ctx.needs_input_grad
        return (*(grad if wanted else None for grad, wanted in zip(grads, need[:5], strict=True)),
                None, dh0, None, None, None, None)


def _backward(q, k, v, g, beta, do, h0, dht, cu_seqlens, scale, use_l2, want_dh0, kept=None):
    """(dq, dk, dv, dg, dβ, d initial state or None) of one pass over the whole sequence; `kept`, the forward's
    (W, T, chunk-start states, V_new) where it kept them, else recomputed here."""
    lay = _Layout(q, cu_seqlens)
    if kept is None:
        w, u, tm = _prepare(q, k, v, g, beta, lay, use_l2, store_t=True)
        _, _, hs, vn = _forward_states(
            q, k, g, w, u, h0, lay, scale, use_l2,
            compute_o=False, store_final=False, store_states=True, v_dtype=v.dtype,
        )
        del u
    else:
        w, tm, hs, vn = kept
    dhs, dvn, dh0 = _backward_states(q, k, g, do, w, dht, lay, scale, use_l2, want_dh0)
    del w
    return (*_backward_inputs(q, k, v, g, beta, do, tm, hs, dhs, vn, dvn, lay, scale, use_l2), dh0)


def _backward_by_windows(q, k, v, g, beta, do, h0, dht, scale, use_l2, want_dh0):
    """The backward of a fixed-length batch longer than WINDOW tokens, one window at a time from the last:
    the scratch (fp32, about 15 times the bytes of a bf16 v) is that of one window, not of the sequence.
    A first pass runs the states forward to keep each window's starting state; the gradient of a window's
    starting state is the next one back's end-state gradient."""
    windows = [slice(start, min(start + WINDOW, q.shape[1])) for start in range(0, q.shape[1], WINDOW)]
    starts = [h0]
    for window in windows[:-1]:
        xs = [x[:, window] for x in (q, k, v, g, beta)]
        lay = _Layout(xs[0], None)
        w, u, _ = _prepare(*xs, lay, use_l2, store_t=False)
        starts.append(_forward_states(
            xs[0], xs[1], xs[3], w, u, starts[-1], lay, scale, use_l2,
            compute_o=False, store_final=True, store_states=False, v_dtype=v.dtype,
        )[1])
        del w, u
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta)]
    for n in reversed(range(len(windows))):
        window = windows[n]
        xs = [x[:, window] for x in (q, k, v, g, beta)]
        *window_grads, dht = _backward(
            *xs, do[:, window], starts[n], dht, None, scale, use_l2, want_dh0=n > 0 or want_dh0
        )
        for grad, window_grad in zip(grads, window_grads, strict=True):
            grad[:, window].copy_(window_grad)
    return grads, dht


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """The gated delta rule over q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g, beta `[B, T, Hv]`.

    Returns `(o [B, T, Hv, Dv] in v's dtype, final state [N, Hv, Dk, Dv] fp32 or None)`; N is B, or the number
    of documents of `cu_seqlens` (then B must be 1 and each document starts from its own `initial_state[n]`).
    """
    check_args(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    inputs = (q, k, v, g, beta, initial_state)
    keep = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    return ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, scale, initial_state, bool(output_final_state), bool(use_qk_l2norm_in_kernel), cu_seqlens,
        keep,
    )
