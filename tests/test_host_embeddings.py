"""The input embedding kept in host memory (`offload_embeddings_to_host`): lookups equal the table's rows, a
LoRA model trains exactly as with its embedding on the device, moves and casts leave the table on the host,
bad models are refused; `load_model` and the recipe key; on CUDA (marked `gpu`) the device memory it frees."""

import copy
import gc

import pytest
import torch
from helpers import assert_close
from peft import LoraConfig, get_peft_model
from test_patch_model import batch, tiny_model
from test_qlora_models import save_tiny_checkpoint

from unsloth_lite.models import HostEmbedding, load_model, offload_embeddings_to_host, patch_model
from unsloth_lite.recipes import RecipeError, load_recipe
from unsloth_lite.training.checkpointing import enable_gradient_checkpointing


def lora_model(device):
    model = get_peft_model(tiny_model("qwen3", device), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False,
    ))
    return patch_model(model)


def loss_and_gradients(model, device):
    torch.manual_seed(0)
    input_ids, labels = batch(device)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_lookups_are_the_table_rows(device):
    table = torch.randn(37, 24, device=device)
    embedding = HostEmbedding(table, padding_idx=0)
    ids = torch.randint(0, 37, (3, 5), device=device)
    out = embedding(ids)
    assert embedding.weight.device.type == "cpu" and not embedding.weight.requires_grad
    assert out.device == ids.device and out.shape == (3, 5, 24)
    assert torch.equal(out, table[ids])
    assert torch.equal(embedding(ids[:1, :2]), table[ids[:1, :2]])  # a smaller batch after a larger one


def test_lora_model_trains_as_with_its_device_embedding(device):
    """Loss and every LoRA gradient as with the embedding on the device, with our gradient checkpointing (which
    makes the embedding's output require grad)."""
    reference = lora_model(device)
    offloaded = offload_embeddings_to_host(copy.deepcopy(reference))
    assert isinstance(offloaded.get_input_embeddings(), HostEmbedding)
    for model in (reference, offloaded):
        enable_gradient_checkpointing(model)
        model.train()
    expected_loss, expected = loss_and_gradients(reference, device)
    loss, grads = loss_and_gradients(offloaded, device)
    # the same rows in, the same kernels: equal up to the order of atomic sums on a GPU
    assert_close(loss, expected_loss, 1e-6, "loss")
    assert grads.keys() == expected.keys() and grads
    for name, grad in grads.items():
        assert_close(grad, expected[name], 1e-6, name)


def test_moves_and_casts_leave_the_table_on_the_host(device):
    model = offload_embeddings_to_host(tiny_model("qwen3", device))
    table = model.get_input_embeddings().weight
    model.to(device=device, dtype=torch.bfloat16)
    assert model.get_input_embeddings().weight is table and table.device.type == "cpu"
    assert table.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    assert all(p.device.type == device.split(":")[0] for p in model.parameters())  # none on the host
    assert offload_embeddings_to_host(model).get_input_embeddings().weight is table  # already there: unchanged


def test_state_dict_holds_the_table(device):
    reference = tiny_model("qwen3", device)
    expected = reference.state_dict()
    model = offload_embeddings_to_host(copy.deepcopy(reference))
    state = model.state_dict()
    assert state.keys() == expected.keys()
    assert torch.equal(state["model.embed_tokens.weight"], expected["model.embed_tokens.weight"].cpu())
    other = offload_embeddings_to_host(tiny_model("qwen3", device))
    other.load_state_dict(state)
    assert torch.equal(other.get_input_embeddings().weight, model.get_input_embeddings().weight)
    with pytest.raises(RuntimeError, match="Missing key.*embed_tokens.weight"):
        other.load_state_dict({k: v for k, v in state.items() if k != "model.embed_tokens.weight"})


def test_refuses_tied_and_unknown_embeddings(device):
    tied = tiny_model("qwen3", device, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tied to the lm_head"):
        offload_embeddings_to_host(tied)
    other = tiny_model("qwen3", device)
    other.set_input_embeddings(torch.nn.Identity())
    with pytest.raises(ValueError, match="Identity, not an Embedding"):
        offload_embeddings_to_host(other)


def test_load_model_and_recipe_key(tmp_path):
    path = save_tiny_checkpoint("qwen3", tmp_path / "model")
    model, _ = load_model(path, load_in_4bit=False, dtype=torch.float32, device_map="cpu",
                          offload_embeddings=True, quantize_embeddings=True)
    assert isinstance(model.get_input_embeddings(), HostEmbedding)
    assert type(model.lm_head).__name__ == "Linear4bit"
    input_ids, labels = batch("cpu")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=input_ids, labels=labels).loss)
    assert load_recipe("tiny_qwen").model.offload_embeddings is False
    assert load_recipe("tiny_qwen", ["model.offload_embeddings=true"]).model.offload_embeddings is True
    with pytest.raises(RecipeError, match="^model.offload_embeddings: not with training.fsdp"):
        load_recipe("qlora_qwen27b_fsdp", ["model.offload_embeddings=true"])


@pytest.mark.gpu
def test_device_memory_freed_and_table_pinned():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model("qwen3", "cuda", torch.bfloat16, vocab_size=8192, hidden_size=256, num_hidden_layers=1)
    table_bytes = model.get_input_embeddings().weight.numel() * 2
    before = torch.cuda.memory_allocated()
    offload_embeddings_to_host(model)
    gc.collect()
    assert before - torch.cuda.memory_allocated() >= table_bytes
    table = model.get_input_embeddings().weight
    assert table.is_pinned()
    ids = torch.randint(0, 8192, (2, 64), device="cuda")
    assert torch.equal(model.get_input_embeddings()(ids), table.to("cuda")[ids])
