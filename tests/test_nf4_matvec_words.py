"""`nf4_matvec`'s word kernel (`WORD_KERNEL`: the weight read as 32-bit words of eight codes) against the product
with the dequantised weight in float64, as the blocked kernel is checked: whole-block shapes, 1 to 8 rows, bias,
adapter, the nested and the flat absmax, bf16 x read as pairs or element by element, the K split. The PTX
lookup runs compiled only: its bits are checked on the CPU by `test_nf4_ptx_lookup.py`, the compiled kernel at
every tile of the benchmark's sweep on the GPU."""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCE, assert_close, assert_counters_settled, dtype_id
from test_nf4_matvec import check, check_split_along_k, float64_reference, make_case

from unsloth_lite.kernels import lora_down as lora_down_module
from unsloth_lite.kernels import matvec_epilogue, nf4_matvec_state
from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.nf4_codes import CODE_PAIRS, word_lookup_tables
from unsloth_lite.kernels.nf4_matvec import nf4_matvec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def word_kernel(monkeypatch):
    """The word kernel on, its launches counted (a product that fell back to another kernel fails the test)."""
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", True)
    launches = []
    kernel = nf4_matvec_module._nf4_matvec_words_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(nf4_matvec_module, "_nf4_matvec_words_kernel", Counted())
    return launches


@pytest.mark.parametrize("flat", [True, False], ids=["flat_absmax", "nested_absmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3])
def test_word_kernel(rows, dtype, flat, device, word_kernel, monkeypatch):
    """Several tiles along K, the last part-filled, 40 features (a part-filled feature block where compiled)."""
    monkeypatch.setattr(nf4_matvec_module, "FLAT_ABSMAX", flat)
    check((40, 64 * 37), rows, dtype, nested=True, blocksize=64, with_bias=True, rank=4, device=device)
    assert len(word_kernel) == 1


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("shape", [(130, 64), (20, 320), (2050, 128)], ids=str)
def test_word_kernel_shapes_and_rows(shape, rows, device, word_kernel):
    check(shape, rows, torch.bfloat16, nested=False, blocksize=64, with_bias=rows % 2 == 0, rank=rows % 3,
          device=device)
    assert word_kernel


def test_word_kernel_reads_unaligned_bf16_x_element_by_element(device, word_kernel):
    """bf16 x whose rows do not start on 4 bytes (odd row stride) cannot be read as pairs: read as elements."""
    x, weight, bias, lora_a, lora_b = make_case((24, 128), 3, torch.bfloat16, True, 64, True, 4, device)
    wide = torch.randn(3, 129, dtype=torch.bfloat16, device=device)
    wide[:, :128] = x
    got = nf4_matvec(wide[:, :128], weight, bias, lora_a, lora_b, scale=0.5)
    assert_close(got, float64_reference(x, weight, bias, lora_a, lora_b, 0.5), TOLERANCE[torch.bfloat16], "y")
    assert word_kernel


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("tiles_a_split", [True, 3], ids=["one_tile", "three_tiles"])
def test_word_kernel_split_along_k(rows, tiles_a_split, device, word_kernel, monkeypatch):
    """K split over programs (tiles of 2 blocks: 19 splits of one tile, or 7 of three, the last part-filled):
    deterministic, counters left at 0."""
    monkeypatch.setattr(nf4_matvec_module, "word_tile", lambda *_: (16, 128, 4, tiles_a_split))
    check_split_along_k(rows, device)
    assert word_kernel


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("split_k", [False, True], ids=["walk", "split_along_k"])
def test_word_kernel_with_register_prefetch(rows, split_k, device, word_kernel, monkeypatch):
    """`REGISTER_PREFETCH`: each step loads the next tile before decoding its own; several tiles along K, the last
    part-filled (its prefetch past the walk reloads it), 40 features, and a walk of one tile (the K split)."""
    monkeypatch.setattr(nf4_matvec_module, "REGISTER_PREFETCH", True)
    monkeypatch.setattr(nf4_matvec_module, "word_tile", lambda *_: (16, 256, 4, split_k))
    check((40, 64 * 37), rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=4, device=device)
    assert len(word_kernel) == 1


def assert_first_products_in_the_launch(shape, rows, rank, device, launches):
    """One word-kernel launch whose first rank x steps programs computed t = x Aᵀ (`FIRST_PRODUCTS_IN_LAUNCH`),
    y against float64, the launch's column counters and its flags left at 0 for the next one."""
    check(shape, rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=rank, device=device)
    steps = -(-shape[1] // lora_down_module.LORA_BLOCK_K)
    block_n = nf4_matvec_module.word_tile(*shape)[0]
    assert [grid[0] for grid in launches] == [rank * steps + -(-shape[0] // block_n)]
    assert_counters_settled(device)
    assert not matvec_epilogue._arrival_counters(torch.device(device), rank).any()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape,rank", [((40, 64 * 37), 4), ((130, 64), 16)], ids=str)
def test_word_kernel_takes_the_first_product_in_its_launch(shape, rank, rows, device, word_kernel,
                                                           monkeypatch):
    """An adapter given by A (no precomputed t): its first product by the launch's first programs (several steps
    along K, or one), which the others await before adding t Bᵀ."""
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    monkeypatch.setattr(nf4_matvec_module, "lora_down_rows", None)  # no launch of its own
    assert_first_products_in_the_launch(shape, rows, rank, device, word_kernel)


@pytest.mark.parametrize("rows", [1, 3])
def test_first_products_readers_counted_in_groups(rows, device, word_kernel, monkeypatch):
    """More programs await t than one reader group holds (`lora_down.READER_GROUP`; 4 features a program: 33
    readers, a full group and one of 1): every group counter and the flags are back at 0 after each of three
    launches."""
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    monkeypatch.setattr(nf4_matvec_module, "lora_down_rows", None)
    monkeypatch.setattr(nf4_matvec_module, "word_tile", lambda *_: (4, 256, 4, False))
    assert -(-130 // 4) > lora_down_module.READER_GROUP
    for _ in range(3):
        word_kernel.clear()
        assert_first_products_in_the_launch((130, 64 * 5), rows, 4, device, word_kernel)


def given_t_products(shape, rows, parts, device, monkeypatch):
    """The word kernel's product with an adapter's t given (`lora_t`, as `parts` stripes where more than one),
    t written by a launch just before (as decoding's are), then a residual; with t loaded in the epilogue and
    before the walk (`matvec_epilogue.T_BEFORE_WALK`)."""
    x, weight, _, lora_a, lora_b = make_case(shape, rows, torch.bfloat16, True, 64, False, 16, device)
    residual = torch.randn(rows, shape[0], dtype=torch.bfloat16, device=device)
    shares = torch.arange(1, parts + 1, device=device) / (parts * (parts + 1) / 2)  # summing to 1
    products = []
    for early in (False, True):
        monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", early)
        t = lora_down_module.lora_down_rows(x, [lora_a])
        lora_t = shares[:, None, None] * t if parts > 1 else t
        products.append(nf4_matvec(x, weight, lora_b=lora_b, scale=0.5, lora_t=lora_t, residual=residual))
    expected = float64_reference(x, weight, None, lora_a, lora_b, 0.5) + residual.double()
    return products, expected


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("rows", [1, 3])
def test_word_kernel_loads_a_given_t_before_the_walk(rows, parts, device, word_kernel, monkeypatch):
    """t given whole or in parts: loaded before the walk, the same bits as loaded in the epilogue."""
    (late, early), expected = given_t_products((40, 64 * 37), rows, parts, device, monkeypatch)
    assert torch.equal(early, late)
    assert_close(early, expected, TOLERANCE[torch.bfloat16], "y")
    assert len(word_kernel) == 2


def test_t_before_walk_only_where_the_walk_waits_first(monkeypatch):
    """Only a pipelined walk without register prefetch waits before its first load (`gdc_wait`), and only a
    given t can be loaded then."""
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", True)
    assert matvec_epilogue.t_before_walk(True, True, 3, False)
    assert not matvec_epilogue.t_before_walk(False, True, 3, False)
    assert not matvec_epilogue.t_before_walk(True, False, 3, False)
    assert not matvec_epilogue.t_before_walk(True, True, 1, False)
    assert not matvec_epilogue.t_before_walk(True, True, 3, True)
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", False)
    assert not matvec_epilogue.t_before_walk(True, True, 3, False)


def test_lane_tables_hold_the_lookup_tables_once_per_lane():
    tables = nf4_matvec_state.lane_tables(torch.device("cpu"), True)
    assert tables.shape == (32, 8) and tables.dtype == torch.int32
    expected = word_lookup_tables(True)
    assert all(row[:4] == expected and row[4:] == [0] * 4 for row in tables.tolist())


def test_word_tiles_table_by_launch_and_shape(monkeypatch):
    """`WORD_TILES`: a compiled launch at a listed (launch, N, K) takes its tile and stages; another launch or
    shape the blocked kernel's tile and `PIPELINE_STAGES` (the interpreter always its own tile)."""
    monkeypatch.setattr(nf4_matvec_module, "INTERPRET", False)
    monkeypatch.setattr(nf4_matvec_module, "WORD_TILES", {("gated", 12288, 4096): (4, 1024, 2, False, 5)})
    assert nf4_matvec_module.word_tile(12288, 4096, "gated") == (4, 1024, 2, False)
    assert nf4_matvec_module.word_stages(12288, 4096, "gated") == 5
    for other in ((12288, 4096, "words"), (12288, 5120, "gated")):
        assert nf4_matvec_module.word_tile(*other) == nf4_matvec_module.blocked_tile(other[0])
        assert nf4_matvec_module.word_stages(*other) == nf4_matvec_module.PIPELINE_STAGES
    # a launch without adapters takes `WORD_TILES_WITHOUT_ADAPTERS`' entry first, with them `WORD_TILES`'
    monkeypatch.setattr(nf4_matvec_module, "WORD_TILES_WITHOUT_ADAPTERS", {("gated", 12288, 4096): (32, 256, 4, 0, 2),
                                                                           ("grouped", 6144, 4096): (8, 256, 2, 0, 4)})
    assert nf4_matvec_module.word_tile(12288, 4096, "gated", False) == (32, 256, 4, 0)
    assert nf4_matvec_module.word_stages(12288, 4096, "gated", False) == 2
    assert nf4_matvec_module.word_tile(12288, 4096, "gated", True) == (4, 1024, 2, False)
    assert nf4_matvec_module.word_tile(6144, 4096, "grouped") == nf4_matvec_module.blocked_tile(6144)
    assert nf4_matvec_module.word_stages(6144, 4096, "grouped", False) == 4
    monkeypatch.setattr(nf4_matvec_module, "INTERPRET", True)
    assert nf4_matvec_module.word_tile(12288, 4096, "gated") == nf4_matvec_module.blocked_tile(12288)
    assert nf4_matvec_module.word_tile(12288, 4096, "gated", False) == nf4_matvec_module.blocked_tile(12288)


def sweep_word_tiles():
    """Every tile `bench_nf4_matvec.py --sweep` times the word kernel at: each may be chosen from its results."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("bench_nf4_matvec").WORD_SWEEP_TILES


W3_SHAPES = [(48, 5120), (1024, 4096), (4096, 4096), (4096, 12288), (5120, 5120), (17408, 5120), (5120, 17408),
             (12288, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", [(40, 64 * 37), (130, 64), (2050, 128), *W3_SHAPES], ids=str)
def test_word_kernel_cuda(shape, rows, dtype, word_kernel):
    """Compiled, the PTX lookup: bf16 weights with the code book rounded to bf16, fp32 ones with the exact one."""
    check(shape, rows, dtype, nested=True, blocksize=64, with_bias=True, rank=16, device="cuda")
    assert word_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", W3_SHAPES, ids=str)
def test_word_kernel_takes_the_first_product_in_its_launch_cuda(shape, rows, word_kernel, monkeypatch):
    """Compiled, at the W3 models' shapes: the launch's first programs' t awaited by the others (one wave or
    several), flags back at 0 after each of three launches."""
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    monkeypatch.setattr(nf4_matvec_module, "lora_down_rows", None)
    for _ in range(3):
        word_kernel.clear()
        assert_first_products_in_the_launch(shape, rows, 16, "cuda", word_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [1, 16])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 12288), (5120, 17408)], ids=str)
def test_word_kernel_loads_a_given_t_before_the_walk_cuda(shape, rows, parts, word_kernel, monkeypatch):
    """Compiled, with dependent launches: t loaded once `gdc_wait` returns gives the epilogue's bits."""
    (late, early), expected = given_t_products(shape, rows, parts, "cuda", monkeypatch)
    assert torch.equal(early, late)
    assert_close(early, expected, TOLERANCE[torch.bfloat16], "y")


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["BF16_CODES", "BF16_PAIR_PRODUCTS"], ids=["exact_codes", "fp32_products"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", W3_SHAPES, ids=str)
def test_word_kernel_without_bf16_codes_or_pairs_cuda(shape, rows, setting, word_kernel, monkeypatch):
    """bf16 weights with the exact code book (`BF16_CODES` off), or bf16 weights and x with the products in fp32
    (`BF16_PAIR_PRODUCTS` off)."""
    monkeypatch.setattr(nf4_matvec_module, setting, False)
    check(shape, rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=16, device="cuda")


def test_word_code_form_pairs_only_bf16_codes_with_bf16_x(monkeypatch):
    """The word walk multiplies in bf16 pairs only where both the codes and x are bf16 and the setting is on."""
    form = nf4_matvec_module.word_code_form
    assert form(True, True) == CODE_PAIRS.value and form(True, False) == 1 and form(False, True) == 0
    monkeypatch.setattr(nf4_matvec_module, "BF16_PAIR_PRODUCTS", False)
    assert form(True, True) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 3, "prefetch"], ids=lambda n: f"{n}stages" if n != "prefetch" else n)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", [(1024, 4096), (17408, 5120), (5120, 17408)], ids=str)
def test_word_kernel_every_swept_tile_cuda(shape, rows, stages, word_kernel, monkeypatch):
    """Every tile of the benchmark's sweep (split along K or not, 1 to 8 warps), looped, pipelined and with the
    next tile loaded into registers (`REGISTER_PREFETCH`)."""
    monkeypatch.setattr(nf4_matvec_module, "PIPELINE_STAGES", 1 if stages == "prefetch" else stages)
    monkeypatch.setattr(nf4_matvec_module, "REGISTER_PREFETCH", stages == "prefetch")
    for tile in sweep_word_tiles():
        monkeypatch.setattr(nf4_matvec_module, "word_tile", lambda *_, tile=tile: tile)
        check(shape, rows, torch.bfloat16, nested=True, blocksize=64, with_bias=True, rank=16, device="cuda")


@pytest.mark.gpu
def test_word_kernel_first_called_in_a_capture_takes_the_blocked_kernel(word_kernel, monkeypatch):
    """The lane tables are copied from the host: a first product inside a CUDA graph capture cannot make them and
    takes the blocked kernel; the next product outside a capture makes them and takes the word kernel."""
    monkeypatch.setattr(nf4_matvec_state, "_LANE_TABLES", {})
    x, weight, bias, lora_a, lora_b = make_case((1024, 4096), 1, torch.bfloat16, True, 64, True, 16, "cuda")
    expected = float64_reference(x, weight, bias, lora_a, lora_b, 0.5)
    nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)  # both kernels compiled before the capture
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", False)
    nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    monkeypatch.setattr(nf4_matvec_module, "WORD_KERNEL", True)
    nf4_matvec_state._LANE_TABLES.clear()
    word_kernel.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5)
    assert not word_kernel
    captured.fill_(float("nan"))
    graph.replay()
    assert_close(captured, expected, TOLERANCE[torch.bfloat16], "replayed y")
    assert_close(nf4_matvec(x, weight, bias, lora_a, lora_b, scale=0.5), expected, TOLERANCE[torch.bfloat16], "y")
    assert word_kernel
