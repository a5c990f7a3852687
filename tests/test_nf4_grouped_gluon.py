"""`nf4_grouped_matvec`'s walks in Gluon (`nf4_grouped_gluon`, `nf4_grouped_matvec.GLUON_GROUPED`): compiled for
sm_90 on any machine (Gluon has no interpreter), its resources against the Triton launch's; on a GPU at the
Qwen3-8B shape's q/k/v, with and without adapters (t given) and biases, against float64 and the Triton launch."""

import json

import pytest
import torch
from helpers import TOLERANCE, assert_close
from test_bench_kernels import run_compiled
from test_nf4_grouped_matvec import group_case
from test_nf4_matvec import float64_reference

from unsloth_lite.kernels import nf4_grouped_gluon
from unsloth_lite.kernels import nf4_grouped_matvec as grouped_module
from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.nf4_matvec_gluon import step_weights


def test_gluon_grouped_walk_compiles_for_hopper_without_shared_memory_in_its_loop(tmp_path):
    """Offline for sm_90, with and without adapters: no spills, at most 160 registers, no shared memory but the
    final reduction's (the Triton launch stages its tiles there)."""
    out = tmp_path / "resources.json"
    result = run_compiled("--nf4-matvec", "--matvec-shapes", f"64x{step_weights()}", "--matvec-groups",
                          f"64/32/32x{step_weights()}", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["kernel"]: row for row in json.loads(out.read_text())["rows"]}
    for name in ("grouped_gluon", "grouped_gluon_adapted"):
        assert 0 < rows[name]["registers"] <= 160 and rows[name]["stack_bytes"] == 0, rows[name]
        assert rows[name]["shared_bytes"] <= 1024 < rows["grouped_words"]["shared_bytes"], rows


def test_kernel_resources_refuses_malformed_groups():
    result = run_compiled("--nf4-matvec", "--matvec-shapes", "64x128", "--matvec-groups", "64x128")
    assert result.returncode == 2 and "--matvec-groups '64x128'" in result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("adapted", [False, True], ids=["plain", "adapters_bias"])
def test_gluon_grouped_walk_cuda(adapted, monkeypatch):
    """q, k and v of the Qwen3-8B shape, one bf16 row: each y against float64 and the Triton launch."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", True)
    monkeypatch.setattr(nf4_matvec_module, "GLUON_WALK", True)
    monkeypatch.setattr(grouped_module, "GLUON_GROUPED", True)
    widths, ranks = (4096, 1024, 1024), (16, 16, 0) if adapted else (0, 0, 0)
    x, weights, biases, loras, t, a = group_case(widths, 4096, ranks, 1, torch.bfloat16, True, adapted, "cuda")
    launches, launch = [], nf4_grouped_gluon.launch_gluon_grouped
    monkeypatch.setattr(nf4_grouped_gluon, "launch_gluon_grouped",
                        lambda *args, **kw: launches.append(len(args[3])) or launch(*args, **kw))
    outputs = grouped_module.nf4_grouped_matvec(x, weights, biases, loras, t)
    assert launches == [4], "the launch did not take the Gluon walks"
    monkeypatch.setattr(grouped_module, "GLUON_GROUPED", False)
    triton_outputs = grouped_module.nf4_grouped_matvec(x, weights, biases, loras, t)
    for i, (weight, bias, lora, y) in enumerate(zip(weights, biases, loras, outputs, strict=True)):
        assert y.shape == (1, widths[i]) and y.dtype == torch.bfloat16
        expected = float64_reference(x, weight, bias, a.get(i), lora[0] if lora else None, lora[1] if lora else 0)
        assert_close(y, expected, TOLERANCE[torch.bfloat16], f"y{i}")
        assert_close(y, triton_outputs[i], TOLERANCE[torch.bfloat16], f"y{i} against the Triton launch")
