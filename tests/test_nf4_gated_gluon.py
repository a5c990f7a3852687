"""`nf4_gated_matvec`'s walk in Gluon (`nf4_gated_gluon`, `nf4_gated_matvec.GLUON_GATED`): compiled for sm_90 on
any machine (Gluon has no interpreter), its resources against the Triton launch's; which launches it takes; on a
GPU at the Qwen3-8B MLP, with and without adapters and the down adapter's shares, against float64 and the Triton
launch."""

import json

import pytest
import torch
from helpers import TOLERANCE, assert_close
from test_bench_kernels import run_compiled
from test_nf4_gated_matvec import float64_gated, gated_case

from unsloth_lite.kernels import nf4_gated_gluon
from unsloth_lite.kernels import nf4_gated_matvec as gated_module
from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.nf4_gated_gluon import BLOCK_N
from unsloth_lite.kernels.nf4_matvec_gluon import step_weights


def test_gluon_gated_walk_compiles_for_hopper_without_shared_memory_in_its_loop(tmp_path):
    """Offline for sm_90, with and without the adapters and the down shares: no spills, at most 160 registers
    (three programs an SM), no shared memory but the final reductions' (the Triton launch stages its tiles
    there)."""
    out = tmp_path / "resources.json"
    result = run_compiled("--nf4-matvec", "--matvec-shapes", f"64x{2 * step_weights()}", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["kernel"]: row for row in json.loads(out.read_text())["rows"]}
    for name in ("gated_gluon", "gated_gluon_adapted"):
        assert 0 < rows[name]["registers"] <= 160 and rows[name]["stack_bytes"] == 0, rows[name]
        assert rows[name]["shared_bytes"] <= 1024 < rows["gated_words"]["shared_bytes"], rows
        assert rows[name]["tile"] == f"{BLOCK_N}x{step_weights()}/4w", rows[name]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["plain", "adapters", "adapters_down_shares"])
def test_gluon_gated_walk_cuda(case, monkeypatch):
    """The Qwen3-8B MLP (12,288 x 4,096), one bf16 row: h against float64 and the Triton launch; the stripes'
    sum against h A_dᵀ of h as written."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", True)
    monkeypatch.setattr(nf4_matvec_module, "GLUON_WALK", True)
    monkeypatch.setattr(gated_module, "GLUON_GATED", True)
    adapted = case != "plain"
    x, gate, up, biases, loras = gated_case((12288, 4096), 1, torch.bfloat16, True, (adapted, adapted), adapted,
                                            "cuda")
    kwargs = {}
    if case == "adapters_down_shares":
        down_a = torch.randn(16, 12288, device="cuda", dtype=torch.bfloat16)
        kwargs["down_shares"] = (down_a, torch.zeros(16, 1, 16, device="cuda"))
    launches, launch = [], nf4_gated_gluon.launch_gluon_gated
    monkeypatch.setattr(nf4_gated_gluon, "launch_gluon_gated",
                        lambda *args, **kw: launches.append(args[5:7]) or launch(*args, **kw))
    adapters = [lora[:3] if lora else None for lora in loras]
    got = gated_module.nf4_gated_matvec(x, gate, up, *biases, *adapters, **kwargs)
    assert launches == [(12288, 4096)], "the launch did not take the Gluon walk"
    assert got.shape == (1, 12288) and got.dtype == torch.bfloat16
    assert_close(got, float64_gated(x, gate, up, biases, loras), 2 * TOLERANCE[torch.bfloat16], "h")
    monkeypatch.setattr(gated_module, "GLUON_GATED", False)
    assert_close(got, gated_module.nf4_gated_matvec(x, gate, up, *biases, *adapters), TOLERANCE[torch.bfloat16],
                 "h against the Triton launch")
    if "down_shares" in kwargs:
        stripes = kwargs["down_shares"][1]
        assert_close(stripes.sum(0), got.double() @ down_a.double().t(), TOLERANCE[torch.float32], "Σ stripes")
