#!/usr/bin/env bash
# Every GPU check and benchmark behind docs/benchmarks.md, in one go, logs and JSON under OUT_DIR.
#   bash scripts/run_benchmarks.sh OUT_DIR [UNSLOTH_SITE]
# Needs a CUDA machine with the package's dependencies plus liger-kernel, cut-cross-entropy and bitsandbytes;
# UNSLOTH_SITE is a directory holding Unsloth (the W1 peer), put first on the workers' PYTHONPATH.
set -u
out=${1:?usage: run_benchmarks.sh OUT_DIR [UNSLOTH_SITE]}
unsloth_site=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME COMMAND...: runs it, keeps its output, reports its exit status
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $?"
}

step tests python -m pytest -q -n 8 -p no:cacheprovider tests
step kernels python scripts/bench_kernels.py --out "$out/bench_kernels.json"
step sweep python scripts/bench_sweep.py --out "$out/bench_sweep.json"
step loss python scripts/bench_loss.py --out "$out/bench_loss.json"
step dequantize python scripts/bench_dequantize.py --out "$out/bench_dequantize.json"
step train python scripts/bench_train.py ${unsloth_site:+--unsloth-site "$unsloth_site"} --out "$out/bench_train.json"
step packing python scripts/bench_packing.py ${unsloth_site:+--unsloth-site "$unsloth_site"} --epoch \
    --out "$out/bench_packing_w4.json"
step max_seq_ours python scripts/bench_train.py --max-seq --variants unsloth_lite --seq 16384 \
    --out "$out/bench_train_maxseq_unsloth_lite.json"
step max_seq_hf python scripts/bench_train.py --max-seq --variants hf --seq 8192 \
    --out "$out/bench_train_maxseq_hf.json"
checkpoint=$(ls -d /tmp/unsloth_lite_w1/qwen3_8b_shape-* | head -1)
step data python scripts/random_alpaca.py /tmp/alpaca.jsonl --vocab 151936 --records 256 --words 2400
step recipe python -m unsloth_lite.cli --recipe qlora_qwen3_8b.yaml "model.name_or_path=$checkpoint" \
    data.path=/tmp/alpaca.jsonl training.max_steps=10 training.logging_steps=2 training.save_strategy=no \
    training.report_to=none training.output_dir=/tmp/qlora_qwen3_8b
cp /tmp/qlora_qwen3_8b/train_summary.json /tmp/qlora_qwen3_8b/trainer_state.json "$out/" 2>/dev/null
step generate_cli python scripts/generate.py --model "$checkpoint" --adapter /tmp/qlora_qwen3_8b \
    --prompt "t1 t2 t3 t4" --max-new-tokens 64
step generate python scripts/bench_generate.py ${unsloth_site:+--unsloth-site "$unsloth_site"} --measure-bandwidth \
    --out "$out/bench_generate.json"
# Qwen3.5-27B: the DeltaNet (K2), the training step (W2) against every peer, its gradients against Hugging Face
# and float32, the longest sequence within 24 GiB, LoRA on every linear, and the recipe through the CLI on the
# pre-quantised checkpoint that W2 writes for Unsloth.
step k2 python scripts/bench_deltanet.py --profile --out "$out/bench_deltanet.json"
step w2 python scripts/bench_train_27b.py ${unsloth_site:+--unsloth-site "$unsloth_site"} --profile \
    --out "$out/bench_train_w2.json"
step w2_gradients python scripts/bench_train_27b.py --check-gradients --out "$out/bench_train_w2_gradients.json"
step w2_max_seq python scripts/bench_train_27b.py --max-seq --seq 32768 --variants unsloth_lite_nf4_embeddings \
    --out "$out/bench_train_w2_maxseq.json"
step w2_all_linear python scripts/bench_train_27b.py --variants unsloth_lite --all-linear \
    --out "$out/bench_train_w2_lora_all.json"
checkpoint_27b=$(python -c "import sys; sys.path.insert(0, 'scripts'); import torch, bench_train_27b as b; \
print(b.unsloth_checkpoint(b.parse_args([]), torch.device('cuda')))" | tail -1)
step data_27b python scripts/random_alpaca.py /tmp/alpaca_27b.jsonl --vocab 248320 --records 64 --words 2400
step recipe_27b python -m unsloth_lite.cli --recipe qlora_qwen27b.yaml "model.name_or_path=$checkpoint_27b" \
    data.path=/tmp/alpaca_27b.jsonl training.max_steps=10 training.logging_steps=1 training.save_strategy=no \
    training.report_to=none training.output_dir=/tmp/qlora_qwen27b
cp /tmp/qlora_qwen27b/train_summary.json "$out/train_summary_27b.json" 2>/dev/null
