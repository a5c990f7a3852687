"""Where the error of `chunk_gated_delta_rule` on bf16 inputs comes from, emulated on the CPU.

    TRITON_INTERPRET=1 python scripts/deltanet_precision.py                # T = 2048, 1 key / 3 value heads of 128
    TRITON_INTERPRET=1 python scripts/deltanet_precision.py --tiny         # seconds: the test's run

With 16-bit inputs' products in tf32 (`input_precision="tf32"`), the H200's errors are those of fp32 operands
cut to tf32 by dropping their 13 low mantissa bits (truncation, not rounding). The last rows run the kernels'
own precisions: operands rounded to tf32 first, and the default's three bf16 products of the operands' halves. Triton's
interpreter multiplies in fp32; this script runs the kernels there with the operands of every tf32 product
first truncated (`truncate`) or rounded to nearest (`round`) to tf32, optionally keeping the products of some
launchers in fp32, on the bf16 inputs' values upcast to fp32 so that the outputs are not rounded to bf16.
Each row: ||x - ref|| / ||ref|| of the output and the five input gradients against the float64 recurrence;
`bf16 floor` is the error of that reference itself rounded to bf16, which no bf16 output can beat. A bf16
run's error is about the root of the sum of squares of the floor and its row's.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from bench_common import markdown_table, write_json
from bench_deltanet import forward_backward, make_inputs, ours, reference, relative

from unsloth_lite.kernels import gated_delta_rule

LAUNCHERS = ("_prepare", "_forward_states", "_output", "_backward_states", "_backward_inputs")
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
TF32_DROPPED = 0xFFFFE000  # fp32 bits kept by tf32: sign, exponent, 10 mantissa bits


def to_tf32(x: np.ndarray, mode: str) -> np.ndarray:
    if x.dtype != np.float32:
        return x
    bits = x.view(np.uint32).astype(np.uint64)
    if mode == "round":  # to nearest, ties to even
        bits = bits + 0xFFF + ((bits >> 13) & 1)
    return (bits & TF32_DROPPED).astype(np.uint32).view(np.float32)


class Emulation:
    """Patches the interpreter's dot (tf32 operands as `mode` makes them, except in the launchers of `exact`)
    and wraps the launchers so that the dot knows which one runs."""

    def __init__(self):
        from triton.runtime import interpreter

        self.builder = interpreter.InterpreterBuilder
        self.handle = interpreter.TensorHandle
        self.mode, self.exact, self.running = "truncate", set(), None
        original = self.builder.create_dot
        emulation = self

        def create_dot(builder, a, b, acc, input_precision, max_num_imprecise_acc):
            if "TF32" in str(input_precision).upper() and emulation.running not in emulation.exact:
                a = emulation.handle(to_tf32(a.data, emulation.mode), a.dtype)
                b = emulation.handle(to_tf32(b.data, emulation.mode), b.dtype)
            return original(builder, a, b, acc, input_precision, max_num_imprecise_acc)

        self.builder.create_dot = create_dot
        for name in LAUNCHERS:
            setattr(gated_delta_rule, name, self._tracked(name, getattr(gated_delta_rule, name)))
        # fp32 inputs (the bf16 values upcast) with the 16-bit inputs' product precision
        precision_of = gated_delta_rule._dot_precision
        gated_delta_rule._dot_precision = lambda dtype, kernel: precision_of(torch.bfloat16, kernel)

    def _tracked(self, name, launcher):
        def run(*args, **kwargs):
            outer, self.running = self.running, name
            try:
                return launcher(*args, **kwargs)
            finally:
                self.running = outer

        return run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="70 tokens, head dim 16: the test's run")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--key-heads", type=int, default=1, help="key heads (value heads: 3 times as many)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("deltanet_precision.py: run it under TRITON_INTERPRET=1 (it emulates tf32 in Triton's interpreter)",
              file=sys.stderr)
        return 2
    seq, key_heads, head_dim = (70, 1, 16) if args.tiny else (args.seq, args.key_heads, args.head_dim)
    emulation = Emulation()
    inputs, grad_out = make_inputs(seq, key_heads, 3 * key_heads, head_dim, torch.device("cpu"), torch.bfloat16)
    expected = reference(inputs, grad_out)
    refs = (expected[0], *expected[1])
    rows = [dict(variant="bf16 floor", **{f"err_{n}": f"{relative(r.bfloat16(), r):.2e}" for n, r in zip(
        NAMES, refs, strict=True)})]
    wide = [x.float() for x in inputs]
    cases = [("truncate", ()), *(("truncate", (name,)) for name in LAUNCHERS), ("round", ()), ("truncate", LAUNCHERS)]
    cases.append(("truncate", (), "tf32_rounded"))  # the kernels' own rounding: as `round` above if it is right
    cases.append(("truncate", (), "bf16x3"))  # the default's bf16 halves: no tf32 product left to truncate
    for mode, exact, *precision in cases:
        emulation.mode, emulation.exact = mode, set(exact)
        gated_delta_rule.LAUNCH["precision"] = precision[0] if precision else "tf32"
        out, grads = forward_backward(ours, wide, grad_out.float())
        label = f"tf32 {mode}" + (f", fp32 in {', '.join(exact)}" if exact else "")
        label = f"kernels' {precision[0]}, {label}" if precision else label
        rows.append(dict(variant=label, **{f"err_{n}": f"{relative(x, r):.2e}" for n, x, r in zip(
            NAMES, (out, *grads), refs, strict=True)}))
    print(markdown_table(rows, ["variant"] + [f"err_{n}" for n in NAMES]))
    write_json(args.out, dict(seq=seq, key_heads=key_heads, value_heads=3 * key_heads, head_dim=head_dim, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
