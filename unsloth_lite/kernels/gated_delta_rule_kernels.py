"""Triton kernels of the chunked Gated DeltaNet: the helpers every kernel shares and the forward's kernels
(`gated_delta_rule.py` has the math, launchers and autograd; `gated_delta_rule_backward_kernels.py` the backward's).

Layout conventions shared by every kernel:

* q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g, beta `[B, T, Hv]`, dO `[B, T, Hv, Dv]` are read through their
  strides; value head h reads key head h // G (G = Hv / Hk).
* A "sequence" n is batch row n (fixed length T), or document n of a varlen batch (B = 1, tokens
  [cu[n], cu[n+1])). Chunks of C tokens never straddle sequences. Chunk c of the whole batch is numbered
  globally: n * NC + i for fixed length, `chunk_first[n] + i` for varlen (`chunk_seq[c]` = its document).
* Scratch buffers are chunk-major per value head, fp32, rows of a whole chunk (padding rows hold zeros):
  W `[Hv, NCH, C, Dk]`, U / V_new / dV_new `[Hv, NCH, C, Dv]`, T `[Hv, NCH, C, C]`, states `[Hv, NCH, Dk, Dv]`.
* Math is fp32. Every product takes fp32 tiles at an explicit precision, PREC of `_dot`: "ieee" for fp32 inputs;
  for 16-bit ones "bf16x3", "tf32", "tf32_rounded" or "tf32x3" (`LAUNCH["precision"]` of `gated_delta_rule.py`).
  Under "bf16x3" a product of bf16 inputs' values as stored (EXACT: q, k, v, dO) skips their low halves, so q and
  k enter products as stored and their L2 norms (`_load_raw_rows`), like the decays, scale the other operand or
  the result. Only bf16 products see 16-bit operands (the interpreter's are wrong: `_dot_bf16x3` upcasts there).
* No `tl.trans` anywhere: a transposed operand is loaded transposed through pointer arithmetic (Triton on Hopper
  miscompiles a transposed dot result fed to another dot); computed tiles, dot results included, enter
  products untransposed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from unsloth_lite.kernels.utils import INTERPRETED


@triton.jit
def _round_to_tf32(x):
    """fp32 values rounded to nearest (ties away from zero) at tf32's 10 mantissa bits."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)  # -8192: 0xFFFFE000, sign/exponent/10 bits


@triton.jit
def _dot(a, b, PREC: tl.constexpr, A_EXACT: tl.constexpr = False, B_EXACT: tl.constexpr = False):
    """`tl.dot(a, b)` at PREC. "tf32_rounded": tf32 products of operands rounded to nearest first (the H200's
    errors are those of operands truncated to tf32, which about doubles a bf16 run's error over bf16's own
    rounding: `scripts/deltanet_precision.py`). "bf16x3": `_dot_bf16x3`; A_EXACT / B_EXACT say that an
    operand's values are exact in bf16 (a bf16 input's), so that its low half's product is skipped."""
    return _dot_operands(_operand(a, PREC), _operand(b, PREC), PREC, A_EXACT, B_EXACT)


@triton.jit
def _operand(x, PREC: tl.constexpr):
    """x made a product operand once, for `_dot_operands` (a tile that enters several products is made once, not
    at each): rounded to tf32 under "tf32_rounded", split into its bf16 halves (hi, lo) under "bf16x3", else as
    it is."""
    if PREC == "tf32_rounded":
        return _round_to_tf32(x)
    elif PREC == "bf16x3":
        return _split_bf16(x)
    else:
        return x


@triton.jit
def _input_operand(x, PREC: tl.constexpr):
    """A 16-bit input's values (exact in tf32) made a product operand: as they are but split under "bf16x3"
    (fp16 values are not all exact in bf16)."""
    if PREC == "bf16x3":
        return _split_bf16(x)
    else:
        return x


@triton.jit
def _dot_operands(a, b, PREC: tl.constexpr, A_EXACT: tl.constexpr = False, B_EXACT: tl.constexpr = False):
    """`_dot` of operands `_operand` made."""
    if PREC == "tf32_rounded":
        return tl.dot(a, b, input_precision="tf32")
    elif PREC == "bf16x3":
        return _dot_bf16x3(a[0], a[1], b[0], b[1], A_EXACT, B_EXACT)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _split_bf16(x):
    """(hi, lo), x = hi + lo to about 2^-17 of x: hi x rounded to bf16, lo the remainder (exact in fp32) rounded
    to bf16."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_bf16x3(a_hi, a_lo, b_hi, b_lo, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr):
    """fp32 a b from bf16 tensor-core products of the operands' halves: a_hi b_hi + a_hi b_lo + a_lo b_hi, with
    a_lo b_lo (2^-17 of a product) left out, and the product of an exact operand's (zero) low half skipped.
    About fp32's error at 1.5 tf32 products' cost (bf16 products run at twice tf32's rate), 1 where one operand
    is a bf16 input's, 0.5 where both are."""
    acc = _dot_halves(a_hi, b_hi)
    if not B_EXACT:
        acc = _dot_halves(a_hi, b_lo, acc)
    if not A_EXACT:
        acc = _dot_halves(a_lo, b_hi, acc)
    return acc


@triton.jit
def _dot_halves(a, b, acc=None):
    """acc + a b of bf16 halves, fp32 sums. The interpreter's bf16 products are wrong: there the halves are
    multiplied in fp32, exactly as bf16 products with fp32 sums are."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


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
def _load_raw_rows(ptr, b, t, h, s_b, s_t, s_h, s_d, mask_t, Dk, DK: tl.constexpr, L2: tl.constexpr):
    """A `[C, DK]` tile of q or k (rows = tokens `t`) as stored (fp32 of the input's values: a bf16 input's are
    exact bf16 operands), and each row's 1/norm when L2-normalised (else ones): the normalised tile is
    x * r[:, None], which a product takes as a scale of its result or of its other operand."""
    d = tl.arange(0, DK)
    x = tl.load(
        ptr + b * s_b + t[:, None] * s_t + h * s_h + d[None, :] * s_d,
        mask=mask_t[:, None] & (d[None, :] < Dk), other=0.0,
    ).to(tl.float32)
    if L2:
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6)
    else:
        r = tl.full(t.shape, 1.0, tl.float32)
    return x, r


@triton.jit
def _load_raw_cols(ptr, b, t, h, s_b, s_t, s_h, s_d, mask_t, Dk, DK: tl.constexpr, L2: tl.constexpr):
    """The tile of `_load_raw_rows` loaded transposed, `[DK, C]`, with each column's 1/norm."""
    d = tl.arange(0, DK)
    x = tl.load(
        ptr + b * s_b + t[None, :] * s_t + h * s_h + d[:, None] * s_d,
        mask=mask_t[None, :] & (d[:, None] < Dk), other=0.0,
    ).to(tl.float32)
    if L2:
        r = 1.0 / tl.sqrt(tl.sum(x * x, 0) + 1e-6)
    else:
        r = tl.full(t.shape, 1.0, tl.float32)
    return x, r


@triton.jit
def _load_state_block(ptr, n, h, s_n, s_h, s_d, s_e, d, e, mask, PRESENT: tl.constexpr, DK: tl.constexpr,
                      BV: tl.constexpr):
    """Columns e of the `[Dk, Dv]` state of sequence n, value head h, fp32 (zeros where there is no such state)."""
    if PRESENT:
        return tl.load(ptr + n * s_n + h * s_h + d[:, None] * s_d + e[None, :] * s_e, mask=mask, other=0.0).to(
            tl.float32)
    else:
        return tl.zeros([DK, BV], dtype=tl.float32)


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
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
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
    # k as stored (exact operands when EXACT), its L2 norm as scales r of the products' results or other operands
    k, r_k = _load_raw_rows(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    kT, r_cols = _load_raw_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    beta = _load_vec(beta_ptr, b, t, h, s_bb, s_bt, s_bh, mask_t)
    gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)

    # A[i, j] = β_i (k_i·k_j) exp(γ_i − γ_j) for i > j
    lower = rows[None, :] < rows[:, None]
    kk = _dot(k, kT, PREC, EXACT, EXACT) * (r_k[:, None] * r_cols[None, :])
    a = tl.where(lower, beta[:, None] * kk * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
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
    # T's columns take the scales of K's rows: K stays an exact operand
    w = _dot(tm * (beta * tl.exp(gam) * r_k)[None, :], k, PREC, False, EXACT)
    e = tl.arange(0, DV)
    mask_e = e < Dv
    v = tl.load(
        v_ptr + b * s_vb + t[:, None] * s_vt + h * s_vh + e[None, :] * s_vd,
        mask=mask_t[:, None] & mask_e[None, :], other=0.0,
    ).to(tl.float32)
    u = _dot(tm * beta[None, :], v, PREC, False, EXACT)
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
    COMPUTE_O: tl.constexpr, STORE_STATES: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
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
    S = _load_state_block(h0_ptr, n, h, s_h0n, s_h0h, s_h0d, s_h0e, d, e, mask_de, HAS_H0, DK, BV)
    for i in range(0, count):
        c = first + i
        t = bos + i * C + rows
        mask_t = t < eos
        gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
        gam_last = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)
        base = h * NCH + c
        w = tl.load(w_ptr + (base * C + rows[:, None]) * Dk + d[None, :], mask=mask_d[None, :], other=0.0)
        u = tl.load(u_ptr + (base * C + rows[:, None]) * Dv + e[None, :], mask=mask_e[None, :], other=0.0)
        vn = u - _dot(w, S, PREC)
        if STORE_STATES:
            tl.store(hs_ptr + base * Dk * Dv + d[:, None] * Dv + e[None, :], S, mask=mask_de)
            tl.store(vn_ptr + (base * C + rows[:, None]) * Dv + e[None, :], vn, mask=mask_e[None, :])
        kT, r_k = _load_raw_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
        if COMPUTE_O:
            o = _chunk_output(q_ptr, s_qb, s_qt, s_qh, s_qd, b, t, hk, mask_t, Dk, kT, r_k, gam, S, vn, scale,
                              C, DK, L2, PREC, EXACT)
            tl.store(
                o_ptr + ((b * T + t[:, None]) * Hv + h) * Dv + e[None, :],
                o.to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_e[None, :],
            )
        # K̃ᵀ V_new with K̃'s scales on V_new's rows
        S = S * tl.exp(gam_last) + _dot(kT, vn * (r_k * tl.exp(gam_last - gam))[:, None], PREC, EXACT, False)
    if STORE_HT:
        tl.store(ht_ptr + ((n * Hv + h) * Dk + d[:, None]) * Dv + e[None, :], S, mask=mask_de)


@triton.jit
def _chunk_output(q_ptr, s_qb, s_qt, s_qh, s_qd, b, t, hk, mask_t, Dk, kT, r_k, gam, s0, vn, scale,
                  C: tl.constexpr, DK: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr):
    """O = scale (Q⊙Γ) S0 + M V_new of one chunk, M = tril(scale Q Kᵀ ⊙ D), from the chunk's keys as stored
    (`kT`, `[DK, C]`, with their 1/norms `r_k`): q and k enter the products as stored, their scales applied to
    the results."""
    rows = tl.arange(0, C)
    q, r_q = _load_raw_rows(q_ptr, b, t, hk, s_qb, s_qt, s_qh, s_qd, mask_t, Dk, DK, L2)
    r_q = r_q * scale
    lower_incl = rows[None, :] <= rows[:, None]
    m = _dot(q, kT, PREC, EXACT, EXACT) * (r_q[:, None] * r_k[None, :])
    m = tl.where(lower_incl, m * tl.exp(tl.where(lower_incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
    return _dot(q, s0, PREC, EXACT, False) * (r_q * tl.exp(gam))[:, None] + _dot(m, vn, PREC)


@triton.jit
def _output_kernel(
    q_ptr, s_qb, s_qt, s_qh, s_qd,
    k_ptr, s_kb, s_kt, s_kh, s_kd,
    g_ptr, s_gb, s_gt, s_gh,
    hs_ptr, vn_ptr, o_ptr,
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,
    T, NC, NCH, Hv, G, Dk, Dv, scale,
    C: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
    L2: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
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
    kT, r_k = _load_raw_cols(k_ptr, b, t, hk, s_kb, s_kt, s_kh, s_kd, mask_t, Dk, DK, L2)
    gam = tl.cumsum(_load_vec(g_ptr, b, t, h, s_gb, s_gt, s_gh, mask_t), 0)
    base = h * NCH + pid_c
    s0 = tl.load(hs_ptr + base * Dk * Dv + d[:, None] * Dv + e[None, :], mask=(d[:, None] < Dk) & mask_e[None, :],
                 other=0.0)
    vn = tl.load(vn_ptr + (base * C + rows[:, None]) * Dv + e[None, :], mask=mask_e[None, :], other=0.0)
    o = _chunk_output(q_ptr, s_qb, s_qt, s_qh, s_qd, b, t, hk, mask_t, Dk, kT, r_k, gam, s0, vn, scale,
                      C, DK, L2, PREC, EXACT)
    tl.store(
        o_ptr + ((b * T + t[:, None]) * Hv + h) * Dv + e[None, :],
        o.to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_e[None, :],
    )
