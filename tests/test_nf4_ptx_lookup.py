"""The PTX that decodes NF4 codes in registers (`nf4_codes._nf4_lookup_ptx`), run on the CPU by a small
interpreter of the instructions it uses: every byte value, in every byte of the word, decodes to the code
book's fp32 bit patterns (or, with `bf16_codes`, those of the codes rounded to bf16) for its high and its low
nibble; and the word lookup (`nf4_codes._nf4_word_lookup_ptx`) every code in every nibble of a word, in
element order, as fp32 values or as bf16 pairs, and the pairs' sum of products (`_bf16_pair_dot_ptx`) bit for
bit against its rounding steps. The GPU tests run the same PTX compiled."""

import struct

import pytest
import torch

from unsloth_lite.kernels import nf4_codes

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


def bf16_bits(value: float) -> int:
    """The bf16 nearest `value` (ties to even), as its 16 bits."""
    return torch.tensor(value, dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def bf16_value(bits: int) -> float:
    return torch.tensor(bits << 16, dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def fma_bf16x2(a: int, b: int, c: int) -> int:
    """PTX `fma.rn.bf16x2`: in each half, a · b + c rounded once to bf16 (exact in float64 for bf16 operands)."""
    out = 0
    for shift in (0, 16):
        half = [(v >> shift) & 0xFFFF for v in (a, b, c)]
        out |= bf16_bits(bf16_value(half[0]) * bf16_value(half[1]) + bf16_value(half[2])) << shift
    return out


def add_f32(a: int, b: int) -> int:
    total = torch.tensor([a, b], dtype=torch.int64).to(torch.int32).view(torch.float32).sum()
    return total.view(torch.int32).item() & MASK


OPS = {
    "mov.b32": lambda a: a,
    "fma.rn.bf16x2": fma_bf16x2,
    "add.f32": add_f32,
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
    for nibbles, word in words_with_every_code_in_every_position():
        decoded = run_ptx(ptx, {"$8": word, **tables}, 8)
        assert decoded == [expected[n] for n in nibbles], hex(word)


def words_with_every_code_in_every_position():
    """(the eight nibbles in element order, the packed word): every code at every position, the other seven
    varying (four patterns each)."""
    for code in range(16):
        for position in range(8):
            for seed in range(4):
                nibbles = [(code * 7 + 5 * i + 3 * seed) & 0xF for i in range(8)]
                nibbles[position] = code
                yield nibbles, sum(((nibbles[2 * j] << 4) | nibbles[2 * j + 1]) << (8 * j) for j in range(4))


def test_word_lookup_tables_fill_the_registers_the_ptx_reads():
    """Two table registers per byte plane (bf16: planes 2 and 3; exact: all four), each in int32 range, and the
    PTX reads exactly those registers."""
    for bf16_codes, planes in ((True, 2), (False, 4)):
        tables = nf4_codes.word_lookup_tables(bf16_codes)
        assert len(tables) == 2 * planes and all(-(1 << 31) <= t < 1 << 31 for t in tables)
        ptx = nf4_codes._nf4_word_lookup_ptx(bf16_codes)
        assert f"${8 + 2 * planes}" in ptx and f"${9 + 2 * planes}" not in ptx


def test_word_lookup_to_pairs_decodes_every_code_in_every_nibble():
    """With `pairs`, weight j of a word decodes to its code rounded to bf16 in half j % 2 of output j // 2."""
    ptx = nf4_codes._nf4_word_lookup_ptx(True, pairs=True)
    tables = {f"${5 + i}": t & MASK for i, t in enumerate(nf4_codes.word_lookup_tables(True))}
    expected = [bits >> 16 for bits in expected_codes(True)]
    for nibbles, word in words_with_every_code_in_every_position():
        pairs = run_ptx(ptx, {"$4": word, **tables}, 4)
        assert pairs == [expected[nibbles[2 * i]] | expected[nibbles[2 * i + 1]] << 16 for i in range(4)], hex(word)


def bf16_pairs(values: torch.Tensor) -> list[int]:
    """Eight bf16 values as four 32-bit pairs, element 2i in the low half of pair i."""
    bits = (values.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    return [bits[2 * i] | bits[2 * i + 1] << 16 for i in range(4)]


def test_pair_dot_sums_eight_products_in_two_bf16_chains():
    """`_bf16_pair_dot_ptx`: each half a chain of four bf16 fused multiply-adds (even and odd weights apart), the
    two chains added in fp32; within bf16's rounding of four steps of the exact sum, for random bf16 pairs of
    mixed signs and magnitudes."""
    ptx = nf4_codes._bf16_pair_dot_ptx()
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        codes = torch.randn(8, generator=generator).to(torch.bfloat16)
        scales = 10.0 ** torch.randint(-2, 3, (8,), generator=generator)
        x = (torch.randn(8, generator=generator) * scales).to(torch.bfloat16)
        inputs = {f"${1 + i}": p for i, p in enumerate(bf16_pairs(codes) + bf16_pairs(x))}
        got = torch.tensor(run_ptx(ptx, inputs, 1)[0], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
        products = codes.double() * x.double()
        chains = []
        for lane in (0, 1):
            total = torch.tensor(-0.0, dtype=torch.float64)
            for i in range(4):
                total = (products[2 * i + lane] + total).to(torch.bfloat16).double()
            chains.append(total.item())
        assert got == torch.tensor(chains, dtype=torch.float32).sum().item()
        assert abs(got - products.sum().item()) <= 4 * 2 ** -8 * products.abs().sum().item()
