"""`nf4_matvec_gluon` (the word walk in Gluon, a measurement kernel): compiled for sm_90 on any machine (Gluon has
no interpreter), its resources against the Triton word kernel's; on a GPU against the dequantised product in
float64 and against the word kernel; what it refuses; the benchmark's variants skipped where it does not run."""

import json

import pytest
import torch
from helpers import TOLERANCE, assert_close
from test_bench_kernels import run_compiled, run_tiny
from test_dequantize_nf4 import quantize
from test_nf4_matvec import float64_reference

from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.nf4_matvec_gluon import gluon_matvec_supported, nf4_matvec_gluon, step_weights


def test_gluon_walk_compiles_for_hopper_without_shared_memory_in_its_loop(tmp_path):
    """Offline for sm_90: no spills, no shared memory but the final reduction's (the word kernel stages every
    tile's words, absmax and x there), fewer loop instructions per eight weights than the word kernel."""
    out = tmp_path / "resources.json"
    result = run_compiled("--nf4-matvec", "--matvec-shapes", f"64x{step_weights()}", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["kernel"]: row for row in json.loads(out.read_text())["rows"]}
    gluon, words = rows["words_gluon"], rows["words"]
    assert 0 < gluon["registers"] <= 255 and gluon["stack_bytes"] == 0, gluon
    assert gluon["shared_bytes"] <= 1024 < words["shared_bytes"], rows
    assert gluon["per_8_weights"] < words["per_8_weights"], rows


def test_gluon_walk_refuses_what_it_does_not_take():
    weight = quantize((64, step_weights()), torch.bfloat16, True, 64, "cpu")
    x = torch.randn(1, step_weights(), dtype=torch.bfloat16)
    assert not gluon_matvec_supported(x, weight)  # not on a CUDA device
    with pytest.raises(ValueError, match="one bf16 row on a CUDA device"):
        nf4_matvec_gluon(x, weight)
    with pytest.raises(ValueError, match="words_per_thread must be"):
        nf4_matvec_gluon(x, weight, 3)


def test_bench_nf4_matvec_skips_the_gluon_walk_where_it_does_not_run():
    out = run_tiny("bench_nf4_matvec.py", "--shapes", "qwen3_8b", "--variants",
                   "unsloth_lite,unsloth_lite_gluon,unsloth_lite_no_pdl")
    assert "| qwen3_8b | unsloth_lite_no_pdl |" in out
    assert "unsloth_lite_gluon |" not in out


@pytest.mark.gpu
@pytest.mark.parametrize("words_per_thread", [4, 2])
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (4096, 12288), (12288, 4096)], ids=str)
def test_gluon_walk_cuda(shape, words_per_thread, monkeypatch):
    """The Qwen3-8B shape's projections: against float64 and against the word kernel, nested absmax (read flat)."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", True)
    weight = quantize(shape, torch.bfloat16, True, 64, "cuda")
    x = torch.randn(1, shape[1], dtype=torch.bfloat16, device="cuda")
    assert gluon_matvec_supported(x, weight, words_per_thread)
    got = nf4_matvec_gluon(x, weight, words_per_thread)
    assert got.shape == (1, shape[0]) and got.dtype == torch.bfloat16
    assert_close(got, float64_reference(x, weight, None, None, None, 0.0), TOLERANCE[torch.bfloat16], "y")
    assert_close(got, nf4_matvec_module.nf4_matvec(x, weight), TOLERANCE[torch.bfloat16], "y against the word kernel")
