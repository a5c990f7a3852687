"""The PTX that decodes NF4 codes in registers (`nf4_codes._nf4_lookup_ptx`), run on the CPU by a small
interpreter of the instructions it uses: every byte value, in every byte of the word, decodes to the code
book's fp32 bit patterns (or, with `bf16_codes`, those of the codes rounded to bf16) for its high and its low
nibble; the word lookup (`nf4_codes._nf4_word_lookup_ptx`) every code in every nibble of a word, in element
order; and the tensor-core kernel's block (`nf4_matvec_mma._block_ptx`: a lookup, four `mma` and the scale),
run for the 32 lanes of a warp with `mma.sync.m16n8k16`'s fragment layout, against the block's product. The GPU
tests run the same PTX compiled."""

import struct

import numpy as np
import pytest
import torch

from unsloth_lite.kernels import nf4_codes, nf4_matvec_mma

MASK = 0xFFFFFFFF


def prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32` (default mode): byte j of the result is byte selector[j] & 7 of b:a, or its sign
    replicated where selector[j] has bit 3 set."""
    source = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for j in range(4):
        nibble = (selector >> (4 * j)) & 0xF
        byte = source[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * j)
    return out


OPS = {
    "mov.b32": lambda a: a,
    "shr.b32": lambda a, n: a >> n,
    "shl.b32": lambda a, n: a << n,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "not.b32": lambda a: ~a,
    "prmt.b32": prmt,
}


def run_ptx(ptx: str, inputs: dict[str, int], outputs: int) -> list[int]:
    """The output registers $0..$(outputs - 1) of `ptx` with its input registers holding `inputs`."""
    registers = dict(inputs)
    for line in ptx.strip("{}\n").splitlines():
        line = line.strip().rstrip(";")
        if line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dest, *sources = (token.strip() for token in rest.split(","))
        values = [registers[s] if s in registers else int(s, 0) for s in sources]
        registers[dest] = OPS[op](*values) & MASK
    return [registers[f"${i}"] for i in range(outputs)]


def fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


@pytest.mark.parametrize("bf16_codes", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("high_nibbles", [True, False], ids=["even", "odd"])
def test_lookup_decodes_every_byte_in_every_position(high_nibbles, bf16_codes):
    ptx = nf4_codes._nf4_lookup_ptx(high_nibbles, bf16_codes)
    codes = torch.tensor(nf4_codes.NF4_CODE, dtype=torch.float32)
    expected = [fp32_bits(c) for c in (codes.to(torch.bfloat16).float() if bf16_codes else codes).tolist()]
    for value in range(256):
        for position in range(4):
            others = [(value * 37 + 11 * i) & 0xFF for i in range(4)]  # the other bytes vary too
            others[position] = value
            word = sum(byte << (8 * i) for i, byte in enumerate(others))
            decoded = run_ptx(ptx, {"$4": word}, 4)
            for i, byte in enumerate(others):
                nibble = byte >> 4 if high_nibbles else byte & 0xF
                assert decoded[i] == expected[nibble], (hex(word), i)


def expected_codes(bf16_codes: bool) -> list[int]:
    codes = torch.tensor(nf4_codes.NF4_CODE, dtype=torch.float32)
    return [fp32_bits(c) for c in (codes.to(torch.bfloat16).float() if bf16_codes else codes).tolist()]


@pytest.mark.parametrize("bf16_codes", [False, True], ids=["fp32", "bf16"])
def test_word_lookup_decodes_every_code_in_every_nibble(bf16_codes):
    """Weight j of a word (the high nibble of byte j // 2 for even j, the low one for odd j) decodes to its code's
    fp32 bit pattern, for every code in every position while the other seven vary, with the code-book tables in
    the registers the kernel loads them into (`word_lookup_tables`, as unsigned 32-bit values)."""
    ptx = nf4_codes._nf4_word_lookup_ptx(bf16_codes)
    tables = {f"${9 + i}": t & MASK for i, t in enumerate(nf4_codes.word_lookup_tables(bf16_codes))}
    expected = expected_codes(bf16_codes)
    for code in range(16):
        for position in range(8):
            for seed in range(4):
                nibbles = [(code * 7 + 5 * i + 3 * seed) & 0xF for i in range(8)]
                nibbles[position] = code
                word = sum(((nibbles[2 * j] << 4) | nibbles[2 * j + 1]) << (8 * j) for j in range(4))
                decoded = run_ptx(ptx, {"$8": word, **tables}, 8)
                assert decoded == [expected[n] for n in nibbles], (hex(word), position)


def test_word_lookup_tables_fill_the_registers_the_ptx_reads():
    """Two table registers per byte plane (bf16: planes 2 and 3; exact: all four), each in int32 range, and the
    PTX reads exactly those registers."""
    for bf16_codes, planes in ((True, 2), (False, 4)):
        tables = nf4_codes.word_lookup_tables(bf16_codes)
        assert len(tables) == 2 * planes and all(-(1 << 31) <= t < 1 << 31 for t in tables)
        ptx = nf4_codes._nf4_word_lookup_ptx(bf16_codes)
        assert f"${8 + 2 * planes}" in ptx and f"${9 + 2 * planes}" not in ptx


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & MASK))[0]


def bf16_halves(bits: int) -> tuple[float, float]:
    """The two bf16 values of a 32-bit register (low half first) as floats."""
    return f32((bits & 0xFFFF) << 16), f32(bits & 0xFFFF0000)


def fragment_rows_cols(g: int, t: int) -> tuple:
    """(row, column) of the four fp32 registers of an m16n8 accumulator fragment in lane (g, t)."""
    return (g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)


def mma_m16n8k16(lanes: list[dict], dest, a, b, c) -> None:
    """`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` over the warp's registers: lane (g, t) = (lane / 4,
    lane % 4) holds A[g, 2t..2t+1] in a0, A[g+8, 2t..] in a1, A[g, 2t+8..] in a2, A[g+8, 2t+8..] in a3; B[2t..2t+1,
    g] in b0, B[2t+8.., g] in b1; C and D [g, 2t..2t+1] in the first two, [g+8, 2t..] in the last two."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, registers in enumerate(lanes):
        g, t = divmod(lane, 4)
        for (row, col), name in zip(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)), a, strict=True):
            A[row, col:col + 2] = bf16_halves(registers[name])
        for k, name in zip((2 * t, 2 * t + 8), b, strict=True):
            B[k:k + 2, g] = bf16_halves(registers[name])
        for (row, col), name in zip(fragment_rows_cols(g, t), c, strict=True):
            C[row, col] = registers[name]
    D = (A @ B + C).astype(np.float32)
    for lane, registers in enumerate(lanes):
        g, t = divmod(lane, 4)
        for (row, col), name in zip(fragment_rows_cols(g, t), dest, strict=True):
            registers[name] = float(D[row, col])


def run_warp_ptx(ptx: str, lanes: list[dict], shared: dict[int, int]) -> None:
    """Runs `ptx` on the 32 lanes' registers in step (`run_ptx`'s integer instructions, and those of the tensor-core
    block: `mad.lo.u32`, `ld.shared.b32` from `shared` (address -> word), `mov.f32`, `fma.rn.f32`, `mma`)."""
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op.startswith("mma.sync"):
            groups = [[r.strip() for r in group.split(",") if r.strip()]
                      for group in rest.replace("}", "").split("{")[1:]]
            mma_m16n8k16(lanes, *groups)
            continue
        dest, *sources = (token.strip() for token in rest.split(","))
        for registers in lanes:
            if op == "ld.shared.b32":
                registers[dest] = shared[registers[sources[0].strip("[]")]]
            elif op == "mov.f32":
                registers[dest] = f32(int(sources[0][2:], 16))
            elif op == "fma.rn.f32":
                product, factor, addend = (registers[s] for s in sources)
                registers[dest] = float(np.float32(np.float64(product) * factor + addend))
            else:
                values = [registers[s] if s in registers else int(s, 0) for s in sources]
                registers[dest] = (values[0] * values[1] + values[2] if op == "mad.lo.u32" else OPS[op](*values)) & MASK


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shared_lookup", [True, False], ids=["shared_lookup", "register_lookup"])
def test_mma_block_is_the_blocks_product(shared_lookup, rows):
    """One 64-weight block of 16 features times x's rows, each lane given what the kernel loads for it: lane (g,
    t)'s four accumulators become acc + absmax · Σ_k code_bf16[q[feature, k]] · x[row, k] for features g, g + 8 and
    rows 2t, 2t + 1 (zero x past x's rows)."""
    generator = torch.Generator().manual_seed(rows)
    nibbles = torch.randint(0, 16, (16, 64), generator=generator)
    x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
    absmax = torch.rand(16, generator=generator) + 0.5
    acc = torch.randn(32, 4, generator=generator)
    packed = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # bytes: the even weight in the high nibble
    words = (packed.view(16, 8, 4) << torch.tensor([0, 8, 16, 24])).sum(-1)  # [features, words of the block]
    x_pairs = torch.zeros(8, 64, dtype=torch.bfloat16)
    x_pairs[:rows] = x
    x_pairs = x_pairs.view(torch.int16).to(torch.int64) & 0xFFFF
    x_pairs = (x_pairs[:, 0::2] | (x_pairs[:, 1::2] << 16)).tolist()  # [rows, 32 pairs]
    base = 0x400
    shared = {}
    if shared_lookup:
        table = [p & MASK for p in nf4_matvec_mma.pair_table(torch.device("cpu")).tolist()]
        shared = {base + 128 * byte + 4 * lane: table[byte] for byte in range(256) for lane in range(32)}
    tables = [t & MASK for t in nf4_codes.word_lookup_tables(True)]
    lanes = []
    for lane in range(32):
        g, t = divmod(lane, 4)
        registers = {f"${4 + i}": float(acc[lane, i]) for i in range(4)}
        for i, (feature, word) in enumerate(fragment_rows_cols(g, t)):  # words 2t, 2t + 1 of features g, g + 8
            registers[f"${8 + i}"] = int(words[feature, word]) & MASK
        for j in range(8):
            registers[f"${12 + j}"] = x_pairs[g][8 * t + j]
        registers["$20"], registers["$21"] = float(absmax[g]), float(absmax[g + 8])
        if shared_lookup:
            registers["$22"] = base + 4 * lane
        else:
            registers.update({f"${22 + i}": table for i, table in enumerate(tables)})
        lanes.append(registers)
    run_warp_ptx(nf4_matvec_mma._block_ptx(shared_lookup), lanes, shared)
    codes = torch.tensor(nf4_codes.NF4_CODE).to(torch.bfloat16).double()
    sums = absmax.double()[:, None] * (codes[nibbles] @ x.double().t())  # [features, rows]
    for lane, registers in enumerate(lanes):
        g, t = divmod(lane, 4)
        for i, (feature, row) in enumerate(fragment_rows_cols(g, t)):
            expected = float(acc[lane, i]) + (float(sums[feature, row]) if row < rows else 0.0)
            assert registers[f"${i}"] == pytest.approx(expected, rel=1e-5, abs=1e-5), (lane, i)
