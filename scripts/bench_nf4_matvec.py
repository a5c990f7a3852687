"""Batch-1 NF4 projections of decoding (workload W3's kernels): unsloth-lite's `nf4_matvec` against
bitsandbytes' own matrix-vector kernel and against dequantising the weight then multiplying, at every distinct
decoder projection shape of the W3 models, with the time each model spends in them per token.

    python scripts/bench_nf4_matvec.py --out bench_nf4_matvec.json              # on a GPU: both W3 shapes
    TRITON_INTERPRET=1 python scripts/bench_nf4_matvec.py --tiny               # CPU smoke run
    ncu --kernel-name regex:_nf4_matvec_words_kernel --launch-skip 3 --launch-count 1 \
        python scripts/bench_nf4_matvec.py --profile-shape 4096x12288          # one product, for a profiler

Shapes: the NF4 decoder linears of `decode_shapes.py`'s `qwen3_8b` and `qwen3_5_27b` (random weights, bf16
compute, double quantisation, block 64, as `quantize_linears_nf4` stores them), one row of x (`--rows`: 1 to 8, as
a decoding step of that many sequences). Variants:
- `unsloth_lite`: `unsloth_lite.kernels.nf4_matvec` (the weight read once, dequantised in registers; each
  block's absmax read as one float32 value, dequantised from the nested form once: `nf4_matvec.FLAT_ABSMAX`);
- `unsloth_lite_nested_absmax`: the same kernel reading the nested absmax itself (`FLAT_ABSMAX` off: fewer
  bytes, but a dependent second-level lookup before each block's scale);
- `unsloth_lite_words`: the word kernel (`nf4_matvec.WORD_KERNEL`: the weight read as 32-bit words, eight codes
  decoded at once, 30% fewer instructions a weight);
- `unsloth_lite_prefetch`: the word kernel with each step's next tile loaded into registers before it decodes its
  own (`nf4_matvec.REGISTER_PREFETCH`) instead of Triton's pipelining through shared memory;
- `unsloth_lite_fp32_x`: the default kernel with x given in float32 (y then in float32): the walk reads x's
  elements as they are instead of widening bf16 pairs, twice the bytes of x (what x's widening costs in the
  integer pipe, which bounds the kernel: docs/benchmarks.md, "The word kernel under Nsight Compute");
- `unsloth_lite_fp32_products`: the default kernel with each weight's product with x in fp32
  (`nf4_matvec.BF16_PAIR_PRODUCTS` off: codes and x widened to fp32 one by one) instead of in bf16 pairs;
- `unsloth_lite_no_pdl`: the default kernel launched as an ordinary launch (`nf4_matvec.PDL` off);
- `unsloth_lite_triton_walk`: the Triton word kernel where the default takes the Gluon walk
  (`nf4_matvec.GLUON_WALK` off: one bf16 row, K a multiple of 2,048, the Qwen3-8B shape's projections);
- `bitsandbytes`: `bitsandbytes.matmul_4bit` on one row (its `gemv_4bit` kernel: what Hugging Face decodes with);
- `dequantize_matmul`: `dequantize_nf4` into a bf16 weight, then `F.linear` (a path that writes the weight out).

`--sweep` also times the unsloth-lite kernel at each tile of `SWEEP_TILES` (features x weights along K / warps
of a program, and whether K is split over programs, one tile each: `nf4_matvec.blocked_tile`'s choice) per
shape, and the word kernel at each tile of `WORD_SWEEP_TILES` (columns "words <tile>"), to choose those tables
from one run (`--sweep-chosen-tile`: each shape's chosen tile only); and at the
chosen tile with each setting of `CHOSEN_OPTIONS`: the codes read from memory instead of looked up in registers
(`nf4_matvec.LOOKUP` "pairs", the interpreter's lookup, and "code_book"), the exact fp32 code book instead of
the one rounded to bf16 that bf16 weights take (`BF16_CODES` off: more instructions a weight; whether they
bound the kernel), the loop's loads kept 2, 3, 4 or 6 tiles ahead (`PIPELINE_STAGES`; three also at two other
tiles), and the word kernel at its chosen tile (`word_tile`), looped, with three stages and with the next tile
loaded into registers a step ahead (`REGISTER_PREFETCH`).

Each model's MLP input (gate and up) is also timed as decoding runs it: the two products and `swiglu` (three
launches) against `nf4_gated_matvec` (one launch, `decode.GATED_MATVEC`) and that launch walked in Gluon
(`gated_gluon_us`, `nf4_gated_matvec.GLUON_GATED`, where it fits: one row, the Qwen3-8B MLP), with and without LoRA
adapters of rank 16 on both; and each group of projections of one input (q/k/v; the DeltaNet's qkv/z/b/a): one
`nf4_matvec` each against `nf4_grouped_matvec` (one launch, `decode.GROUPED_MATVEC`) and that launch walked in
Gluon (`grouped_gluon_us`, `nf4_grouped_matvec.GLUON_GROUPED`, where it fits: one row, the Qwen3-8B q/k/v), without
and with rank-16 adapters on all.

Times are device times (`bench_common.graph_ms`): per product, a chain of products captured in one CUDA graph and
replayed, each reading its own copy of the weight (`weight_copies`: together more than the L2 cache holds), as
a decoding step's graph runs one projection after another (the table of variants; the sweeps and the fused
launches time one product a graph, which adds the graph's own launch, a few microseconds). GB/s counts
the bytes a projection must read (packed weights, the absmax in the form the variant reads it: 8-bit with its
second level, or float32 for `unsloth_lite`; x) and write (y) once;
"% copy" compares it with a device-to-device copy measured in the same run. `ms_per_token` sums each shape's
time times the number of such linears in the model: the NF4 projections' share of one decoded token.
"""

from __future__ import annotations

import collections
import copy
import sys

import torch
from bench_common import (
    bench_device,
    bench_ms,
    copy_bandwidth_gbps,
    environment,
    graph_ms,
    markdown_table,
    report_unknown,
    shape_run_parser,
    timed_row,
    write_json,
)
from decode_shapes import SHAPES, nf4_bytes, shape_config
from random_checkpoint import weightless_model

VARIANTS = ("unsloth_lite", "unsloth_lite_nested_absmax", "unsloth_lite_words", "unsloth_lite_prefetch",
            "unsloth_lite_fp32_x", "unsloth_lite_fp32_products", "unsloth_lite_no_pdl", "unsloth_lite_triton_walk",
            "bitsandbytes", "dequantize_matmul")
FP32_X = "unsloth_lite_fp32_x"  # the same product of x given in float32: no widening of x in the walk
NESTED_ABSMAX = "unsloth_lite_nested_absmax"  # the kernel reading the double-quantised absmax itself
# `nf4_matvec` settings of the unsloth-lite variants
KERNEL_SETTINGS = {"unsloth_lite": {}, NESTED_ABSMAX: {"FLAT_ABSMAX": False},
                   "unsloth_lite_words": {"WORD_KERNEL": True, "GLUON_WALK": False},
                   "unsloth_lite_prefetch": {"WORD_KERNEL": True, "PIPELINE_STAGES": 1, "REGISTER_PREFETCH": True,
                                             "GLUON_WALK": False},
                   FP32_X: {}, "unsloth_lite_fp32_products": {"BF16_PAIR_PRODUCTS": False, "GLUON_WALK": False},
                   "unsloth_lite_no_pdl": {"PDL": False}, "unsloth_lite_triton_walk": {"GLUON_WALK": False}}
# (features, weights along K, warps, tiles a split along K: False none, True one) a program
SWEEP_TILES = [(4, 1024, 4, False), (8, 512, 4, False), (16, 1024, 4, False), (32, 512, 4, False),
               (8, 512, 8, False), (16, 1024, 8, False), (32, 512, 8, False), (64, 256, 8, False),
               (8, 512, 4, True), (8, 1024, 4, True), (16, 512, 4, True), (16, 1024, 8, True), (32, 1024, 8, True),
               (16, 2048, 8, True)]
# the word kernel's tiles (same form). Offline for sm_90 (triton 3.6), the loop's instructions per eight weights and
# the registers: 8x512/4w 54 at 47, 16x256/4w 53, 32x256/4w 50 (two features a thread share x), 32x512/4w 50 at
# 128; 8x1024/4w 47 at 80 (two words a step in flight per thread: for the projections of few programs). Programs
# of one or two warps: the pipelined loop's barriers then hold no other warp's loads back, and an SM holds more
# programs (offline, three stages: 2x512/1w 59.5 at 60, 4x512/1w 53.6 at 80, 2x1024/1w 54.8 at 61, 4x1024/2w and
# 8x512/2w 53.6 at 80). K split in two or four (2 or 4 tiles a split): the long-K projections' (down_proj, out_proj)
# programs doubled or quadrupled at the same tile, each walking a half or a quarter of the row
WORD_SWEEP_TILES = [(4, 1024, 4, False), (8, 512, 4, False), (8, 1024, 4, False), (16, 256, 4, False),
                    (32, 256, 4, False), (32, 512, 4, False), (16, 512, 8, False), (8, 512, 4, True),
                    (16, 1024, 8, True), (2, 512, 1, False), (4, 512, 1, False), (2, 1024, 1, False),
                    (4, 1024, 2, False), (8, 512, 2, False), (8, 512, 4, 2), (8, 512, 4, 4), (8, 1024, 4, 2)]
TINY_VARIANTS = ("unsloth_lite", NESTED_ABSMAX, "unsloth_lite_words", "dequantize_matmul")


def tile_name(tile: tuple[int, int, int, int]) -> str:
    """"8x512/4w", with " split" (one tile a split along K) or " split 2" (two tiles a split)."""
    features, tile_k, warps, tiles_a_split = tile
    split = "" if not tiles_a_split else " split" if tiles_a_split == 1 else f" split {int(tiles_a_split)}"
    return f"{features}x{tile_k}/{warps}w{split}"


# `nf4_matvec` settings the sweep times at the chosen tile only (column "chosen, <name>")
CHOSEN_OPTIONS = {
    "pairs": {"LOOKUP": "pairs"}, "code_book": {"LOOKUP": "code_book"}, "exact codes": {"BF16_CODES": False},
    **{f"{n} stages": {"PIPELINE_STAGES": n} for n in (2, 3, 4, 6)},
    # other tiles with three stages, where pipelining frees registers (offline sm_90 at 17408 x 5120: 16x512/8w
    # 71, 4x1024/4w 64)
    **{f"3 stages, {tile_name(tile)}": {"PIPELINE_STAGES": 3, "blocked_tile": lambda _n, tile=tile: tile}
       for tile in ((16, 512, 8, False), (4, 1024, 4, False))},
    "words": {"WORD_KERNEL": True}, "words, 3 stages": {"WORD_KERNEL": True, "PIPELINE_STAGES": 3},
    "words, prefetch": {"WORD_KERNEL": True, "PIPELINE_STAGES": 1, "REGISTER_PREFETCH": True},
}


def projection_shapes(shape: str, tiny: bool) -> collections.Counter:
    """(out, in) -> how many NF4 decoder linears of that shape the model has (lm_head and embeddings stay bf16)."""
    model = weightless_model(shape, shape_config(shape, tiny))
    return collections.Counter(
        (m.out_features, m.in_features) for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.endswith(("lm_head", "embed_tokens"))
    )


def nf4_weight(n_out: int, n_in: int, device, dtype):
    import bitsandbytes as bnb

    weight = torch.randn(n_out, n_in, dtype=dtype, generator=torch.Generator().manual_seed(n_out * n_in)) * 0.02
    param = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True,
                              blocksize=64, quant_storage=torch.uint8)
    return param.to(device)


def flat_absmax_bytes(n: int) -> float:
    """Packed weights and a float32 absmax per 64-weight block (what the kernel reads with `FLAT_ABSMAX`)."""
    return n / 2 + n / 64 * 4


def with_settings(module, settings: dict, fn):
    """`fn` as a call made with `module`'s attributes set to `settings`, restored after it."""
    def call():
        saved = {name: getattr(module, name) for name in settings}
        try:
            for name, value in settings.items():
                setattr(module, name, value)
            return fn()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    return call


def variant_fn(variant: str, x, weight):
    import torch.nn.functional as F

    from unsloth_lite.kernels import dequantize_nf4
    from unsloth_lite.kernels import nf4_matvec as matvec

    if variant in KERNEL_SETTINGS:
        x = x.float() if variant == FP32_X else x

        return with_settings(matvec, KERNEL_SETTINGS[variant], lambda: matvec.nf4_matvec(x, weight))
    if variant == "bitsandbytes":
        import bitsandbytes as bnb

        return lambda: bnb.matmul_4bit(x, weight.t(), quant_state=weight.quant_state)
    return lambda: F.linear(x, dequantize_nf4(weight))


def measure(shapes: list[str], variants: list[str], device, tiny: bool, bandwidth: float,
            x_rows: int = 1) -> list[dict]:
    dtype = torch.float32 if tiny else torch.bfloat16
    rows, counts = [], {s: projection_shapes(s, tiny) for s in shapes}
    for n_out, n_in in sorted({key for c in counts.values() for key in c}):
        weights = weight_copies(nf4_weight(n_out, n_in, device, dtype), tiny)
        x = torch.randn(x_rows, n_in, device=device, dtype=dtype)
        for variant in variants:
            reads_flat = variant in KERNEL_SETTINGS and KERNEL_SETTINGS[variant].get("FLAT_ABSMAX", True)
            absmax_bytes = flat_absmax_bytes if reads_flat else nf4_bytes
            x_bytes = 4 if variant == FP32_X else x.element_size()
            moved = absmax_bytes(n_out * n_in) + x_bytes * x_rows * (n_in + n_out)
            with torch.no_grad():
                calls = [variant_fn(variant, x, weight) for weight in weights]
                row = timed_row(lambda calls=calls: [call() for call in calls], device, moved * len(weights),
                                bandwidth, out=n_out, **{"in": n_in}, variant=variant)
            if "us" in row:  # one call's share of the chain
                row["us"] = round(row["us"] / len(weights), 2)
            rows.append(row)
        del weights
    return rows


def weight_copies(weight, tiny: bool) -> list:
    """`weight` and copies of it in storage of their own (the same codes), enough that the L2 cache holds none of
    them when a chain of products reads them in turn, as a decoding step reads its layers' weights (2 on the CPU)."""
    count = 2 if tiny else max(4, min(64, -(-200_000_000 // weight.numel())))
    copies = [weight]
    for _ in range(count - 1):
        clone = torch.nn.Parameter(weight.data.clone(), requires_grad=False)
        clone.quant_state = copy.deepcopy(weight.quant_state)
        copies.append(clone)
    return copies


def sweep_tiles(shapes: list[str], device, tiny: bool, chosen_only: bool = False) -> list[dict]:
    """Device time of the blocked kernel at every tile of SWEEP_TILES, per projection shape, one row of x
    (columns: the tiles' names; column "chosen": the chosen tile's name); and at the chosen tile with each
    setting of CHOSEN_OPTIONS (columns "chosen, <name>"). `chosen_only`: the chosen tile only, its time in
    column "chosen" instead of its name, a sweep of minutes instead of a quarter of an hour of compilation. The word
    kernel likewise at WORD_SWEEP_TILES (columns "words <tile>"; `chosen_only`: none)."""
    from unsloth_lite.kernels import nf4_matvec as matvec

    dtype = torch.float32 if tiny else torch.bfloat16
    keys = sorted({key for s in shapes for key in projection_shapes(s, tiny)})
    rows = []

    def time_us(x, weight, tile, options):
        saved = {name: getattr(matvec, name) for name in ("blocked_tile", "word_tile", "GLUON_WALK", *options)}
        try:
            matvec.blocked_tile = matvec.word_tile = lambda *_: tile
            matvec.GLUON_WALK = False  # the Triton kernels' tiles
            for name, value in options.items():
                setattr(matvec, name, value)
            with torch.no_grad():
                fn = variant_fn("unsloth_lite", x, weight)
                ms = graph_ms(fn, device) if device.type == "cuda" else bench_ms(fn, device)
        finally:
            for name, value in saved.items():
                setattr(matvec, name, value)
        return None if ms is None else round(1e3 * ms, 2)

    for n_out, n_in in keys:
        weight = nf4_weight(n_out, n_in, device, dtype)
        x = torch.randn(1, n_in, device=device, dtype=dtype)
        chosen = matvec.blocked_tile(n_out)
        row = dict(out=n_out, **{"in": n_in}, chosen=tile_name(chosen))
        if chosen_only:
            row["chosen"] = time_us(x, weight, chosen, {})
        else:
            for tile in SWEEP_TILES:
                row[tile_name(tile)] = time_us(x, weight, tile, {})
            for tile in WORD_SWEEP_TILES:
                row[f"words {tile_name(tile)}"] = time_us(x, weight, tile, {"WORD_KERNEL": True})
        for name, options in CHOSEN_OPTIONS.items():
            tile = matvec.word_tile(n_out) if options.get("WORD_KERNEL") else chosen
            row[f"chosen, {name}"] = time_us(x, weight, tile, options)
        rows.append(row)
    return rows


def mlp_shapes(shapes: list[str], tiny: bool) -> list[tuple[str, int, int, int]]:
    """(model, intermediate, hidden, layers) of each model's MLP: its gate and up projections' shape."""
    found = []
    for shape in shapes:
        model = weightless_model(shape, shape_config(shape, tiny))
        gates = [m for n, m in model.named_modules() if n.endswith("gate_proj")]
        found.append((shape, gates[0].out_features, gates[0].in_features, len(gates)))
    return found


def mlp_input_calls(x, gate, up, rank: int):
    """(three launches, one launch, the one launch walked in Gluon or None where it does not fit): the MLP input
    `silu(x Gᵀ) · x Uᵀ` with adapters of `rank` on both (none at 0) as decoding runs it without and with
    `nf4_gated_matvec`, and with `nf4_gated_matvec.GLUON_GATED`; their first products from one `lora_down_rows`."""
    from unsloth_lite.kernels import nf4_gated_matvec as gated_module
    from unsloth_lite.kernels.lora_down import lora_down_rows
    from unsloth_lite.kernels.nf4_gated_gluon import gluon_gated_fits
    from unsloth_lite.kernels.nf4_gated_matvec import nf4_gated_matvec
    from unsloth_lite.kernels.nf4_matvec import nf4_matvec, word_kernel_rows
    from unsloth_lite.kernels.swiglu import swiglu

    a = [0.01 * torch.randn(rank, x.shape[-1], device=x.device) for _ in range(2)]
    b = [0.01 * torch.randn(gate.quant_state.shape[0], rank, device=x.device) for _ in range(2)]

    def adapters():
        if not rank:
            return [None, None]
        t = lora_down_rows(x, a)
        return [(b[0], t[:, :rank], 1.0), (b[1], t[:, rank:], 1.0)]

    def three():
        products = [nf4_matvec(x, weight, **(dict(lora_b=lora[0], lora_t=lora[1]) if lora else {}))
                    for weight, lora in zip((gate, up), adapters(), strict=True)]
        return swiglu(*products)

    def gated():
        return nf4_gated_matvec(x, gate, up, None, None, *adapters())

    fits = gluon_gated_fits(word_kernel_rows(x)[0], *gate.quant_state.shape)
    return three, gated, with_settings(gated_module, {"GLUON_GATED": True}, gated) if fits else None


def measure_gated(shapes: list[str], device, tiny: bool, x_rows: int = 1) -> list[dict]:
    """Per model: the MLP input's three launches against `nf4_gated_matvec`, `x_rows` rows of x, without and with
    an adapter on both projections (us, and ms a token over the model's layers)."""
    dtype = torch.float32 if tiny else torch.bfloat16
    rows = []
    for model, n_out, n_in, layers in mlp_shapes(shapes, tiny):
        gate, up = nf4_weight(n_out, n_in, device, dtype), nf4_weight(n_out, n_in, device, dtype)
        x = torch.randn(x_rows, n_in, device=device, dtype=dtype)
        for rank in (0, 16):
            with torch.no_grad():
                times = [None if fn is None else graph_ms(fn, device) if device.type == "cuda" else bench_ms(fn, device)
                         for fn in mlp_input_calls(x, gate, up, rank)]
            if None in times[:2]:
                continue
            rows.append(dict(model=model, out=n_out, **{"in": n_in}, rank=rank,
                             three_launches_us=round(1e3 * times[0], 2), gated_us=round(1e3 * times[1], 2),
                             gated_vs_three=round(times[0] / times[1], 3),
                             ms_per_token_saved=round(layers * (times[0] - times[1]), 3),
                             gated_gluon_us=None if times[2] is None else round(1e3 * times[2], 2)))
    return rows


def projection_groups(shapes: list[str], tiny: bool) -> list[tuple[str, str, tuple, int, int]]:
    """(model, group, widths, input width, layers) of each model's groups of projections of one input."""
    names = {"attention": ("q_proj", "k_proj", "v_proj"),
             "deltanet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    found = []
    for shape in shapes:
        modules = dict(weightless_model(shape, shape_config(shape, tiny)).named_modules())
        for group, members in names.items():
            owners = [n for n in modules if n.endswith("." + members[0])]
            if owners:
                linears = [modules[owners[0].rsplit(".", 1)[0] + "." + m] for m in members]
                found.append((shape, group, tuple(m.out_features for m in linears), linears[0].in_features,
                              len(owners)))
    return found


def measure_grouped(shapes: list[str], device, tiny: bool, x_rows: int = 1) -> list[dict]:
    """Per model and group: one `nf4_matvec` per projection against `nf4_grouped_matvec`, `x_rows` rows of x,
    without and with rank-16 adapters on all (their first products from one `lora_down_rows` in both)."""
    dtype = torch.float32 if tiny else torch.bfloat16
    rows = []
    for model, group, widths, n_in, layers in projection_groups(shapes, tiny):
        weights = [nf4_weight(n, n_in, device, dtype) for n in widths]
        x = torch.randn(x_rows, n_in, device=device, dtype=dtype)
        for rank in (0, 16):
            a = [0.01 * torch.randn(rank, n_in, device=device) for _ in widths]
            loras = [(0.01 * torch.randn(n, rank, device=device), 1.0) if rank else None for n in widths]
            calls = grouped_calls(x, weights, a, loras)
            with torch.no_grad():
                times = [None if fn is None else graph_ms(fn, device) if device.type == "cuda" else bench_ms(fn, device)
                         for fn in calls]
            if None in times[:2]:
                continue
            rows.append(dict(model=model, group=group, widths="/".join(map(str, widths)), rank=rank,
                             separate_us=round(1e3 * times[0], 2), grouped_us=round(1e3 * times[1], 2),
                             grouped_vs_separate=round(times[0] / times[1], 3),
                             ms_per_token_saved=round(layers * (times[0] - times[1]), 3),
                             grouped_gluon_us=None if times[2] is None else round(1e3 * times[2], 2)))
    return rows


def grouped_calls(x, weights, a, loras):
    """(one launch a projection, one for all, the one walked in Gluon or None where the group does not fit) of a
    group, adapters' first products from one launch in each."""
    from unsloth_lite.kernels import nf4_grouped_matvec as grouped_module
    from unsloth_lite.kernels.lora_down import lora_down_rows
    from unsloth_lite.kernels.nf4_grouped_gluon import gluon_grouped_fits
    from unsloth_lite.kernels.nf4_grouped_matvec import nf4_grouped_matvec
    from unsloth_lite.kernels.nf4_matvec import nf4_matvec, word_kernel_rows

    rank = loras[0][0].shape[1] if loras[0] else 0

    def separate():
        t = lora_down_rows(x, a) if rank else None
        return [nf4_matvec(x, w, **(dict(lora_b=lora[0], lora_t=t[:, i * rank:(i + 1) * rank]) if rank else {}))
                for i, (w, lora) in enumerate(zip(weights, loras, strict=True))]

    def grouped():
        return nf4_grouped_matvec(x, weights, [None] * len(weights), loras, lora_down_rows(x, a) if rank else None)

    widths = [int(w.quant_state.shape[0]) for w in weights]
    fits = gluon_grouped_fits(word_kernel_rows(x)[0], widths, x.shape[-1])
    return separate, grouped, with_settings(grouped_module, {"GLUON_GROUPED": True}, grouped) if fits else None


def per_token(rows: list[dict], shapes: list[str], variants: list[str], tiny: bool,
              column: str = "ms_per_token") -> list[dict]:
    """Per model and variant, the sum over its decoder projections of each shape's time (`us` of `rows`) times
    the number of such linears, in ms under `column`; models missing a shape's time are left out."""
    times = {(r["out"], r["in"], r["variant"]): r.get("us") for r in rows}
    totals = []
    for shape in shapes:
        for variant in variants:
            parts = [(count, times.get((n_out, n_in, variant)))
                     for (n_out, n_in), count in projection_shapes(shape, tiny).items()]
            if all(us is not None for _, us in parts):
                totals.append({"model": shape, "variant": variant,
                               column: round(sum(count * us for count, us in parts) / 1e3, 3)})
    return totals


def profile_shape(shape: str, device, tiny: bool) -> int:
    """`--profile-shape`: `nf4_matvec` at `shape` ("OUTxIN") on one row, each weight copy in turn, twice (the
    first pass compiles and makes the kept absmax; a profiler's `--launch-skip` passes it)."""
    try:
        n_out, n_in = (int(n) for n in shape.lower().split("x"))
    except ValueError:
        print(f"--profile-shape: expected OUTxIN such as 4096x12288, got {shape!r}", file=sys.stderr)
        return 2
    if n_out <= 0 or n_in <= 0 or n_in % 64:
        print(f"--profile-shape: OUT must be positive and IN a positive multiple of 64, got {shape!r}",
              file=sys.stderr)
        return 2
    from unsloth_lite.kernels.nf4_matvec import nf4_matvec

    dtype = torch.float32 if tiny else torch.bfloat16
    weights = weight_copies(nf4_weight(n_out, n_in, device, dtype), tiny)
    x = torch.randn(1, n_in, device=device, dtype=dtype)
    with torch.no_grad():
        for _ in range(2):
            for weight in weights:
                nf4_matvec(x, weight)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"profiled {n_out}x{n_in}: {2 * len(weights)} products over {len(weights)} weight copies")
    return 0


def main(argv=None) -> int:
    parser = shape_run_parser(__doc__, SHAPES)
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--rows", type=int, default=1, choices=range(1, 9), metavar="1-8",
                        help="rows of x (default 1: batch-1 decoding)")
    parser.add_argument("--sweep", action="store_true", help="also time every tile of SWEEP_TILES (microseconds)")
    parser.add_argument("--sweep-chosen-tile", action="store_true",
                        help="with --sweep: each projection's chosen tile only, not every tile of SWEEP_TILES")
    parser.add_argument("--profile-shape", default=None, metavar="OUTxIN",
                        help="only run unsloth-lite's product at this shape over its weight copies, twice, untimed: "
                             "for a profiler (docs/benchmarks.md names the ncu command)")
    args = parser.parse_args(argv)
    device = bench_device(args.tiny)
    if device is None:
        return 1
    if args.profile_shape is not None:
        return profile_shape(args.profile_shape, device, args.tiny)
    shapes = args.shapes.split(",")
    variants = args.variants.split(",") if args.variants else list(TINY_VARIANTS if args.tiny else VARIANTS)
    if report_unknown("shapes", shapes, SHAPES) or report_unknown("variants", variants, VARIANTS):
        return 2
    bandwidth = copy_bandwidth_gbps(device, 0.25 if args.tiny else 4.0)
    rows = measure(shapes, variants, device, args.tiny, bandwidth, args.rows)
    totals = per_token(rows, shapes, variants, args.tiny)
    print(f"copy bandwidth {bandwidth:.0f} GB/s; {args.rows} row(s) of x; device times")
    print(markdown_table(rows, ["out", "in", "variant", "us", "gb_per_s", "copy_fraction"]))
    print(markdown_table(totals, ["model", "variant", "ms_per_token"]))
    gated = measure_gated(shapes, device, args.tiny, args.rows) if "unsloth_lite" in variants else []
    if gated:
        print(markdown_table(gated, ["model", "out", "in", "rank", "three_launches_us", "gated_us", "gated_vs_three",
                                     "ms_per_token_saved", "gated_gluon_us"]))
    grouped = measure_grouped(shapes, device, args.tiny, args.rows) if "unsloth_lite" in variants else []
    if grouped:
        print(markdown_table(grouped, ["model", "group", "widths", "rank", "separate_us", "grouped_us",
                                       "grouped_vs_separate", "ms_per_token_saved", "grouped_gluon_us"]))
    sweep = sweep_tiles(shapes, device, args.tiny, args.sweep_chosen_tile) if args.sweep else []
    if sweep:
        tiles = [] if args.sweep_chosen_tile else [
            *(tile_name(t) for t in SWEEP_TILES), *(f"words {tile_name(t)}" for t in WORD_SWEEP_TILES)]
        print(markdown_table(sweep, ["out", "in", "chosen", *tiles, *(f"chosen, {n}" for n in CHOSEN_OPTIONS)]))
    write_json(args.out, dict(environment=environment(device, ("torch", "triton", "bitsandbytes")),
                              copy_bandwidth_gbps=bandwidth, rows=rows, per_token=totals, gated=gated, grouped=grouped,
                              sweep=sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
