"""`nf4_matvec`'s walk in Gluon (`nf4_matvec_gluon`, `nf4_matvec.GLUON_WALK`): compiled for sm_90 on any machine
(Gluon has no interpreter), its resources against the Triton word kernel's; which products it takes; on a GPU,
with its epilogue (bias, residual, an adapter's given t in one part or several), against the dequantised product
in float64 and against the Triton word kernel; the benchmark's variants."""

import json

import pytest
import torch
from helpers import TOLERANCE, assert_close
from test_bench_kernels import run_compiled, run_tiny
from test_dequantize_nf4 import quantize
from test_nf4_matvec import float64_reference

from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels import nf4_matvec_gluon
from unsloth_lite.kernels.nf4_gated_gluon import gluon_gated_fits
from unsloth_lite.kernels.nf4_matvec import nf4_matvec
from unsloth_lite.kernels.nf4_matvec_gluon import gluon_walk_fits, step_weights


def test_gluon_walk_compiles_for_hopper_without_shared_memory_in_its_loop(tmp_path):
    """Offline for sm_90: no spills, with or without down_proj's epilogue, no shared memory but the final
    reduction's (the word kernel stages every tile's words, absmax and x there), fewer loop instructions per
    eight weights than the word kernel."""
    out = tmp_path / "resources.json"
    result = run_compiled("--nf4-matvec", "--matvec-shapes", f"64x{2 * step_weights()}", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["kernel"]: row for row in json.loads(out.read_text())["rows"]}
    gluon, words = rows["words_gluon"], rows["words"]
    assert 0 < gluon["registers"] <= 255 and gluon["stack_bytes"] == 0, gluon
    # the adapter's B and t's 16 parts spread over the threads during the walk (held whole by each thread they
    # took all 255 registers and spilled): three programs an SM still
    adapted = rows["words_gluon_adapted"]
    assert adapted["registers"] <= 160 and adapted["stack_bytes"] == 0, adapted
    assert gluon["shared_bytes"] <= 1024 < words["shared_bytes"], rows
    assert gluon["per_8_weights"] < words["per_8_weights"], rows


@pytest.mark.parametrize("fits", [gluon_walk_fits, gluon_gated_fits], ids=["words", "gated"])
def test_gluon_walks_take_one_row_of_bf16_pairs_on_a_gpu_at_whole_steps(fits):
    step = step_weights()
    pairs = torch.zeros(1, step // 2, dtype=torch.int32)
    assert not fits(pairs, 64, step)  # not on a CUDA device
    if torch.cuda.is_available():
        on_gpu = pairs.cuda()
        assert fits(on_gpu, 64, step)
        assert not fits(on_gpu.expand(2, -1), 64, step)  # two rows
        assert not fits(on_gpu, 64, step + 64)  # K not a whole number of steps
        assert not fits(on_gpu, 66, step)  # N not a multiple of the program's features
        assert not fits(on_gpu.view(torch.float32), 64, step)  # x not bf16 pairs


def test_bench_nf4_matvec_runs_the_triton_walk_variant():
    out = run_tiny("bench_nf4_matvec.py", "--shapes", "qwen3_8b", "--variants",
                   "unsloth_lite,unsloth_lite_triton_walk,unsloth_lite_no_pdl")
    for variant in ("unsloth_lite", "unsloth_lite_triton_walk", "unsloth_lite_no_pdl"):
        assert f"| qwen3_8b | {variant} |" in out


def _gluon_launches(monkeypatch) -> list:
    """The Gluon walk's launches from here on (each still made)."""
    launches, launch = [], nf4_matvec_gluon.launch_gluon_walk

    def counted(*args, **kwargs):
        launches.append(args[5:7])
        return launch(*args, **kwargs)

    monkeypatch.setattr(nf4_matvec_gluon, "launch_gluon_walk", counted)
    return launches


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual", "adapter", "adapter_parts_residual",
                                      "first_products_residual"])
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (4096, 12288), (12288, 4096)], ids=str)
def test_gluon_walk_cuda(shape, epilogue, monkeypatch):
    """The Qwen3-8B shape's projections with each epilogue: against float64 and the Triton word kernel (nested
    absmax read flat; PDL as shipped). First products: t = x Aᵀ written by the launch's first programs, three
    launches in a row (each leaves the ready flag and the readers' counters at 0 for the next)."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", True)
    monkeypatch.setattr(nf4_matvec_module, "GLUON_FIRST_PRODUCTS", True)
    n_out, n_in = shape
    weight = quantize(shape, torch.bfloat16, True, 64, "cuda")
    x = torch.randn(1, n_in, dtype=torch.bfloat16, device="cuda")
    kwargs, expected_extra = {}, torch.zeros(1, n_out, dtype=torch.float64, device="cuda")
    if epilogue == "bias":
        kwargs["bias"] = torch.randn(n_out, dtype=torch.bfloat16, device="cuda")
        expected_extra += kwargs["bias"].double()
    if epilogue.endswith("residual"):
        kwargs["residual"] = torch.randn(1, n_out, dtype=torch.bfloat16, device="cuda")
        expected_extra += kwargs["residual"].double()
    if epilogue.startswith("adapter"):
        parts = 16 if "parts" in epilogue else 1
        t_parts = torch.randn(parts, 1, 16, device="cuda")
        kwargs.update(lora_b=0.3 * torch.randn(n_out, 16, device="cuda"), scale=0.5,
                      lora_t=t_parts if parts > 1 else t_parts[0])
        expected_extra += 0.5 * t_parts.double().sum(0) @ kwargs["lora_b"].double().t()
    if epilogue.startswith("first_products"):
        kwargs.update(lora_a=0.3 * torch.randn(16, n_in, device="cuda"),
                      lora_b=0.3 * torch.randn(n_out, 16, device="cuda"), scale=0.5)
        expected_extra += 0.5 * (x.double() @ kwargs["lora_a"].double().t()) @ kwargs["lora_b"].double().t()
    launches = _gluon_launches(monkeypatch)
    got = nf4_matvec(x, weight, **kwargs)
    assert launches == [(n_out, n_in)], "the product did not take the Gluon walk"
    if "lora_a" in kwargs:
        for _ in range(2):
            assert torch.equal(nf4_matvec(x, weight, **kwargs), got), "a launch after the first"
        launches.clear()
    assert got.shape == (1, n_out) and got.dtype == torch.bfloat16
    expected = float64_reference(x, weight, None, None, None, 0.0) + expected_extra
    assert_close(got, expected, TOLERANCE[torch.bfloat16], "y")
    monkeypatch.setattr(nf4_matvec_module, "GLUON_WALK", False)
    assert_close(got, nf4_matvec(x, weight, **kwargs), TOLERANCE[torch.bfloat16], "y against the word kernel")
    assert len(launches) == 1


@pytest.mark.gpu
def test_gluon_walk_leaves_what_it_does_not_take_to_the_triton_kernels(monkeypatch):
    """Two rows, K of no whole step (the 27B's 5,120) and, without `GLUON_FIRST_PRODUCTS`, first products in the
    launch: the Triton kernels."""
    monkeypatch.setattr(nf4_matvec_module, "GLUON_FIRST_PRODUCTS", False)
    launches = _gluon_launches(monkeypatch)
    weight = quantize((1024, 4096), torch.bfloat16, True, 64, "cuda")
    x = torch.randn(2, 4096, dtype=torch.bfloat16, device="cuda")
    assert_close(nf4_matvec(x, weight), float64_reference(x, weight, None, None, None, 0.0),
                 TOLERANCE[torch.bfloat16], "two rows")
    lora_a, lora_b = 0.3 * torch.randn(16, 4096, device="cuda"), 0.3 * torch.randn(1024, 16, device="cuda")
    assert_close(nf4_matvec(x[:1], weight, lora_a=lora_a, lora_b=lora_b, scale=0.5),
                 float64_reference(x[:1], weight, None, lora_a, lora_b, 0.5), TOLERANCE[torch.bfloat16], "first")
    other = quantize((1024, 5120), torch.bfloat16, True, 64, "cuda")
    x = torch.randn(1, 5120, dtype=torch.bfloat16, device="cuda")
    assert_close(nf4_matvec(x, other), float64_reference(x, other, None, None, None, 0.0),
                 TOLERANCE[torch.bfloat16], "K = 5120")
    assert launches == []
