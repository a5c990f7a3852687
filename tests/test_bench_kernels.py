"""The kernel benchmarks' tiny CPU modes run end to end, so the scripts cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size"
)


def run_tiny(script: str, *options: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    result = subprocess.run(
        [sys.executable, f"scripts/{script}", "--tiny", *options], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_bench_kernels_tiny_mode_runs():
    out = run_tiny("bench_kernels.py")
    for kernel in ("rms_norm", "swiglu", "apply_rope", "qk_norm_rope"):
        assert f"| {kernel} |" in out
    assert "| unsloth_lite |" in out and "| eager |" in out


def test_bench_sweep_tiny_mode_runs():
    out = run_tiny("bench_sweep.py")
    for kernel in ("apply_rope", "qk_norm_rope", "fused_linear_cross_entropy"):
        assert f"| {kernel} |" in out
    rope_forms = [f"{form}{tables}" for tables in ("", ", duplicated halves") for form in ("out of place", "in place")]
    for direction in (*rope_forms, "forward", "backward"):
        assert f"| {direction} |" in out
    # the launchers' own choice: 4 RoPE forms, 2 q/k-norm directions, 1 chunk height
    assert out.count("| yes |") == 7


def test_bench_deltanet_tiny_mode_runs():
    """Both of our variants (one or two value-sum kernels in the backward) timed, each within bf16's tolerance of
    the float64 recurrence."""
    out = run_tiny("bench_deltanet.py")
    for variant in ("unsloth_lite_split_values", "unsloth_lite_one_value_kernel"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {variant} | 70 |"))
        errors = [float(cell) for cell in row.split("|")[5:11]]
        assert len(errors) == 6 and all(0 <= e < 1e-2 for e in errors), row  # bf16 against float64


def test_deltanet_precision_tiny_mode_runs():
    """The emulation: fp32 products everywhere reach fp32 accuracy; truncated tf32 operands cost more than
    rounded ones; keeping one launcher's products in fp32 removes most of the error of what it computes."""
    out = run_tiny("deltanet_precision.py")
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("variant", "---"):
            rows[cells[0]] = [float(c) for c in cells[1:]]
    exact = next(errors for name, errors in rows.items() if "_backward_inputs" in name and "_prepare" in name)
    assert all(e < 1e-5 for e in exact), rows
    truncated, rounded = rows["tf32 truncate"], rows["tf32 round"]
    assert all(1e-4 < e < 1e-2 for e in truncated), rows
    assert sum(rounded) < 0.6 * sum(truncated), rows
    assert rows["tf32 truncate, fp32 in _output"][0] < 0.5 * truncated[0], rows  # o is the output kernel's
    own = rows["kernels' tf32_rounded, tf32 truncate"]  # rounded in the kernels: truncation then drops nothing
    assert all(abs(a - b) <= 0.05 * b for a, b in zip(own, rounded, strict=True)), rows
    halves = rows["kernels' bf16x3, tf32 truncate"]  # three bf16 products: about fp32's error
    assert all(e < 0.2 * r for e, r in zip(halves, rounded, strict=True)), rows
    assert all(1e-3 < e < 3e-3 for e in rows["bf16 floor"]), rows


def test_bench_nf4_matvec_tiny_mode_runs():
    out = run_tiny("bench_nf4_matvec.py", "--sweep", "--shapes", "qwen3_8b")
    assert "| unsloth_lite |" in out and "| dequantize_matmul |" in out and "| unsloth_lite_nested_absmax |" in out
    assert "| qwen3_8b | unsloth_lite |" in out and "| qwen3_8b | unsloth_lite_words |" in out
    assert "| out | in | chosen | 4x1024/4w | 8x512/4w |" in out
    assert "| 16x2048/8w split | words 4x1024/4w | words 8x512/4w |" in out
    assert ("| words 8x1024/4w split 2 | chosen, pairs | chosen, code_book | chosen, exact codes | chosen, 2 stages |"
            in out)
    assert "| chosen, words | chosen, words, 3 stages |" in out
    assert ("| model | out | in | rank | three_launches_us | gated_us | gated_vs_three | ms_per_token_saved "
            "| gated_gluon_us |") in out
    assert "| qwen3_8b | 128 | 64 | 16 |" in out  # the MLP input with adapters on gate and up
    assert "| model | group | widths | rank | separate_us | grouped_us | grouped_vs_separate |" in out
    assert "| qwen3_8b | attention | 64/32/32 | 16 |" in out


def test_bench_word_tiles_tiny_mode_runs(tmp_path):
    """Every launch of a decoding step that takes the word walk's tile, timed at each candidate, with the model's
    sums a token."""
    out = run_tiny("bench_word_tiles.py", "--shapes", "qwen3_8b", "--out", str(tmp_path / "tiles.json"))
    assert "| launch | per_token | shipped | 4x1024/4w | 8x512/4w |" in out
    for launch in ("| words o_proj ", "| words down_proj ", "| gated ", "| grouped attention "):
        assert launch in out, launch
    result = json.loads((tmp_path / "tiles.json").read_text())
    assert all(row["shipped"] > 0 and row["best"] for row in result["rows"]), result["rows"]
    totals = result["ms_per_token"][0]
    assert totals["model"] == "qwen3_8b" and 0 < totals["best per launch"] <= totals["shipped"]
    assert "nf4_matvec.WORD_TILES_WITHOUT_ADAPTERS entries" in out


def test_bench_word_tiles_with_adapters(tmp_path):
    """`--adapters R`: every launch with rank-R adapters (first products in the launch), the entries printed for
    `WORD_TILES`; a negative rank refused."""
    out = run_tiny("bench_word_tiles.py", "--shapes", "qwen3_8b", "--tiles", "8x512/4w", "--adapters", "4",
                   "--out", str(tmp_path / "tiles.json"))
    result = json.loads((tmp_path / "tiles.json").read_text())
    assert result["adapter_rank"] == 4 and all(row["shipped"] > 0 for row in result["rows"]), result["rows"]
    assert "nf4_matvec.WORD_TILES entries" in out
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    done = subprocess.run([sys.executable, "scripts/bench_word_tiles.py", "--tiny", "--adapters", "-1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--adapters -1" in done.stderr, done.stderr


def test_bench_word_tiles_chosen_tiles_and_stages(tmp_path):
    """`--tiles` and `--stages`: each named tile at each number of stages, beside the default tile; unknown tiles
    and stages refused by name."""
    out = run_tiny("bench_word_tiles.py", "--shapes", "qwen3_8b", "--tiles", "2x512/1w", "--stages", "2,3")
    assert "| launch | per_token | shipped | 2x512/1w, 2 stages | 2x512/1w |" in out
    for bad, message in ((("--tiles", "9x9/1w"), "unknown tiles"), (("--stages", "0"), "--stages")):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
        done = subprocess.run([sys.executable, "scripts/bench_word_tiles.py", "--tiny", *bad], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_bench_nf4_matvec_several_rows():
    out = run_tiny("bench_nf4_matvec.py", "--rows", "3", "--shapes", "qwen3_8b", "--variants",
                   "unsloth_lite,unsloth_lite_fp32_x")
    assert "3 row(s) of x" in out and "| qwen3_8b | unsloth_lite |" in out
    assert "| qwen3_8b | unsloth_lite_fp32_x |" in out
    assert "| qwen3_8b | attention | 64/32/32 | 16 |" in out


def test_bench_nf4_matvec_profile_shape():
    """`--profile-shape`: the product alone at one shape (for a profiler), untimed; a malformed shape refused by
    name in one line."""
    out = run_tiny("bench_nf4_matvec.py", "--profile-shape", "48x128")
    assert "profiled 48x128: 4 products over 2 weight copies" in out and "| variant |" not in out
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]), TRITON_INTERPRET="1")
    for bad in ("48x100", "48by128"):
        done = subprocess.run([sys.executable, "scripts/bench_nf4_matvec.py", "--tiny", "--profile-shape", bad],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--profile-shape" in done.stderr, done.stderr


def test_bench_nf4_matvec_sweep_of_the_chosen_tile():
    out = run_tiny("bench_nf4_matvec.py", "--sweep", "--sweep-chosen-tile", "--shapes", "qwen3_8b",
                   "--variants", "unsloth_lite")
    header = ("| out | in | chosen | chosen, pairs | chosen, code_book | chosen, exact codes | chosen, 2 stages | "
              "chosen, 3 stages | chosen, 4 stages | chosen, 6 stages | chosen, 3 stages, 16x512/8w | "
              "chosen, 3 stages, 4x1024/4w | "
              "chosen, words | chosen, words, 3 stages |")
    assert header in out
    assert "| 4x1024/4w |" not in out and "| words 8x512/4w |" not in out  # no other tile's column
    rows = [line.strip("|").split("|") for line in out.split(header)[1].splitlines()[2:] if line.startswith("|")]
    assert rows and all(float(cell) > 0 for row in rows for cell in row[2:]), out  # "chosen": the tile's time


def test_bench_dequantize_tiny_mode_runs():
    out = run_tiny("bench_dequantize.py", "--shapes", "qwen3_8b")
    for variant in ("unsloth_lite", "unsloth_lite_interleaved", "unsloth_lite_pairs"):
        assert f"| qwen3_8b | {variant} |" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "unsloth_lite" in line]
    assert all(float(row[4]) > 0 for row in rows if len(row) > 6), out  # us


def run_compiled(*options: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "scripts"), str(ROOT)])
    return subprocess.run([sys.executable, "scripts/kernel_resources.py", *options], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_kernel_resources_compiles_every_deltanet_kernel_for_hopper(tmp_path):
    """Every kernel of a DeltaNet forward and backward compiled for sm_90 with no GPU; a LAUNCH override reaches
    the launch it names and no other."""
    out = tmp_path / "resources.json"
    result = run_compiled("--tiny", "--launch", '{"values_warps": 8}', "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["kernel"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"_prepare_kernel", "_forward_states_kernel", "_output_kernel", "_backward_state_free_kernel",
                         "_backward_states_kernel", "_backward_key_products_kernel", "_backward_values_kernel",
                         "_backward_keys_kernel"}
    assert all(0 < row["registers"] <= 255 and row["stack_bytes"] >= 0 for row in rows.values()), rows
    assert rows["_prepare_kernel"]["shared_bytes"] > 0  # its products stage operands in shared memory
    assert rows["_backward_values_kernel"]["warps"] == 8  # shipped: 4
    assert rows["_backward_states_kernel"]["warps"] == 8  # as shipped


def test_kernel_resources_refuses_unknown_launch_settings():
    result = run_compiled("--tiny", "--launch", '{"value_warps": 4}')
    assert result.returncode == 2
    assert "unknown settings ['value_warps']" in result.stderr and "Traceback" not in result.stderr


def test_kernel_resources_counts_the_nf4_matvec_kernels_loops(tmp_path):
    """`--nf4-matvec`: the NF4 matrix-vector kernels compiled for sm_90 with no GPU, their loop found in the SASS;
    the word kernel decodes eight weights in fewer instructions than the blocked one (its reason to exist), the
    gate-and-up kernel on either walk fewer than the walk's own kernel (x converted once for both weights); with
    the register prefetch, the word kernel's loads go to registers, not to shared memory."""
    out = tmp_path / "matvec.json"
    result = run_compiled("--nf4-matvec", "--matvec-shapes", "4096x512", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["kernel"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"blocked", "words", "words_prefetch", "gated", "gated_words", "gated_words_prefetch"}
    assert all(0 < row["registers"] <= 255 and 0 < row["loop"] < row["instructions"] for row in rows.values()), rows
    assert rows["words"]["per_8_weights"] < 0.85 * rows["blocked"]["per_8_weights"], rows
    assert rows["gated"]["per_8_weights"] < rows["blocked"]["per_8_weights"], rows  # x decoded once for two
    assert rows["gated_words"]["per_8_weights"] < rows["words"]["per_8_weights"], rows
    for kernel in ("words", "gated_words"):
        assert rows[f"{kernel}_prefetch"]["shared_bytes"] < rows[kernel]["shared_bytes"], rows


def test_kernel_resources_refuses_a_matvec_shape_off_the_blocks():
    result = run_compiled("--nf4-matvec", "--matvec-shapes", "64x100")
    assert result.returncode == 2
    assert "expected OUTxIN" in result.stderr and "Traceback" not in result.stderr


def test_kernel_resources_compiles_the_decoding_kernels_for_hopper(tmp_path):
    """`--decode-kernels`: the decoding attention kernel compiled for sm_90 at W3's attention shapes without
    spills, the longer cache split over more programs; the DeltaNet's gated step at the 27B's shape; the norm with
    its adapters' first products at both models' hidden sizes."""
    out = tmp_path / "decode.json"
    result = run_compiled("--decode-kernels", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    attention = [row for row in rows if row["kernel"] == "decode_attention"]
    assert {(row["model"], row["cache"]) for row in attention} == {
        (model, cache) for model in ("qwen3_8b", "qwen3_5_27b") for cache in (256, 4096)}
    assert all(0 < row["registers"] <= 255 and row["stack_bytes"] == 0 for row in rows), rows
    assert all(row["shared_bytes"] > 0 for row in attention)  # its products stage operands in shared memory
    by_cache = {(row["model"], row["cache"]): row["splits"] for row in attention}
    assert all(by_cache[(model, 4096)] > by_cache[(model, 256)] for model in ("qwen3_8b", "qwen3_5_27b"))
    assert [row["kernel"] for row in rows].count("delta_rule_gated_step") == 1
    assert [row["kernel"] for row in rows].count("rms_norm_lora_down") == 2
