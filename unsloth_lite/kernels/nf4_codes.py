"""NF4 codes to values in a kernel: the code-book lookups that `nf4_matvec`'s kernels use.

A byte of packed NF4 holds two weights' codes (high nibble: the even element, low nibble: the odd one); a
code's value is NF4_CODE[code] (times its block's absmax, applied by the caller). Three ways to look up
(`_nf4_codes`, LOOKUP the index of `nf4_matvec.LOOKUPS`):

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

_WORD_TABLES: dict = {}


def word_lookup_tables(code: torch.Tensor) -> torch.Tensor:
    """int32 `[8]`: the code book rounded to bf16 as `prmt` tables, its low bytes then its high bytes, four
    entries a word (entries 0-3, 4-7, 8-11, 12-15; entry i in byte i % 4). Built on the code book's device
    without a host sync (a CUDA graph may be capturing), once per code-book tensor."""
    key = (code.data_ptr(), code.device)
    tables = _WORD_TABLES.get(key)
    if tables is None:
        bits = code.float().to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        planes = torch.stack([bits & 0xFF, bits >> 8]).view(2, 4, 4)  # [plane, word, entry in the word]
        words = (planes << (8 * torch.arange(4, device=code.device))).sum(dim=2).view(8)
        tables = _WORD_TABLES[key] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return tables


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


def _nf4_bf16_word_lookup_ptx(bf16_pairs: bool = False) -> str:
    """PTX that maps the eight nibbles of the packed word `$in` to the code-book values rounded to bf16, with
    the tables of `word_lookup_tables` in the 32 operands after it (each input is packed four times: every
    fourth one is read). Outputs: the fp32 bit patterns of the high nibble of byte j (an even weight) in `$j`
    and of its low nibble (an odd weight) in `$(4 + j)` (`$in` = `$8`); with `bf16_pairs`, bf16 pairs, even
    weights of bytes 0-1 and 2-3 in `$0` and `$1`, odd ones in `$2` and `$3` (`$in` = `$4`), an operand of a
    bf16 product as it is.

    Each half word is itself `prmt`'s selector for its four nibbles (bits 3 masked off), so nothing is spread or
    gathered first: per half, one `prmt` marks the nibbles of 8-15 (their top bits, moved to bit 7 of a byte
    each, sign replicated), each of the two byte planes of the bf16 codes is two lookups and a `lop3` select,
    and two `prmt` (with four shifts or masks for fp32 words) form the outputs. The tables come in registers
    loaded once before the kernel's loop (given as constants, ptxas copies them from uniform registers at every
    lookup). Compiled for sm_90 in the 8 x 512 kernel: a loop of 262 instructions for each thread's 32 weights
    against 326 with `_nf4_lookup_ptx`, 80 registers against 94."""
    word = 4 if bf16_pairs else 8
    lines = [".reg .b32 u, s, m, lo, hi, v0, v1, a, b;", f"shl.b32 u, ${word}, 4;"]
    # selector nibbles of half h: odd, even weight of byte 2h, then of byte 2h + 1; mask byte i: 0xFF where
    # nibble i is 8-15 (its top bit is bit 7 of a byte of u or of the word; prmt's sign mode replicates it)
    for half, (shift, mark) in enumerate(((None, "0xD9C8"), ("16", "0xFBEA"))):
        if shift is None:
            lines += [f"and.b32 s, ${word}, 0x7777;"]
        else:
            lines += [f"shr.b32 s, ${word}, {shift};", "and.b32 s, s, 0x7777;"]
        lines += [f"prmt.b32 m, u, ${word}, {mark};"]
        for p in (0, 1):  # table word w of plane p: operand word + 1 + 4 (4p + w)
            t = word + 1 + 16 * p
            lines += [
                f"prmt.b32 lo, ${t}, ${t + 4}, s;", f"prmt.b32 hi, ${t + 8}, ${t + 12}, s;",
                f"lop3.b32 v{p}, lo, hi, m, 0xD8;",  # (lo & ~m) | (hi & m)
            ]
        if bf16_pairs:  # byte j of v0 / v1: low / high byte of nibble j's bf16 (odd, even, odd, even weight)
            lines += [f"prmt.b32 ${half}, v0, v1, 0x7351;", f"prmt.b32 ${2 + half}, v0, v1, 0x6240;"]
            continue
        lines += [  # a: bf16 of the odd weight of byte 2h in its low half, of the even one in its high half
            "prmt.b32 a, v0, v1, 0x5140;", "prmt.b32 b, v0, v1, 0x7362;",
            f"and.b32 ${2 * half}, a, 0xFFFF0000;", f"shl.b32 ${4 + 2 * half}, a, 16;",
            f"and.b32 ${2 * half + 1}, b, 0xFFFF0000;", f"shl.b32 ${5 + 2 * half}, b, 16;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


NF4_EVEN_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=True))
NF4_ODD_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=False))
NF4_EVEN_BF16_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=True, bf16_codes=True))
NF4_ODD_BF16_PTX = tl.constexpr(_nf4_lookup_ptx(high_nibbles=False, bf16_codes=True))
NF4_BF16_WORD_PTX = tl.constexpr(_nf4_bf16_word_lookup_ptx())
NF4_BF16_PAIRS_PTX = tl.constexpr(_nf4_bf16_word_lookup_ptx(bf16_pairs=True))


@triton.jit
def _nf4_codes(packed, table_ptr, LOOKUP: tl.constexpr, BF16_CODES: tl.constexpr, WORD_LOOKUP: tl.constexpr):
    """fp32 code-book values of the high (even weight) and low (odd weight) nibble of each byte of `packed`
    (rounded to bf16 with BF16_CODES, which only the PTX lookup takes). LOOKUP: the index of `LOOKUPS`;
    `table_ptr` is the pair table (`code_pairs`) for "pairs", the fp32 code book for "code_book"."""
    if LOOKUP == 0 and BF16_CODES and WORD_LOOKUP:  # table_ptr: `word_lookup_tables`
        even, odd = tl.inline_asm_elementwise(
            NF4_BF16_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r" + ",r" * 32,
            [packed, tl.load(table_ptr), tl.load(table_ptr + 1), tl.load(table_ptr + 2), tl.load(table_ptr + 3),
             tl.load(table_ptr + 4), tl.load(table_ptr + 5), tl.load(table_ptr + 6), tl.load(table_ptr + 7)],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=4,
        )
        return even.to(tl.float32, bitcast=True), odd.to(tl.float32, bitcast=True)
    elif LOOKUP == 0:
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
def _nf4_codes_bf16(packed, table_ptr, LOOKUP: tl.constexpr):
    """bf16 code-book values (rounded) of the high (even weight) and low (odd weight) nibble of each byte of
    `packed`: an operand of a bf16 product. `table_ptr` as for `_nf4_codes` (`word_lookup_tables` for the
    registers)."""
    if LOOKUP == 0:
        return tl.inline_asm_elementwise(
            NF4_BF16_PAIRS_PTX, "=r,=r,=r,=r,r" + ",r" * 32,
            [packed, tl.load(table_ptr), tl.load(table_ptr + 1), tl.load(table_ptr + 2), tl.load(table_ptr + 3),
             tl.load(table_ptr + 4), tl.load(table_ptr + 5), tl.load(table_ptr + 6), tl.load(table_ptr + 7)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )
    else:
        even, odd = _nf4_codes(packed, table_ptr, LOOKUP, False, False)
        return even.to(tl.bfloat16), odd.to(tl.bfloat16)
