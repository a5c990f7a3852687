"""NF4 codes to values in a kernel: the code-book lookups that `nf4_matvec`'s kernels use.

A byte of packed NF4 holds two weights' codes (high nibble: the even element, low nibble: the odd one); a
code's value is NF4_CODE[code] (times its block's absmax, applied by the caller). Three ways to look up
(`_nf4_codes`, LOOKUP the index of `LOOKUPS`):

- registers (compiled only): `prmt` treats two registers as an 8-byte table and looks up four bytes at once,
  with selectors taken from the nibbles, so the code book never leaves registers. Per byte plane of the codes'
  bit patterns, two lookups (entries 0-7 and 8-15) and a select on each nibble's top bit. Four planes give the
  exact fp32 codes; two give them rounded to bf16 (the high half of each fp32 word).
- pairs: one load a byte from a 256-entry table of both nibbles' values (`code_pairs`; the interpreter's path).
- code_book: one load a weight from the 16 fp32 codes, one cache line.

The PTX is checked instruction by instruction on the CPU by `tests/test_nf4_ptx_lookup.py` and compiled on the
GPU by `tests/test_nf4_matvec.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The lookups `_nf4_codes` takes, in the order of its LOOKUP index (module docstring).
LOOKUPS = ("registers", "pairs", "code_book")
# `_nf4_word_codes`' BF16_CODES for codes rounded to bf16 and kept as bf16 pairs, multiplied with x's bf16 pairs
# two at a time (`code_pair_sums`); False and True: fp32 codes, exact or rounded to bf16.
CODE_PAIRS = tl.constexpr(2)

_CODE_PAIRS: dict = {}


def code_pairs(code: torch.Tensor) -> torch.Tensor:
    """int64 `[256]`: for each byte value, the fp32 code-book values of its high nibble (the even weight: low
    word) and of its low nibble (high word). Built on the code book's device, without a host sync (a CUDA graph
    may be capturing), once per code-book tensor."""
    key = (code.data_ptr(), code.device)
    table = _CODE_PAIRS.get(key)
    if table is None:
        byte = torch.arange(256, device=code.device)
        pairs = torch.stack([code.float()[byte >> 4], code.float()[byte & 0xF]], dim=1).contiguous()
        table = _CODE_PAIRS[key] = pairs.view(torch.int64).view(256)
    return table


# bitsandbytes' NF4 code book (the NormalFloat levels of QLoRA; `quant_type="nf4"` always uses it).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def _nf4_lookup_ptx(high_nibbles: bool, bf16_codes: bool = False) -> str:
    """PTX that maps the four bytes of `$4` to the fp32 bit patterns of NF4_CODE[nibble] in `$0..$3` (the high
    or the low nibble of each byte), with no memory access: `prmt` looks up four bytes at once in an 8-byte
    table held in two registers, so each of the four byte planes of the 16 fp32 codes is two lookups (entries
    0-7 and 8-15) and a select on the nibble's top bit; eight more `prmt` transpose the planes into words.
    `bf16_codes`: the codes rounded to bf16 (fp32 words whose low half is zero): two planes, not four, and two
    `prmt` with four shifts or masks to form the words: 33 PTX instructions for four weights instead of 53."""
    codes = torch.tensor(NF4_CODE, dtype=torch.float32)
    words = (codes.to(torch.bfloat16).float() if bf16_codes else codes).view(torch.int32).tolist()
    plane = [[(w >> (8 * p)) & 0xFF for w in words] for p in range(4)]

    def table(p, first):  # entries first..first+3 of plane p, little-endian
        return sum(plane[p][first + i] << (8 * i) for i in range(4))

    lines = [".reg .b32 n, t, s, m, lo, hi, v0, v1, v2, v3, a, b, c, d, ta, tb;"]
    lines += ["shr.b32 n, $4, 4;" if high_nibbles else "mov.b32 n, $4;", "and.b32 n, n, 0x0F0F0F0F;"]
    # selector: the four nibbles side by side in 16 bits, top bits cleared (prmt reads bit 3 as a sign flag)
    lines += ["shr.b32 t, n, 4;", "or.b32 t, t, n;", "prmt.b32 s, t, t, 0x20;", "and.b32 s, s, 0x7777;"]
    # 0xFF in each byte whose nibble is 8-15: prmt's sign mode replicates bit 7 of the byte
    lines += ["shl.b32 m, n, 4;", "prmt.b32 m, m, m, 0xBA98;", "not.b32 t, m;"]
    for p in (2, 3) if bf16_codes else range(4):
        lines += [
            f"mov.b32 ta, 0x{table(p, 0):08X};", f"mov.b32 tb, 0x{table(p, 4):08X};", "prmt.b32 lo, ta, tb, s;",
            f"mov.b32 ta, 0x{table(p, 8):08X};", f"mov.b32 tb, 0x{table(p, 12):08X};", "prmt.b32 hi, ta, tb, s;",
            "and.b32 hi, hi, m;", "and.b32 lo, lo, t;", f"or.b32 v{p}, lo, hi;",
        ]
    if bf16_codes:  # word j = the bf16 code's two bytes (planes 2 and 3 of byte j) in its high half
        lines += [
            "prmt.b32 a, v2, v3, 0x5140;", "prmt.b32 b, v2, v3, 0x7362;",
            "shl.b32 $0, a, 16;", "and.b32 $1, a, 0xFFFF0000;", "shl.b32 $2, b, 16;", "and.b32 $3, b, 0xFFFF0000;",
        ]
        return "{\n" + "\n".join(lines) + "\n}"
    lines += [
        "prmt.b32 a, v0, v1, 0x5140;", "prmt.b32 b, v0, v1, 0x7362;",
        "prmt.b32 c, v2, v3, 0x5140;", "prmt.b32 d, v2, v3, 0x7362;",
        "prmt.b32 $0, a, c, 0x5410;", "prmt.b32 $1, a, c, 0x7632;",
        "prmt.b32 $2, b, d, 0x5410;", "prmt.b32 $3, b, d, 0x7632;",
    ]
    return "{\n" + "\n".join(lines) + "\n}"


def word_lookup_tables(bf16_codes: bool) -> list[int]:
    """The registers `_nf4_word_lookup_ptx` takes as `$9...`: per byte plane, entries 0-3 and 8-11 of the code
    book's plane (little-endian; entries 4-7 and 12-15 are immediates of the PTX). Loaded by the kernel, not
    written in the PTX: a constant operand is materialised again before each use (one more instruction per
    lookup in the SASS), a loaded one stays in its register."""
    codes = torch.tensor(NF4_CODE, dtype=torch.float32)
    words = (codes.to(torch.bfloat16).float() if bf16_codes else codes).view(torch.int32).tolist()
    planes = (2, 3) if bf16_codes else range(4)
    tables = []
    for p in planes:
        tables += [_plane_word(words, p, 0), _plane_word(words, p, 8)]
    return [t - (1 << 32) if t >= 1 << 31 else t for t in tables]  # as int32


def _plane_word(words: list[int], plane: int, first: int) -> int:
    """Bytes `plane` of code-book entries first..first+3 as one little-endian word."""
    return sum(((words[first + i] >> (8 * plane)) & 0xFF) << (8 * i) for i in range(4))


def _nf4_word_lookup_ptx(bf16_codes: bool, pairs: bool = False) -> str:
    """PTX that maps the eight codes of the 32-bit word `$8` (four packed bytes: weights 0-7 of the word in
    element order, the high nibble of byte j being weight 2j) to their values' fp32 bit patterns in `$0..$7`,
    with `word_lookup_tables` in `$9...` (`pairs`, with `bf16_codes`: to four bf16 pairs in `$0..$3`, weights
    2i and 2i + 1 in the low and the high half of `$i`, the word in `$4`, the tables in `$5...`). The nibbles of
    two bytes, side by side in the word's low half, are themselves a `prmt` selector (weights 1, 0, 3, 2 of those
    bytes): with each nibble's top bit cleared (one `and` for all eight), two lookups per byte plane (entries 0-7
    and 8-15) and a `prmt` that turns the top bits into byte masks (its sign mode, on the word and the word
    shifted by 4) select four values at once, with no other selector arithmetic. `bf16_codes`: the codes rounded
    to bf16, two planes; one `prmt` per bf16 pair of the codes, and the words formed from the pairs by a shift or
    a mask (compiled for sm_90: 27 SASS instructions for eight weights, against 41 for two calls of
    `_nf4_lookup_ptx` with their tables copied in from uniform registers; 21 as pairs)."""
    codes = torch.tensor(NF4_CODE, dtype=torch.float32)
    words = (codes.to(torch.bfloat16).float() if bf16_codes else codes).view(torch.int32).tolist()
    planes = (2, 3) if bf16_codes else range(4)
    values = ", ".join(f"v{p}_{h}" for p in planes for h in (0, 1))
    word = 4 if pairs else 8  # the input register after the outputs
    lines = [f".reg .b32 s0, s1, w4, m0, m1, lo, hi, a, b, c, d, {values};"]
    # selectors: bytes 0-1 (half 0) and 2-3 (half 1) of the word, each nibble's top bit cleared (prmt reads it
    # as its sign flag); masks: 0xFF in each output byte whose nibble is 8-15 (bit 7 of the word's byte j is the
    # top bit of weight 2j, bit 7 of the shifted word's byte j that of weight 2j + 1)
    lines += [f"and.b32 s0, ${word}, 0x77777777;", "shr.b32 s1, s0, 16;", f"shl.b32 w4, ${word}, 4;",
              f"prmt.b32 m0, w4, ${word}, 0xD9C8;", f"prmt.b32 m1, w4, ${word}, 0xFBEA;"]
    for i, p in enumerate(planes):
        for h in (0, 1):
            lines += [
                f"prmt.b32 lo, ${word + 1 + 2 * i}, 0x{_plane_word(words, p, 4):08X}, s{h};",
                f"prmt.b32 hi, ${word + 2 + 2 * i}, 0x{_plane_word(words, p, 12):08X}, s{h};",
                f"and.b32 hi, hi, m{h};", f"not.b32 a, m{h};", "and.b32 lo, lo, a;", f"or.b32 v{p}_{h}, lo, hi;",
            ]
    # byte i of v{p}_{h} is plane p of weight 4h + (1, 0, 3, 2)[i]
    for h in (0, 1):
        first = 4 * h
        if bf16_codes and pairs:
            lines += [f"prmt.b32 ${2 * h}, v2_{h}, v3_{h}, 0x4051;", f"prmt.b32 ${2 * h + 1}, v2_{h}, v3_{h}, 0x6273;"]
        elif bf16_codes:  # bf16 pairs: the even weight's code in the low half
            lines += [
                f"prmt.b32 a, v2_{h}, v3_{h}, 0x4051;", f"prmt.b32 b, v2_{h}, v3_{h}, 0x6273;",
                f"shl.b32 ${first}, a, 16;", f"and.b32 ${first + 1}, a, 0xFFFF0000;",
                f"shl.b32 ${first + 2}, b, 16;", f"and.b32 ${first + 3}, b, 0xFFFF0000;",
            ]
        else:  # transpose the four planes into the four words
            lines += [
                f"prmt.b32 a, v0_{h}, v1_{h}, 0x5140;", f"prmt.b32 b, v0_{h}, v1_{h}, 0x7362;",
                f"prmt.b32 c, v2_{h}, v3_{h}, 0x5140;", f"prmt.b32 d, v2_{h}, v3_{h}, 0x7362;",
                f"prmt.b32 ${first + 1}, a, c, 0x5410;", f"prmt.b32 ${first}, a, c, 0x7632;",
                f"prmt.b32 ${first + 3}, b, d, 0x5410;", f"prmt.b32 ${first + 2}, b, d, 0x7632;",
            ]
    return "{\n" + "\n".join(lines) + "\n}"


def _bf16_pair_dot_ptx() -> str:
    """PTX that takes four bf16 pairs of codes (`$1..$4`) and of x (`$5..$8`) to the fp32 sum of their eight
    products in `$0`: four `fma.rn.bf16x2` (each half a chain of four products, rounded to bf16 at each step),
    then the two halves widened and added in fp32."""
    return "\n".join([
        "{", ".reg .b32 s, z, lo, hi;", ".reg .f32 even, odd, sum;",
        "mov.b32 z, 0x80008000;",  # -0.0 in each half: the first products alone
        "fma.rn.bf16x2 s, $1, $5, z;", "fma.rn.bf16x2 s, $2, $6, s;", "fma.rn.bf16x2 s, $3, $7, s;",
        "fma.rn.bf16x2 s, $4, $8, s;",
        "shl.b32 lo, s, 16;", "and.b32 hi, s, 0xFFFF0000;", "mov.b32 even, lo;", "mov.b32 odd, hi;",
        "add.f32 sum, even, odd;", "mov.b32 $0, sum;", "}",
    ])


NF4_EVEN_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=True))
NF4_ODD_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=False))
NF4_EVEN_BF16_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=True, bf16_codes=True))
NF4_ODD_BF16_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=False, bf16_codes=True))
NF4_WORD_PTX = tl.constexpr(_nf4_word_lookup_ptx(bf16_codes=False))
NF4_WORD_BF16_PTX = tl.constexpr(_nf4_word_lookup_ptx(bf16_codes=True))
NF4_WORD_PAIRS_PTX = tl.constexpr(_nf4_word_lookup_ptx(bf16_codes=True, pairs=True))
BF16_PAIR_DOT_PTX = tl.constexpr(_bf16_pair_dot_ptx())


@triton.jit
def _nf4_codes(packed, table_ptr, LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr):
    """fp32 code-book values of the high (even weight) and low (odd weight) nibble of each byte of `packed`
    (rounded to bf16 with BF16_CODES, which only the PTX lookup takes). LOOKUP: the index of `LOOKUPS`;
    `table_ptr` is the pair table (`code_pairs`) for "pairs", the fp32 code book for "code_book"."""
    if LOOKUP == 0:
        even = tl.inline_asm_elementwise(NF4_EVEN_BF16_PTX if BF16_CODES else NF4_EVEN_PTX, "=r,=r,=r,=r,r",
                                         [packed], dtype=tl.int32, is_pure=True, pack=4)
        odd = tl.inline_asm_elementwise(NF4_ODD_BF16_PTX if BF16_CODES else NF4_ODD_PTX, "=r,=r,=r,=r,r",
                                        [packed], dtype=tl.int32, is_pure=True, pack=4)
        return even.to(tl.float32, bitcast=True), odd.to(tl.float32, bitcast=True)
    elif LOOKUP == 1:
        both = tl.load(table_ptr + packed.to(tl.int32))
        return both.to(tl.int32).to(tl.float32, bitcast=True), (both >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        byte = packed.to(tl.int32)
        return tl.load(table_ptr + (byte >> 4)), tl.load(table_ptr + (byte & 0xF))


@triton.jit
def _nf4_word_codes(words, code_ptr, t0, t1, t2, t3, t4, t5, t6, t7, PTX: tl.constexpr, BF16_CODES: tl.constexpr):
    """The fp32 code-book values of the eight weights of each int32 word of `words` (four packed bytes), in
    element order (weight 2j: the high nibble of byte j), as eight tensors of `words`' shape. PTX (compiled
    only): `_nf4_word_lookup_ptx`, with `word_lookup_tables` loaded into t0... (the first four with BF16_CODES,
    the codes rounded to bf16); else each nibble shifted out and its value loaded from the fp32 code book
    (exact). BF16_CODES == CODE_PAIRS (PTX only): the codes rounded to bf16 as four int32 tensors of bf16 pairs
    (weights 2i and 2i + 1: low and high half), for `code_pair_sums`."""
    if PTX and BF16_CODES == CODE_PAIRS:
        codes = tl.inline_asm_elementwise(NF4_WORD_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r,r", [words, t0, t1, t2, t3],
                                          dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    elif PTX:
        if BF16_CODES:
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                NF4_WORD_BF16_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r", [words, t0, t1, t2, t3],
                dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                NF4_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [words, t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        codes = (c0.to(tl.float32, bitcast=True), c1.to(tl.float32, bitcast=True), c2.to(tl.float32, bitcast=True),
                 c3.to(tl.float32, bitcast=True), c4.to(tl.float32, bitcast=True), c5.to(tl.float32, bitcast=True),
                 c6.to(tl.float32, bitcast=True), c7.to(tl.float32, bitcast=True))
    else:
        codes = (tl.load(code_ptr + ((words >> 4) & 0xF)), tl.load(code_ptr + (words & 0xF)),
                 tl.load(code_ptr + ((words >> 12) & 0xF)), tl.load(code_ptr + ((words >> 8) & 0xF)),
                 tl.load(code_ptr + ((words >> 20) & 0xF)), tl.load(code_ptr + ((words >> 16) & 0xF)),
                 tl.load(code_ptr + ((words >> 28) & 0xF)), tl.load(code_ptr + ((words >> 24) & 0xF)))
    return codes


@triton.jit
def code_pair_sums(codes, x01, x23, x45, x67):
    """Σ_j code[j] · x[j] over the eight weights of each word, in fp32 (`_bf16_pair_dot_ptx`): codes as
    `_nf4_word_codes` gives them with CODE_PAIRS, x as its four bf16 pairs (int32, the even element in the low
    half)."""
    c01, c23, c45, c67 = codes
    return tl.inline_asm_elementwise(BF16_PAIR_DOT_PTX, "=r,r,r,r,r,r,r,r,r", [c01, c23, c45, c67, x01, x23, x45, x67],
                                     dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
