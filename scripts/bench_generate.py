"""Batch-1 decoding in NF4 (workload W3 of BENCHMARKS.md): decode tokens/s, time to first token, peak memory and
the fraction of the bandwidth bound reached by Hugging Face `generate`, the same with a static cache, Unsloth's
inference mode and unsloth-lite (without and with an unmerged LoRA adapter), at the Qwen3-8B and Qwen3.5-27B
shapes, in one run.

    python scripts/bench_generate.py --out bench_generate.json --unsloth-site /tmp/uns_site     # on a GPU: W3
    python scripts/bench_generate.py --shapes qwen3_5_27b --variants hf,unsloth_lite            # a subset
    TRITON_INTERPRET=1 python scripts/bench_generate.py --tiny                                  # CPU smoke run

Shapes: `qwen3_8b` (W1's config, `bench_train_setup.W1`) and `qwen3_5_27b` (W2's, `bench_train_27b.W2`), random
weights. Every variant but Unsloth builds the model from its config on the GPU in bf16 (Hugging Face's
initialisation, seed 0: the same weights in every worker) and quantises each decoder linear to bitsandbytes NF4
in place (double quantisation, block 64, bf16 compute; `unsloth_lite.models.quantize_linears_nf4`); embeddings
and lm_head stay bf16. Unsloth loads from disk: the parent writes a random-weight checkpoint under `--workdir`,
reused when present: the 8B's is `bench_train_setup.py`'s bf16 one (`ensure_checkpoint`, 16 GB); the 27B's is written
shard by shard, each tensor drawn on the GPU (N(0, 0.02) matrices, unit norms), its decoder linears stored
pre-quantised in the same NF4 format (16 GB where bf16 would take 54: both checkpoints fit the disk of the
GPU machine at once). Its weights differ from the built ones, so its tokens are not compared.

Variants, each in its own process (Unsloth patches transformers on import), each measuring every shape in turn:
- `hf`: `model.generate`, dynamic cache.
- `hf_static`: the same with `cache_implementation="static"`.
- `unsloth`: `FastLanguageModel.from_pretrained(load_in_4bit=True)` + `FastLanguageModel.for_inference`, only
  where unsloth imports (from `--unsloth-site`, prepended to the worker's PYTHONPATH).
- `unsloth_lite`: `unsloth_lite.patch_model`, then `model.generate`.
- `unsloth_lite_lora`: the same with LoRA r=16 (random B, so the adapters change the output) on q,k,v,o,gate,
  up,down through `unsloth_lite.add_lora`, unmerged.
- `unsloth_lite_hf_loop`: `unsloth_lite` with every call left to Hugging Face's `generate` loop instead of the
  patched model's (`models.decode_loop`), only when named: the same forwards and captured step, the host loop
  of each.

An unsloth-lite variant may carry decoding settings after `@` (`generate_variants.py`: what each one sets), so
that one run compares them.

A measurement: a `--prompt`-token random prompt (seed 1234), batch 1, greedy, exactly `--new-tokens` new tokens
(`min_new_tokens`: random weights may say end-of-sequence at any step), one warm-up generation (compilation,
graph capture), then the best of `--repeats`. A streamer takes the time of each new token as it reaches the
host: time to first token (`ttft_ms`) from the call to the first token, decode tokens/s over the tokens after
it. `peak_gib`: `torch.cuda.max_memory_allocated()` over the timed generations, the weights included.

Bandwidth bound: bytes a decoding step must read from device memory at least, counted from the config on a
weightless model: every decoder linear in NF4 (half a byte per weight, one byte of absmax per 64 weights and a
float32 per 256 blocks), the other decoder weights (norms, convolution, gates) and lm_head in bf16, one row of
the input embedding, the KV cache of the full-attention layers at the mean context (prompt + new tokens / 2),
and each DeltaNet layer's float32 state read and written (plus its convolution state); with LoRA, its adapters.
`bound_tokens_per_s` = `--bandwidth-gbps` (the H200's device-to-device copy rate in BENCHMARKS.md, 4270 GB/s;
`--measure-bandwidth` measures it in this run) / bytes per token; `bound_fraction` = decode tokens/s / that
(BENCHMARKS.md's 17.7 GB a token at the 27B counts the whole input embedding, 2.5 GB; decoding reads one row).

unsloth-lite variants on CUDA also report `graph_step_ms`, the median GPU time of one replay of the captured
decode step in one more generation (each replay between two CUDA events: `graph_step_ms()`), and `host_gap_ms` =
the time a token takes in `generate` minus it: what `generate`'s host loop adds to each step while the GPU waits.

Ratios within the run: `vs_hf` and `vs_unsloth`, decode tokens/s over that variant's on the same shape;
`lora_cost`, the share of unsloth_lite's decode speed that the unmerged adapter costs (`unsloth_lite_lora`).
`--resume` continues the run in `--out` where one command's time limit stopped it: on the same GPU, code and
versions, with the same prompt, new tokens, repeats and bandwidth (refused with one line otherwise), it keeps
the rows without an error and runs only the (variant, shape) pairs without one. The file is rewritten after
each worker.

`--tiny`: a CPU smoke run through the same parent/worker path (2-layer models of both shapes, fp32, NF4 through
bitsandbytes' CPU backend, kernels in Triton's interpreter; prompt 8, 4 new tokens; no memory figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from bench_common import (
    bench_device,
    copy_bandwidth_gbps,
    drop_missing_unsloth,
    environment,
    markdown_table,
    report_unknown,
    resumed_run,
    run_worker_process,
    set_module_settings,
    worker_timed_out,
    write_json,
)
from bench_train import worker_env
from bench_train_setup import ensure_checkpoint
from decode_shapes import LORA_R, SHAPES, build_model, bytes_per_token, shape_config
from generate_variants import (
    ADAPTED_GROUPS,
    DECODE_SETTINGS,
    DEFAULT_VARIANTS,
    VARIANTS,
    skip_layer_norms,
    split_variant,
)
from random_checkpoint import write_checkpoint_in_shards
from train_timing import _error

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_GENERATE_RESULT "
TINY_VARIANTS = ("hf", "unsloth_lite", "unsloth_lite_lora")
H200_COPY_GBPS = 4270.0
LORA_ALPHA, SEED = 16, 1234


# ----------------------------------------------------------------------------------------------------------
# Worker: one variant, every shape in turn


class TokenTimes:
    """A `generate` streamer: the time each new token reaches the host (the first `put` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


def load(variant: str, shape: str, c: dict, checkpoint: str | None, device, dtype, max_length: int):
    if variant == "unsloth":
        import unsloth  # noqa: F401  (before transformers: it patches it on import)
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=checkpoint, max_seq_length=max_length, dtype=dtype,
                                                     load_in_4bit=True)
        return FastLanguageModel.for_inference(model) or model
    model = build_model(shape, c, device, dtype)
    if variant.startswith("hf"):
        return model
    import unsloth_lite

    variant, settings = split_variant(variant)
    adapted = settings.pop("adapted", 15)
    if settings.pop("norms_skipped", 0):
        skip_layer_norms()
    set_module_settings(settings, DECODE_SETTINGS)
    if variant == "unsloth_lite_hf_loop":
        from unsloth_lite.models import decode_loop

        decode_loop.plan = lambda *args: None
    model = unsloth_lite.patch_model(model)
    if variant == "unsloth_lite_lora":
        torch.manual_seed(SEED)
        targets = [name for bit, names in ADAPTED_GROUPS.items() if adapted & bit for name in names]
        model = unsloth_lite.add_lora(model, r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=targets)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
    return model.eval() if device.type == "cuda" else model


def measure(model, variant: str, c: dict, device, prompt: int, new_tokens: int, repeats: int) -> dict:
    """One warm-up generation, then the best of `repeats` (module docstring)."""
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(0, c["vocab_size"] - 3, (1, prompt), generator=generator).to(device)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    pad_token_id=c["pad_token_id"], eos_token_id=c["eos_token_id"])
    if variant == "hf_static":
        settings["cache_implementation"] = "static"

    def generate(streamer=None):
        with torch.no_grad():
            return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  streamer=streamer, **settings)

    runs, tokens = [], None
    for i in range(1 + repeats):
        if cuda and i == 1:
            torch.cuda.reset_peak_memory_stats(device)
        streamer = TokenTimes()
        start = time.perf_counter()
        tokens = generate(streamer)[0, prompt:].tolist()
        times = streamer.times
        if i and len(times) > 1:
            runs.append(dict(ttft_ms=1e3 * (times[0] - start), decode_tokens_per_s=(len(times) - 1) /
                             (times[-1] - times[0])))
    best = max(runs, key=lambda r: r["decode_tokens_per_s"])
    out = dict(best, new_tokens=len(tokens), tokens=tokens, all_runs=runs)
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if variant.startswith("unsloth_lite"):
            step_ms = graph_step_ms(generate, device)
            if step_ms is not None:
                out["graph_step_ms"] = step_ms
                out["host_gap_ms"] = 1e3 / best["decode_tokens_per_s"] - step_ms
    return out


def graph_step_ms(generate, device) -> float | None:
    """Median GPU time of one replay of a CUDA graph during `generate()` (the captured decode step of
    `models.decode_graph`; each replay bracketed by two CUDA events, so the time excludes the GPU's waits for
    the host between steps). None where nothing was replayed."""
    events = []
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        events.append((start, end))

    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        generate()
    finally:
        torch.cuda.CUDAGraph.replay = replay
    if not events:
        return None
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def profile_path(directory: str, variant: str, shape: str) -> Path:
    """The profile's file for a variant and shape: the variant's "@" settings written with `_` for the characters
    a file name should not hold (`unsloth_lite_lora@lora_split=1/lora_pdl=1` would name a directory)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{variant}_{shape}")
    return Path(directory) / f"{name}.txt"


def write_profile(model, c: dict, device, prompt: int, path: Path, new_tokens: int = 16) -> None:
    """The GPU kernels of one more `new_tokens`-token generation (warm), by total time, as a table at `path`."""
    from torch.profiler import ProfilerActivity, profile

    input_ids = torch.randint(0, c["vocab_size"] - 3, (1, prompt), device=device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=c["pad_token_id"])
        torch.cuda.synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))


def worker_main(args) -> int:
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    for shape in args.shapes.split(","):
        c = shape_config(shape, args.tiny)
        result = dict(variant=args.worker, shape=shape)
        model = None
        try:
            start = time.perf_counter()
            checkpoint = args.checkpoints.get(shape) if args.checkpoints else None
            model = load(args.worker, shape, c, checkpoint, device, dtype, args.prompt + args.new_tokens)
            result["load_s"] = round(time.perf_counter() - start, 1)
            result.update(measure(model, args.worker, c, device, args.prompt, args.new_tokens, args.repeats))
            if args.profile_dir:
                write_profile(model, c, device, args.prompt, profile_path(args.profile_dir, args.worker, shape))
        except (Exception, SystemExit) as error:  # this variant's error on this shape, never a crash of the run
            traceback.print_exc()
            result.update(_error(error))
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


# ----------------------------------------------------------------------------------------------------------
# Parent


def run_worker(args, variant: str, shapes: list[str], checkpoints: dict) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--shapes", ",".join(shapes),
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
           "--checkpoints", json.dumps(checkpoints)] + ["--tiny"] * args.tiny
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    label = f"[{variant}]"
    print(f"{label} starting", flush=True)
    start = time.perf_counter()
    results, lines, returncode = run_worker_process(
        cmd, worker_env(variant, args), ROOT, RESULT_PREFIX, args.worker_timeout, label, args.verbose,
    )
    code = returncode
    if worker_timed_out(returncode):
        code = f"no result within --worker-timeout {args.worker_timeout:.0f} s"
    done = {r["shape"] for r in results}
    results += [dict(variant=variant, shape=s, error=f"worker: {code}")
                for s in shapes if s not in done]
    if any("error" in r for r in results) and not args.verbose:
        print("\n".join(f"{label} {line}" for line in lines[-25:]), flush=True)
    print(f"{label} done in {time.perf_counter() - start:.0f} s", flush=True)
    return results


def summarise(rows: list[dict], bandwidth_gbps: float, prompt: int, new_tokens: int, tiny: bool) -> None:
    """Adds the bandwidth bound and the fraction reached, and how many leading tokens equal hf's (the built
    models share their weights; Unsloth's checkpoint does not)."""
    reference = {r["shape"]: r["tokens"] for r in rows if r["variant"] == "hf" and "tokens" in r}
    speed = {(r["shape"], r["variant"]): r["decode_tokens_per_s"] for r in rows if "decode_tokens_per_s" in r}
    context = prompt + new_tokens / 2
    for row in rows:
        c = shape_config(row["shape"], tiny)
        read = bytes_per_token(row["shape"], c, context, lora=row["variant"].startswith("unsloth_lite_lora"))
        row["gb_per_token"] = float(f"{read['total'] / 1e9:.4g}")
        row["bound_tokens_per_s"] = round(bandwidth_gbps * 1e9 / read["total"], 1)
        if "decode_tokens_per_s" in row:
            row["bound_fraction"] = float(f"{row['decode_tokens_per_s'] / row['bound_tokens_per_s']:.3g}")
            for peer in ("hf", "unsloth"):
                if (row["shape"], peer) in speed and row["variant"] != peer:
                    row[f"vs_{peer}"] = round(row["decode_tokens_per_s"] / speed[(row["shape"], peer)], 2)
            name, at, suffix = row["variant"].partition("@")
            suffix = "/".join(item for item in suffix.split("/") if not item.startswith("adapted="))
            without = (row["shape"], "unsloth_lite" + ("@" + suffix if suffix else ""))
            if name == "unsloth_lite_lora" and without in speed:
                row["lora_cost"] = round(1 - row["decode_tokens_per_s"] / speed[without], 3)
            row["decode_tokens_per_s"] = round(row["decode_tokens_per_s"], 2)
        for key in ("graph_step_ms", "host_gap_ms"):
            if key in row:
                row[key] = round(row[key], 3)
        if "ttft_ms" in row:
            row["ttft_ms"] = round(row["ttft_ms"], 1)
        if "peak_gib" in row:
            row["peak_gib"] = round(row["peak_gib"], 2)
        ours, theirs = row.get("tokens"), reference.get(row["shape"])
        same_weights = row["variant"].partition("@")[0] in ("hf_static", "unsloth_lite", "unsloth_lite_hf_loop")
        if ours and theirs and same_weights:
            row["same_tokens_as_hf"] = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                                             if a != b), min(len(ours), len(theirs)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (2-layer tiny models, interpreter)")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {','.join(VARIANTS)}, unsloth-lite's with @ settings")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; tiny 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens (default 128; tiny 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed generations, best kept (default 3; tiny 1)")
    parser.add_argument("--bandwidth-gbps", type=float, default=H200_COPY_GBPS,
                        help=f"device memory bandwidth for the bound (default {H200_COPY_GBPS:.0f}: the H200's copy "
                             "rate in BENCHMARKS.md)")
    parser.add_argument("--measure-bandwidth", action="store_true", help="measure the copy bandwidth in this run")
    parser.add_argument("--workdir", default="/tmp/unsloth_lite_w1", help="where Unsloth's checkpoints are written")
    parser.add_argument("--unsloth-site", default=None, help="directory holding unsloth (put first on PYTHONPATH)")
    parser.add_argument("--worker-timeout", type=float, default=1800)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--profile-dir", default=None,
                        help="CUDA only: after measuring, profile one 16-token generation per variant and shape and "
                             "write its kernel table here")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out on the same GPU and code: keep its rows, run only the "
                             "(variant, shape) pairs it lacks (a run longer than one command's time limit)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, full, tiny in (("prompt", 128, 8), ("new_tokens", 128, 4), ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


def unsloth_checkpoints(args, device: torch.device, shapes: list[str]) -> dict:
    """Shape -> the checkpoint directory Unsloth loads, written where missing."""
    dtype = torch.float32 if args.tiny else torch.bfloat16
    paths = {}
    for shape in shapes:
        c = shape_config(shape, args.tiny)
        if shape == "qwen3_8b":  # bench_train_setup.py's, shared
            paths[shape] = str(ensure_checkpoint(c, args.workdir, dtype, device,
                                                 "tiny_qwen3" if args.tiny else "qwen3_8b_shape"))
        else:
            name = "tiny_qwen3_5_nf4" if args.tiny else "qwen3_5_27b_shape_nf4"
            paths[shape] = str(write_checkpoint_in_shards(shape, c, Path(args.workdir) / name, device, dtype,
                                                          quantized=True))
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    device = bench_device(args.tiny)
    if device is None:
        return 1
    shapes = args.shapes.split(",")
    if report_unknown("shapes", shapes, SHAPES):
        return 2
    variants = args.variants.split(",") if args.variants else list(TINY_VARIANTS if args.tiny else DEFAULT_VARIANTS)
    variants = drop_missing_unsloth(variants, bool(args.variants), args.unsloth_site)
    try:
        for variant in variants:
            split_variant(variant)
    except ValueError as exc:
        print(f"bench_generate.py: --variants: {exc}", file=sys.stderr)
        return 2
    packages = ("torch", "triton", "transformers", "peft", "bitsandbytes", "unsloth")
    env = environment(device, packages)
    settings = dict(prompt=args.prompt, new_tokens=args.new_tokens, repeats=args.repeats)
    rows, bandwidth, measured, checkpoints = [], args.bandwidth_gbps, args.measure_bandwidth, {}
    if args.resume:
        try:
            run = resumed_run(args.out, env, settings)
        except ValueError as exc:
            print(f"bench_generate.py: --resume: {exc}", file=sys.stderr)
            return 2
        rows = [r for r in run.get("rows", []) if "error" not in r]
        bandwidth, measured = run.get("bandwidth_gbps", bandwidth), run.get("bandwidth_measured", measured)
        checkpoints = run.get("checkpoints", {})
        print(f"resuming {args.out}: {len(rows)} rows kept", flush=True)
    elif args.measure_bandwidth:
        bandwidth = copy_bandwidth_gbps(device)
    done = {(r["variant"], r["shape"]) for r in rows}
    todo = {v: [s for s in shapes if (v, s) not in done] for v in variants}
    if todo.get("unsloth"):
        checkpoints = {**checkpoints, **unsloth_checkpoints(args, device, todo["unsloth"])}
    for variant in variants:  # the file is rewritten after each worker: a later one's crash loses nothing
        if todo[variant]:
            rows = [r for r in rows if (r["variant"], r["shape"]) not in {(variant, s) for s in todo[variant]}]
            rows += run_worker(args, variant, todo[variant], checkpoints)
        summarise(rows, bandwidth, args.prompt, args.new_tokens, args.tiny)
        write_json(args.out, dict(environment=env, bandwidth_gbps=bandwidth, bandwidth_measured=measured,
                                  **settings, checkpoints=checkpoints, rows=rows))
    order = list(dict.fromkeys([*variants, *VARIANTS]))
    rows.sort(key=lambda r: (SHAPES.index(r["shape"]), order.index(r["variant"])))
    columns = ["shape", "variant", "decode_tokens_per_s", "vs_hf", "vs_unsloth", "lora_cost", "ttft_ms", "peak_gib",
               "bound_tokens_per_s", "bound_fraction", "gb_per_token", "graph_step_ms", "host_gap_ms",
               "same_tokens_as_hf", "error"]
    print(f"bandwidth {bandwidth:.0f} GB/s ({'measured' if measured else 'given'}); prompt "
          f"{args.prompt}, {args.new_tokens} new tokens, batch 1, greedy")
    print(markdown_table(rows, columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
