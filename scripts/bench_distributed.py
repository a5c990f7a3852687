"""QLoRA training on several GPUs of one machine: data parallel on W1 and on W4's packed records, FSDP2 on W2
(BENCHMARKS.md), each on 2 GPUs against 1, unsloth-lite and Hugging Face in the same run.

    python scripts/bench_distributed.py --out bench_distributed.json          # on 2 GPUs: every variant
    python scripts/bench_distributed.py --tiny                                # CPU smoke run (gloo)

Each variant runs once per process count (`--gpus`, default 1,2) as its own
`torchrun --standalone --nproc-per-node N scripts/bench_distributed.py --worker VARIANT` (one process per
GPU); every process builds or loads its model the way the one-GPU benchmarks do (their functions, imported),
and on more than one process distributes it:
- `dp_w1`: unsloth-lite on W1 (`bench_train_setup.py`'s checkpoint and loader: fused path, offloaded checkpointing,
  CUDA graphs), each process its own batch of 4 random rows, the model wrapped in PyTorch DDP
  (`find_unused_parameters=False`: the reentrant checkpointing builds no graph in the forward,
  `unsloth_lite.training.distributed`).
- `dp_w1_hf` (only when named): Hugging Face + PEFT + bitsandbytes on W1 (`bench_train.py`'s `hf`), DDP.
- `dp_w4`: the `dp_w1` model, DDP, on W4's records as `bench_packing.py`'s `unsloth_lite` variant batches them
  (its functions: the same records, `pack_dataset` into rows of 2048 tokens, `PackingCollator` laying 4 rows
  end to end as one micro-batch); every process packs all the records the same way and process r of N trains
  micro-batches r, r + N, r + 2N, ...: `--warmup` of them, then `--steps` timed.
- `fsdp_w2`: unsloth-lite on W2 (`bench_train_27b.py`'s model built on the GPU, NF4 packed in bf16, offloaded
  checkpointing, no CUDA graphs), batch 1 per process, sharded by `unsloth_lite.training.distributed.
  shard_model` (FSDP2: each decoder layer its own unit, then the root).
- `fsdp_w2_hf`: FSDP-QLoRA as Hugging Face users run it: the same model with PEFT LoRA, bitsandbytes NF4
  packed in bf16 (`bnb_4bit_quant_storage`), non-reentrant checkpointing, flash-linear-attention (guard
  bypassed, as `bench_train_27b.py`'s `hf_fla`; transformers' PyTorch delta rule in --tiny), sharded the way
  accelerate's FSDP2 plugin does it for `Trainer(fsdp="full_shard auto_wrap", fsdp_config={"version": 2})`:
  `fully_shard` on each of the model's `_no_split_modules` layers, then the root. The plugin itself is not
  used because it shards only on GPUs, and the CPU smoke run is to go through the same code; its
  mixed-precision policy would cast nothing (every floating parameter is already bf16).
On one process the model is trained as it is (no DDP, no FSDP): the one-GPU figures to compare against.
The NF4 storage is the compute dtype for the FSDP variants at every process count (the same bytes).

Each process times its own steps (W1, W2: `train_timing.measure`, `--warmup` steps, then `--steps` timed,
batch i of process r drawn from seed 1234 + 10000 r + i; W4: `bench_packing.train` on the process's
micro-batches), and rank 0 gathers every process's figures and prints one result line. Columns:
`tokens_per_s`, real (non-padding) tokens trained per second, summed over processes (every token of W1's and
W2's rows is real; W4's are counted by `bench_packing.token_counts`, with `real_tokens_per_rank` and
`timed_micro_batches_per_rank`, the indices of the micro-batches each process timed); `peak_gib_per_rank`,
each process's `torch.cuda.max_memory_allocated()` over warm-up and timed steps (`peak_gib`: the largest; in --tiny, the
process's peak resident memory instead); `first_loss`, rank 0's first-step loss, which on any process count
is the loss of the same model on the same rows. Ratios, on rows of more than one process:
`tokens_vs_1_process` and `peak_vs_1_process` (the same variant on one process), `tokens_vs_hf` (unsloth-lite
over its Hugging Face peer at the same process count). `bars` checks them against the targets: data-parallel
W1 and W4 >= 1.9x one GPU's tokens/s; FSDP2 W2 per-GPU peak <= 0.6x one GPU's, tokens/s >= 1.6x one GPU's and
>= 1.5x Hugging Face's FSDP-QLoRA.

A run longer than one sitting can be split: `--merge` takes earlier outputs of the script (same machine, same
session) whose rows join this run's before the ratios are computed.

`--tiny`: the tiny models of both scripts in fp32 on the CPU (gloo), 2 steps; W4 on `bench_packing.py`'s
tiny records packed in rows of 16 tokens, one row a micro-batch (5 micro-batches: a warm-up and a timed one
for each of 2 processes); the processes run the plain PyTorch references (TRITON_INTERPRET unset). All
variants of a process count share one launch there, to keep the torchrun start-ups few.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import bench_packing
import bench_train_27b
import bench_train_setup
import torch
import torch.distributed as dist
import train_timing
from bench_common import bench_device, environment, markdown_table, report_unknown, run_worker_process, write_json

from unsloth_lite.training.distributed import shard_model

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_DISTRIBUTED_RESULT "
VARIANTS = ("dp_w1", "dp_w4", "fsdp_w2", "fsdp_w2_hf")
ALL_VARIANTS = (*VARIANTS, "dp_w1_hf")
HF_PEER = {"dp_w1": "dp_w1_hf", "fsdp_w2": "fsdp_w2_hf"}
W1_LOADER = {"dp_w1": "unsloth_lite", "dp_w1_hf": "hf", "dp_w4": "unsloth_lite"}  # variants on W1's checkpoint
W1_BATCH, W2_BATCH = 4, 1
W4_ROW_TOKENS, W4_ROWS = 2048, 4  # tokens of a packed row, rows of a micro-batch: bench_packing.py's defaults
# enough micro-batches from bench_packing.py's 8 tiny records for a warm-up and a timed step on each of 2 processes
TINY_W4_ROW_TOKENS, TINY_W4_ROWS = 16, 1
RANK_SEED_STRIDE = 10_000  # process r draws its batches from seeds apart from every other process's
# (variant, column, comparison, target) on the rows of the most processes
BARS = (
    ("dp_w1", "tokens_vs_1_process", ">=", 1.9),
    ("dp_w4", "tokens_vs_1_process", ">=", 1.9),
    ("fsdp_w2", "peak_vs_1_process", "<=", 0.6),
    ("fsdp_w2", "tokens_vs_1_process", ">=", 1.6),
    ("fsdp_w2", "tokens_vs_hf", ">=", 1.5),
)


# ----------------------------------------------------------------------------------------------------------
# Worker: one process of a torchrun launch


def shard_like_accelerate(model):
    """FSDP2 as accelerate's plugin applies it with transformer-based wrapping: each module whose class is in
    the model's `_no_split_modules` its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = set(model.get_base_model()._no_split_modules)
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module)
    fully_shard(model)
    return model


def load_variant(variant: str, args, device: torch.device, dtype: torch.dtype):
    """(model, model config) of a variant, built or loaded as the one-GPU benchmarks do."""
    if variant in W1_LOADER:
        model, _ = bench_train_setup.LOADERS[W1_LOADER[variant]](args.checkpoint, device, dtype, args.seq)
        return model, json.loads((Path(args.checkpoint) / "config.json").read_text())
    c = bench_train_27b.model_config(args.tiny, args.layers)
    peer = "hf" if args.tiny else "hf_fla"
    model = bench_train_27b.load(peer if variant == "fsdp_w2_hf" else "unsloth_lite", c, device, dtype,
                                 all_linear=False, quant_storage=dtype)
    return model, c


def distribute(model, variant: str, device: torch.device):
    """The model wrapped for several processes (module docstring); as it is on one."""
    if dist.get_world_size() == 1:
        return model
    if variant.startswith("dp_"):
        device_ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=False)
    return shard_like_accelerate(model) if variant == "fsdp_w2_hf" else shard_model(model)


def peak_memory_gib(cuda_peak_gib: float | None, device: torch.device) -> float:
    if device.type == "cuda":
        return round(cuda_peak_gib, 2)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # KiB on Linux


def w4_micro_batch_shape(tiny: bool) -> tuple[int, int]:
    """(packed rows per micro-batch, tokens per row)."""
    return (TINY_W4_ROWS, TINY_W4_ROW_TOKENS) if tiny else (W4_ROWS, W4_ROW_TOKENS)


def measure_random_rows(args, model, optimizer, device: torch.device, batch: int, vocab: int, rank: int) -> dict:
    """W1's and W2's steps on random rows, every token real (module docstring)."""
    result = train_timing.measure(args, model, optimizer, device, batch, args.seq, vocab, args.warmup, args.steps,
                                 profile=False, seed=bench_train_setup.SEED + RANK_SEED_STRIDE * rank)
    return dict(tokens_per_s=batch * args.seq / result["step_s"], step_s=result["step_s"],
                peak_gib=result.get("peak_gib"), peak_reserved_gib=result.get("peak_reserved_gib", 0.0),
                first_loss=result["first_loss"], warmup_s=result["warmup_s"])


def measure_packed(args, model, optimizer, device: torch.device, c: dict, rank: int, world_size: int) -> dict:
    """W4's steps: this process's share of the packed micro-batches (module docstring), real tokens counted."""
    rows, row_tokens = w4_micro_batch_shape(args.tiny)
    pad_id = bench_packing.padding_id(c)
    records = bench_packing.make_records(bench_packing.TINY_RECORDS if args.tiny else bench_packing.W4_RECORDS,
                                         c["vocab_size"])
    batches = bench_packing.packed_batches(records, row_tokens, rows, pad_id)
    mine = list(range(rank, len(batches), world_size))
    warmup, timed = bench_packing.split_steps(mine, args.warmup, args.steps, epoch=False)
    result = bench_packing.train(model, optimizer, device, [batches[i] for i in warmup],
                                 [batches[i] for i in timed], pad_id)
    return dict(tokens_per_s=result["real_tokens"] / result["time_s"], step_s=result["time_s"] / len(timed),
                peak_gib=result.get("peak_gib"), peak_reserved_gib=result.get("peak_reserved_gib", 0.0),
                first_loss=result["first_losses"][0], warmup_s=result["warmup_s"],
                real_tokens=result["real_tokens"], timed_micro_batches=timed)


def run_variant(variant: str, args, device: torch.device, dtype: torch.dtype) -> dict | None:
    """Trains and times the variant on every process; returns the gathered row on rank 0 (None elsewhere)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    model, c = load_variant(variant, args, device, dtype)
    model = distribute(model, variant, device)
    model.train()
    # after sharding: FSDP2 replaces the parameters by their shards
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=bench_train_setup.LR)
    load_s = time.perf_counter() - start
    # what each process holds before training: its shard of the model under FSDP, the whole model otherwise
    load_gib = round(torch.cuda.memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    if variant == "dp_w4":
        batch, seq = w4_micro_batch_shape(args.tiny)
        mine = measure_packed(args, model, optimizer, device, c, rank, world_size)
    else:
        batch, seq = (W2_BATCH if variant.startswith("fsdp") else W1_BATCH), args.seq
        mine = measure_random_rows(args, model, optimizer, device, batch, c["vocab_size"], rank)
    mine.update(peak_gib=peak_memory_gib(mine["peak_gib"], device),
                peak_reserved_gib=round(mine["peak_reserved_gib"], 2), load_s=round(load_s, 1), load_gib=load_gib)
    ranks = [None] * world_size
    dist.all_gather_object(ranks, mine)
    del model, optimizer  # before the launch's next variant (--tiny)
    gc.collect()
    if rank != 0:
        return None
    row = dict(
        variant=variant, processes=world_size, batch_per_process=batch, seq=seq,
        tokens_per_s=round(sum(r["tokens_per_s"] for r in ranks), 1),
        tokens_per_s_per_rank=[round(r["tokens_per_s"], 1) for r in ranks],
        step_ms=round(1e3 * max(r["step_s"] for r in ranks), 1),
        peak_gib=max(r["peak_gib"] for r in ranks), peak_gib_per_rank=[r["peak_gib"] for r in ranks],
        peak_reserved_gib_per_rank=[r["peak_reserved_gib"] for r in ranks],
        load_gib_per_rank=[r["load_gib"] for r in ranks],
        first_loss=ranks[0]["first_loss"], first_loss_per_rank=[r["first_loss"] for r in ranks],
        load_s=ranks[0]["load_s"], warmup_s=ranks[0]["warmup_s"],
    )
    if "real_tokens" in mine:
        row.update(real_tokens_per_rank=[r["real_tokens"] for r in ranks],
                   timed_micro_batches_per_rank=[r["timed_micro_batches"] for r in ranks])
    return row


def worker_main(args) -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.tiny:
        device, dtype, backend = torch.device("cpu"), torch.float32, "gloo"
    else:
        torch.cuda.set_device(local_rank)
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "nccl"
    dist.init_process_group(backend)
    try:
        for variant in args.worker.split(","):
            row = run_variant(variant, args, device, dtype)
            if row is not None:
                print(RESULT_PREFIX + json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------------------
# Parent


def worker_env(tiny: bool) -> dict:
    # The processes run the PyTorch references on the CPU, Triton on GPUs: never the interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if tiny:
        env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), str(ROOT), env.get("PYTHONPATH")]))
    return env


def launch(args, variants: list[str], processes: int, checkpoint: Path | None) -> list[dict]:
    """One torchrun launch of `processes` workers training `variants` in turn; a row per variant (an error
    row for each one that printed none)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
           str(Path(__file__).resolve()), "--worker", ",".join(variants), "--seq", str(args.seq),
           "--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += ["--tiny"] * args.tiny + (["--layers", str(args.layers)] if args.layers else [])
    cmd += ["--checkpoint", str(checkpoint)] if checkpoint else []
    label = f"[{','.join(variants)} x{processes}]"
    print(f"{label} starting", flush=True)
    start = time.perf_counter()
    rows, lines, returncode = run_worker_process(cmd, worker_env(args.tiny), ROOT, RESULT_PREFIX,
                                                 args.worker_timeout, label, args.verbose)
    done = {row["variant"] for row in rows}
    missing = [v for v in variants if v not in done]
    if missing:
        tail = [line for line in lines if line.strip()][-25:]
        print(f"{label} exited with {returncode}; last output:\n" + "\n".join(tail), flush=True)
        error = f"exited with {returncode}: {tail[-1] if tail else ''}"[:300]
        rows += [dict(variant=v, processes=processes, error=error) for v in missing]
    for row in rows:
        status = row.get("error") or f"{row['tokens_per_s']} tokens/s, peak per rank {row['peak_gib_per_rank']} GiB"
        print(f"{label} {row['variant']}: {status}", flush=True)
    print(f"{label} done in {time.perf_counter() - start:.0f} s", flush=True)
    return rows


RATIO_COLUMNS = ("tokens_vs_1_process", "peak_vs_1_process", "tokens_vs_hf")


def merge_rows(rows: list[dict], paths: list[str]) -> list[dict]:
    """This run's rows and those of earlier outputs (`--merge`) of variants and process counts it did not
    measure, their ratios left to be computed again, in the order of ALL_VARIANTS."""
    measured = {(r["variant"], r["processes"]) for r in rows}
    merged = list(rows)
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if (row["variant"], row["processes"]) not in measured:
                measured.add((row["variant"], row["processes"]))
                merged.append({k: v for k, v in row.items() if k not in RATIO_COLUMNS})
    return sorted(merged, key=lambda r: (ALL_VARIANTS.index(r["variant"]), r["processes"]))


def add_ratios(rows: list[dict]) -> None:
    """The ratio columns (module docstring), in place."""
    measured = {(r["variant"], r["processes"]): r for r in rows if "tokens_per_s" in r}
    for (variant, processes), row in measured.items():
        one = measured.get((variant, 1))
        if one and processes > 1:
            row["tokens_vs_1_process"] = round(row["tokens_per_s"] / one["tokens_per_s"], 3)
            if one["peak_gib"]:
                row["peak_vs_1_process"] = round(row["peak_gib"] / one["peak_gib"], 3)
        peer = measured.get((HF_PEER.get(variant), processes))
        if peer:
            row["tokens_vs_hf"] = round(row["tokens_per_s"] / peer["tokens_per_s"], 3)


def check_bars(rows: list[dict], processes: int) -> list[dict]:
    """Each target of BARS with the value reached on `processes` processes (None where not measured)."""
    by_variant = {r["variant"]: r for r in rows if r["processes"] == processes}
    bars = []
    for variant, column, comparison, target in BARS:
        value = by_variant.get(variant, {}).get(column)
        met = None if value is None else (value >= target if comparison == ">=" else value <= target)
        bars.append(dict(bar=f"{variant} {column} {comparison} {target}", processes=processes, value=value, met=met))
    return bars


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(ALL_VARIANTS)} "
                                                        f"(default {','.join(VARIANTS)})")
    parser.add_argument("--gpus", default="1,2", help="comma-separated process counts (one GPU each)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 32)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (default 2; tiny: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5; tiny: 1)")
    parser.add_argument("--layers", type=int, default=None, help="W2 with fewer decoder layers (keeps the pattern)")
    parser.add_argument("--workdir", default="/tmp/unsloth_lite_w1", help="where W1's checkpoint is written once")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds before a launch is killed")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, gloo (smoke run)")
    parser.add_argument("--verbose", action="store_true", help="echo the workers' output")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                        help="earlier outputs of this script on the same machine: their rows of variants not run "
                             "now join the table and the ratios")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(seq=32, warmup=1, steps=1) if args.tiny else dict(seq=2048, warmup=2, steps=5)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    device = bench_device(args.tiny)
    if device is None:
        return 2
    variants = [v for v in args.variants.split(",") if v] if args.variants else list(VARIANTS)
    if report_unknown("variants", variants, ALL_VARIANTS):
        return 2
    process_counts = [int(n) for n in args.gpus.split(",") if n]
    if device.type == "cuda" and max(process_counts) > torch.cuda.device_count():
        print(f"--gpus {args.gpus} needs {max(process_counts)} GPUs; {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    checkpoint = None
    if any(v in W1_LOADER for v in variants):
        c, dtype = (bench_train_setup.TINY, torch.float32) if args.tiny else (bench_train_setup.W1, torch.bfloat16)
        checkpoint = bench_train_setup.ensure_checkpoint(c, args.workdir, dtype, device,
                                                         "tiny_qwen3" if args.tiny else "qwen3_8b_shape")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    env = environment(device, ("torch", "triton", "transformers", "peft", "bitsandbytes", "accelerate", "fla-core"))
    if device.type == "cuda":
        env["gpus"] = torch.cuda.device_count()
    print(f"environment: {env}")

    rows = []
    for processes in process_counts:
        if args.tiny:
            rows += launch(args, variants, processes, checkpoint)
        else:  # each in a fresh process group: fla is bound at import, and memory figures start clean
            rows += [row for variant in variants for row in launch(args, [variant], processes, checkpoint)]
    rows = merge_rows(rows, args.merge)
    add_ratios(rows)
    bars = check_bars(rows, max(process_counts))
    columns = ["variant", "processes", "tokens_per_s", "tokens_vs_1_process", "tokens_vs_hf", "peak_gib_per_rank",
               "peak_vs_1_process", "step_ms", "first_loss", "error"]
    print(markdown_table(rows, columns))
    print(markdown_table(bars, ["bar", "processes", "value", "met"]))
    w4_rows, w4_row_tokens = w4_micro_batch_shape(args.tiny)
    w4_records = bench_packing.TINY_RECORDS if args.tiny else bench_packing.W4_RECORDS
    workload = dict(seq=args.seq, warmup=args.warmup, steps=args.steps, w1_batch_per_process=W1_BATCH,
                    w2_batch_per_process=W2_BATCH, w2_layers=args.layers, w4_records=w4_records,
                    w4_rows_per_micro_batch=w4_rows, w4_row_tokens=w4_row_tokens, checkpoint=str(checkpoint))
    merged = [dict(path=path, environment=json.loads(Path(path).read_text())["environment"]) for path in args.merge]
    write_json(args.out, dict(environment=env, workload=workload, rows=rows, bars=bars, merged=merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
