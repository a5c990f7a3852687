"""The word walk's tiles at W3's shapes, for each launch of a decoding step that takes them: the word kernel
(`nf4_matvec` of the output projections: o_proj, out_proj, down_proj), the gate-and-up launch (`nf4_gated_matvec`)
and the grouped launch of one input's projections (`nf4_grouped_matvec`). All three read `nf4_matvec.word_tile`
(features x weights along K / warps of a program, split along K) and `word_stages` by launch and shape:
`nf4_matvec.WORD_TILES`' entry (for a launch without adapters `WORD_TILES_WITHOUT_ADAPTERS`' first), else the
blocked kernel's tile (`blocked_tile`) with `PIPELINE_STAGES`.

    python scripts/bench_word_tiles.py --out word_tiles.json                    # on a GPU: both W3 shapes
    python scripts/bench_word_tiles.py --shapes qwen3_8b --out word_tiles.json  # one model
    TRITON_INTERPRET=1 python scripts/bench_word_tiles.py --tiny                # CPU smoke run

Candidates: each tile of `bench_nf4_matvec.WORD_SWEEP_TILES` (or those `--tiles` names) with three stages (or
each of `--stages`), and the default tile of each launch with 2 to 5 stages, e.g. a second pass at a first
pass's best tiles:

    python scripts/bench_word_tiles.py --shapes qwen3_8b --tiles "2x512/1w,8x512/4w split" --stages 2,3,4,5
 Each launch, one row of x, bf16, no adapters (their epilogue is the same at every
tile), is timed as a decoding step runs it: a chain of calls captured in one CUDA graph, each call reading its own
copy of the weights (together more than the L2 cache holds), the chain's device time over its calls (us a call).
Per model, `ms_per_token` at a candidate: Σ over its launches of the time times the launches a token; "shipped":
`word_tile` and `word_stages` as they are; "best per launch": each launch at its fastest candidate (what
`WORD_TILES` entries would give). Printed last: the entries of the launches whose fastest candidate beats the
default by more than `TABLE_MARGIN`, in the form of `WORD_TILES` (with `--adapters`) or of
`WORD_TILES_WITHOUT_ADAPTERS`.
"""

from __future__ import annotations

import sys

import torch
from bench_common import (
    bench_device,
    bench_ms,
    environment,
    graph_ms,
    markdown_table,
    report_unknown,
    shape_run_parser,
    write_json,
)
from bench_nf4_matvec import WORD_SWEEP_TILES, mlp_shapes, nf4_weight, projection_groups, tile_name, weight_copies
from decode_shapes import SHAPES, shape_config
from random_checkpoint import weightless_model

OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj")
EXTRA_STAGES = (2, 4, 5)  # at the default tile
# A launch's `nf4_matvec.WORD_TILES` entry is printed where its best candidate beats the default tile with three
# stages by more than this (the spread of repeated chains is about 1%).
TABLE_MARGIN = 0.03


def output_shapes(shape: str, tiny: bool) -> list[tuple[str, int, int, int]]:
    """(launch name, N, K, launches a token) of each model's output projections, by shape."""
    counts: dict = {}
    for name, module in weightless_model(shape, shape_config(shape, tiny)).named_modules():
        if name.endswith(OUTPUT_PROJECTIONS):
            key = (name.rsplit(".", 1)[1], module.out_features, module.in_features)
            counts[key] = counts.get(key, 0) + 1
    return [(f"words {name} {n}x{k}", n, k, count) for (name, n, k), count in counts.items()]


def launches(shape: str, device, tiny: bool, rank: int = 0) -> list[tuple[str, tuple[str, int, int], int, list]]:
    """(launch name, its key in `nf4_matvec.WORD_TILES` (launch, N, K), launches a token, its calls: one per copy
    of its weights) of a model's decoding step; `rank` > 0: each weight with a rank-`rank` adapter (A and B
    shared by the copies), its first products left to the launch."""
    from unsloth_lite.kernels.nf4_gated_matvec import nf4_gated_matvec
    from unsloth_lite.kernels.nf4_grouped_matvec import nf4_grouped_matvec
    from unsloth_lite.kernels.nf4_matvec import nf4_matvec

    dtype = torch.float32 if tiny else torch.bfloat16

    def adapter(n_out, n_in):  # (A, B) or None
        if not rank:
            return None
        return (torch.randn(rank, n_in, device=device, dtype=dtype) * 0.02,
                torch.randn(n_out, rank, device=device, dtype=dtype) * 0.02)

    found = []
    for name, n_out, n_in, count in output_shapes(shape, tiny):
        x = torch.randn(1, n_in, device=device, dtype=dtype)
        copies = weight_copies(nf4_weight(n_out, n_in, device, dtype), tiny)
        ab = adapter(n_out, n_in)
        lora = {} if ab is None else dict(lora_a=ab[0], lora_b=ab[1])
        found.append((name, ("words", n_out, n_in), count,
                      [lambda w=w, x=x, lora=lora: nf4_matvec(x, w, **lora) for w in copies]))
    for _, n_out, n_in, count in mlp_shapes([shape], tiny):
        x = torch.randn(1, n_in, device=device, dtype=dtype)
        pairs = zip(weight_copies(nf4_weight(n_out, n_in, device, dtype), tiny),
                    weight_copies(nf4_weight(n_out, n_in, device, dtype), tiny), strict=True)
        adapters = [adapter(n_out, n_in) for _ in range(2)]
        loras = [None if ab is None else (ab[1], None, 2.0) for ab in adapters]
        lora_as = [ab[0] for ab in adapters if ab is not None] or None
        found.append((f"gated {n_out}x{n_in}", ("gated", n_out, n_in), count,
                      [lambda g=g, u=u, x=x, loras=loras, lora_as=lora_as:
                       nf4_gated_matvec(x, g, u, None, None, *loras, lora_as=lora_as) for g, u in pairs]))
    for _, group, widths, n_in, count in projection_groups([shape], tiny):
        x = torch.randn(1, n_in, device=device, dtype=dtype)
        # as many sets as the widest weight has copies (the narrower ones have more)
        sets = list(zip(*(weight_copies(nf4_weight(n, n_in, device, dtype), tiny) for n in widths), strict=False))
        adapters = [adapter(n, n_in) for n in widths]
        loras = [None if ab is None else (ab[1], 2.0) for ab in adapters]
        lora_as = [ab[0] for ab in adapters if ab is not None] or None
        found.append((f"grouped {group} {'/'.join(map(str, widths))}x{n_in}", ("grouped", max(widths), n_in), count,
                      [lambda ws=ws, x=x, loras=loras, lora_as=lora_as:
                       nf4_grouped_matvec(x, list(ws), [None] * len(ws), loras, None, lora_as) for ws in sets]))
    return found


def candidate_name(tile, stages: int) -> str:
    return tile_name(tile) if stages == 3 else f"{tile_name(tile)}, {stages} stages"


def candidates(default_tile, tiny: bool, tiles=None, stages=(3,)) -> list[tuple[str, tuple, int]]:
    """(name, tile, stages) to time a launch at: each of `tiles` (all of WORD_SWEEP_TILES by default) with each of
    `stages`, and the launch's default tile with three stages and with EXTRA_STAGES (`--tiny`: by default the
    first two tiles, and one other number of stages, for the interpreter's sake)."""
    tiles = tiles or (WORD_SWEEP_TILES[:2] if tiny else WORD_SWEEP_TILES)
    extra = EXTRA_STAGES[:1] if tiny else EXTRA_STAGES
    found = {candidate_name(tile, n): (tile, n) for tile in tiles for n in stages}
    found.update({candidate_name(default_tile, n): (default_tile, n) for n in (3, *extra)})
    return [(name, tile, n) for name, (tile, n) in found.items()]


def time_us(calls, tile, stages, device) -> float | None:
    """Device time of one call of the chain at `tile` and `stages` (None where it does not capture or launch)."""
    from unsloth_lite.kernels import nf4_matvec as matvec

    saved = matvec.word_tile, matvec.word_stages, matvec.WORD_KERNEL, matvec.GLUON_WALK
    try:
        matvec.word_tile, matvec.word_stages, matvec.WORD_KERNEL = (lambda *_: tile), (lambda *_: stages), True
        matvec.GLUON_WALK = False  # the Triton word kernel's tiles
        with torch.no_grad():
            chain = lambda: [call() for call in calls]  # noqa: E731
            ms = graph_ms(chain, device) if device.type == "cuda" else bench_ms(chain, device)
    except (RuntimeError, ValueError) as error:  # a tile a launch refuses, or one that fails to compile
        print(f"{tile_name(tile)}, {stages} stages: {str(error).splitlines()[0]}")
        ms = None
    finally:
        matvec.word_tile, matvec.word_stages, matvec.WORD_KERNEL, matvec.GLUON_WALK = saved
    return None if ms is None else round(1e3 * ms / len(calls), 2)


def sweep(shape: str, device, tiny: bool, tiles=None, stages=(3,), rank: int = 0) -> tuple[list[dict], dict]:
    """(a row per launch: us at each candidate, the shipped setting and the fastest; the model's ms a token at
    the shipped setting, at each candidate everywhere and at each launch's fastest)."""
    from unsloth_lite.kernels import nf4_matvec as matvec

    rows, totals = [], {"model": shape}
    for name, key, count, calls in launches(shape, device, tiny, rank):
        adapted = rank > 0
        shipped_tile = matvec.word_tile(key[1], key[2], key[0], adapted)
        row = {"model": shape, "launch": name, "per_token": count,
               "shipped": time_us(calls, shipped_tile, matvec.word_stages(key[1], key[2], key[0], adapted), device)}
        default = matvec.blocked_tile(key[1])
        options = {candidate: (tile, n) for candidate, tile, n in candidates(default, tiny, tiles, stages)}
        for candidate, (tile, n) in options.items():
            row[candidate] = time_us(calls, tile, n, device)
        timed = {k: v for k, v in row.items() if k not in ("model", "launch", "per_token") and v is not None}
        row["best"] = min(timed, key=timed.get) if timed else None
        default_us = row.get(tile_name(default))
        if row["best"] in options and default_us and row[row["best"]] < (1 - TABLE_MARGIN) * default_us:
            best_tile, best_stages = options[row["best"]]
            row["word_tiles_entry"] = [list(key), [*best_tile, best_stages]]
        rows.append(row)
        best = row["best"]  # each launch as it is done, so that a run cut short still tells
        print(f"{shape} {name}: shipped {row['shipped']} us, fastest {best} {best and row[best]} us", flush=True)
    columns = dict.fromkeys(c for row in rows for c in row if c not in ("model", "launch", "per_token", "best")
                            and not c.startswith("word_tiles"))
    for column in columns:  # a candidate every launch was timed at (the default tiles differ by launch)
        if all(row.get(column) is not None for row in rows):
            totals[column] = round(sum(row[column] * row["per_token"] for row in rows) / 1e3, 3)
    if all(row["best"] for row in rows):
        totals["best per launch"] = round(sum(row[row["best"]] * row["per_token"] for row in rows) / 1e3, 3)
    return rows, totals


def main(argv=None) -> int:
    parser = shape_run_parser(__doc__, SHAPES)
    names = {tile_name(tile): tile for tile in WORD_SWEEP_TILES}
    parser.add_argument("--tiles", default=None,
                        help=f"comma-separated tiles to time (all by default), of: {', '.join(names)}")
    parser.add_argument("--stages", default="3", help="comma-separated pipeline stages to time each tile at")
    parser.add_argument("--adapters", type=int, default=0, metavar="R",
                        help="a rank-R adapter on every weight (0: none, the default)")
    args = parser.parse_args(argv)
    if args.adapters < 0:
        print(f"bench_word_tiles.py: --adapters {args.adapters}: expected a rank >= 0", file=sys.stderr)
        return 2
    tiles = None if args.tiles is None else args.tiles.split(",")
    if tiles is not None and report_unknown("tiles", tiles, names):
        return 2
    try:
        stages = tuple(int(n) for n in args.stages.split(","))
    except ValueError:
        stages = ()
    if not stages or min(stages) < 1:
        print(f"bench_word_tiles.py: --stages {args.stages!r}: expected positive integers, comma-separated",
              file=sys.stderr)
        return 2
    device = bench_device(args.tiny)
    if device is None:
        return 1
    shapes = args.shapes.split(",")
    if report_unknown("shapes", shapes, SHAPES):
        return 2
    rows, totals = [], []
    for shape in shapes:
        shape_rows, shape_totals = sweep(shape, device, args.tiny, tiles and [names[t] for t in tiles], stages,
                                         args.adapters)
        rows += shape_rows
        totals.append(shape_totals)
        columns = [k for k in shape_rows[0] if k not in ("model", "best", "word_tiles_entry")] + ["best"]
        print(markdown_table(shape_rows, columns))
        print(markdown_table([shape_totals], list(shape_totals)))
    entries = [row["word_tiles_entry"] for row in rows if "word_tiles_entry" in row]
    table = "WORD_TILES" if args.adapters else "WORD_TILES_WITHOUT_ADAPTERS"
    print(f"nf4_matvec.{table} entries (faster than the default tile with three stages by more than "
          f"{TABLE_MARGIN:.0%}):")
    for (launch, n_out, n_in), (features, tile_k, warps, split_k, stages) in entries:
        print(f"    ({launch!r}, {n_out}, {n_in}): ({features}, {tile_k}, {warps}, {split_k}, {stages}),")
    write_json(args.out, dict(environment=environment(device, ("torch", "triton", "bitsandbytes")), rows=rows,
                              ms_per_token=totals, adapter_rank=args.adapters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
