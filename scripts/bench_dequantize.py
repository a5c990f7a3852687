"""NF4 dequantisation of the training path: unsloth-lite's `dequantize_nf4` against bitsandbytes'
`dequantize_4bit`, at every distinct decoder projection shape of the W1/W2 models (Qwen3-8B, Qwen3.5-27B).

    python scripts/bench_dequantize.py --out bench_dequantize.json      # on a GPU: both models' shapes
    TRITON_INTERPRET=1 python scripts/bench_dequantize.py --tiny       # CPU smoke run

A QLoRA step dequantises every frozen NF4 weight to bf16 before each of its products (forward, recomputation,
input gradients): three times a step for most projections, 47 ms of the W2 step in its profile. The kernel is
memory-bound when its instructions keep up: it reads half a byte a weight (and the absmax) and writes two bytes.

Weights: random, bf16, double quantisation, block 64 (as `quantize_linears_nf4` stores them). Variants:
- `unsloth_lite`: `dequantize_nf4` as shipped;
- `unsloth_lite_interleaved`: the kernel writing its tile as an interleave of the two nibbles' values instead
  of one 32-bit word a packed byte (`dequantize_nf4.PAIRED_STORE` off);
- `unsloth_lite_pairs`: codes from the 256-entry table of value pairs, one load a byte (`LOOKUP = "pairs"`),
  instead of one load a weight from the 16 codes;
- `bitsandbytes`: `bitsandbytes.functional.dequantize_4bit` (its CUDA kernel).

Times are device times (`bench_common.graph_ms`: the call captured in a CUDA graph and replayed). GB/s counts
the packed weights, the 8-bit absmax and its second level read and the bf16 weight written, once; "% copy"
compares it with a device-to-device copy measured in the same run. `ms_per_pass` sums each shape's time times
the number of such linears in the model: one dequantisation of all its decoder projections.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import torch
from bench_common import (
    bench_device,
    copy_bandwidth_gbps,
    environment,
    markdown_table,
    report_unknown,
    shape_run_parser,
    timed_row,
    write_json,
)
from bench_nf4_matvec import nf4_weight, per_token, projection_shapes
from decode_shapes import SHAPES, nf4_bytes

# variant -> `unsloth_lite.kernels.dequantize_nf4` settings it runs with
OPTIONS = {
    "unsloth_lite": {},
    "unsloth_lite_interleaved": {"PAIRED_STORE": False},
    "unsloth_lite_pairs": {"LOOKUP": "pairs"},
}
VARIANTS = (*OPTIONS, "bitsandbytes")
TINY_VARIANTS = tuple(OPTIONS)


@contextlib.contextmanager
def dequantize_settings(settings: dict):
    """`dequantize_nf4`'s module settings changed for the duration (its cached launches, which hold them,
    dropped before and after)."""
    module = importlib.import_module("unsloth_lite.kernels.dequantize_nf4")
    saved = {name: getattr(module, name) for name in settings}
    module._LAUNCHES.clear()
    for name, value in settings.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        module._LAUNCHES.clear()


def variant_fn(variant: str, weight):
    if variant == "bitsandbytes":
        import bitsandbytes.functional as F

        return lambda: F.dequantize_4bit(weight.data, weight.quant_state)
    from unsloth_lite.kernels import dequantize_nf4

    out = torch.empty(weight.quant_state.shape, dtype=weight.quant_state.dtype, device=weight.device)
    return lambda: dequantize_nf4(weight, out=out)


def measure(shapes: list[str], variants: list[str], device, tiny: bool, bandwidth: float) -> list[dict]:
    dtype = torch.float32 if tiny else torch.bfloat16
    rows, counts = [], {s: projection_shapes(s, tiny) for s in shapes}
    for n_out, n_in in sorted({key for c in counts.values() for key in c}):
        weight = nf4_weight(n_out, n_in, device, dtype)
        n = n_out * n_in
        moved = nf4_bytes(n) + n * dtype.itemsize
        for variant in variants:
            with dequantize_settings(OPTIONS.get(variant, {})):
                fn = variant_fn(variant, weight)
                rows.append(timed_row(fn, device, moved, bandwidth, out=n_out, **{"in": n_in}, variant=variant))
    return rows


def main(argv=None) -> int:
    parser = shape_run_parser(__doc__, SHAPES)
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    args = parser.parse_args(argv)
    device = bench_device(args.tiny)
    if device is None:
        return 1
    shapes = args.shapes.split(",")
    variants = args.variants.split(",") if args.variants else list(TINY_VARIANTS if args.tiny else VARIANTS)
    if report_unknown("shapes", shapes, SHAPES) or report_unknown("variants", variants, VARIANTS):
        return 2
    bandwidth = copy_bandwidth_gbps(device, 0.25 if args.tiny else 4.0)
    rows = measure(shapes, variants, device, args.tiny, bandwidth)
    totals = per_token(rows, shapes, variants, args.tiny, column="ms_per_pass")
    print(f"copy bandwidth {bandwidth:.0f} GB/s; device times")
    print(markdown_table(rows, ["out", "in", "variant", "us", "gb_per_s", "copy_fraction"]))
    print(markdown_table(totals, ["model", "variant", "ms_per_pass"]))
    write_json(args.out, dict(environment=environment(device, ("torch", "triton", "bitsandbytes")),
                              copy_bandwidth_gbps=bandwidth, rows=rows, per_pass=totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
