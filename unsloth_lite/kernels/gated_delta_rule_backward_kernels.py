"""The backward's Triton kernels of the chunked Gated DeltaNet (layout conventions in `gated_delta_rule_kernels.py`,
the math in `gated_delta_rule.py`): the reverse pass's state-free terms, the reverse sequential pass, and the
chunk-parallel input gradients."""

from __future__ import annotations

import triton
import triton.language as tl

from unsloth_lite.kernels.gated_delta_rule_kernels import (
    _chunk_of_program,
    _dot,
    _dot_operands,
    _input_operand,
    _load_raw_cols,
    _load_raw_rows,
    _load_state_block,
    _load_vec,
    _operand,
    _sequence_of_program,
)


@triton.jit
def _backward_state_free_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    g_ptr, s_gb, s_gt, s_gh,
    do_ptr, s_ob, s_ot, s_oh, s_oe,
    dhs_ptr, dvn_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """Chunk-parallel, the reverse pass's terms that do not depend on the state, for the Dv columns
    [pid_v*BV, +BV) of one chunk of one value head: Mᵀ dO into dV_new's slot and scale (Q⊙Γ)ᵀ dO into
    dS_C's slot (the reverse pass reads each before it writes its own value there)."""
    pid_c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pid_v = tl.program_id(2)
    hk = h // G
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    e = pid_v * BV + tl.arange(0, BV)
    mask_e = e < Dv
    gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
    k, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    qT, r_q = _load_raw_cols(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    r_q = r_q * scale
    # mT[j, i] = M[i, j] = scale (q_i·k_j) exp(γ_i - γ_j) for i >= j.
    upper_incl = rows[None, :] >= rows[:, None]
    mT = _dot(k, qT, PREC, EXACT, EXACT) * (r_k[:, None] * r_q[None, :])
    mT = tl.where(upper_incl, mT * tl.exp(tl.where(upper_incl, gam[None, :] - gam[:, None], 0.0)), 0.0)
    do = tl.load(
        do_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + e[None, :] * s_oe,
        mask=mask_t[:, None] & mask_e[None, :], other=0.0,
    ).to(tl.float32)
    base = h * NCH + pid_c
    tl.store(dvn_ptr + (base * C + rows[:, None]) * Dv + e[None, :], _dot(mT, do, PREC, False, EXACT),
             mask=mask_e[None, :])
    tl.store(dhs_ptr + base * Dk * Dv + d[:, None] * Dv + e[None, :],
             _dot(qT * (r_q * tl.exp(gam))[None, :], do, PREC, False, EXACT),
             mask=(d[:, None] < Dk) & mask_e[None, :])


@triton.jit
def _backward_states_kernel(
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    g_ptr, s_gb, s_gt, s_gh,
    w_ptr,
    dht_ptr, s_dtn, s_dth, s_dtd, s_dte,
    dhs_ptr, dvn_ptr, dh0_ptr,
    cu_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """The reverse sequential pass: for each chunk from the last, store dS_C (the gradient of its end state),
    dV_new = Mᵀ dO + K̃ dS_C, and dS <- exp(γ_C) dS_C + scale (Q⊙Γ)ᵀ dO - Wᵀ dV_new, the state-free terms
    Mᵀ dO and scale (Q⊙Γ)ᵀ dO read from the slots `_backward_state_free_kernel` wrote them to."""
    pid_v = tl.program_id(0)
    pid_nh = tl.program_id(1).to(tl.int64)
    n = pid_nh // Hv
    h = pid_nh % Hv
    hk = h // G
    b, bos, eos, first, count = _sequence_of_program(n, cu_ptr, chunk_first_ptr, T, NC, VARLEN)
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    mask_d = d < Dk
    e = pid_v * BV + tl.arange(0, BV)
    mask_e = e < Dv
    mask_de = mask_d[:, None] & mask_e[None, :]
    dS = _load_state_block(dht_ptr, n, h, s_dtn, s_dth, s_dtd, s_dte, d, e, mask_de, HAS_DHT, DK, BV)
    for j in range(0, count):
        i = count - 1 - j
        c = first + i
        t = bos + i * C + rows
        mask_t = t < eos
        base = h * NCH + c
        state_slot = dhs_ptr + base * Dk * Dv + d[:, None] * Dv + e[None, :]
        value_slot = dvn_ptr + (base * C + rows[:, None]) * Dv + e[None, :]
        q_do = tl.load(state_slot, mask=mask_de, other=0.0)
        m_do = tl.load(value_slot, mask=mask_e[None, :], other=0.0)
        tl.debug_barrier()  # every thread has read its slots before any overwrites them
        tl.store(state_slot, dS, mask=mask_de)
        gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
        gam_last = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        k, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
        dvn = m_do + _dot(k, dS, PREC, EXACT, False) * (r_k * tl.exp(gam_last - gam))[:, None]  # K̃ dS_C
        tl.store(value_slot, dvn, mask=mask_e[None, :])
        wT = tl.load(w_ptr + (base * C + rows[None, :]) * Dk + d[:, None], mask=mask_d[:, None], other=0.0)
        dS = dS * tl.exp(gam_last) + q_do - _dot(wT, dvn, PREC)
    if STORE_DH0:
        tl.store(dh0_ptr + ((n * Hv + h) * Dk + d[:, None]) * Dv + e[None, :], dS, mask=mask_de)


@triton.jit
def _backward_key_products_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    out_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Dk, scale,
    C: tl.constexpr, DK: tl.constexpr, L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Chunk-parallel, one program per (chunk, key head): scale·Q Kᵀ and K Kᵀ of the chunk (`[2, C, C]`, fp32),
    which every value head of the key head reads in `_backward_values_kernel` (its products over Dk cost that
    kernel most of its shared memory)."""
    pid_c = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    rows = tl.arange(0, C)
    q, r_q = _load_raw_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    k, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    kT, r_cols = _load_raw_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    out = out_ptr + (hk * NCH + pid_c) * 2 * C * C + rows[:, None] * C + rows[None, :]
    tl.store(out, _dot(q, kT, PREC, EXACT, EXACT) * ((r_q * scale)[:, None] * r_cols[None, :]))
    tl.store(out + C * C, _dot(k, kT, PREC, EXACT, EXACT) * (r_k[:, None] * r_cols[None, :]))


@triton.jit
def _backward_values_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    v_ptr, s_vb, s_vt, s_vh, s_vd,
    g_ptr, s_gb, s_gt, s_gh,
    beta_ptr, s_bb, s_bt, s_bh,
    do_ptr, s_ob, s_ot, s_oh, s_oe,
    tm_ptr, hs_ptr, dhs_ptr, vn_ptr, dvn_ptr, key_products_ptr,
    flip_ptr, flip_slot, part_ptr, part_slot,
    dv_ptr, dg_ptr, dbeta_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """Chunk-parallel, one program per (chunk, value head): dv, dg, dβ, and this value head's share of the
    gradients of scale·q̂ and k̂ (fp32, `[2, C, Dk]` at `part_ptr + program * part_slot`; `_backward_keys_kernel`
    sums a key head's G shares). The transposes of dM and of dA's term G are read back from the program's own
    `[2, C, C]` at `flip_ptr + program * flip_slot` after a barrier, not accumulated as second products. Both
    slots may lie in the program's own dS_C and dV_new slots (the launcher's choice): each is written only after
    the barrier that follows the program's last read of those."""
    pid_c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // G
    base = h * NCH + pid_c
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    mask_d = d < Dk
    lower = rows[None, :] < rows[:, None]
    lower_incl = rows[None, :] <= rows[:, None]
    beta = _load_vec(beta_ptr, b, t, h, s_bb, s_bt, s_bh, mask_t)
    gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
    gam_last = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
    decay_q = tl.exp(gam)
    decay_k = tl.exp(gam_last - gam)
    # Tiles that enter products are made operands once as loaded (dO, a 16-bit input's values, by `_input_operand`).
    tm_T = _operand(tl.load(tm_ptr + (base * C + rows[None, :]) * C + rows[:, None]), PREC)  # Tᵀ
    # The three products over Dv, summed whole before their row sums with q and k (which are loaded after the
    # loop: fewer tiles live through it)
    do_s0 = tl.zeros([C, DK], dtype=tl.float32)  # dO S0ᵀ
    vn_dsc = tl.zeros([C, DK], dtype=tl.float32)  # V_new dS_Cᵀ
    du_s0 = tl.zeros([C, DK], dtype=tl.float32)  # Tᵀ dV_new S0ᵀ
    dA = tl.zeros([C, C], dtype=tl.float32)
    dM = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    dgam = tl.zeros([C], dtype=tl.float32)  # terms of exp(γ_i) alone: they reach g_t for t <= i
    dgam_after = tl.zeros([C], dtype=tl.float32)  # terms of exp(γ_C - γ_i): they reach g_t for t > i
    dgam_last = tl.sum(tl.zeros([C], dtype=tl.float32), 0)  # terms of exp(γ_C) alone: every g_t
    for v0 in range(0, Dv, BV):
        e = v0 + tl.arange(0, BV)
        mask_e = e < Dv
        mask_te = mask_t[:, None] & mask_e[None, :]
        rows_ce = (base * C + rows[:, None]) * Dv + e[None, :]
        cols_ce = (base * C + rows[None, :]) * Dv + e[:, None]
        vn = _operand(tl.load(vn_ptr + rows_ce, mask=mask_e[None, :], other=0.0), PREC)
        vn_T = _operand(tl.load(vn_ptr + cols_ce, mask=mask_e[:, None], other=0.0), PREC)
        dvn = _operand(tl.load(dvn_ptr + rows_ce, mask=mask_e[None, :], other=0.0), PREC)
        do = _input_operand(tl.load(
            do_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + e[None, :] * s_oe, mask=mask_te, other=0.0
        ).to(tl.float32), PREC)
        state = base * Dk * Dv + d[None, :] * Dv + e[:, None]
        mask_ed = mask_e[:, None] & mask_d[None, :]
        s0_T = tl.load(hs_ptr + state, mask=mask_ed, other=0.0)  # S0ᵀ [BV, DK]
        dsc_T = tl.load(dhs_ptr + state, mask=mask_ed, other=0.0)  # dS_Cᵀ
        # state update: S_C = exp(γ_C) S0 + ...
        dgam_last += tl.exp(gam_last) * tl.sum(tl.sum(s0_T * dsc_T, 1), 0)
        s0_T = _operand(s0_T, PREC)
        dsc_T = _operand(dsc_T, PREC)
        v = tl.load(
            v_ptr + b * s_vb + t[:, None] * s_vt + h * s_vh + e[None, :] * s_vd, mask=mask_te, other=0.0
        ).to(tl.float32)

        du = _dot_operands(tm_T, dvn, PREC)  # Tᵀ dV_new
        tl.store(
            dv_ptr + ((b * T + t[:, None]) * Hv + h) * Dv + e[None, :],
            (du * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mask_te,
        )
        dbeta += tl.sum(v * du, 1)
        du_operand = _operand(du, PREC)
        dA -= _dot_operands(du_operand, vn_T, PREC)
        dM += _dot_operands(do, vn_T, PREC, EXACT, False)
        do_s0 += _dot_operands(do, s0_T, PREC, EXACT, False)
        vn_dsc += _dot_operands(vn, dsc_T, PREC)
        du_s0 += _dot_operands(du_operand, s0_T, PREC)

    # q and k as stored (the products' exact operands) and normalised (the row sums')
    q_raw, r_q = _load_raw_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    k_raw, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    r_q = r_q * scale
    q = q_raw * r_q[:, None]
    k = k_raw * r_k[:, None]
    # inter-chunk read of the state: O += scale (Q⊙Γ) S0
    dq = do_s0 * decay_q[:, None]  # gradient of scale·q̂
    dgam += decay_q * tl.sum(q * do_s0, 1)
    # state update: S_C += K̃ᵀ V_new
    dk = vn_dsc * decay_k[:, None]  # gradient of k̂
    dgam_after += tl.sum(k * vn_dsc, 1) * decay_k
    # W = T(βΓ⊙K): dW̃ = Tᵀ dW = -Tᵀ dV_new S0ᵀ
    dk -= du_s0 * (beta * decay_q)[:, None]
    x = -tl.sum(k * du_s0, 1) * decay_q
    dbeta += x
    dgam += beta * x

    # intra-chunk attention M = tril(scale Q Kᵀ ⊙ D)
    decay = tl.exp(tl.where(lower_incl, gam[:, None] - gam[None, :], 0.0))
    dM = tl.where(lower_incl, dM * decay, 0.0)
    dq += _dot(dM * r_k[None, :], k_raw, PREC, False, EXACT)
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
    tl.debug_barrier()  # every thread has read its dS_C and dV_new: the flip and share slots may overwrite them
    tl.store(flip + square, dM)
    tl.store(flip + C * C + square, dA)
    tl.debug_barrier()  # every thread's stores visible to every thread of the program
    dM_T = tl.load(flip + square_T, cache_modifier=".cg")
    dA_T = tl.load(flip + C * C + square_T, cache_modifier=".cg")
    dk += _dot(dM_T * r_q[None, :], q_raw, PREC, False, EXACT)
    dk += _dot((dA + dA_T) * r_k[None, :], k_raw, PREC, False, EXACT)  # (G + Gᵀ) K
    # dg_t = Σ_{s>=t} dγ_s + dγ_C, summed by what each term depends on (module docstring): a D_ij term reaches
    # g_t for j < t <= i only, so the pairs are summed over that range directly rather than as row and column
    # sums that cancel in the reverse cumulative sum.
    after = tl.cumsum(pairs, 0, reverse=True)  # [t, j]: Σ_{i>=t} pairs_ij
    dg = tl.sum(tl.where(lower, after, 0.0), 1)
    dg += tl.cumsum(dgam, 0, reverse=True)
    dg += tl.sum(tl.where(lower, dgam_after[None, :], 0.0), 1) + dgam_last
    tl.store(dg_ptr + (b * T + t) * Hv + h, dg.to(dg_ptr.dtype.element_ty), mask=mask_t)
    tl.store(dbeta_ptr + (b * T + t) * Hv + h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mask_t)
    share = part_ptr + base * part_slot + rows[:, None] * Dk + d[None, :]
    tl.store(share, dq, mask=mask_d[None, :])
    tl.store(share + C * Dk, dk, mask=mask_d[None, :])


@triton.jit
def _backward_keys_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    part_ptr, part_slot, dq_ptr, dk_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hk, G, Dk, scale,
    C: tl.constexpr, DK: tl.constexpr, L2: tl.constexpr, VARLEN: tl.constexpr,
):
    """Chunk-parallel, one program per (chunk, key head): dq, dk as the sum of the G value heads' shares (in
    order: the same bits every run), through the scale and the L2 norm."""
    pid_c = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    mask_d = d < Dk
    at = rows[:, None] * Dk + d[None, :]
    dq = tl.zeros([C, DK], dtype=tl.float32)
    dk = tl.zeros([C, DK], dtype=tl.float32)
    for j in range(0, G):
        share = part_ptr + ((hk * G + j) * NCH + pid_c) * part_slot
        dq += tl.load(share + at, mask=mask_d[None, :], other=0.0)
        dk += tl.load(share + C * Dk + at, mask=mask_d[None, :], other=0.0)
    dq = dq * scale
    if L2:
        q, r_q = _load_raw_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
        k, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
        q = q * r_q[:, None]
        k = k * r_k[:, None]
        dq = r_q[:, None] * (dq - q * tl.sum(q * dq, 1)[:, None])
        dk = r_k[:, None] * (dk - k * tl.sum(k * dk, 1)[:, None])
    out = ((b * T + t[:, None]) * Hk + hk) * Dk + d[None, :]
    mask_td = mask_t[:, None] & mask_d[None, :]
    tl.store(dq_ptr + out, dq.to(dq_ptr.dtype.element_ty), mask=mask_td)
    tl.store(dk_ptr + out, dk.to(dk_ptr.dtype.element_ty), mask=mask_td)
