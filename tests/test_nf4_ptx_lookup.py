"""The PTX that decodes NF4 codes in registers (`nf4_codes._nf4_lookup_ptx`), run on the CPU by a small
interpreter of the instructions it uses: every byte value, in every byte of the word, decodes to the code
book's fp32 bit patterns (or, with `bf16_codes`, those of the codes rounded to bf16) for its high and its low
nibble. The GPU tests run the same PTX compiled."""

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


OPS = {
    "mov.b32": lambda a: a,
    "shr.b32": lambda a, n: a >> n,
    "shl.b32": lambda a, n: a << n,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "not.b32": lambda a: ~a,
    "prmt.b32": prmt,
}


def run_ptx(ptx: str, word: int) -> list[int]:
    """The output registers $0..$3 of `ptx` with its input register `$4` holding `word`."""
    registers = {"$4": word}
    for line in ptx.strip("{}\n").splitlines():
        line = line.strip().rstrip(";")
        if line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dest, *sources = (token.strip() for token in rest.split(","))
        values = [registers[s] if s in registers else int(s, 0) for s in sources]
        registers[dest] = OPS[op](*values) & MASK
    return [registers[f"${i}"] for i in range(4)]


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
            decoded = run_ptx(ptx, word)
            for i, byte in enumerate(others):
                nibble = byte >> 4 if high_nibbles else byte & 0xF
                assert decoded[i] == expected[nibble], (hex(word), i)
