"""The kernel benchmark's tiny CPU mode runs end to end, so the script cannot rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_kernels_tiny_mode_runs():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    result = subprocess.run(
        [sys.executable, "scripts/bench_kernels.py", "--tiny"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for kernel in ("rms_norm", "swiglu", "apply_rope", "qk_norm_rope"):
        assert f"| {kernel} |" in result.stdout
    assert "| unsloth_lite |" in result.stdout and "| eager |" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; on a CUDA machine the script runs at full size")
def test_bench_sweep_tiny_mode_runs():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
    result = subprocess.run(
        [sys.executable, "scripts/bench_sweep.py", "--tiny"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for kernel in ("apply_rope", "qk_norm_rope", "fused_linear_cross_entropy"):
        assert f"| {kernel} |" in result.stdout
    for direction in ("out of place", "in place", "forward", "backward"):
        assert f"| {direction} |" in result.stdout
    assert "| yes |" in result.stdout  # the launchers' own choice is among the rows
