"""QLoRA training step at Qwen3.5-27B's shape (workload W2 of BENCHMARKS.md): tokens/s and peak memory of
Hugging Face + PEFT + bitsandbytes (with and without flash-linear-attention) and unsloth-lite, in one run.

    python scripts/bench_train_27b.py --out bench_train_w2.json                # on a GPU: W2
    python scripts/bench_train_27b.py --check-gradients --out w2_gradients.json  # patched vs HF vs float32
    python scripts/bench_train_27b.py --variants unsloth,unsloth_lite --profile  # + kernels and idle time a step
    python scripts/bench_train_27b.py --max-seq --variants unsloth_lite_nf4_embeddings --out w2_max_seq.json
    python scripts/bench_train_27b.py --variants hf --resume --out bench_train_w2.json  # the run, continued
    TRITON_INTERPRET=1 python scripts/bench_train_27b.py --tiny                # CPU smoke run

Model: `qwen3_5_text` as published for Qwen3.5-27B (hidden 5120, 64 layers as 16 x [3 Gated DeltaNet + 1 gated
full attention], 24 q / 4 KV heads of 256 with a quarter rotary, DeltaNet 16 key / 48 value heads of 128,
intermediate 17408, vocabulary 248,320, untied), random weights. A checkpoint of it is 54 GB, so each worker
builds it from its config directly on the GPU in bf16 (Hugging Face's initialisation) and quantises every
decoder linear to bitsandbytes NF4 in place (double quantisation, block 64, bf16 compute;
`unsloth_lite.models.quantize_linears_nf4`), one layer at a time; embeddings and lm_head stay bf16. LoRA r=16,
alpha=16, dropout 0 on q,k,v,o,gate,up,down (`--all-linear` adds the DeltaNet projections: in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, out_proj); gradient checkpointing; AdamW over the adapters. One step and
its timing as in `bench_train.py` (`measure`): batch 1 x `--seq` random tokens, labels = inputs, `--warmup`
steps then `--steps` timed ones.

Variants, each in its own process (flash-linear-attention is picked up by transformers at import):
- `hf_fla`: Hugging Face's Qwen3.5 with flash-linear-attention 0.6.0's kernels, its Hopper guard bypassed
  (triton < 3.7.1 miscompiles its gated backward on Hopper for some block configurations: timing only).
- `hf`: the same without flash-linear-attention (transformers' PyTorch delta rule and convolution).
- `unsloth_lite`: `patch_model` + `add_lora` + `enable_gradient_checkpointing(offload_to_cpu=True)`: every
  module on the fused path, the DeltaNet on our Triton kernels.
- `unsloth_lite_nf4_embeddings`: the same with the embedding and lm_head in NF4 too (`quantize_embeddings_nf4`:
  rows dequantised on lookup, lm_head tiles inside the fused loss).
- `unsloth_lite_host_embeddings`: the same with the bf16 input embedding in host memory
  (`offload_embeddings_to_host`: the GPU reads a batch's rows from the pinned table); with `nf4_head` in the name
  also the lm_head in NF4.
- `unsloth_lite_graphs`: the same with `cuda_graphs=True`.
- `unsloth_lite_kept_mlp`, `unsloth_lite_graphs_kept_mlp`, `unsloth_lite_host_embeddings_graphs_kept_mlp`,
  `unsloth_lite_nf4_embeddings_graphs_kept_mlp`, `unsloth_lite_host_embeddings_nf4_head_graphs_kept_mlp`: with
  `keep_mlp_preactivations=True` (each checkpoint keeps its MLP's gate and up outputs, offloaded with its input:
  the recomputation skips their products). A suffix `@keep=N/gpu=G` keeps them in N of the checkpointed layers
  only, spread evenly, G of those in GPU memory (`keep_mlp_preactivations=N`, `mlp_preactivations_on_gpu=G`), so
  one run compares several placements; `proj=P`: P of the checkpointed layers keep their token mixers' input
  projections' outputs in GPU memory (`keep_projection_outputs=P`); `sets=S`
  (with graphs) gives the graphed layers S sets of kept-tensor buffers (`layer_graphs.KEPT_SETS`, default 2),
  `lead=L` lets the host queue L offloads ahead (`checkpointing.MAX_PENDING_OFFLOADS`, default 2), `gather=0`
  has the host gather the host table's rows, not the GPU (`host_embeddings.DEVICE_GATHER`, default on), `res=0`
  runs the decoder layers' residual adds apart from their norms (`decoder_layer.FUSED_RESIDUALS`, default on),
  `join=0` adds the adapters' updates to the products' outputs instead of forming them in the products
  (`lora.ADAPTERS_IN_PRODUCTS`, default on).
- Any unsloth_lite variant with a suffix `:N` (after any `@...`): its last N decoder layers not checkpointed
  (`--uncheckpointed-layers N` for the unsuffixed ones), so one run compares several N.
- `unsloth`: Unsloth's `FastLanguageModel.from_pretrained(load_in_4bit=True)` + `get_peft_model` (the same
  targets, `use_gradient_checkpointing="unsloth"`), only where unsloth imports (from `--unsloth-site`). Unsloth
  loads from disk: the parent writes the random-weight checkpoint under `--workdir` first (reused when
  present), its decoder linears pre-quantised in the same NF4 format (`random_checkpoint.write_checkpoint_in_shards`:
  16 GB instead of 54). Its weights differ from the built ones, so its first loss is not compared.
Hugging Face's variants use its non-reentrant checkpointing with `enable_input_require_grads`.

`--resume` continues the run in `--out` where one command's time limit stopped it: on the same GPU (its UUID),
code, versions, model and settings (refused with one line otherwise), it keeps the rows and the measured matmul
rate, runs only the variants without a row, and computes the ratios over all of them.

`--max-seq`: per variant, the longest batch-1 sequence (a multiple of 256) that trains one step within
`--memory-cap-gib` (24): after loading, the allocator's cache is emptied and
`torch.cuda.set_per_process_memory_fraction` holds the process to the cap; the search is `bench_train.py`'s
(doubling from `--seq`, then bisection, at most `--max-probes` probes; running out of memory fails a probe).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from bench_common import (
    apply_module_settings,
    bench_device,
    drop_missing_unsloth,
    environment,
    host_link_gbps,
    kept_mlp_options,
    markdown_table,
    matmul_tflops,
    memory_peak_report,
    resumed_run,
    run_worker_process,
    uncheckpointed_suffix,
    worker_failure,
    write_json,
)
from bench_train import print_passes, worker_env
from bench_train_setup import SEQ_MULTIPLE, _checkpointed_layers, load_unsloth
from random_checkpoint import write_checkpoint_in_shards
from train_timing import _error, measure, one_step_probe, search_max_seq
from w2_flops import executed_flops_per_token, linear_params

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_TRAIN_27B_RESULT "
VARIANTS = (
    "hf_fla", "hf", "unsloth", "unsloth_lite", "unsloth_lite_nf4_embeddings", "unsloth_lite_host_embeddings",
    "unsloth_lite_graphs", "unsloth_lite_kept_mlp", "unsloth_lite_graphs_kept_mlp",
    "unsloth_lite_host_embeddings_graphs_kept_mlp", "unsloth_lite_nf4_embeddings_graphs_kept_mlp",
    "unsloth_lite_host_embeddings_nf4_head_graphs_kept_mlp",
)
TINY_VARIANTS = ("hf", "unsloth_lite")
ATTENTION_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
LORA_R, LORA_ALPHA, LR, SEED = 16, 16, 1e-4, 1234

W2 = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
)
# Every linear's input a multiple of 64: bitsandbytes' CPU kernels (the Hugging Face variants' path in --tiny)
# dequantise rows that split a 64-element block wrongly.
TINY = dict(
    W2, vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, max_position_embeddings=256,
)


def model_config(tiny: bool, layers: int | None) -> dict:
    """W2's config (or the tiny one), with `layers` decoder layers: every fourth full attention, or (tiny, for the
    interpreter's sake) every second."""
    c = dict(TINY if tiny else W2)
    if layers:
        c["num_hidden_layers"] = layers
    period = 2 if tiny else 4
    c["layer_types"] = ["full_attention" if (i + 1) % period == 0 else "linear_attention"
                        for i in range(c["num_hidden_layers"])]
    return c


def with_special_tokens(c: dict) -> dict:
    """`c` with the special token ids W1 has (the last three of the vocabulary): the stand-in tokenizer of a
    written checkpoint needs them."""
    return dict(c, pad_token_id=c["vocab_size"] - 3, eos_token_id=c["vocab_size"] - 1, bos_token_id=None)


def build_model(c: dict, device: torch.device, dtype: torch.dtype, quant_storage: torch.dtype = torch.uint8):
    """The random-weight model of config `c`, built on `device` in `dtype`, decoder linears quantised to NF4,
    packed as `quant_storage` (the compute dtype where FSDP shards them)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from unsloth_lite.models.quantize import quantize_linears_nf4

    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**c, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(default_dtype)
    model = quantize_linears_nf4(model, dtype, quant_storage=quant_storage)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the bf16 weights' blocks: reserved figures then describe training alone
    return model


def load(variant: str, c: dict, device: torch.device, dtype: torch.dtype, all_linear: bool,
         quant_storage: torch.dtype = torch.uint8, checkpoint: str | None = None, seq: int = 0,
         uncheckpointed_layers: int | None = None):
    if variant == "unsloth":
        return load_unsloth(checkpoint, device, dtype, seq, ATTENTION_MLP + DELTANET * all_linear)[0]
    if variant == "hf":
        sys.modules["fla"] = None  # transformers then binds its PyTorch delta rule
    elif variant == "hf_fla":
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.IS_NVIDIA_HOPPER = False  # the Hopper guard's switch (module docstring)
    model = build_model(c, device, dtype, quant_storage)
    targets = ATTENTION_MLP + DELTANET * all_linear
    torch.manual_seed(SEED)
    if variant.startswith("hf"):
        from peft import LoraConfig, get_peft_model

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.config.use_cache = False
        config = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                            bias="none", task_type="CAUSAL_LM")
        return get_peft_model(model, config)
    import unsloth_lite
    from unsloth_lite.training.checkpointing import enable_gradient_checkpointing

    if "host_embeddings" in variant:
        unsloth_lite.offload_embeddings_to_host(model)
    if "nf4_embeddings" in variant or "nf4_head" in variant:  # after the offload: the host table stays bf16
        unsloth_lite.quantize_embeddings_nf4(model)
    model = unsloth_lite.add_lora(unsloth_lite.patch_model(model), r=LORA_R, lora_alpha=LORA_ALPHA,
                                  target_modules=targets)
    enable_gradient_checkpointing(model, offload_to_cpu=device.type == "cuda", cuda_graphs="graphs" in variant,
                                  uncheckpointed_layers=uncheckpointed_layers or 0,
                                  **apply_module_settings(kept_mlp_options(variant)[1]))
    return model


def worker_main(args) -> int:
    device = torch.device("cpu" if args.tiny else "cuda", 0 if not args.tiny else None)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    c = model_config(args.tiny, args.layers)
    result = dict(variant=args.worker, seq=args.seq, layers=c["num_hidden_layers"], all_linear=args.all_linear)
    if args.worker == "check_gradients":
        try:
            from w2_gradients import check_gradients  # it imports this module: not at the top

            check_dtype = getattr(torch, args.check_dtype) if args.check_dtype else dtype
            result.update(check_gradients(c, device, check_dtype, args.seq))
        except (Exception, SystemExit) as error:
            traceback.print_exc()
            result.update(_error(error))
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    try:
        start = time.perf_counter()
        model = load(args.worker, c, device, dtype, args.all_linear, checkpoint=args.checkpoint, seq=args.seq,
                     uncheckpointed_layers=args.uncheckpointed_layers)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=LR)
        result.update(load_s=round(time.perf_counter() - start, 1), trainable_params=sum(p.numel() for p in params),
                      checkpointed_layers=_checkpointed_layers(model))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            result["load_gib"] = torch.cuda.memory_allocated(device) / 2**30
        if args.max_seq:
            result.update(max_seq_search(args, model, optimizer, device, c))
            print(RESULT_PREFIX + json.dumps(result), flush=True)
            return 0
        result.update(measure(args, model, optimizer, device, 1, args.seq, c["vocab_size"], args.warmup, args.steps,
                              profile=args.profile and device.type == "cuda"))
        if args.memory_report and device.type == "cuda":
            result["memory_report"] = memory_report(model, optimizer, device, args.seq, c["vocab_size"])
    except (Exception, SystemExit) as error:  # this variant's error, never a crash of the whole run
        traceback.print_exc()
        result.update(_error(error))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def max_seq_search(args, model, optimizer, device: torch.device, c: dict) -> dict:
    """The longest sequence that trains one step within --memory-cap-gib (module docstring)."""
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), device)
    probe = one_step_probe(args, model, optimizer, device, c["vocab_size"])
    ceiling = c["max_position_embeddings"] // SEQ_MULTIPLE * SEQ_MULTIPLE
    return dict(memory_cap_gib=args.memory_cap_gib, **search_max_seq(probe, args.seq, ceiling, args.max_probes))


def memory_report(model, optimizer, device: torch.device, seq: int, vocab: int) -> dict:
    """One more step with the allocator's history recorded: what is live at its peak, by allocation site."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(SEED)).to(device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return memory_peak_report(step, device)


def unsloth_checkpoint(args, device: torch.device) -> str:
    """The directory of the pre-quantised checkpoint Unsloth loads, written where missing (module docstring)."""
    c = with_special_tokens(model_config(args.tiny, args.layers))
    name = f"qwen3_5_27b_shape_nf4_{c['num_hidden_layers']}_layers"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    return str(write_checkpoint_in_shards("qwen3_5_27b", c, Path(args.workdir) / name, device, dtype, quantized=True))


def run_worker(args, variant: str, checkpoint: str | None = None) -> dict:
    """Runs one variant's worker (a ":N" suffix: its last N layers not checkpointed, else
    `--uncheckpointed-layers`); its result row, labelled with the variant as named, or an error row."""
    name, uncheckpointed = uncheckpointed_suffix(variant)
    uncheckpointed = args.uncheckpointed_layers if uncheckpointed is None else uncheckpointed
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--seq", str(args.seq),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--tiny"] * args.tiny + ["--all-linear"] * args.all_linear + ["--memory-report"] * args.memory_report
    cmd += ["--profile"] * args.profile
    cmd += ["--check-dtype", args.check_dtype] if args.check_dtype else []
    if args.max_seq:
        cmd += ["--max-seq", "--memory-cap-gib", str(args.memory_cap_gib), "--max-probes", str(args.max_probes)]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--uncheckpointed-layers", str(uncheckpointed)] if uncheckpointed else []
    cmd += ["--checkpoint", checkpoint] if checkpoint else []
    label = f"[{variant}]"
    print(f"{label} starting", flush=True)
    start = time.perf_counter()
    results, lines, returncode = run_worker_process(
        cmd, worker_env(variant, args), ROOT, RESULT_PREFIX, args.worker_timeout, label, args.verbose,
    )
    if results:
        result = dict(results[0], variant=variant)
    else:
        reason = worker_failure(returncode)
        result = dict(variant=variant, error=f"worker {reason}")
    if "error" in result and not args.verbose:
        print("\n".join(f"{label} {line}" for line in lines[-25:]), flush=True)
    print(f"{label} done in {time.perf_counter() - start:.0f} s: {result.get('error', 'ok')}", flush=True)
    return result


def summarise(rows: list[dict], seq: int, c: dict, all_linear: bool, offload: bool,
              peak_tflops: float | None = None) -> list[dict]:
    """Copies of the rows with tokens/s, the speed ratios to hf_fla and to Unsloth, the executed TFLOP/s (and
    their fraction of the run's matmul rate, HFU), and rounded memory."""
    rows = [dict(r) for r in rows]
    step = {r["variant"]: r["step_s"] for r in rows if r.get("step_s")}
    params = linear_params(c) if step else None  # a weightless model built once, not once a row
    for r in rows:
        if r.get("step_s"):
            r["tokens_per_s"] = round(seq / r["step_s"], 1)
            flops = executed_flops_per_token(r, c, seq, all_linear, offload, params)
            r["flops_per_token"] = flops
            r["executed_TFLOPs"] = round(flops * seq / r["step_s"] / 1e12, 1)
            if peak_tflops:
                r["HFU"] = round(r["executed_TFLOPs"] / peak_tflops, 3)
            for peer in ("hf_fla", "unsloth"):
                if peer in step:
                    r[f"vs_{peer}"] = round(step[peer] / r["step_s"], 3)
        for key in ("peak_gib", "peak_reserved_gib", "load_gib"):
            if key in r:
                r[key] = round(r[key], 2)
    return rows


def resumed_rows(args, env: dict, c: dict) -> tuple[list[dict], float | None]:
    """(rows without an error, matmul rate) of the run in `args.out`, if it was measured on this GPU from the same
    code and versions, model and settings (ValueError naming what differs otherwise)."""
    run = resumed_run(args.out, env, dict(config=c)) or dict(config=c)
    rows = [r for r in run.get("rows", []) if "error" not in r]
    for r in rows:
        for key, value in (("seq", args.seq), ("all_linear", args.all_linear)):
            if r.get(key) != value:
                raise ValueError(f"{args.out}: its {r['variant']} row has {key} {r.get(key)!r}, this run {value!r}")
    return rows, run.get("matmul_TFLOPs")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (2-layer tiny model, interpreter)")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny 32)")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (keeps the pattern)")
    parser.add_argument("--all-linear", action="store_true", help="LoRA on the DeltaNet projections too")
    parser.add_argument("--uncheckpointed-layers", type=int, default=0,
                        help="unsloth-lite variants: the last N decoder layers not checkpointed")
    parser.add_argument("--check-gradients", action="store_true",
                        help="instead of timing: first-step loss and LoRA gradients, patched vs Hugging Face's "
                             "PyTorch path, on one model")
    parser.add_argument("--check-dtype", choices=("bfloat16", "float32"), default=None,
                        help="--check-gradients: the compute dtype (default bfloat16, float32 with --tiny); float32 "
                             "compares the patched path with Hugging Face's without bf16's rounding noise")
    parser.add_argument("--memory-report", action="store_true",
                        help="one more step with the allocator's history: live blocks at its peak, by site")
    parser.add_argument("--profile", action="store_true",
                        help="one more step under torch.profiler: the kernels with the most device time, and the "
                             "device's time without a kernel, by the kernels around it; then one more with its "
                             "forward and backward profiled apart (GPU only)")
    parser.add_argument("--max-seq", action="store_true", help="longest batch-1 sequence within --memory-cap-gib")
    parser.add_argument("--memory-cap-gib", type=float, default=24.0, help="--max-seq: the GPU memory cap")
    parser.add_argument("--max-probes", type=int, default=8, help="--max-seq: probes per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker-timeout", type=float, default=900)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out on the same GPU and code: keep its rows and matmul rate, run "
                             "only the variants it lacks (a run longer than one command's time limit)")
    parser.add_argument("--workdir", default="/tmp/unsloth_lite_w1", help="where Unsloth's checkpoint is written")
    parser.add_argument("--unsloth-site", default=None, help="directory holding unsloth (put first on PYTHONPATH)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host-profile", action="store_true", help=argparse.SUPPRESS)  # read by `measure`
    args = parser.parse_args(argv)
    args.seq = args.seq or (32 if args.tiny else 2048)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.max_seq and args.tiny:
        print("--max-seq: needs a GPU (the memory cap is the CUDA allocator's); not with --tiny", file=sys.stderr)
        return 2
    device = bench_device(args.tiny)
    if device is None:
        return 1
    if args.check_gradients:
        row = run_worker(args, "check_gradients")
        print(json.dumps(row, indent=1))
        write_json(args.out, dict(environment=environment(device), config=model_config(args.tiny, args.layers),
                                  check_gradients=row))
        return 0 if "error" not in row else 1
    variants = args.variants.split(",") if args.variants else list(TINY_VARIANTS if args.tiny else VARIANTS)
    variants = drop_missing_unsloth(variants, bool(args.variants), args.unsloth_site)
    try:
        unknown = [v for v in variants if kept_mlp_options(uncheckpointed_suffix(v)[0])[0] not in VARIANTS]
    except ValueError as exc:
        print(f"bench_train_27b.py: --variants {exc}", file=sys.stderr)
        return 2
    suffixed = next((v for v in variants if uncheckpointed_suffix(v)[1] is not None
                     and not v.startswith("unsloth_lite")), None)
    if suffixed:
        print(f"bench_train_27b.py: --variants {suffixed}: only the unsloth_lite variants take ':N', N the decoder "
              "layers left uncheckpointed", file=sys.stderr)
        return 2
    if unknown:
        print(f"bench_train_27b.py: --variants: unknown {', '.join(unknown)}; expected among {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    packages = ("torch", "triton", "transformers", "peft", "bitsandbytes", "fla-core")
    env = environment(device, packages)
    c = model_config(args.tiny, args.layers)
    rows, peak_tflops = [], None
    if args.resume:
        try:
            rows, peak_tflops = resumed_rows(args, env, c)
        except ValueError as exc:
            print(f"bench_train_27b.py: --resume: {exc}", file=sys.stderr)
            return 2
        done = {r["variant"] for r in rows}
        variants = [v for v in variants if v not in done]
        print(f"resuming {args.out}: {len(done)} variants kept, running {','.join(variants) or 'none'}", flush=True)
    checkpoint = unsloth_checkpoint(args, device) if "unsloth" in variants else None
    if peak_tflops is None and not (args.tiny or args.max_seq):
        peak_tflops = matmul_tflops(device)
    if peak_tflops:
        print(f"bf16 matmul rate (8192^3, measured in this run): {peak_tflops:.1f} TFLOP/s", flush=True)
    if device.type == "cuda" and "host_link_GBps" not in env:
        env["host_link_GBps"] = host_link_gbps(device)  # what the kept MLP pre-activations travel over
        print(f"host link (pinned, 128 MiB copies): {env['host_link_GBps']} GB/s", flush=True)

    def summary():
        return summarise(rows, args.seq, c, args.all_linear, device.type == "cuda", peak_tflops)

    for variant in variants:  # the file is rewritten after each worker: a later one's crash loses nothing
        rows.append(run_worker(args, variant, checkpoint if variant == "unsloth" else None))
        write_json(args.out, dict(environment=env, config=c, matmul_TFLOPs=peak_tflops, rows=summary()))
    columns = ["variant", "seq", "layers", "tokens_per_s", "vs_hf_fla", "vs_unsloth", "executed_TFLOPs", "HFU",
               "peak_gib", "peak_reserved_gib", "load_gib", "first_loss", "warmup_s", "error"]
    if args.max_seq:
        columns = ["variant", "max_seq", "first_failure", "memory_cap_gib", "load_gib", "error"]
    print(markdown_table(summary(), columns))
    for row in rows:
        print_passes(row, row["variant"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
