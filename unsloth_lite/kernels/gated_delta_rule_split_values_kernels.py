"""The backward's chunk-parallel input gradients of the chunked Gated DeltaNet in two kernels (`LAUNCH["values_split"]`;
the math in `gated_delta_rule.py`, the one-kernel form `_backward_values_kernel`): what it sums over the value
columns falls into two families with no product in common but Ū = Tᵀ dV_new, and one program holding both
(three `[C, Dk]` and two `[C, C]` fp32 accumulators) spills at 255 registers a thread.

1. `_backward_state_products_kernel`, first: the products with the chunk's states, dO S0ᵀ, V_new dS_Cᵀ and
   W̄ = −Ū S0ᵀ (Ū recomputed), and every term of dq, dk, dβ and dg that they feed. Its reads of dS_C are the
   last: it writes its dq, dk terms over its own dS_C slot (from Dv = 2C on; a buffer below), its dg, dβ terms
   to a small buffer of their own (S0 may be the forward's, kept for another backward).
2. `_backward_chunk_pairs_kernel`, then: Ū and dv, dM = dO V_newᵀ and dA = −Ū V_newᵀ, and the terms they feed;
   it adds the first kernel's terms and writes dv, dg, dβ and the value head's shares of dq, dk (which
   `_backward_keys_kernel` sums over the key head's value heads). It reads no state: its flip of dM and G passes
   through its own dV_new slot (from Dv = 2C on) after its last read of it, as in the one-kernel form.

Both compute the same terms as the one-kernel form, in the same products; only the order of a few fp32 sums
differs."""

from __future__ import annotations

import triton
import triton.language as tl

from unsloth_lite.kernels.gated_delta_rule_kernels import (
    _chunk_of_program,
    _dot,
    _dot_operands,
    _input_operand,
    _load_raw_rows,
    _load_vec,
    _operand,
)


@triton.jit
def _value_head_chunk(
    g_ptr, s_gb, s_gt, s_gh, beta_ptr, s_bb, s_bt, s_bh, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, NCH, G,
    C: tl.constexpr, VARLEN: tl.constexpr,
):
    """The program's (chunk, value head, its key head, its scratch slot, batch row, tokens, which tokens lie in
    the sequence, β of the tokens, γ = the in-chunk cumsum of g)."""
    pid_c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    beta = _load_vec(beta_ptr, b, t, h, s_bb, s_bt, s_bh, mask_t)
    gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
    return pid_c, h, h // G, h * NCH + pid_c, b, t, mask_t, beta, gam


@triton.jit
def _backward_state_products_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    g_ptr, s_gb, s_gt, s_gh,
    beta_ptr, s_bb, s_bt, s_bh,
    do_ptr, s_ob, s_ot, s_oh, s_oe,
    tm_ptr, hs_ptr, dhs_ptr, dvn_ptr, vn_ptr,
    part_ptr, part_slot, terms_ptr, terms_slot,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """Chunk-parallel, one program per (chunk, value head): the terms of dq, dk (`[2, C, Dk]` at
    `part_ptr + program * part_slot`) and of dg, dβ (`[2, C]` at `terms_ptr + program * terms_slot`) that come
    from the state products (module docstring). The first may lie in the program's own dS_C slot (the launcher's
    choice): it is written after the barrier that follows the program's last read of it."""
    pid_c, h, hk, base, b, t, mask_t, beta, gam = _value_head_chunk(
        g_ptr, s_gb, s_gt, s_gh, beta_ptr, s_bb, s_bt, s_bh, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, NCH, G,
        C, VARLEN,
    )
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    mask_d = d < Dk
    lower = rows[None, :] < rows[:, None]
    gam_last = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
    decay_q = tl.exp(gam)
    decay_k = tl.exp(gam_last - gam)
    tm_T = _operand(tl.load(tm_ptr + (base * C + rows[None, :]) * C + rows[:, None]), PREC)  # Tᵀ
    do_s0 = tl.zeros([C, DK], dtype=tl.float32)  # dO S0ᵀ
    vn_dsc = tl.zeros([C, DK], dtype=tl.float32)  # V_new dS_Cᵀ
    du_s0 = tl.zeros([C, DK], dtype=tl.float32)  # Ū S0ᵀ
    dgam_last = tl.sum(tl.zeros([C], dtype=tl.float32), 0)  # terms of exp(γ_C) alone: every g_t
    for v0 in range(0, Dv, BV):
        e = v0 + tl.arange(0, BV)
        mask_e = e < Dv
        rows_ce = (base * C + rows[:, None]) * Dv + e[None, :]
        vn = _operand(tl.load(vn_ptr + rows_ce, mask=mask_e[None, :], other=0.0), PREC)
        dvn = _operand(tl.load(dvn_ptr + rows_ce, mask=mask_e[None, :], other=0.0), PREC)
        do = _input_operand(tl.load(
            do_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + e[None, :] * s_oe,
            mask=mask_t[:, None] & mask_e[None, :], other=0.0,
        ).to(tl.float32), PREC)
        state = base * Dk * Dv + d[None, :] * Dv + e[:, None]
        mask_ed = mask_e[:, None] & mask_d[None, :]
        s0_T = tl.load(hs_ptr + state, mask=mask_ed, other=0.0)  # S0ᵀ [BV, DK]
        dsc_T = tl.load(dhs_ptr + state, mask=mask_ed, other=0.0)  # dS_Cᵀ
        dgam_last += tl.exp(gam_last) * tl.sum(tl.sum(s0_T * dsc_T, 1), 0)  # S_C = exp(γ_C) S0 + ...
        s0_T = _operand(s0_T, PREC)
        du = _operand(_dot_operands(tm_T, dvn, PREC), PREC)  # Ū = Tᵀ dV_new
        do_s0 += _dot_operands(do, s0_T, PREC, EXACT, False)
        vn_dsc += _dot_operands(vn, _operand(dsc_T, PREC), PREC)
        du_s0 += _dot_operands(du, s0_T, PREC)

    q_raw, r_q = _load_raw_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    k_raw, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    q = q_raw * (r_q * scale)[:, None]
    k = k_raw * r_k[:, None]
    # inter-chunk read of the state: O += scale (Q⊙Γ) S0
    dq = do_s0 * decay_q[:, None]  # gradient of scale·q̂
    dgam = decay_q * tl.sum(q * do_s0, 1)  # terms of exp(γ_i) alone: they reach g_t for t <= i
    # state update: S_C += K̃ᵀ V_new
    dk = vn_dsc * decay_k[:, None]  # gradient of k̂
    dgam_after = tl.sum(k * vn_dsc, 1) * decay_k  # terms of exp(γ_C - γ_i): they reach g_t for t > i
    # W = T(βΓ⊙K): dW̃ = Tᵀ dW = -Ū S0ᵀ
    dk -= du_s0 * (beta * decay_q)[:, None]
    dbeta = -tl.sum(k * du_s0, 1) * decay_q
    dgam += beta * dbeta
    dg = tl.cumsum(dgam, 0, reverse=True)
    dg += tl.sum(tl.where(lower, dgam_after[None, :], 0.0), 1) + dgam_last
    tl.debug_barrier()  # every thread has read its dS_C: the share may overwrite it
    share = part_ptr + base * part_slot + rows[:, None] * Dk + d[None, :]
    tl.store(share, dq, mask=mask_d[None, :])
    tl.store(share + C * Dk, dk, mask=mask_d[None, :])
    terms = terms_ptr + base * terms_slot + rows
    tl.store(terms, dg)
    tl.store(terms + C, dbeta)


@triton.jit
def _backward_chunk_pairs_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    v_ptr, s_vb, s_vt, s_vh, s_vd,
    g_ptr, s_gb, s_gt, s_gh,
    beta_ptr, s_bb, s_bt, s_bh,
    do_ptr, s_ob, s_ot, s_oh, s_oe,
    tm_ptr, vn_ptr, dvn_ptr, key_products_ptr,
    flip_ptr, flip_slot, part_ptr, part_slot, terms_ptr, terms_slot,
    dv_ptr, dg_ptr, dbeta_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """Chunk-parallel, one program per (chunk, value head), after `_backward_state_products_kernel`: dv, and the
    in-chunk pair terms of dq, dk, dβ and dg added to that kernel's (read from its slots, the shares written back
    in place). The transposes of dM and of dA's term G are read back from the program's own `[2, C, C]` at
    `flip_ptr + program * flip_slot` after a barrier, which may lie in its dV_new slot."""
    pid_c, h, hk, base, b, t, mask_t, beta, gam = _value_head_chunk(
        g_ptr, s_gb, s_gt, s_gh, beta_ptr, s_bb, s_bt, s_bh, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, NCH, G,
        C, VARLEN,
    )
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    mask_d = d < Dk
    lower = rows[None, :] < rows[:, None]
    lower_incl = rows[None, :] <= rows[:, None]
    tm_T = _operand(tl.load(tm_ptr + (base * C + rows[None, :]) * C + rows[:, None]), PREC)  # Tᵀ
    dA = tl.zeros([C, C], dtype=tl.float32)
    dM = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, Dv, BV):
        e = v0 + tl.arange(0, BV)
        mask_e = e < Dv
        mask_te = mask_t[:, None] & mask_e[None, :]
        rows_ce = (base * C + rows[:, None]) * Dv + e[None, :]
        cols_ce = (base * C + rows[None, :]) * Dv + e[:, None]
        vn_T = _operand(tl.load(vn_ptr + cols_ce, mask=mask_e[:, None], other=0.0), PREC)
        dvn = _operand(tl.load(dvn_ptr + rows_ce, mask=mask_e[None, :], other=0.0), PREC)
        do = _input_operand(tl.load(
            do_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + e[None, :] * s_oe, mask=mask_te, other=0.0
        ).to(tl.float32), PREC)
        v = tl.load(
            v_ptr + b * s_vb + t[:, None] * s_vt + h * s_vh + e[None, :] * s_vd, mask=mask_te, other=0.0
        ).to(tl.float32)
        du = _dot_operands(tm_T, dvn, PREC)  # Ū = Tᵀ dV_new
        tl.store(
            dv_ptr + ((b * T + t[:, None]) * Hv + h) * Dv + e[None, :],
            (du * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mask_te,
        )
        dbeta += tl.sum(v * du, 1)
        dA -= _dot_operands(_operand(du, PREC), vn_T, PREC)
        dM += _dot_operands(do, vn_T, PREC, EXACT, False)

    q_raw, r_q = _load_raw_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    k_raw, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    r_q = r_q * scale
    # intra-chunk attention M = tril(scale Q Kᵀ ⊙ D)
    decay = tl.exp(tl.where(lower_incl, gam[:, None] - gam[None, :], 0.0))
    dM = tl.where(lower_incl, dM * decay, 0.0)
    dq = _dot(dM * r_k[None, :], k_raw, PREC, False, EXACT)
    square = rows[:, None] * C + rows[None, :]
    key_products = key_products_ptr + (hk * NCH + pid_c) * 2 * C * C
    pairs = dM * tl.load(key_products + square)  # dM ⊙ M: terms of D_ij = exp(γ_i - γ_j)
    # A = strictly-lower(β_i (k_i·k_j) D_ij)
    p = tl.where(lower, tl.load(key_products + C * C + square) * decay, 0.0)
    dA = tl.where(lower, dA, 0.0)
    x = dA * p
    dbeta += tl.sum(x, 1)
    pairs += x * beta[:, None]
    dA = dA * decay * beta[:, None]  # G
    square_T = rows[None, :] * C + rows[:, None]
    flip = flip_ptr + base * flip_slot
    tl.debug_barrier()  # every thread has read its dV_new: the flip may overwrite it
    tl.store(flip + square, dM)
    tl.store(flip + C * C + square, dA)
    tl.debug_barrier()  # every thread's stores visible to every thread of the program
    dM_T = tl.load(flip + square_T, cache_modifier=".cg")
    dA_T = tl.load(flip + C * C + square_T, cache_modifier=".cg")
    dk = _dot(dM_T * r_q[None, :], q_raw, PREC, False, EXACT)
    dk += _dot((dA + dA_T) * r_k[None, :], k_raw, PREC, False, EXACT)  # (G + Gᵀ) K
    # the D_ij terms reach g_t for j < t <= i only (`_backward_values_kernel`)
    after = tl.cumsum(pairs, 0, reverse=True)  # [t, j]: Σ_{i>=t} pairs_ij
    dg = tl.sum(tl.where(lower, after, 0.0), 1)
    terms = terms_ptr + base * terms_slot + rows
    dg += tl.load(terms)
    dbeta += tl.load(terms + C)
    tl.store(dg_ptr + (b * T + t) * Hv + h, dg.to(dg_ptr.dtype.element_ty), mask=mask_t)
    tl.store(dbeta_ptr + (b * T + t) * Hv + h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mask_t)
    share = part_ptr + base * part_slot + rows[:, None] * Dk + d[None, :]
    tl.store(share, tl.load(share, mask=mask_d[None, :], other=0.0) + dq, mask=mask_d[None, :])
    tl.store(share + C * Dk, tl.load(share + C * Dk, mask=mask_d[None, :], other=0.0) + dk, mask=mask_d[None, :])
