"""QLoRA training step (workload W1 of BENCHMARKS.md): tokens/s, peak memory, kernel launches, MFU and HFU of
Hugging Face + PEFT + bitsandbytes, the same with Liger-Kernel, Unsloth, and unsloth-lite, on one checkpoint.

    python scripts/bench_train.py --out bench_train.json --unsloth-site /tmp/uns_site     # on a GPU: W1
    python scripts/bench_train.py --max-seq --out bench_train_maxseq.json                 # longest seq in 24 GiB
    TRITON_INTERPRET=1 python scripts/bench_train.py --tiny                               # CPU smoke run

The model, its checkpoint, each variant's loading and the MFU/HFU FLOP accounting: `bench_train_setup.py`.

Each variant runs in its own process (Unsloth and Liger patch transformers globally): the parent starts
`scripts/bench_train.py --worker VARIANT --batch-sizes 1,4 ...`, which loads the model once, measures each
batch size in turn (peak statistics reset in between) and prints one JSON line for each.

One step: forward with labels = input ids (the loss), backward, `optimizer.step()`, `zero_grad(set_to_none=True)`
on a random token batch `[batch, seq]`; batch i comes from seed 1234 + i, so every variant sees the same batches
and the first-step losses must agree (within bf16 rounding; LoRA B starts at zero). `--warmup` steps, then
`--steps` timed ones, each `torch.cuda.synchronize()`d and timed with `perf_counter`: wall time per step, host
overhead included (what bounds batch 1). Then, unless `--no-profile`, one more step under `torch.profiler`
counts the CUDA kernels launched and their summed time (`gpu_busy` = that time over the mean step time), and
lists the kernels that take the most of it (`top_kernels`) and the host-side calls with the most self CPU
time (`top_host_ops`: CUDA runtime calls; with `--host-profile` also PyTorch ops and autograd Functions); and
one more with its forward and backward profiled apart (`passes`: each pass's kernel and idle time).

Columns: `tokens_per_s` = batch x seq / mean step time; `load_gib`, GPU memory allocated once the model and its
adapters are loaded; `peak_gib`, `torch.cuda.max_memory_allocated()` from then through the last timed step
(the peak statistics reset after loading; Unsloth keeps its checkpointed activations in pinned CPU memory,
which this leaves out); `peak_reserved_gib`, `torch.cuda.max_memory_reserved()` over the same span (what the
caching allocator held, its cached free blocks and CUDA graph pools included; in a worker the second batch
size's figure includes blocks still cached from the first); in the JSON, `reserved_default_pool_gib` and
`reserved_private_pools_gib` split what is held after the last timed step between the allocator's default pool
and private pools (CUDA graphs' temporaries); `first_loss` and `loss_rel_diff` (to hf's first loss).

`--max-seq`: for hf and unsloth_lite, the longest sequence (batch 1, a multiple of 256, at most the model's
positions) that trains one step with `torch.cuda.set_per_process_memory_fraction` holding the process to
`--memory-cap-gib`: doubling from `--seq` (halving if that fails), then bisection, at most `--max-probes`
probes, all in the variant's one worker (the model loads once; after a probe runs out of memory its
tensors are freed and the allocator's cache emptied before the next); running out of memory is a failed
probe, any other error ends the search.

`--tiny`: a CPU smoke run through the same parent/worker path (a 2-layer qwen3, hidden 64, vocab 257, fp32,
still NF4 through bitsandbytes' CPU backend, kernels in Triton's interpreter; no profile, no memory figures).
Workers never touch the network (HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from bench_common import (
    apply_module_settings,
    bench_device,
    environment,
    kept_mlp_options,
    markdown_table,
    matmul_tflops,
    report_unknown,
    run_worker_process,
    worker_failure,
    write_json,
)
from bench_train_setup import (
    LOADERS,
    LORA_ALPHA,
    LORA_R,
    LR,
    RECOMPUTE_SKIPPED,
    SEQ_MULTIPLE,
    TARGET_MODULES,
    TINY,
    W1,
    _checkpointed_layers,
    decoder_linear_params,
    ensure_checkpoint,
    flops_per_token,
    total_params,
)
from train_timing import _error, _sync, measure, one_step_probe, search_max_seq

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_TRAIN_RESULT "
DEFAULT_VARIANTS = ("hf", "hf_liger", "unsloth", "unsloth_lite")
ALL_VARIANTS = (
    *DEFAULT_VARIANTS, "unsloth_lite_hf_ckpt", "unsloth_lite_ckpt", "unsloth_lite_offload", "unsloth_lite_graphs",
    "unsloth_lite_inputs_only", "unsloth_lite_kept_mlp",
)
TINY_VARIANTS = ("hf", "unsloth_lite")
MAX_SEQ_VARIANTS = ("hf", "unsloth_lite")


# ----------------------------------------------------------------------------------------------------------
# Worker: one variant, one batch size, in its own process


def load(args, device, dtype) -> tuple:
    """(model, optimizer, info) of the worker's variant."""
    start = time.perf_counter()
    loader, options = kept_mlp_options(args.worker)
    options = apply_module_settings(options)
    if args.uncheckpointed_layers and loader.startswith("unsloth_lite"):
        options["uncheckpointed_layers"] = args.uncheckpointed_layers
    model, info = LOADERS[loader](args.checkpoint, device, dtype, args.seq, **options)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    info.update(
        load_s=round(time.perf_counter() - start, 1), trainable_params=sum(p.numel() for p in params),
        checkpointed_layers=_checkpointed_layers(model),
    )
    if device.type == "cuda":
        _sync(device)
        info["load_gib"] = torch.cuda.memory_allocated(device) / 2**30
    return model, optimizer, info


def worker_main(args) -> int:
    """Loads the variant once, then measures each batch size (or runs the --max-seq search) and prints one
    result line for each."""
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        if args.memory_cap_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), device)
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]

    def report(result):
        print(RESULT_PREFIX + json.dumps(result), flush=True)

    try:
        model, optimizer, info = load(args, device, dtype)
    except (Exception, SystemExit) as error:  # reported as this variant's error, never a crash of the whole run
        traceback.print_exc()
        for batch in batch_sizes:
            report(dict(variant=args.worker, batch=batch, seq=args.seq, **_error(error)))
        return 0

    if args.max_seq:
        probe = one_step_probe(args, model, optimizer, device, config["vocab_size"])
        ceiling = config["max_position_embeddings"] // SEQ_MULTIPLE * SEQ_MULTIPLE
        search = search_max_seq(probe, args.seq, ceiling, args.max_probes)
        report(dict(variant=args.worker, memory_cap_gib=args.memory_cap_gib, load_gib=info.get("load_gib"), **search))
        return 0

    for batch in batch_sizes:
        result = dict(variant=args.worker, batch=batch, seq=args.seq, **info)
        try:
            result.update(measure(args, model, optimizer, device, batch, args.seq, config["vocab_size"],
                                  args.warmup, args.steps, profile=device.type == "cuda" and not args.no_profile))
        except (Exception, SystemExit) as error:
            traceback.print_exc()
            result.update(_error(error))
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report(result)
    return 0


# ----------------------------------------------------------------------------------------------------------
# Parent


def worker_env(variant: str, args) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    paths = [str(ROOT / "scripts"), str(ROOT)]
    if variant == "unsloth":
        env.update(UNSLOTH_DISABLE_STATISTICS="1", UNSLOTH_COMPILE_LOCATION="/tmp/unsloth_compiled_cache")
        if args.unsloth_site:
            paths.insert(0, str(Path(args.unsloth_site).resolve()))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if args.tiny:
        env["TRITON_INTERPRET"] = "1"  # read when triton is imported: must be in the worker's environment
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_worker(args, checkpoint: Path, variant: str, batch_sizes: list[int], max_seq: bool = False) -> list[dict]:
    """Runs one worker process for `variant`; returns its result lines (one per batch size, or the search)."""
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--checkpoint", str(checkpoint),
        "--batch-sizes", ",".join(map(str, batch_sizes)), "--seq", str(args.seq), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--max-probes", str(args.max_probes),
    ]
    for flag, on in (("--tiny", args.tiny), ("--no-profile", args.no_profile), ("--max-seq", max_seq),
                     ("--host-profile", args.host_profile)):
        if on:
            cmd.append(flag)
    if args.memory_cap_gib:
        cmd += ["--memory-cap-gib", str(args.memory_cap_gib)]
    if args.uncheckpointed_layers:
        cmd += ["--uncheckpointed-layers", str(args.uncheckpointed_layers)]
    label = f"[{variant} {'max-seq' if max_seq else 'b' + ','.join(map(str, batch_sizes))} s{args.seq}]"
    print(f"{label} starting", flush=True)
    start = time.perf_counter()
    results, lines, returncode = run_worker_process(
        cmd, worker_env(variant, args), ROOT, RESULT_PREFIX, args.worker_timeout, label, args.verbose,
    )
    if not results or (not max_seq and len(results) < len(batch_sizes)):
        tail = [line for line in lines if line.strip()][-15:]
        reason = worker_failure(returncode)
        done = {r.get("batch") for r in results}
        results += [dict(variant=variant, batch=b, seq=args.seq, error=f"worker {reason}: {tail[-1] if tail else ''}")
                    for b in ([None] if max_seq else [b for b in batch_sizes if b not in done])]
        print(f"{label} {reason}; last output:\n" + "\n".join(tail), flush=True)
    elif any("error" in r for r in results) and not args.verbose:
        print(f"{label} error; last output:\n" + "\n".join(lines[-15:]), flush=True)
    for r in results:
        if max_seq:
            status = f"max_seq {r.get('max_seq')}" if "error" not in r else r["error"]
        else:
            status = r.get("error") or f"b{r['batch']}: {r['batch'] * r['seq'] / r['step_s']:.0f} tokens/s"
        print(f"{label} {status}", flush=True)
    print(f"{label} done in {time.perf_counter() - start:.0f} s", flush=True)
    return results


def summarise(results: list[dict], c: dict, peak_tflops: float) -> list[dict]:
    """Adds tokens/s, MFU, HFU, GPU busy fraction and the first-loss difference to hf's (same batch size)."""
    n_total = total_params(c)
    reference = {r["batch"]: r["first_loss"] for r in results if r["variant"] == "hf" and "first_loss" in r}
    rows = []
    for r in results:
        row = dict(r)
        if "step_s" in r:
            tokens_per_s = r["batch"] * r["seq"] / r["step_s"]
            flops = flops_per_token(c, r["seq"], RECOMPUTE_SKIPPED.get(r["variant"], ()))["total"]
            row.update(
                tokens_per_s=round(tokens_per_s, 1),
                step_ms=round(1e3 * r["step_s"], 1),
                MFU=round(4 * n_total * tokens_per_s / (peak_tflops * 1e12), 3),
                HFU=round(flops * tokens_per_s / (peak_tflops * 1e12), 3),
            )
            if r.get("kernel_ms") is not None:
                row["gpu_busy"] = round(r["kernel_ms"] / (1e3 * r["step_s"]), 2)
            if r["batch"] in reference:
                ref = reference[r["batch"]]
                row["loss_rel_diff"] = float(f"{abs(r['first_loss'] - ref) / abs(ref):.2e}")
        for key in ("load_gib", "peak_gib", "peak_measured_gib", "peak_reserved_gib", "reserved_default_pool_gib",
                    "reserved_private_pools_gib"):
            if key in row:
                row[key] = round(row[key], 2)
        rows.append(row)
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(ALL_VARIANTS)}")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4; tiny: 1)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 32)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8; tiny: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (default 2; tiny: 1)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (kernel counts)")
    parser.add_argument("--host-profile", action="store_true",
                        help="the profiled step also records PyTorch ops and autograd Functions on the host")
    parser.add_argument("--workdir", default="/tmp/unsloth_lite_w1", help="where the checkpoint is written once")
    parser.add_argument("--unsloth-site", default=None, help="directory holding unsloth (put first on PYTHONPATH)")
    parser.add_argument("--max-seq", action="store_true", help="longest batch-1 sequence within --memory-cap-gib")
    parser.add_argument("--memory-cap-gib", type=float, default=None, help="GPU memory cap (--max-seq: default 24)")
    parser.add_argument("--max-probes", type=int, default=8, help="--max-seq: probes per variant")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds before a worker is killed")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the workload's)")
    parser.add_argument("--uncheckpointed-layers", type=int, default=0,
                        help="unsloth-lite variants with our checkpointing: the last N decoder layers not checkpointed")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke run)")
    parser.add_argument("--verbose", action="store_true", help="echo the workers' output")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", choices=ALL_VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tiny = args.tiny
    defaults = dict(batch_sizes="1" if tiny else "1,4", seq=32 if tiny else 2048, steps=2 if tiny else 8,
                    warmup=1 if tiny else 2)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.max_seq and args.memory_cap_gib is None:
        args.memory_cap_gib = 24.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)

    device = bench_device(args.tiny)
    if device is None:
        return 2
    if args.variants:
        variants = [v for v in args.variants.split(",") if v]
    else:
        variants = list(MAX_SEQ_VARIANTS if args.max_seq else TINY_VARIANTS if args.tiny else DEFAULT_VARIANTS)
    if report_unknown("variants", variants, ALL_VARIANTS):
        return 2
    if args.max_seq and args.tiny:
        print("--max-seq needs a GPU", file=sys.stderr)
        return 2
    c = TINY if args.tiny else W1
    if args.layers:
        c = dict(c, num_hidden_layers=args.layers)
    dtype = torch.float32 if args.tiny else torch.bfloat16

    checkpoint = ensure_checkpoint(c, args.workdir, dtype, device, "tiny_qwen3" if args.tiny else "qwen3_8b_shape")
    env = environment(device, ("torch", "triton", "transformers", "peft", "bitsandbytes", "liger-kernel",
                               "accelerate"))
    matmul_size = 256 if args.tiny else 8192
    peak_tflops = matmul_tflops(device, size=matmul_size)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flops = flops_per_token(c, args.seq)
    workload = dict(
        config=c, dtype=str(dtype), seq=args.seq, steps=args.steps, warmup=args.warmup, lora_r=LORA_R,
        lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES, lr=LR, total_params=total_params(c),
        decoder_linear_params=decoder_linear_params(c), flops_per_token=flops, checkpoint=str(checkpoint),
    )
    print(f"environment: {env}")
    print(f"bf16 matmul rate ({matmul_size}^3, measured in this run): {peak_tflops:.1f} TFLOP/s")
    print(f"params: {total_params(c):,} in all, {decoder_linear_params(c):,} in decoder linears; "
          f"executed FLOPs/token at seq {args.seq}: {flops['total'] / 1e9:.2f} G "
          f"(decoder {flops['decoder'] / 1e9:.2f}, lm_head {flops['lm_head'] / 1e9:.2f}, "
          f"attention {flops['attention'] / 1e9:.2f})")
    payload = dict(environment=env, matmul_size=matmul_size, matmul_TFLOPs=peak_tflops, workload=workload)

    if args.max_seq:
        searches = [r for v in variants for r in run_worker(args, checkpoint, v, [1], max_seq=True)]
        print(markdown_table(searches, ["variant", "max_seq", "first_failure", "memory_cap_gib", "error"]))
        for search in searches:
            print(f"{search['variant']} probes: "
                  + ", ".join(f"{p['seq']}:{'ok' if p['ok'] else 'no'}" for p in search.get("probes", [])))
        write_json(args.out, dict(payload, max_seq=searches))
        return 0

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    results = [r for variant in variants for r in run_worker(args, checkpoint, variant, batch_sizes)]
    results.sort(key=lambda r: (r.get("batch") or 0, variants.index(r["variant"])))
    rows = summarise(results, c, peak_tflops)
    columns = ["variant", "batch", "seq", "tokens_per_s", "step_ms", "peak_gib", "peak_reserved_gib", "load_gib",
               "first_loss",
               "loss_rel_diff", "kernels_per_step", "gpu_busy", "MFU", "HFU", "error"]
    shown = [dict(r, first_loss=round(r["first_loss"], 5)) if "first_loss" in r else r for r in rows]
    print(markdown_table(shown, columns))
    for row in rows:
        if "first_loss" in row:
            print(f"first-step loss {row['variant']} b{row['batch']}: {row['first_loss']!r} "
                  f"(relative difference to hf: {row.get('loss_rel_diff')}); all: {row['losses']}")
        if row.get("top_host_ops"):
            print(f"host time by op (self), {row['variant']} b{row['batch']}: "
                  + "; ".join(f"{k['ms']:.1f} ms {k['calls']}x {k['name'][:50]}" for k in row["top_host_ops"]))
        if row.get("top_kernels"):
            print(f"device time by kernel, {row['variant']} b{row['batch']} (of {row['kernel_ms']:.0f} ms): "
                  + "; ".join(f"{k['ms']:.1f} ms {k['calls']}x {k['name'][:60]}" for k in row["top_kernels"]))
        print_passes(row, f"{row['variant']} b{row['batch']}")
    write_json(args.out, dict(payload, results=rows))
    return 0


def print_passes(row: dict, label: str) -> None:
    """The profile's forward and backward apart (`train_timing.profile_passes`), where the row has them."""
    for name, summary in (row.get("passes") or {}).items():
        if summary.get("kernel_ms") is not None:
            print(f"{name}, {label}: kernels {summary['kernel_ms']:.1f} ms, idle {summary['idle_ms']} ms of a "
                  f"{summary['span_ms']} ms span, idle while copies ran {summary['idle_during_copies_ms']}")


if __name__ == "__main__":
    sys.exit(main())
