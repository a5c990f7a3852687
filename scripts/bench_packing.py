"""QLoRA training on instruction-shaped records (workload W4 of BENCHMARKS.md): real tokens trained per second
and peak memory of padded batches, Hugging Face's padding-free flattening, Unsloth's packing and unsloth-lite's
packing, on the same records in one run, next to unsloth-lite on W1's full synthetic rows.

    python scripts/bench_packing.py --out bench_packing.json --unsloth-site /tmp/uns_site      # on a GPU: W4
    python scripts/bench_packing.py --epoch --out bench_packing_epoch.json                    # a whole epoch
    python scripts/bench_packing.py --model qwen3_5_27b --out bench_packing_27b.json           # 27B shape
    TRITON_INTERPRET=1 python scripts/bench_packing.py --tiny                                  # CPU smoke run

Records (BENCHMARKS.md's W4, exactly): 4,096 records whose lengths are
`clip(round(exp(N(ln 220, 0.8))), 32, 2048)`, drawn with `numpy.random.default_rng(0)`; token ids uniform over
the vocabulary less its last three ids (the special tokens, so no record token equals the padding id) from
`numpy.random.default_rng(1)`; the first third of each record (`length // 3` tokens) is the prompt, labels -100,
the rest the response, labels = ids. The Hugging Face variants take the records in this order; the packing
variants order their packed rows as their packing does (shuffled).

Model and QLoRA setup: `--model qwen3_8b` is W1's (`bench_train_setup.py`: the random-weight checkpoint it writes
under `--workdir`, each variant through `bench_train_setup.LOADERS`: NF4 decoder linears, LoRA r=16 on
q,k,v,o,gate,up,down, gradient checkpointing, AdamW lr 1e-4 over the adapters). `--model qwen3_5_27b` is
W2's (`bench_train_27b.load`: built on the GPU and quantised in place; Hugging Face with flash-linear-attention
where it is installed, its Hopper guard bypassed); there is no checkpoint, so no `unsloth` variant.

Variants, each in its own worker process, and their micro-batches:
- `hf_padded`: Hugging Face + PEFT + bitsandbytes (sdpa, as `bench_train.py`'s `hf`); `--padded-batch` (8)
  consecutive records padded on the right to the longest of them, with an attention mask.
- `hf_flatten`: the same model; consecutive records up to `--flatten-tokens` tokens (default: rows x
  packing tokens, ours), one record beyond that starting the next micro-batch, through
  `transformers.DataCollatorWithFlattening`: one padding-free sequence, position ids restarting at each
  record, each record's first label ignored. With sdpa, transformers reads the record boundaries from the
  position ids (a block-diagonal causal mask); on Qwen3.5 the collator also returns `cu_seq_lens_*` for the
  DeltaNet layers, which transformers keeps apart only with flash-linear-attention (without it, this
  variant reports transformers' refusal as its error).
- `unsloth`: `FastLanguageModel` as in `bench_train_setup.py`, imported from `--unsloth-site`; micro-batches from
  the dataloader of Unsloth's TRL `SFTTrainer` with `SFTConfig(packing=True, max_length=--packing-tokens,
  per_device_train_batch_size=--rows, completion_only_loss=True)` on the tokenised records (a
  `completion_mask` marks the response): its packing, collator and sampler, as Unsloth configures them. Only
  when unsloth is importable from `--unsloth-site` (TRL with it).
- `unsloth_lite`: `bench_train.py`'s `unsloth_lite` (offloaded checkpointing, CUDA graphs where layer calls
  repeat; at 27B `bench_train_27b.py`'s, offload only); `pack_dataset(records, --packing-tokens)` (best fit,
  rows of 2048 tokens by default, as the qlora_qwen3_8b recipe) and `PackingCollator`: `--rows` (4, the
  recipe's batch) packed rows laid end to end, one sequence of `rows x packing tokens` (8,192 by default,
  W1's batch-4 tokens), each row's tail padded.
- `unsloth_lite_w1`: the same model on W1's workload, `train_timing.measure` on `--w1-batch` (4) random rows
  of 2048 tokens, labels = ids: every token real; `--warmup` then `--steps` timed steps, with `--epoch` too.
  Its tokens/s is the ">= 0.95x its own W1" reference.
- `unsloth_lite_kept_mlp`: `unsloth_lite` with `keep_mlp_preactivations=True` (each checkpoint keeps its MLP's
  gate and up outputs in CPU memory with its input: the recomputation skips their products).
- `unsloth_lite_kept_mlp@keep=K/gpu=G`: only K of the checkpointed layers keep them, spread evenly, G of those in
  GPU memory instead of CPU memory (`keep_mlp_preactivations=K`, `mlp_preactivations_on_gpu=G`); either key
  may be left out.
- `unsloth_lite:N`, `unsloth_lite_kept_mlp:N`, `unsloth_lite_w1:N`: the same with the last N decoder layers not
  checkpointed (their activations kept, their recomputation skipped), so that one run compares several N
  against the peers; `--uncheckpointed-layers N` sets it for the unsuffixed unsloth-lite variants.

One step, as in `bench_train.py`: forward with the micro-batch (labels included: the loss), backward,
`optimizer.step()`, `zero_grad(set_to_none=True)`. Micro-batches are collated on the host before timing and
copied to the GPU inside each step. `--warmup` steps (the first micro-batches), then `--steps` timed ones (the
next), each `torch.cuda.synchronize()`d and timed with `perf_counter`; with `--epoch`, after the warm-up steps
every micro-batch of the epoch is timed (the warm-up ones again), so every variant's timed steps cover every
record once.

Columns: `real_tokens` = tokens of the timed micro-batches that are not the padding id (record tokens: the
prompt's and the response's), `tokens` = all tokens the model ran (padding included), `real_fraction` their
ratio, `target_tokens` = labels that are trained (`labels[..., 1:] != -100`); `real_tokens_per_s` =
real_tokens / summed time of the timed steps. `peak_gib` = `torch.cuda.max_memory_allocated()` from after
loading through the last step (warm-up included), `peak_reserved_gib` the same for reserved memory, `load_gib`
after loading. `x_fastest_peer`: real tokens/s over the fastest peer's (hf_padded, hf_flatten, unsloth);
`x_lite_w1`: over unsloth_lite_w1's tokens/s; `peak_x_lowest_peer`: peak over the lowest peer peak.
`first_losses`: the first steps' losses (micro-batches differ between variants: not comparable).

`--tiny`: a CPU smoke run through the same parent/worker path: bench_train_setup.py's tiny qwen3 with one decoder
layer (fp32, NF4 through bitsandbytes' CPU backend, kernels in Triton's interpreter), 8 records of
`clip(round(exp(N(ln 6, 0.8))), 3, 16)` tokens (70 in all), padded batches of 4, 3 packed rows of 16 tokens
(flattened: 48), W1 batch 2 x 16, `--epoch` with no warm-up (two steps a variant), workers run `--jobs` at a
time; no memory figures. Workers never touch the network.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import bench_train
import bench_train_setup
import numpy as np
import torch
import train_timing
from bench_common import (
    bench_device,
    environment,
    kept_mlp_options,
    markdown_table,
    report_unknown,
    run_worker_process,
    uncheckpointed_suffix,
    worker_failure,
    write_json,
)
from w4_records import (
    IGNORE_INDEX,
    TINY_RECORDS,
    W4_RECORDS,
    flattened_batches,
    make_records,
    packed_batches,
    padded_batches,
    record_lengths,
    token_counts,
)

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_PACKING_RESULT "
PEERS = ("hf_padded", "hf_flatten", "unsloth")
VARIANTS = (*PEERS, "unsloth_lite", "unsloth_lite_kept_mlp", "unsloth_lite_w1")
BENCH_TRAIN_LOADER = {"hf_padded": "hf", "hf_flatten": "hf", "unsloth": "unsloth", "unsloth_lite": "unsloth_lite",
                      "unsloth_lite_kept_mlp": "unsloth_lite_kept_mlp", "unsloth_lite_w1": "unsloth_lite"}
FIRST_LOSSES = 8


# ----------------------------------------------------------------------------------------------------------
# Micro-batches of the peers' own making


def unsloth_batches(model, checkpoint: str, records: list[dict], args) -> list[dict]:
    """Micro-batches from the dataloader of Unsloth's TRL SFTTrainer with packing (module docstring)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    def completion_mask(labels):
        return [int(label != IGNORE_INDEX) for label in labels]

    dataset = datasets.Dataset.from_list(
        [{"input_ids": r["input_ids"], "completion_mask": completion_mask(r["labels"])} for r in records]
    )
    config = SFTConfig(
        output_dir="/tmp/bench_packing_unsloth", per_device_train_batch_size=args.rows,
        max_length=args.packing_tokens, packing=True, completion_only_loss=True, report_to="none",
        bf16=not args.tiny, seed=bench_train_setup.SEED, dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                         processing_class=AutoTokenizer.from_pretrained(checkpoint))
    # the dataloader places batches on the GPU; kept on the host until their step, as every variant's are
    return [{k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
            for batch in trainer.get_train_dataloader()]


def micro_batches(args, model, records: list[dict], pad_id: int) -> list[dict]:
    if args.worker == "hf_padded":
        return padded_batches(records, args.padded_batch, pad_id)
    if args.worker == "hf_flatten":
        return flattened_batches(records, args.flatten_tokens, boundary_kwargs=args.model == "qwen3_5_27b")
    if args.worker == "unsloth":
        return unsloth_batches(model, args.checkpoint, records, args)
    return packed_batches(records, args.packing_tokens, args.rows, pad_id)


# ----------------------------------------------------------------------------------------------------------
# Worker: one variant in its own process


def model_config(args) -> dict:
    if args.model == "qwen3_5_27b":
        import bench_train_27b

        return bench_train_27b.model_config(args.tiny, args.layers)
    c = bench_train_setup.TINY if args.tiny else bench_train_setup.W1
    return dict(c, num_hidden_layers=args.layers) if args.layers else c


def padding_id(c: dict) -> int:
    """The config's padding id; Qwen3.5's config (built, no tokenizer) has none: its last id, which no record
    holds."""
    return c["pad_token_id"] if c.get("pad_token_id") is not None else c["vocab_size"] - 1


def load_variant(args, device: torch.device, dtype: torch.dtype) -> tuple:
    """(model, optimizer, info): through `bench_train.load` for qwen3_8b, `bench_train_27b.load` for 27B."""
    kept_mlp = "@" + args.kept_mlp if args.kept_mlp else ""
    if args.model == "qwen3_8b":
        loader_args = SimpleNamespace(worker=BENCH_TRAIN_LOADER[args.worker] + kept_mlp, checkpoint=args.checkpoint,
                                      seq=max(args.packing_tokens, args.w1_seq),
                                      uncheckpointed_layers=args.uncheckpointed_layers)
        return bench_train.load(loader_args, device, dtype)
    import bench_train_27b

    hf_loader = "hf_fla" if importlib.util.find_spec("fla") else "hf"
    loader = hf_loader if args.worker.startswith("hf") else BENCH_TRAIN_LOADER[args.worker] + kept_mlp
    start = time.perf_counter()
    model = bench_train_27b.load(loader, model_config(args), device, dtype, all_linear=False,
                                 uncheckpointed_layers=args.uncheckpointed_layers)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    info = dict(loader=loader, load_s=round(time.perf_counter() - start, 1),
                trainable_params=sum(p.numel() for p in params))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        info["load_gib"] = torch.cuda.memory_allocated(device) / 2**30
    return model, torch.optim.AdamW(params, lr=bench_train_setup.LR), info


def split_steps(batches: list, warmup: int, steps: int, epoch: bool) -> tuple[list, list]:
    """(warm-up, timed) micro-batches: the first `warmup`, then the next `steps`, or with `epoch` all of them."""
    if epoch:
        return batches[:warmup], batches
    if len(batches) < warmup + steps:
        raise ValueError(f"{len(batches)} micro-batches, fewer than {warmup} warm-up + {steps} timed steps")
    return batches[:warmup], batches[warmup:warmup + steps]


def train(model, optimizer, device: torch.device, warmup: list[dict], timed: list[dict], pad_id: int) -> dict:
    """Trains the warm-up then the timed micro-batches (module docstring); their counts, times and peaks."""
    cuda = device.type == "cuda"

    def step(batch):
        inputs = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    train_timing._sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    warmup_start = time.perf_counter()
    losses = [step(batch) for batch in warmup]
    train_timing._sync(device)
    warmup_s = time.perf_counter() - warmup_start
    times = []
    for batch in timed:
        train_timing._sync(device)
        start = time.perf_counter()
        losses.append(step(batch))
        train_timing._sync(device)
        times.append(time.perf_counter() - start)
    counts = [token_counts(batch, pad_id) for batch in timed]
    out = {key: sum(c[key] for c in counts) for key in ("real_tokens", "tokens", "target_tokens")}
    out.update(timed_steps=len(timed), time_s=sum(times), warmup_s=round(warmup_s, 1),
               step_s=[round(t, 4) for t in times],
               first_losses=[float(x) for x in losses[:FIRST_LOSSES]])
    if cuda:
        out.update(peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30)
    return out


def measure_w1(args, model, optimizer, device: torch.device, vocab: int) -> dict:
    """W1's step on `--w1-batch` full random rows through `train_timing.measure`, in this script's columns."""
    w1 = train_timing.measure(args, model, optimizer, device, args.w1_batch, args.w1_seq, vocab, args.warmup,
                             args.steps, profile=False)
    tokens = args.w1_batch * args.w1_seq * args.steps
    out = dict(real_tokens=tokens, tokens=tokens, target_tokens=args.w1_batch * (args.w1_seq - 1) * args.steps,
               timed_steps=args.steps, time_s=w1["step_s"] * args.steps, first_losses=w1["losses"][:FIRST_LOSSES])
    out.update({key: w1[key] for key in ("peak_gib", "peak_reserved_gib") if key in w1})
    return out


def worker_main(args) -> int:
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    c = model_config(args)
    pad_id = padding_id(c)
    result = dict(variant=args.worker, model=args.model)
    try:
        model, optimizer, info = load_variant(args, device, dtype)
        result.update(info)
        if args.worker == "unsloth_lite_w1":
            result.update(measure_w1(args, model, optimizer, device, c["vocab_size"]))
        else:
            records = make_records(TINY_RECORDS if args.tiny else W4_RECORDS, c["vocab_size"])
            batches = micro_batches(args, model, records, pad_id)
            result["micro_batches"] = len(batches)
            warmup, timed = split_steps(batches, args.warmup, args.steps, args.epoch)
            result.update(train(model, optimizer, device, warmup, timed, pad_id))
    except (Exception, SystemExit) as error:  # this variant's error, never a crash of the whole run
        traceback.print_exc()
        result.update(train_timing._error(error))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------------
# Parent


def split_variant(variant: str) -> tuple[str, str, int | None]:
    """(name, its kept-MLP suffix, uncheckpointed layers) of "NAME[@keep=N/gpu=G][:L]": ("unsloth_lite", "", 8)
    of "unsloth_lite:8", ("unsloth_lite_kept_mlp", "keep=24", None) of "unsloth_lite_kept_mlp@keep=24"."""
    head, layers = uncheckpointed_suffix(variant)
    name, _, suffix = head.partition("@")
    return name, suffix, layers


def run_variant(args, checkpoint: Path | None, variant: str) -> dict:
    """Runs one variant's worker; its result (labelled with the variant as named), or an error row."""
    name, kept_mlp, uncheckpointed = split_variant(variant)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model", args.model]
    cmd += ["--kept-mlp", kept_mlp] if kept_mlp else []
    flags = dict(vars(args), uncheckpointed_layers=uncheckpointed if uncheckpointed is not None
                 else args.uncheckpointed_layers)
    for flag in ("packing_tokens", "rows", "padded_batch", "flatten_tokens", "w1_batch", "w1_seq", "warmup",
                 "steps", "layers", "uncheckpointed_layers"):
        if flags[flag] is not None:
            cmd += ["--" + flag.replace("_", "-"), str(flags[flag])]
    cmd += ["--checkpoint", str(checkpoint)] if checkpoint else []
    cmd += ["--epoch"] * args.epoch + ["--tiny"] * args.tiny
    label = f"[{variant}]"
    print(f"{label} starting", flush=True)
    start = time.perf_counter()
    results, lines, returncode = run_worker_process(
        cmd, bench_train.worker_env(name, args), ROOT, RESULT_PREFIX, args.worker_timeout, label, args.verbose,
    )
    if results:
        result = dict(results[0], variant=variant)
        if name.startswith("unsloth_lite"):
            result["uncheckpointed_layers"] = flags["uncheckpointed_layers"] or 0
    else:
        reason = worker_failure(returncode)
        result = dict(variant=variant, model=args.model, error=f"worker {reason}")
    if "error" in result and not args.verbose:
        print("\n".join(f"{label} {line}" for line in lines[-15:]), flush=True)
    print(f"{label} done in {time.perf_counter() - start:.0f} s: {result.get('error', 'ok')}", flush=True)
    return result


def summarise(results: list[dict]) -> list[dict]:
    """Adds real tokens/s, the real fraction and the ratios to the fastest peer, to unsloth_lite_w1 and to the
    lowest peer peak."""
    rows = [dict(r) for r in results]
    rates = {r["variant"]: r["real_tokens"] / r["time_s"] for r in rows if r.get("time_s")}
    peer_rates = [rate for variant, rate in rates.items() if variant in PEERS]
    fastest = max(peer_rates, default=None)
    lowest_peak = min((r["peak_gib"] for r in rows if r["variant"] in PEERS and "peak_gib" in r), default=None)
    w1 = rates.get("unsloth_lite_w1")
    for row in rows:
        rate = rates.get(row["variant"])
        if rate:
            row.update(real_tokens_per_s=round(rate, 1), real_fraction=round(row["real_tokens"] / row["tokens"], 3))
            if fastest:
                row["x_fastest_peer"] = round(rate / fastest, 3)
            if w1:
                row["x_lite_w1"] = round(rate / w1, 3)
        if lowest_peak and "peak_gib" in row:
            row["peak_x_lowest_peer"] = round(row["peak_gib"] / lowest_peak, 3)
        for key in ("peak_gib", "peak_reserved_gib", "load_gib", "time_s"):
            if row.get(key) is not None:
                row[key] = round(row[key], 2)
    return rows


def choose_variants(args) -> list[str]:
    """--variants, else every variant the run can load: unsloth only when importable from --unsloth-site (and
    never at the 27B shape, which has no checkpoint for its loader), none of the peers' extras in --tiny."""
    if args.variants:
        return [v for v in args.variants.split(",") if v]
    unsloth_found = bool(args.unsloth_site) and (Path(args.unsloth_site) / "unsloth").is_dir()
    skip = {"unsloth"} if args.tiny or args.model != "qwen3_8b" or not unsloth_found else set()
    if "unsloth" in skip and not args.tiny:
        print("unsloth: skipped (not importable from --unsloth-site, or the 27B shape)")
    return [v for v in VARIANTS if v not in skip]


def records_summary(lengths: np.ndarray) -> dict:
    return dict(records=len(lengths), tokens=int(lengths.sum()), median=float(np.median(lengths)),
                mean=round(float(lengths.mean()), 1), p99=round(float(np.percentile(lengths, 99)), 1),
                at_longest=int((lengths == lengths.max()).sum()))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("qwen3_8b", "qwen3_5_27b"), default="qwen3_8b")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--packing-tokens", type=int, default=None, help="packed row length (default 2048; tiny 16)")
    parser.add_argument("--rows", type=int, default=None,
                        help="packed rows per micro-batch (unsloth_lite, unsloth; default 4; tiny 3)")
    parser.add_argument("--padded-batch", type=int, default=None,
                        help="records per padded micro-batch (hf_padded; default 8; tiny 4)")
    parser.add_argument("--flatten-tokens", type=int, default=None,
                        help="token budget of a flattened micro-batch (hf_flatten; default rows x packing tokens)")
    parser.add_argument("--w1-batch", type=int, default=None, help="unsloth_lite_w1's batch of full rows (default 4; "
                        "tiny 2)")
    parser.add_argument("--w1-seq", type=int, default=None, help="unsloth_lite_w1's row length (default 2048; tiny 16)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (default 2; tiny 0)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 16; tiny 2)")
    parser.add_argument("--epoch", action="store_true", help="time a whole epoch of the records (tiny: always)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the workload's; tiny 1, or 2 at 27B)")
    parser.add_argument("--uncheckpointed-layers", type=int, default=None,
                        help="unsloth-lite variants: the last N decoder layers not checkpointed (default 0)")
    parser.add_argument("--workdir", default="/tmp/unsloth_lite_w1", help="where the qwen3_8b checkpoint is written")
    parser.add_argument("--unsloth-site", default=None, help="directory holding unsloth (put first on PYTHONPATH)")
    parser.add_argument("--jobs", type=int, default=1, help="workers at a time (--tiny only: a GPU runs one)")
    parser.add_argument("--worker-timeout", type=float, default=3600, help="seconds before a worker is killed")
    parser.add_argument("--tiny", action="store_true", help="tiny model and records on the CPU (smoke run)")
    parser.add_argument("--verbose", action="store_true", help="echo the workers' output")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kept-mlp", default=None, help=argparse.SUPPRESS)  # a worker's '@keep=N/gpu=G' suffix
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tiny = args.tiny
    # tiny: one decoder layer, or Qwen3.5's two (a DeltaNet and an attention layer)
    tiny_layers = 1 if args.model == "qwen3_8b" else 2
    defaults = dict(packing_tokens=16, rows=3, padded_batch=4, w1_batch=2, w1_seq=16, warmup=0, steps=2,
                    layers=tiny_layers) if tiny \
        else dict(packing_tokens=2048, rows=4, padded_batch=8, w1_batch=4, w1_seq=2048, warmup=2, steps=16)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.flatten_tokens = args.flatten_tokens or args.rows * args.packing_tokens
    args.epoch = args.epoch or tiny
    args.host_profile = False  # read by train_timing.measure
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    device = bench_device(args.tiny)
    if device is None:
        return 2
    variants = choose_variants(args)
    named = [(v, *split_variant(v)) for v in variants]
    if report_unknown("variants", [name for _, name, _, _ in named], VARIANTS):
        return 2
    bad = next((v for v, name, _, layers in named
                if ":" in v and (layers is None or not name.startswith("unsloth_lite"))), None)
    if bad:
        print(f"bench_packing.py: --variants {bad}: only the unsloth_lite variants take ':N', N the decoder "
              "layers left uncheckpointed", file=sys.stderr)
        return 2
    try:
        for _, name, kept_mlp, _ in named:
            kept_mlp_options(f"{name}@{kept_mlp}" if kept_mlp else name)
    except ValueError as exc:
        print(f"bench_packing.py: --variants {exc}", file=sys.stderr)
        return 2
    c = model_config(args)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    checkpoint = None
    if args.model == "qwen3_8b":
        name = "tiny_qwen3" if args.tiny else "qwen3_8b_shape"
        checkpoint = bench_train_setup.ensure_checkpoint(c, args.workdir, dtype, device, name)
    records = records_summary(record_lengths(**(TINY_RECORDS if args.tiny else W4_RECORDS)))
    print(f"records: {records}")
    jobs = args.jobs if args.tiny else 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda variant: run_variant(args, checkpoint, variant), variants))
    rows = summarise(results)
    columns = ["variant", "real_tokens_per_s", "x_fastest_peer", "x_lite_w1", "peak_gib", "peak_x_lowest_peer",
               "peak_reserved_gib", "load_gib", "real_fraction", "real_tokens", "target_tokens", "timed_steps",
               "micro_batches", "error"]
    print(markdown_table(rows, columns))
    for row in rows:
        if row.get("first_losses"):
            print(f"first losses {row['variant']}: {[round(x, 4) for x in row['first_losses']]}")
    workload = dict(model=args.model, config=c, records=records, packing_tokens=args.packing_tokens, rows=args.rows,
                    padded_batch=args.padded_batch, flatten_tokens=args.flatten_tokens, w1_batch=args.w1_batch,
                    w1_seq=args.w1_seq, warmup=args.warmup, steps=args.steps, epoch=args.epoch,
                    checkpoint=str(checkpoint) if checkpoint else None)
    packages = ("torch", "triton", "transformers", "peft", "bitsandbytes", "trl", "fla-core", "accelerate")
    write_json(args.out, dict(environment=environment(device, packages), workload=workload, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
