"""The training-step benchmark: its tiny CPU mode runs end to end through the parent/worker processes (so the
script cannot rot) and hf and unsloth-lite agree on the first-step loss; its FLOP accounting reproduces
BENCHMARKS.md's W1 figures; the --max-seq search finds the boundary."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    """The module of `scripts/<name>.py`."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module(name)


def bench_train():
    return script("bench_train")


def bench_train_setup():
    return script("bench_train_setup")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_train_tiny_mode_runs(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_train.py", "--tiny", "--workdir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for variant in ("hf", "unsloth_lite"):
        row = re.search(rf"^\| {variant} \| 1 \| 32 \| ([0-9.]+) \|", result.stdout, re.MULTILINE)
        assert row is not None, f"no row with numeric tokens/s for {variant}:\n{result.stdout}"
        assert float(row.group(1)) > 0
        assert f"first-step loss {variant} b1:" in result.stdout

    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"hf", "unsloth_lite"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["checkpointed_layers"] == 2  # gradient checkpointing is on for both, patched layers included
    hf, ours = rows["hf"]["first_loss"], rows["unsloth_lite"]["first_loss"]
    assert abs(ours - hf) / abs(hf) < 1e-3, (hf, ours)
    assert rows["unsloth_lite"]["loss_rel_diff"] < 1e-3


def test_flop_accounting_matches_benchmarks():
    setup = bench_train_setup()
    assert setup.total_params(setup.W1) == pytest.approx(8.19e9, rel=1e-3)
    assert setup.decoder_linear_params(setup.W1) == pytest.approx(6.95e9, rel=1e-3)
    flops = setup.flops_per_token(setup.W1, 2048)
    assert flops["lm_head"] == 4 * 4096 * 151936
    assert flops["attention"] == pytest.approx(2.7e9, rel=0.01)
    assert flops["total"] == pytest.approx(46.9e9, rel=1e-3)


def bench_train_27b():
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("bench_train_27b")


def test_w2_flop_accounting():
    """W2's executed FLOPs: the 27B's decoder linears (24.35B weights; the embeddings bring the model to its
    26.9B), three passes of them less what our recomputation skips, the lm_head twice, the attention."""
    b27 = bench_train_27b()
    flops = importlib.import_module("w2_flops")
    c = b27.model_config(tiny=False, layers=None)
    params = flops.linear_params(c)
    assert sum(params.values()) == pytest.approx(24.35e9, rel=1e-3)
    assert params["q_proj"] == 16 * 5120 * 2 * 24 * 256 and params["down_proj"] == 64 * 17408 * 5120
    assert flops.recompute_skipped("unsloth", False, True) == ()
    assert flops.recompute_skipped("unsloth_lite", True, True) == ("down_proj", "o_proj", "out_proj")
    assert flops.recompute_skipped("unsloth_lite", True, False) == ("down_proj",)
    assert flops.recompute_skipped("unsloth_lite_graphs_kept_mlp", False, True) == (
        "down_proj", "gate_proj", "up_proj", "o_proj")
    full = flops.flops_per_token(c, 2048)
    ours = flops.flops_per_token(c, 2048, ("down_proj", "o_proj"))
    assert full["total"] == pytest.approx(153.0e9, rel=1e-3) and ours["total"] == pytest.approx(140.6e9, rel=1e-3)
    assert full["decoder"] - ours["decoder"] == 2 * (params["down_proj"] + params["o_proj"])
    assert full["attention"] == 9 * 2048 * 24 * 256 * 16
    # 16 of the 64 layers keeping their MLP pre-activations: a quarter of the gate/up recomputation skipped
    kept_all = flops.flops_per_token(c, 2048, ("down_proj", "gate_proj", "up_proj", "o_proj"), params)["total"]
    row = dict(variant="unsloth_lite_graphs_kept_mlp@keep=16", checkpointed_layers=64)
    assert flops.executed_flops_per_token(row, c, 2048, False, True, params) == pytest.approx(
        ours["total"] + (kept_all - ours["total"]) / 4)


def _search(bt, fits, max_probes=8, seq=2048, crash=False):
    """The search over a probe that fits when `fits(seq)`, else runs out of memory (or, with `crash`, fails
    otherwise: None)."""
    def probe(s):
        return True if fits(s) else (None if crash else False)

    return bt.search_max_seq(probe, seq, 40960, max_probes)


def test_max_seq_search():
    bt = script("train_timing")
    found = _search(bt, lambda s: s <= 9000)
    assert [p["seq"] for p in found["probes"]] == [2048, 4096, 8192, 16384, 12288, 10240, 9216, 8704]
    assert (found["max_seq"], found["first_failure"]) == (8704, 9216)
    assert _search(bt, lambda s: s <= 9000, max_probes=20)["max_seq"] == 8960
    assert _search(bt, lambda s: s <= 1000)["max_seq"] == 768  # halving first
    everything = _search(bt, lambda s: True)
    assert everything["max_seq"] == 40960 and len(everything["probes"]) == 6
    assert _search(bt, lambda s: False)["max_seq"] is None
    crashed = _search(bt, lambda s: s <= 4096, crash=True)
    assert crashed["max_seq"] == 4096 and crashed["probes"][-1] == dict(seq=8192, ok=False)


def test_random_alpaca_records(tmp_path):
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    random_alpaca = importlib.import_module("random_alpaca")
    path = tmp_path / "alpaca.jsonl"
    assert random_alpaca.main([str(path), "--vocab", "300", "--records", "5", "--words", "41"]) == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 5
    for record in records:
        words = (record["instruction"] + " " + record["output"]).split()
        assert len(words) == 41 and record["input"] == ""
        assert all(w.startswith("t") and 0 <= int(w[1:]) < 297 for w in words)

    from unsloth_lite.training.data import load_records

    assert len(load_records(str(path))) == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_train_27b_tiny_mode_runs_and_resumes(tmp_path):
    """W2's script end to end on a tiny Qwen3.5 built in memory and quantised in place, in two runs: ours (its
    last layer not checkpointed, `:1`), then Hugging Face's resuming it (--resume keeps the rows in --out and runs
    only the variants it lacks). Both train and start from the same loss; a run measured on another machine is
    refused with one line."""
    out = tmp_path / "out.json"
    run = tiny_run("bench_train_27b.py", "--warmup", "1", "--steps", "1", "--profile", "--out", str(out))
    first = run("--variants", "unsloth_lite:1")
    assert first.returncode == 0, first.stdout + first.stderr
    kept = json.loads(out.read_text())["rows"][0]
    second = run("--variants", "hf,unsloth_lite:1", "--resume")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "1 variants kept, running hf" in second.stdout and "[unsloth_lite:1] starting" not in second.stdout
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"hf", "unsloth_lite:1"}
    rows["unsloth_lite"] = rows.pop("unsloth_lite:1")
    assert rows["unsloth_lite"]["step_s"] == kept["step_s"]
    for variant, row in rows.items():
        assert "error" not in row, f"{variant}: {row['error']}\n{second.stdout}"
        assert row["tokens_per_s"] > 0
    assert abs(rows["hf"]["first_loss"] - rows["unsloth_lite"]["first_loss"]) < 1e-3 * rows["hf"]["first_loss"]
    assert (rows["hf"]["checkpointed_layers"], rows["unsloth_lite"]["checkpointed_layers"]) == (2, 1)
    b27 = bench_train_27b()
    flops = importlib.import_module("w2_flops")
    c = b27.model_config(tiny=True, layers=None)
    assert rows["hf"]["flops_per_token"] == flops.flops_per_token(c, 32)["total"]
    no_offload = flops.flops_per_token(c, 32, ("down_proj",))["total"]
    assert rows["unsloth_lite"]["flops_per_token"] == no_offload
    assert all("executed_TFLOPs" in row and "HFU" not in row for row in rows.values())  # no matmul rate on a CPU

    run_file = json.loads(out.read_text())
    run_file["environment"]["machine"] = "another"
    out.write_text(json.dumps(run_file))
    refused = run("--variants", "hf", "--resume")
    assert refused.returncode == 2
    assert "--resume:" in refused.stderr and "machine 'another'" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_bench_train_27b_records_a_worker_timeout(tmp_path):
    """A worker past --worker-timeout is killed and becomes an error row: the other variants' results and the
    output file are not lost with it."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_train_27b.py", "--tiny", "--variants", "unsloth_lite", "--worker-timeout",
         "0.5", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r.get("error")) for r in rows] == [("unsloth_lite", "worker timed out")]


def tiny_run(script: str, *options):
    """A function running `scripts/<script> --tiny *options *more` in the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))

    def run(*more):
        return subprocess.run([sys.executable, f"scripts/{script}", "--tiny", *options, *more], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)

    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_train_27b_checks_gradients(tmp_path):
    """--check-gradients on the tiny Qwen3.5: the patched model's first-step loss and LoRA gradients equal
    Hugging Face's on the same 4-bit weights (built in bf16, computing in fp32: `--check-dtype float32`, as on the
    GPU; every linear's rows whole quantisation blocks), and both equal the same model's in float64."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_train_27b.py", "--tiny", "--check-gradients", "--check-dtype", "float32",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    row = json.loads(out.read_text())["check_gradients"]
    assert row["lora_grads"] == 20  # A and B of the DeltaNet layer's 3 MLP projections and the attention layer's 7
    assert row["loss_rel_diff"] < 1e-5 and row["grad_rel_err_max"] < 1e-4, row
    # both fp32 paths against the same model in float64: the reference in precision really ran, and agrees
    assert row["loss_rel_err"] < 1e-5 and row["reference_loss_rel_err"] < 1e-5, row
    assert 0 < row["precise_grad_rel_err_max"] < 1e-4 and 0 < row["reference_precise_grad_rel_err_max"] < 1e-4, row


def bench_generate():
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("bench_generate")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_generate_tiny_mode_runs_and_resumes(tmp_path):
    """W3's script end to end on both tiny shapes, in two runs: unsloth-lite's variant, then Hugging Face's
    resuming it (--resume keeps the rows in --out and runs only the (variant, shape) pairs it lacks, the ratios
    over all of them). Decoding is timed and the patched model's greedy tokens equal Hugging Face's on the same NF4
    weights; a resume with other settings is refused with one line."""
    out = tmp_path / "out.json"
    run = tiny_run("bench_generate.py", "--out", str(out))
    first = run("--variants", "unsloth_lite")
    assert first.returncode == 0, first.stdout + first.stderr
    kept = {r["shape"]: r for r in json.loads(out.read_text())["rows"]}
    second = run("--variants", "hf,unsloth_lite", "--resume")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "2 rows kept" in second.stdout and "[unsloth_lite] starting" not in second.stdout
    rows = {(r["shape"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(s, v) for s in ("qwen3_8b", "qwen3_5_27b") for v in ("hf", "unsloth_lite")}
    for key, row in rows.items():
        assert "error" not in row, f"{key}: {row['error']}\n{second.stdout}"
        assert row["new_tokens"] == 4 and row["decode_tokens_per_s"] > 0 and row["ttft_ms"] > 0, row
        assert 0 < row["bound_fraction"] < 1, row
    for shape in ("qwen3_8b", "qwen3_5_27b"):
        ours, theirs = rows[(shape, "unsloth_lite")], rows[(shape, "hf")]
        assert ours["same_tokens_as_hf"] == 4, ours
        assert ours["decode_tokens_per_s"] == kept[shape]["decode_tokens_per_s"]
        assert ours["vs_hf"] == round(ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 2)
    refused = run("--variants", "hf", "--resume", "--new-tokens", "3")
    assert refused.returncode == 2
    assert "--resume:" in refused.stderr and "new_tokens 4" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_generate_profile_names_are_file_names(tmp_path):
    """A variant with "@" settings profiles into one file of the directory, not into a directory of its own."""
    path = bench_generate().profile_path(str(tmp_path), "unsloth_lite_lora@lora_split=1/lora_pdl=1", "qwen3_8b")
    assert path.parent == tmp_path and path.name == "unsloth_lite_lora_lora_split_1_lora_pdl_1_qwen3_8b.txt"


def test_decode_bytes_per_token_match_benchmarks():
    """BENCHMARKS.md's W3 reads: 3.6 GB of NF4 decoder weights + 1.24 GB lm_head at the 8B shape (~870 tokens/s
    at 4.27 TB/s), 12.6 GB of NF4 at the 27B shape; LoRA r=16 adds its adapters."""
    bg = script("decode_shapes")
    w3b = bg.bytes_per_token("qwen3_8b", bg.shape_config("qwen3_8b", False), context=192)
    assert w3b["nf4_linears"] == pytest.approx(3.6e9, rel=0.01) and w3b["lm_head"] == 2 * 4096 * 151936
    assert 4270e9 / w3b["total"] == pytest.approx(870, rel=0.02)
    assert w3b["kv_cache"] == 36 * 2 * 8 * 128 * 2 * 192
    w3 = bg.bytes_per_token("qwen3_5_27b", bg.shape_config("qwen3_5_27b", False), context=192)
    assert w3["nf4_linears"] == pytest.approx(12.6e9, rel=0.01) and w3["deltanet_state"] > 0
    with_lora = bg.bytes_per_token("qwen3_5_27b", bg.shape_config("qwen3_5_27b", False), context=192, lora=True)
    assert with_lora["total"] - w3["total"] == with_lora["lora"] > 0


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "nf4"])
def test_bench_generate_writes_a_checkpoint_in_shards(tmp_path, quantized):
    """The checkpoint Unsloth loads at the 27B shape, written a shard at a time, loads whole; pre-quantised, its
    decoder linears load as bitsandbytes 4-bit layers whose weights decode to the drawn N(0, 0.02)."""
    from transformers import AutoModelForCausalLM

    from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference

    bg = bench_generate()
    c = bg.shape_config("qwen3_5_27b", tiny=True)
    write = script("random_checkpoint").write_checkpoint_in_shards
    path = write("qwen3_5_27b", c, tmp_path / "ckpt", torch.device("cpu"), torch.float32, shard_bytes=2**15,
                 quantized=quantized)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 2
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.model_type == "qwen3_5_text" and model.config.num_hidden_layers == 2
    assert float(model.lm_head.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
    layers = [m for n, m in model.named_modules() if n.endswith(("q_proj", "in_proj_qkv", "down_proj"))]
    assert {type(m).__name__ for m in layers} == ({"Linear4bit"} if quantized else {"Linear"})
    if quantized:
        for layer in layers:
            weight = dequantize_nf4_reference(layer.weight.data, layer.weight.quant_state)
            assert layer.weight.quant_state.nested and float(weight.std()) == pytest.approx(0.02, rel=0.1)


def bench_packing():
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("bench_packing")


def test_variant_suffixes_name_checkpointing_options(monkeypatch):
    """`@keep=N/gpu=G` (kept MLP pre-activations in N layers, G on the GPU) and `:L` (uncheckpointed layers)."""
    bp = bench_packing()
    from bench_common import kept_mlp_options

    assert kept_mlp_options("unsloth_lite_kept_mlp@keep=48/gpu=8") == (
        "unsloth_lite_kept_mlp", {"keep_mlp_preactivations": 48, "mlp_preactivations_on_gpu": 8})
    assert kept_mlp_options("unsloth_lite_graphs_kept_mlp") == (
        "unsloth_lite_graphs_kept_mlp", {"keep_mlp_preactivations": True})
    assert kept_mlp_options("unsloth_lite_kept_mlp@gpu=4") == (
        "unsloth_lite_kept_mlp", {"keep_mlp_preactivations": True, "mlp_preactivations_on_gpu": 4})
    assert kept_mlp_options("unsloth") == ("unsloth", {})
    name, options = kept_mlp_options("unsloth_lite_graphs_kept_mlp@sets=3/lead=4/gather=1/res=0")
    assert options == {"keep_mlp_preactivations": True, "kept_sets": 3, "offload_lead": 4, "device_gather": 1,
                       "fused_residuals": 0}
    from bench_common import apply_module_settings

    from unsloth_lite.models import decoder_layer, host_embeddings
    from unsloth_lite.training import checkpointing, layer_graphs

    monkeypatch.setattr(layer_graphs, "KEPT_SETS", layer_graphs.KEPT_SETS)  # restored after the test
    monkeypatch.setattr(checkpointing, "MAX_PENDING_OFFLOADS", checkpointing.MAX_PENDING_OFFLOADS)
    monkeypatch.setattr(host_embeddings, "DEVICE_GATHER", host_embeddings.DEVICE_GATHER)
    monkeypatch.setattr(decoder_layer, "FUSED_RESIDUALS", decoder_layer.FUSED_RESIDUALS)
    assert apply_module_settings(options) == {"keep_mlp_preactivations": True}
    assert (layer_graphs.KEPT_SETS, checkpointing.MAX_PENDING_OFFLOADS, host_embeddings.DEVICE_GATHER) == (3, 4, True)
    assert decoder_layer.FUSED_RESIDUALS is False
    with pytest.raises(ValueError, match="kept_sets=0"):
        apply_module_settings({"kept_sets": 0})
    for bad in ("unsloth_lite@keep=4", "unsloth_lite_kept_mlp@keep=four", "unsloth_lite_kept_mlp@layers=4"):
        with pytest.raises(ValueError, match="@keep=N/gpu=G"):
            kept_mlp_options(bad)
    assert bp.split_variant("unsloth_lite_kept_mlp@keep=24/gpu=2:8") == ("unsloth_lite_kept_mlp", "keep=24/gpu=2", 8)
    assert bp.split_variant("unsloth_lite:8") == ("unsloth_lite", "", 8)
    assert bp.split_variant("hf_padded") == ("hf_padded", "", None)
    from bench_common import uncheckpointed_suffix

    assert uncheckpointed_suffix("unsloth_lite_graphs_kept_mlp@gpu=6:4") == ("unsloth_lite_graphs_kept_mlp@gpu=6", 4)
    assert uncheckpointed_suffix("unsloth") == ("unsloth", None)


def test_w4_records_and_token_counts():
    """W4's records as BENCHMARKS.md defines them, and every micro-batching counting the same real tokens and
    trained targets for the same records."""
    bench_packing()  # puts scripts/ on the path
    bp = importlib.import_module("w4_records")
    lengths = bp.record_lengths(**bp.W4_RECORDS)
    assert len(lengths) == 4096 and lengths.min() == 32 and lengths.max() == 2048
    groups = lengths.reshape(-1, 8)
    assert round(lengths.sum() / (8 * groups.max(axis=1)).sum(), 2) == 0.39  # "39% real tokens" padded by 8

    records = bp.make_records(bp.TINY_RECORDS, vocab=257)
    for record in records:
        prompt = len(record["input_ids"]) // 3
        assert record["labels"][:prompt] == [-100] * prompt
        assert record["labels"][prompt:] == record["input_ids"][prompt:]
        assert max(record["input_ids"]) < 257 - bp.SPECIAL_IDS  # never the padding id
    pad_id = 254
    real = sum(len(r["input_ids"]) for r in records)
    targets = sum(len(r["input_ids"]) - len(r["input_ids"]) // 3 for r in records)
    batchings = {
        "padded": bp.padded_batches(records, 4, pad_id),
        "flattened": bp.flattened_batches(records, 48, boundary_kwargs=False),
        "packed": bp.packed_batches(records, 16, 3, pad_id),
    }
    for name, batches in batchings.items():
        counts = [bp.token_counts(batch, pad_id) for batch in batches]
        assert sum(c["real_tokens"] for c in counts) == real, name
        assert sum(c["target_tokens"] for c in counts) == targets, name
    assert sum(b["input_ids"].numel() for b in batchings["padded"]) > real  # padding is not counted as real
    assert all(b["input_ids"].shape[1] <= 48 for b in batchings["flattened"][:-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_packing_tiny_mode_runs(tmp_path):
    """W4's script end to end on the tiny model: every variant trains a whole epoch of the same records, and
    counts the same real tokens and targets for them; ours with its last layer not checkpointed, and (":0") with
    every layer checkpointed in the same run; the kept MLP variant with one of the two layers keeping them."""
    bp = bench_packing()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_packing.py", "--tiny", "--jobs", "4", "--workdir", str(tmp_path),
         "--uncheckpointed-layers", "1", "--out", str(out),
         "--variants",
         "hf_padded,hf_flatten,unsloth_lite,unsloth_lite_w1,unsloth_lite:0,unsloth_lite_kept_mlp@keep=1/gpu=1:0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    kept = "unsloth_lite_kept_mlp@keep=1/gpu=1:0"
    assert set(rows) == {"hf_padded", "hf_flatten", "unsloth_lite", "unsloth_lite_w1", "unsloth_lite:0", kept}
    for variant, row in rows.items():
        assert "error" not in row, f"{variant}: {row['error']}\n{result.stdout}"
        assert row["real_tokens_per_s"] > 0
    lengths = bp.record_lengths(**bp.TINY_RECORDS)
    for variant in ("hf_padded", "hf_flatten", "unsloth_lite", "unsloth_lite:0", kept):
        assert rows[variant]["real_tokens"] == lengths.sum(), variant
        assert rows[variant]["target_tokens"] == (lengths - lengths // 3).sum(), variant
    assert rows["hf_padded"]["tokens"] > rows["hf_padded"]["real_tokens"]
    layers = rows["hf_padded"]["checkpointed_layers"]  # Hugging Face checkpoints all; ours keeps the last one out
    assert rows["unsloth_lite"]["checkpointed_layers"] == rows["unsloth_lite_w1"]["checkpointed_layers"] == layers - 1
    every_layer = rows["unsloth_lite:0"]
    assert every_layer["checkpointed_layers"] == layers and every_layer["uncheckpointed_layers"] == 0
    assert rows["unsloth_lite:0"]["first_losses"] == rows["unsloth_lite"]["first_losses"]  # the same steps
    assert rows["hf_flatten"]["real_fraction"] == 1.0
    assert rows["unsloth_lite_w1"]["real_tokens"] == 2 * 16 * 2  # batch 2 x 16 tokens, two steps
    assert rows["unsloth_lite_w1"]["x_lite_w1"] == 1.0
    rates = {variant: row["real_tokens_per_s"] for variant, row in rows.items()}  # time_s is rounded to 10 ms
    fastest_peer = max(rates["hf_padded"], rates["hf_flatten"])
    # the script rounds rates to 0.1 token/s and ratios to three decimals: the ratio recomputed from the rounded
    # rates carries their relative rounding error on top of the ratio's own rounding (the two add up)
    expected = rates["unsloth_lite"] / fastest_peer
    rounding = 0.05 / rates["unsloth_lite"] + 0.05 / fastest_peer
    assert abs(rows["unsloth_lite"]["x_fastest_peer"] - expected) <= 5e-4 + expected * (rounding + 1e-3)


def bench_distributed():
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("bench_distributed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_distributed_tiny_mode_runs(tmp_path):
    """The multi-GPU benchmark on 1 and 2 CPU processes (gloo): every variant trains under torchrun, each process
    on its own rows; rank 0's first loss is the same model's on the same rows whatever the process count (DDP,
    DDP on W4's packed micro-batches, FSDP2 over the NF4 base, Hugging Face's FSDP-QLoRA); W4's processes time
    disjoint micro-batches and count their real tokens as bench_packing does; the ratio columns and bars are
    filled in."""
    bd, bp = bench_distributed(), bench_packing()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "scripts"), str(ROOT)])
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_distributed.py", "--tiny", "--workdir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(out.read_text())
    rows = {(r["variant"], r["processes"]): r for r in payload["rows"]}
    variants = ("dp_w1", "dp_w4", "fsdp_w2", "fsdp_w2_hf")
    assert set(rows) == {(v, n) for v in variants for n in (1, 2)}
    for key, row in rows.items():
        assert "error" not in row, f"{key}: {row['error']}\n{result.stdout}"
        processes = key[1]
        assert len(row["tokens_per_s_per_rank"]) == len(row["peak_gib_per_rank"]) == processes, row
        assert row["tokens_per_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(sum(row["tokens_per_s_per_rank"]), abs=0.2)
        assert all(peak > 0 for peak in row["peak_gib_per_rank"]), row
    for variant in variants:
        one, two = rows[(variant, 1)], rows[(variant, 2)]
        assert two["first_loss"] == pytest.approx(one["first_loss"], rel=1e-5), variant
        assert two["first_loss_per_rank"][1] != two["first_loss_per_rank"][0], variant  # each its own rows
        ratio = two["tokens_per_s"] / one["tokens_per_s"]
        assert two["tokens_vs_1_process"] == pytest.approx(ratio, rel=1e-2, abs=5e-4)  # rounded to 3 decimals
    fsdp, peer = rows[("fsdp_w2", 2)], rows[("fsdp_w2_hf", 2)]
    assert fsdp["tokens_vs_hf"] == pytest.approx(fsdp["tokens_per_s"] / peer["tokens_per_s"], rel=1e-2, abs=5e-4)

    c = bench_train_setup().TINY
    packed = bp.packed_batches(bp.make_records(bp.TINY_RECORDS, c["vocab_size"]), bd.TINY_W4_ROW_TOKENS,
                               bd.TINY_W4_ROWS, c["pad_token_id"])
    for processes in (1, 2):
        row = rows[("dp_w4", processes)]
        timed = row["timed_micro_batches_per_rank"]
        assert len(timed) == processes and all(len(indices) == 1 for indices in timed), row  # --steps 1
        for indices, real_tokens in zip(timed, row["real_tokens_per_rank"], strict=True):
            assert real_tokens == sum(bp.token_counts(packed[i], c["pad_token_id"])["real_tokens"] for i in indices)
            assert 0 < real_tokens < len(indices) * bd.TINY_W4_ROWS * bd.TINY_W4_ROW_TOKENS  # padding not counted
    two = rows[("dp_w4", 2)]["timed_micro_batches_per_rank"]
    assert set(two[0]).isdisjoint(two[1]), two

    bars = {bar["bar"]: bar for bar in payload["bars"]}
    assert set(bars) == {"dp_w1 tokens_vs_1_process >= 1.9", "dp_w4 tokens_vs_1_process >= 1.9",
                         "fsdp_w2 peak_vs_1_process <= 0.6", "fsdp_w2 tokens_vs_1_process >= 1.6",
                         "fsdp_w2 tokens_vs_hf >= 1.5"}
    assert all(bar["processes"] == 2 and isinstance(bar["met"], bool) for bar in bars.values()), bars


def test_bench_distributed_ratios_over_merged_runs(tmp_path):
    """Rows of an earlier output join a run's (their stale ratios dropped, this run's rows kept where both
    measured a variant), and the ratios and bars are computed over them all."""
    bd = bench_distributed()

    def row(variant, processes, tokens_per_s, peak_gib):
        return dict(variant=variant, processes=processes, tokens_per_s=tokens_per_s, peak_gib=peak_gib)

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(dict(environment={}, rows=[
        dict(row("fsdp_w2_hf", 1, 100.0, 20.0), tokens_vs_hf=9.9),
        row("fsdp_w2_hf", 2, 150.0, 12.0),
        row("fsdp_w2", 2, 1.0, 1.0),  # measured again below: this run's row wins
    ])))
    rows = bd.merge_rows([row("dp_w1", 1, 1000.0, 8.0), row("dp_w1", 2, 1950.0, 8.0), row("fsdp_w2", 1, 150.0, 18.0),
                          row("fsdp_w2", 2, 240.0, 9.9), row("dp_w4", 2, 1500.0, 8.5), row("dp_w4", 1, 800.0, 8.5)],
                         [str(earlier)])
    assert [(r["variant"], r["processes"]) for r in rows] == [
        ("dp_w1", 1), ("dp_w1", 2), ("dp_w4", 1), ("dp_w4", 2), ("fsdp_w2", 1), ("fsdp_w2", 2), ("fsdp_w2_hf", 1),
        ("fsdp_w2_hf", 2)]
    bd.add_ratios(rows)
    by_key = {(r["variant"], r["processes"]): r for r in rows}
    assert by_key[("dp_w1", 2)]["tokens_vs_1_process"] == 1.95
    assert by_key[("fsdp_w2", 2)]["tokens_vs_1_process"] == 1.6
    assert by_key[("fsdp_w2", 2)]["peak_vs_1_process"] == 0.55
    assert by_key[("fsdp_w2", 2)]["tokens_vs_hf"] == 1.6
    assert by_key[("fsdp_w2", 1)]["tokens_vs_hf"] == 1.5
    assert "tokens_vs_hf" not in by_key[("fsdp_w2_hf", 1)]
    bars = {bar["bar"]: (bar["value"], bar["met"]) for bar in bd.check_bars(rows, 2)}
    assert bars == {"dp_w1 tokens_vs_1_process >= 1.9": (1.95, True),
                    "dp_w4 tokens_vs_1_process >= 1.9": (1.875, False),
                    "fsdp_w2 peak_vs_1_process <= 0.6": (0.55, True), "fsdp_w2 tokens_vs_1_process >= 1.6": (1.6, True),
                    "fsdp_w2 tokens_vs_hf >= 1.5": (1.6, True)}
    missing = {bar["bar"]: bar["met"] for bar in bd.check_bars(rows[:1], 2)}
    assert set(missing.values()) == {None}


def test_bench_generate_variant_settings():
    """An unsloth-lite variant's "@" settings: parsed, set in the worker's modules, refused in one line when
    unknown or out of range; a suffixed adapter variant's LoRA cost is against the same suffix."""
    bg = bench_generate()
    assert bg.split_variant("unsloth_lite@stages=3/lora_stages=2/flat=0") == (
        "unsloth_lite", {"stages": 3, "lora_stages": 2, "flat": 0})
    assert bg.split_variant("unsloth_lite_lora@adapted=10/flat=0") == ("unsloth_lite_lora", {"adapted": 10, "flat": 0})
    assert bg.split_variant("unsloth_lite@norms_skipped=1") == ("unsloth_lite", {"norms_skipped": 1})
    for bad in ("unsloth_lite@stages=0", "unsloth_lite@flat=2", "unsloth_lite@x=1", "hf@pdl=0", "other",
                "unsloth_lite@adapted=2", "unsloth_lite_lora@adapted=16", "unsloth_lite_lora@adapted=0",
                "unsloth_lite@norms_skipped=0", "unsloth_lite_lora@norms_skipped=1"):
        with pytest.raises(ValueError):
            bg.split_variant(bad)
    from unsloth_lite.kernels import lora_down, nf4_matvec

    saved = nf4_matvec.PIPELINE_STAGES, nf4_matvec.FLAT_ABSMAX, lora_down.PIPELINE_STAGES
    try:
        bg.set_module_settings({"stages": 3, "flat": 0, "lora_stages": 2}, bg.DECODE_SETTINGS)
        assert (nf4_matvec.PIPELINE_STAGES, nf4_matvec.FLAT_ABSMAX, lora_down.PIPELINE_STAGES) == (3, False, 2)
    finally:
        nf4_matvec.PIPELINE_STAGES, nf4_matvec.FLAT_ABSMAX, lora_down.PIPELINE_STAGES = saved
    rows = [dict(variant=v, shape="qwen3_8b", decode_tokens_per_s=speed) for v, speed in
            (("unsloth_lite@stages=3", 100.0), ("unsloth_lite_lora@stages=3", 90.0), ("unsloth_lite_lora", 80.0),
             ("unsloth_lite_lora@adapted=2/stages=3", 95.0))]
    bg.summarise(rows, 4270.0, 128, 128, tiny=False)
    assert rows[1]["lora_cost"] == 0.1 and "lora_cost" not in rows[2]  # no unsloth_lite row without a suffix
    assert rows[3]["lora_cost"] == 0.05  # against unsloth_lite@stages=3: `adapted` is not the base's setting
    assert rows[1]["gb_per_token"] == rows[2]["gb_per_token"] > rows[0]["gb_per_token"]  # the adapters' bytes


def test_bench_generate_summary_keeps_error_rows_and_graph_timing_restores_replay():
    """A variant that failed (no timings) is summarised as it is; the replay timing patches CUDA graphs' replay
    for one generation only, and reports nothing where no graph was replayed."""
    bg = bench_generate()
    rows = [dict(variant="unsloth_lite", shape="qwen3_8b", error="worker: 1"),
            dict(variant="unsloth_lite_lora", shape="qwen3_8b", decode_tokens_per_s=100.123, ttft_ms=80.04,
                 graph_step_ms=7.12345, host_gap_ms=2.87655),
            dict(variant="hf", shape="qwen3_8b", decode_tokens_per_s=20.0),
            dict(variant="unsloth_lite", shape="qwen3_5_27b", decode_tokens_per_s=50.0)]
    bg.summarise(rows, 4270.0, 128, 128, tiny=False)
    assert rows[0]["error"] == "worker: 1" and "decode_tokens_per_s" not in rows[0]
    assert rows[1]["vs_hf"] == 5.01 and "vs_unsloth" not in rows[1] and "lora_cost" not in rows[1]
    assert "vs_hf" not in rows[2] and "vs_hf" not in rows[3]  # a peer of another shape is no peer
    assert rows[1]["ttft_ms"] == 80.0 and rows[1]["graph_step_ms"] == 7.123 and rows[1]["host_gap_ms"] == 2.877
    replay = torch.cuda.CUDAGraph.replay
    calls = []
    assert bg.graph_step_ms(lambda: calls.append(torch.cuda.CUDAGraph.replay), torch.device("cpu")) is None
    assert calls and calls[0] is not replay and torch.cuda.CUDAGraph.replay is replay
