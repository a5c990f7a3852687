"""`kernels.gather_rows`: an embedding lookup whose rows the device reads from a pinned host table. On the CPU
(interpreter) the kernel against indexing, out-of-range ids, shapes; on CUDA (marked `gpu`) from pinned host
memory, inside a CUDA graph, and through `HostEmbedding` with `DEVICE_GATHER`."""

import pytest
import torch

from unsloth_lite.kernels.gather_rows import BLOCK_COLS, gather_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_cols", [24, BLOCK_COLS + 76], ids=["narrow", "two-column-blocks"])
def test_rows_are_the_tables(dtype, n_cols):
    table = torch.randn(53, n_cols).to(dtype)
    ids = torch.randint(0, 53, (3, 7))
    out = gather_rows(table, ids)
    assert out.dtype == dtype and out.shape == (3, 7, n_cols)
    assert torch.equal(out, table[ids])  # copied, not computed: bit-identical


def test_ids_outside_the_table_give_zero_rows():
    table = torch.randn(10, 40)
    ids = torch.tensor([3, -1, 10, 9, 1000])
    out = gather_rows(table, ids)
    inside = (ids >= 0) & (ids < 10)
    assert torch.equal(out[inside], table[ids[inside]])
    assert torch.equal(out[~inside], torch.zeros(int((~inside).sum()), 40))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="integer"):
        gather_rows(torch.randn(4, 4), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="2-D"):
        gather_rows(torch.randn(4, 4, 2), torch.tensor([1]))


@pytest.mark.gpu
def test_rows_read_from_pinned_host_memory_on_gpu():
    table = torch.randn(24_832, 5120, dtype=torch.bfloat16).pin_memory()
    ids = torch.randint(0, table.shape[0], (1, 2048), device="cuda")
    reference = table[ids.cpu()].cuda()
    assert torch.equal(gather_rows(table, ids), reference)
    static_ids = ids.clone()
    gather_rows(table, static_ids)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gather_rows(table, static_ids)
    static_ids.copy_(torch.randint(0, table.shape[0], (1, 2048), device="cuda"))
    graph.replay()
    assert torch.equal(captured, table[static_ids.cpu()].cuda())


@pytest.mark.gpu
def test_host_embedding_gathers_on_the_device_as_on_the_host(monkeypatch):
    from unsloth_lite.models import HostEmbedding, host_embeddings

    embedding = HostEmbedding(torch.randn(1000, 96, dtype=torch.bfloat16))
    ids = torch.randint(0, 1000, (2, 33), device="cuda")
    monkeypatch.setattr(host_embeddings, "DEVICE_GATHER", False)
    on_host = embedding(ids)
    monkeypatch.setattr(host_embeddings, "DEVICE_GATHER", True)
    assert torch.equal(embedding(ids), on_host)
