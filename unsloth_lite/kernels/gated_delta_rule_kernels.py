"""Triton kernels of the chunked Gated DeltaNet (`gated_delta_rule.py` has the math, launchers and autograd).

Layout conventions shared by every kernel:

* q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g, beta `[B, T, Hv]`, dO `[B, T, Hv, Dv]` are read through their
  strides; value head h reads key head h // G (G = Hv / Hk).
* A "sequence" n is batch row n (fixed length T), or document n of a varlen batch (B = 1, tokens
  [cu[n], cu[n+1])). Chunks of C tokens never straddle sequences. Chunk c of the whole batch is numbered
  globally: n * NC + i for fixed length, `chunk_first[n] + i` for varlen (`chunk_seq[c]` = its document).
* Scratch buffers are chunk-major per value head, fp32, rows of a whole chunk (padding rows hold zeros):
  W `[Hv, NCH, C, Dk]`, U / V_new / dV_new `[Hv, NCH, C, Dv]`, T `[Hv, NCH, C, C]`, states `[Hv, NCH, Dk, Dv]`.
* Math is fp32. Every `tl.dot` takes fp32 operands (the interpreter mishandles 16-bit ones) with an explicit
  `input_precision` (PREC: "ieee" for fp32 inputs, "tf32" for 16-bit ones).
* No `tl.trans` anywhere: a transposed operand is loaded transposed through pointer arithmetic, so the only
  `tl.dot` forms are loaded x loaded, computed x loaded and loaded x computed (Triton on Hopper miscompiles a
  transposed dot result fed to another dot).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C: tl.constexpr, VARLEN: tl.constexpr):
    """(batch row, the chunk's C token indices, which of them lie in its sequence) of global chunk `pid_c`."""
    if VARLEN:
        n = tl.load(chunk_seq_ptr + pid_c).to(tl.int64)
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
        first = tl.load(chunk_first_ptr + n).to(tl.int64)
        b = n * 0
        t0 = bos + (pid_c - first) * C
    else:
        b = pid_c // NC
        t0 = (pid_c % NC) * C
        eos = b * 0 + T
    t = t0 + tl.arange(0, C)
    return b, t, t < eos


@triton.jit
def _sequence_of_program(n, cu_ptr, chunk_first_ptr, T, NC, VARLEN: tl.constexpr):
    """(batch row, first token, end token, first global chunk, chunk count) of sequence `n`."""
    if VARLEN:
        first = tl.load(chunk_first_ptr + n).to(tl.int64)
        count = tl.load(chunk_first_ptr + n + 1).to(tl.int64) - first
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
        b = n * 0
    else:
        first = n * NC
        count = n * 0 + NC
        bos = n * 0
        eos = n * 0 + T
        b = n
    return b, bos, eos, first, count


@triton.jit
def _load_rows(ptr, b, t, h, s_b, s_t, s_h, s_d, mask_t, Dk, DK: tl.constexpr, L2: tl.constexpr):
    """A `[C, DK]` tile of q or k (rows = tokens `t`), fp32, L2-normalised per token when asked; and 1/norm."""
    d = tl.arange(0, DK)
    x = tl.load(
        ptr + b * s_b + t[:, None] * s_t + h * s_h + d[None, :] * s_d,
        mask=mask_t[:, None] & (d[None, :] < Dk), other=0.0,
    ).to(tl.float32)
    if L2:
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6)
    else:
        r = tl.full(t.shape, 1.0, tl.float32)
    return x * r[:, None], r


@triton.jit
def _load_cols(ptr, b, t, h, s_b, s_t, s_h, s_d, mask_t, Dk, DK: tl.constexpr, L2: tl.constexpr):
    """The same tile loaded transposed, `[DK, C]`."""
    d = tl.arange(0, DK)
    x = tl.load(
        ptr + b * s_b + t[None, :] * s_t + h * s_h + d[:, None] * s_d,
        mask=mask_t[None, :] & (d[:, None] < Dk), other=0.0,
    ).to(tl.float32)
    if L2:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, 0) + 1e-6))[None, :]
    return x


@triton.jit
def _load_vec(ptr, b, t, h, s_b, s_t, s_h, mask_t):
    return tl.load(ptr + b * s_b + t * s_t + h * s_h, mask=mask_t, other=0.0).to(tl.float32)


@triton.jit
def _invert_diagonal_blocks(block, s_row, B: tl.constexpr):
    """(I + A_bb)^-1 of the four diagonal `[B, B]` blocks of the strictly lower A at `block` (row stride `s_row`),
    by forward substitution in fp32: row i of an inverse is e_i − Σ_{j<i} A_ij (row j). Row i of A is loaded,
    not extracted from a tile (one reduction a step, not two); the four blocks step together."""
    r = tl.arange(0, B)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    t0, t1, t2, t3 = eye, eye, eye, eye
    for i in tl.static_range(1, B):
        row = block + i * s_row + r
        here = r[:, None] == i
        a0 = tl.load(row, cache_modifier=".cg")
        a1 = tl.load(row + (s_row + 1) * B, cache_modifier=".cg")
        a2 = tl.load(row + (s_row + 1) * 2 * B, cache_modifier=".cg")
        a3 = tl.load(row + (s_row + 1) * 3 * B, cache_modifier=".cg")
        t0 -= tl.where(here, tl.sum(a0[:, None] * t0, 0)[None, :], 0.0)
        t1 -= tl.where(here, tl.sum(a1[:, None] * t1, 0)[None, :], 0.0)
        t2 -= tl.where(here, tl.sum(a2[:, None] * t2, 0)[None, :], 0.0)
        t3 -= tl.where(here, tl.sum(a3[:, None] * t3, 0)[None, :], 0.0)
    return t0, t1, t2, t3


@triton.jit
def _prepare_kernel(
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    v_ptr, s_vb, s_vt, s_vh, s_vd,
    g_ptr, s_gb, s_gt, s_gh,
    beta_ptr, s_bb, s_bt, s_bh,
    w_ptr, u_ptr, scratch_ptr, s_row,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, G, Dk, Dv,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and value head: T = (I + A)^-1, W = T(βΓ⊙K), U = T(β⊙V).

    T by blocks of B = C/4 rows: the four diagonal blocks by forward substitution (B steps on B×B tiles, not
    C steps on the whole C×C tile), the others from T_ij = −T_ii Σ_{j<=l<i} A_il T_lj as fp32 products. The
    blocks of A and T pass through the chunk's `[C, C]` of `scratch_ptr` (row stride `s_row`: T's own buffer
    when the backward keeps it, else W's slot, written over by W at the end), between barriers."""
    B: tl.constexpr = C // 4
    pid_c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // G
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    rows = tl.arange(0, C)
    k, _ = _load_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    kT = _load_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    beta = _load_vec(beta_ptr, b, t, h, s_bb, s_bt, s_bh, mask_t)
    gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)

    # A[i, j] = β_i (k_i·k_j) exp(γ_i − γ_j) for i > j
    lower = rows[None, :] < rows[:, None]
    a = tl.where(lower, beta[:, None] * tl.dot(k, kT, input_precision=PREC)
                 * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
    base = h * NCH + pid_c
    scratch = scratch_ptr + base * C * s_row
    tl.store(scratch + rows[:, None] * s_row + rows[None, :], a)
    tl.debug_barrier()  # A visible to every thread of the program

    r = tl.arange(0, B)
    block = scratch + r[:, None] * s_row + r[None, :]  # block (0, 0); block (i, j) at + (i * s_row + j) * B
    t0, t1, t2, t3 = _invert_diagonal_blocks(scratch, s_row, B)
    a10 = tl.load(block + s_row * B, cache_modifier=".cg")
    a20 = tl.load(block + s_row * 2 * B, cache_modifier=".cg")
    a21 = tl.load(block + (s_row * 2 + 1) * B, cache_modifier=".cg")
    a30 = tl.load(block + s_row * 3 * B, cache_modifier=".cg")
    a31 = tl.load(block + (s_row * 3 + 1) * B, cache_modifier=".cg")
    a32 = tl.load(block + (s_row * 3 + 2) * B, cache_modifier=".cg")
    t10 = -tl.dot(t1, tl.dot(a10, t0, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t2, tl.dot(a21, t1, input_precision="ieee"), input_precision="ieee")
    t20 = -tl.dot(t2, tl.dot(a20, t0, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee"),
                  input_precision="ieee")
    t32 = -tl.dot(t3, tl.dot(a32, t2, input_precision="ieee"), input_precision="ieee")
    t31 = -tl.dot(t3, tl.dot(a31, t1, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee"),
                  input_precision="ieee")
    t30 = -tl.dot(
        t3,
        tl.dot(a30, t0, input_precision="ieee") + tl.dot(a31, t10, input_precision="ieee")
        + tl.dot(a32, t20, input_precision="ieee"),
        input_precision="ieee",
    )
    tl.debug_barrier()  # every thread has read A before T overwrites it
    zero = tl.zeros([B, B], dtype=tl.float32)
    tl.store(block, t0)
    tl.store(block + B, zero)
    tl.store(block + 2 * B, zero)
    tl.store(block + 3 * B, zero)
    tl.store(block + s_row * B, t10)
    tl.store(block + (s_row + 1) * B, t1)
    tl.store(block + (s_row + 2) * B, zero)
    tl.store(block + (s_row + 3) * B, zero)
    tl.store(block + s_row * 2 * B, t20)
    tl.store(block + (s_row * 2 + 1) * B, t21)
    tl.store(block + (s_row * 2 + 2) * B, t2)
    tl.store(block + (s_row * 2 + 3) * B, zero)
    tl.store(block + s_row * 3 * B, t30)
    tl.store(block + (s_row * 3 + 1) * B, t31)
    tl.store(block + (s_row * 3 + 2) * B, t32)
    tl.store(block + (s_row * 3 + 3) * B, t3)
    tl.debug_barrier()
    tm = tl.load(scratch + rows[:, None] * s_row + rows[None, :], cache_modifier=".cg")

    d = tl.arange(0, DK)
    w = tl.dot(tm, k * (beta * tl.exp(gam))[:, None], input_precision=PREC)
    e = tl.arange(0, DV)
    mask_e = e < Dv
    v = tl.load(
        v_ptr + b * s_vb + t[:, None] * s_vt + h * s_vh + e[None, :] * s_vd,
        mask=mask_t[:, None] & mask_e[None, :], other=0.0,
    ).to(tl.float32)
    u = tl.dot(tm, v * beta[:, None], input_precision=PREC)
    tl.debug_barrier()  # every thread has read T before W (where W's slot is the scratch) overwrites it
    tl.store(w_ptr + (base * C + rows[:, None]) * Dk + d[None, :], w, mask=d[None, :] < Dk)
    tl.store(u_ptr + (base * C + rows[:, None]) * Dv + e[None, :], u, mask=mask_e[None, :])


@triton.jit
def _forward_states_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    g_ptr, s_gb, s_gt, s_gh,
    w_ptr, u_ptr,
    h0_ptr, s_h0n, s_h0h, s_h0d, s_h0e,
    o_ptr, ht_ptr, hs_ptr, vn_ptr,
    cu_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    COMPUTE_O: tl.constexpr, STORE_STATES: tl.constexpr, PREC: tl.constexpr,
):
    """The sequential pass over chunks for Dv columns [pid_v*BV, +BV) of one value head of one sequence:
    V_new = U - W S; O = scale(Q⊙Γ)S + M V_new; S <- exp(γ_C) S + K̃ᵀ V_new."""
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
    if HAS_H0:
        S = tl.load(
            h0_ptr + n * s_h0n + h * s_h0h + d[:, None] * s_h0d + e[None, :] * s_h0e, mask=mask_de, other=0.0
        ).to(tl.float32)
    else:
        S = tl.zeros([DK, BV], dtype=tl.float32)
    lower_incl = rows[None, :] <= rows[:, None]
    for i in range(0, count):
        c = first + i
        t = bos + i * C + rows
        mask_t = t < eos
        gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
        gam_last = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        base = h * NCH + c
        w = tl.load(w_ptr + (base * C + rows[:, None]) * Dk + d[None, :], mask=mask_d[None, :], other=0.0)
        u = tl.load(u_ptr + (base * C + rows[:, None]) * Dv + e[None, :], mask=mask_e[None, :], other=0.0)
        vn = u - tl.dot(w, S, input_precision=PREC)
        if STORE_STATES:
            tl.store(hs_ptr + base * Dk * Dv + d[:, None] * Dv + e[None, :], S, mask=mask_de)
            tl.store(vn_ptr + (base * C + rows[:, None]) * Dv + e[None, :], vn, mask=mask_e[None, :])
        kT = _load_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
        if COMPUTE_O:
            q, _ = _load_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
            q = q * scale
            qk = tl.dot(q, kT, input_precision=PREC)
            m = tl.where(lower_incl, qk * tl.exp(tl.where(lower_incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
            o = tl.dot(q * tl.exp(gam)[:, None], S, input_precision=PREC) + tl.dot(m, vn, input_precision=PREC)
            tl.store(
                o_ptr + ((b * T + t[:, None]) * Hv + h) * Dv + e[None, :],
                o.to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_e[None, :],
            )
        kT = kT * tl.exp(gam_last - gam)[None, :]
        S = S * tl.exp(gam_last) + tl.dot(kT, vn, input_precision=PREC)
    if STORE_HT:
        tl.store(ht_ptr + ((n * Hv + h) * Dk + d[:, None]) * Dv + e[None, :], S, mask=mask_de)


@triton.jit
def _output_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    g_ptr, s_gb, s_gt, s_gh,
    hs_ptr, vn_ptr, o_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Chunk-parallel, from the stored chunk-start states S0 and V_new: O = scale (Q⊙Γ) S0 + M V_new for the Dv
    columns [pid_v*BV, +BV) of one chunk of one value head."""
    pid_c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pid_v = tl.program_id(2)
    hk = h // G
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    e = pid_v * BV + tl.arange(0, BV)
    mask_e = e < Dv
    q, _ = _load_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    q = q * scale
    kT = _load_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
    lower_incl = rows[None, :] <= rows[:, None]
    m = tl.dot(q, kT, input_precision=PREC)
    m = tl.where(lower_incl, m * tl.exp(tl.where(lower_incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
    base = h * NCH + pid_c
    s0 = tl.load(hs_ptr + base * Dk * Dv + d[:, None] * Dv + e[None, :], mask=(d[:, None] < Dk) & mask_e[None, :],
                 other=0.0)
    vn = tl.load(vn_ptr + (base * C + rows[:, None]) * Dv + e[None, :], mask=mask_e[None, :], other=0.0)
    o = tl.dot(q * tl.exp(gam)[:, None], s0, input_precision=PREC) + tl.dot(m, vn, input_precision=PREC)
    tl.store(
        o_ptr + ((b * T + t[:, None]) * Hv + h) * Dv + e[None, :],
        o.to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_e[None, :],
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
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
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
    k, _ = _load_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    qT = _load_cols(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2) * scale
    # mT[j, i] = M[i, j] = scale (q_i·k_j) exp(γ_i - γ_j) for i >= j.
    upper_incl = rows[None, :] >= rows[:, None]
    mT = tl.dot(k, qT, input_precision=PREC)
    mT = tl.where(upper_incl, mT * tl.exp(tl.where(upper_incl, gam[None, :] - gam[:, None], 0.0)), 0.0)
    do = tl.load(
        do_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + e[None, :] * s_oe,
        mask=mask_t[:, None] & mask_e[None, :], other=0.0,
    ).to(tl.float32)
    base = h * NCH + pid_c
    tl.store(dvn_ptr + (base * C + rows[:, None]) * Dv + e[None, :], tl.dot(mT, do, input_precision=PREC),
             mask=mask_e[None, :])
    tl.store(dhs_ptr + base * Dk * Dv + d[:, None] * Dv + e[None, :],
             tl.dot(qT * tl.exp(gam)[None, :], do, input_precision=PREC),
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
    PREC: tl.constexpr,
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
    if HAS_DHT:
        dS = tl.load(
            dht_ptr + n * s_dtn + h * s_dth + d[:, None] * s_dtd + e[None, :] * s_dte, mask=mask_de, other=0.0
        ).to(tl.float32)
    else:
        dS = tl.zeros([DK, BV], dtype=tl.float32)
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
        k, _ = _load_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
        k = k * tl.exp(gam_last - gam)[:, None]
        dvn = m_do + tl.dot(k, dS, input_precision=PREC)
        tl.store(value_slot, dvn, mask=mask_e[None, :])
        wT = tl.load(w_ptr + (base * C + rows[None, :]) * Dk + d[:, None], mask=mask_d[:, None], other=0.0)
        dS = dS * tl.exp(gam_last) + q_do - tl.dot(wT, dvn, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0_ptr + ((n * Hv + h) * Dk + d[:, None]) * Dv + e[None, :], dS, mask=mask_de)


@triton.jit
def _backward_inputs_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    v_ptr, s_vb, s_vt, s_vh, s_vd,
    g_ptr, s_gb, s_gt, s_gh,
    beta_ptr, s_bb, s_bt, s_bh,
    do_ptr, s_ob, s_ot, s_oh, s_oe,
    tm_ptr, hs_ptr, dhs_ptr, vn_ptr, dvn_ptr, flip_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hk, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Chunk-parallel: dq, dk of one key head (summed over its G value heads), and dv, dg, dβ of each of them.
    The transposes of dM and of dA's term G are read back from the program's own `[2, C, C]` of `flip_ptr`
    after a barrier, not accumulated as second products."""
    pid_c = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    Hv = Hk * G
    b, t, mask_t = _chunk_of_program(pid_c, cu_ptr, chunk_seq_ptr, chunk_first_ptr, T, NC, C, VARLEN)
    rows = tl.arange(0, C)
    d = tl.arange(0, DK)
    mask_d = d < Dk
    q, r_q = _load_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    k, r_k = _load_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    q = q * scale
    lower = rows[None, :] < rows[:, None]
    lower_incl = rows[None, :] <= rows[:, None]
    dq = tl.zeros([C, DK], dtype=tl.float32)  # gradient of scale·q̂
    dk = tl.zeros([C, DK], dtype=tl.float32)  # gradient of k̂
    flip = flip_ptr + (pid_c * Hk + hk) * 2 * C * C
    square = rows[:, None] * C + rows[None, :]
    square_T = rows[None, :] * C + rows[:, None]
    for j in range(0, G):
        h = hk * G + j
        base = h * NCH + pid_c
        beta = _load_vec(beta_ptr, b, t, h, s_bb, s_bt, s_bh, mask_t)
        gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
        gam_last = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        decay_q = tl.exp(gam)
        decay_k = tl.exp(gam_last - gam)
        tm_T = tl.load(tm_ptr + (base * C + rows[None, :]) * C + rows[:, None])  # Tᵀ
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
            vn = tl.load(vn_ptr + rows_ce, mask=mask_e[None, :], other=0.0)
            vn_T = tl.load(vn_ptr + cols_ce, mask=mask_e[:, None], other=0.0)
            dvn = tl.load(dvn_ptr + rows_ce, mask=mask_e[None, :], other=0.0)
            do = tl.load(
                do_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + e[None, :] * s_oe, mask=mask_te, other=0.0
            ).to(tl.float32)
            state = base * Dk * Dv + d[None, :] * Dv + e[:, None]
            mask_ed = mask_e[:, None] & mask_d[None, :]
            s0_T = tl.load(hs_ptr + state, mask=mask_ed, other=0.0)  # S0ᵀ [BV, DK]
            dsc_T = tl.load(dhs_ptr + state, mask=mask_ed, other=0.0)  # dS_Cᵀ
            v = tl.load(
                v_ptr + b * s_vb + t[:, None] * s_vt + h * s_vh + e[None, :] * s_vd, mask=mask_te, other=0.0
            ).to(tl.float32)

            du = tl.dot(tm_T, dvn, input_precision=PREC)  # Tᵀ dV_new
            tl.store(
                dv_ptr + ((b * T + t[:, None]) * Hv + h) * Dv + e[None, :],
                (du * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mask_te,
            )
            dbeta += tl.sum(v * du, 1)
            dA -= tl.dot(du, vn_T, input_precision=PREC)
            dM += tl.dot(do, vn_T, input_precision=PREC)
            # inter-chunk read of the state: O += scale (Q⊙Γ) S0
            x = tl.dot(do, s0_T, input_precision=PREC)
            dq += x * decay_q[:, None]
            dgam += decay_q * tl.sum(q * x, 1)
            # state update: S_C += K̃ᵀ V_new
            x = tl.dot(vn, dsc_T, input_precision=PREC)
            dk += x * decay_k[:, None]
            dgam_after += tl.sum(k * x, 1) * decay_k
            dgam_last += tl.exp(gam_last) * tl.sum(tl.sum(s0_T * dsc_T, 1), 0)
            # W = T(βΓ⊙K): dW̃ = Tᵀ dW = -Tᵀ dV_new S0ᵀ
            x = -tl.dot(du, s0_T, input_precision=PREC)
            dk += x * (beta * decay_q)[:, None]
            x = tl.sum(k * x, 1) * decay_q
            dbeta += x
            dgam += beta * x

        # intra-chunk attention M = tril(scale Q Kᵀ ⊙ D)
        decay = tl.exp(tl.where(lower_incl, gam[:, None] - gam[None, :], 0.0))
        dM = tl.where(lower_incl, dM * decay, 0.0)
        tl.debug_barrier()  # the previous value head's transposes are read: the flip buffer is free
        tl.store(flip + square, dM)
        dq += tl.dot(dM, k, input_precision=PREC)
        kT = _load_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
        pairs = dM * tl.dot(q, kT, input_precision=PREC)  # dM ⊙ M: terms of D_ij = exp(γ_i - γ_j)
        # A = strictly-lower(β_i (k_i·k_j) D_ij)
        p = tl.where(lower, tl.dot(k, kT, input_precision=PREC) * decay, 0.0)
        dA = tl.where(lower, dA, 0.0)
        x = dA * p
        dbeta += tl.sum(x, 1)
        pairs += x * beta[:, None]
        dA = dA * decay * beta[:, None]  # G
        tl.store(flip + C * C + square, dA)
        tl.debug_barrier()  # every thread's stores visible to every thread of the program
        dM_T = tl.load(flip + square_T, cache_modifier=".cg")
        dA_T = tl.load(flip + C * C + square_T, cache_modifier=".cg")
        dk += tl.dot(dM_T, q, input_precision=PREC)
        dk += tl.dot(dA + dA_T, k, input_precision=PREC)  # (G + Gᵀ) K
        # dg_t = Σ_{s>=t} dγ_s + dγ_C, summed by what each term depends on (module docstring): a D_ij term
        # reaches g_t for j < t <= i only, so the pairs are summed over that range directly rather than as
        # row and column sums that cancel in the reverse cumulative sum.
        after = tl.cumsum(pairs, 0, reverse=True)  # [t, j]: Σ_{i>=t} pairs_ij
        dg = tl.sum(tl.where(lower, after, 0.0), 1)
        dg += tl.cumsum(dgam, 0, reverse=True)
        dg += tl.sum(tl.where(lower, dgam_after[None, :], 0.0), 1) + dgam_last
        tl.store(dg_ptr + (b * T + t) * Hv + h, dg.to(dg_ptr.dtype.element_ty), mask=mask_t)
        tl.store(dbeta_ptr + (b * T + t) * Hv + h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mask_t)

    dq = dq * scale
    if L2:
        q_hat = q / scale
        dq = r_q[:, None] * (dq - q_hat * tl.sum(q_hat * dq, 1)[:, None])
        dk = r_k[:, None] * (dk - k * tl.sum(k * dk, 1)[:, None])
    out = ((b * T + t[:, None]) * Hk + hk) * Dk + d[None, :]
    mask_td = mask_t[:, None] & mask_d[None, :]
    tl.store(dq_ptr + out, dq.to(dq_ptr.dtype.element_ty), mask=mask_td)
    tl.store(dk_ptr + out, dk.to(dk_ptr.dtype.element_ty), mask=mask_td)
