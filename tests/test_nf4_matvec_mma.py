"""`nf4_matvec`'s tensor-core kernel (`nf4_matvec_mma.py`) against the product with the dequantised weight in
float64: 1 to 8 rows, bias, adapter, features that part-fill the last block of 16, the K split, the warps'
chunks past the row's end, both lookups. The kernel is compiled-only PTX: on the CPU its block (the lookup and
the four `mma` of a lane) is run lane by lane by `test_nf4_ptx_lookup.py`; here it runs on the GPU."""

import pytest
import torch
from helpers import TOLERANCE, assert_close
from test_nf4_matvec import check, check_split_along_k

from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels import nf4_matvec_mma
from unsloth_lite.kernels.nf4_codes import NF4_CODE


@pytest.fixture(params=[True, False], ids=["shared_lookup", "register_lookup"])
def mma_kernel(request, monkeypatch):
    """The tensor-core kernel on, with either lookup, its launches counted (a product that fell back to another
    kernel fails the test)."""
    monkeypatch.setattr(nf4_matvec_module, "MMA_KERNEL", True)
    monkeypatch.setattr(nf4_matvec_module, "MMA_SHARED_LOOKUP", request.param)
    launches = []
    kernel = nf4_matvec_mma._nf4_matvec_mma_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(nf4_matvec_mma, "_nf4_matvec_mma_kernel", Counted())
    return launches


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("shape", [(16, 64), (40, 320), (48, 5120), (1030, 4096), (4096, 128)], ids=str)
def test_mma_kernel_shapes_and_rows(shape, rows, mma_kernel):
    check(shape, rows, torch.bfloat16, nested=rows % 2 == 1, blocksize=64, with_bias=rows % 2 == 0,
          rank=4 * (rows % 3), device="cuda")
    assert len(mma_kernel) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(1, 1, 1), (4, 1, 3), (2, 3, 2), (4, 5, 4), (16, 2, 3), (8, 7, 1)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_mma_kernel_tiles(tile, rows, mma_kernel, monkeypatch):
    """Every (warps, K split, pipelined stages): chunks that end past the row (37 blocks), several splits' counters."""
    monkeypatch.setattr(nf4_matvec_module, "MMA_TILE", tile)
    check((72, 64 * 37), rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=4, device="cuda")
    assert len(mma_kernel) == 1


@pytest.mark.gpu
def test_mma_kernel_split_is_deterministic(mma_kernel, monkeypatch):
    monkeypatch.setattr(nf4_matvec_module, "MMA_TILE", (2, 5, 2))
    check_split_along_k(3, "cuda")
    assert mma_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (48, 5120),
                                   (17408, 5120), (5120, 17408), (10240, 5120), (6144, 5120), (5120, 6144)], ids=str)
def test_mma_kernel_at_the_models_projections(shape, mma_kernel):
    """The W3 projections at the chosen tiles, one row (decoding) and eight."""
    for rows in (1, 8):
        check(shape, rows, torch.bfloat16, nested=True, blocksize=64, with_bias=False, rank=16, device="cuda")
    assert len(mma_kernel) == 2


@pytest.mark.gpu
def test_mma_kernel_falls_back_where_x_does_not_fit(mma_kernel):
    """fp32 x, nine rows, and rows not 16-byte aligned take the other kernels, still correct."""
    from test_nf4_matvec import float64_reference, make_case

    for dtype, rows, offset in ((torch.float32, 3, 0), (torch.bfloat16, 9, 0), (torch.bfloat16, 2, 1)):
        x, weight, bias, lora_a, lora_b = make_case((64, 256), rows, dtype, True, 64, True, 4, "cuda")
        wide = torch.randn(rows, 256 + 8, dtype=dtype, device="cuda")
        wide[:, offset:offset + 256] = x
        got = nf4_matvec_module.nf4_matvec(wide[:, offset:offset + 256], weight, bias, lora_a, lora_b, scale=0.5)
        assert_close(got, float64_reference(x, weight, bias, lora_a, lora_b, 0.5), TOLERANCE[dtype], "y")
    assert not mma_kernel


def test_pair_table_holds_both_codes_of_each_byte():
    table = nf4_matvec_mma.pair_table(torch.device("cpu"))
    codes = torch.tensor(NF4_CODE).to(torch.bfloat16)
    pairs = table.view(torch.bfloat16).view(256, 2)
    byte = torch.arange(256)
    assert torch.equal(pairs[:, 0], codes[byte >> 4]) and torch.equal(pairs[:, 1], codes[byte & 0xF])


@pytest.mark.gpu
def test_mma_kernel_first_called_in_a_capture_falls_back(mma_kernel, monkeypatch):
    """The pair table is copied from the host: a first product inside a CUDA graph capture cannot make it and takes
    the word kernel; replayed, that graph's product is still right."""
    from test_nf4_matvec import float64_reference, make_case

    monkeypatch.setattr(nf4_matvec_mma, "_PAIR_TABLES", {})
    monkeypatch.setattr(nf4_matvec_module, "MMA_SHARED_LOOKUP", True)
    x, weight, bias, lora_a, lora_b = make_case((1024, 4096), 1, torch.bfloat16, True, 64, True, 16, "cuda")
    expected = float64_reference(x, weight, bias, lora_a, lora_b, 0.5)
    nf4_matvec_module.nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)  # compiled before the capture
    monkeypatch.setattr(nf4_matvec_module, "MMA_KERNEL", False)
    nf4_matvec_module.nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    monkeypatch.setattr(nf4_matvec_module, "MMA_KERNEL", True)
    nf4_matvec_mma._PAIR_TABLES.clear()
    mma_kernel.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nf4_matvec_module.nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    assert not mma_kernel
    graph.replay()
    assert_close(captured, expected, TOLERANCE[torch.bfloat16], "y")
    nf4_matvec_module.nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    assert len(mma_kernel) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, (4, 3, 3), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_grouped_mma_kernel(rows, tile, mma_kernel, monkeypatch):
    """`nf4_grouped_matvec` on the tensor-core kernel (one launch): four projections of different widths (one
    part-filling its last block of 16), adapters on three, biases; then q/k/v at a W3 shape, none adapted."""
    from test_nf4_grouped_matvec import check as check_group

    launches = []
    kernel = nf4_matvec_mma._nf4_grouped_mma_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(nf4_matvec_mma, "_nf4_grouped_mma_kernel", Counted())
    monkeypatch.setattr(nf4_matvec_module, "MMA_TILE", tile)
    check_group((96, 40, 8, 130), (4, 0, 4, 4), rows, torch.bfloat16, True, True, "cuda", exact=False, n_in=64 * 37)
    check_group((4096, 1024, 1024), (0, 0, 0), rows, torch.bfloat16, True, False, "cuda", exact=False, n_in=4096)
    assert len(launches) == 2
