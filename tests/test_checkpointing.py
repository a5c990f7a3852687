"""Gradient checkpointing through `enable_gradient_checkpointing`: the same loss and gradients as training
without checkpointing (and as Hugging Face's own checkpointing), for a full fine-tune and for LoRA, with
dropout drawing the same masks in the recomputation; the saved inputs in pinned CPU memory on a GPU."""

import copy

import pytest
import torch
from helpers import assert_close
from peft import LoraConfig, get_peft_model
from test_patch_model import batch, tiny_model

from unsloth_lite.models import patch_model
from unsloth_lite.training.checkpointing import checkpoint_layer, enable_gradient_checkpointing


def _loss_and_grads(model, input_ids, labels, seed=0):
    model.train()
    torch.manual_seed(seed)
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _compare(model, device, offload_to_cpu=False, tol=1e-5):
    input_ids, labels = batch(device)
    reference = copy.deepcopy(model)
    hf_checkpointed = copy.deepcopy(model)
    hf_checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_checkpointed.enable_input_require_grads()
    enable_gradient_checkpointing(model, offload_to_cpu=offload_to_cpu)
    expected_loss, expected = _loss_and_grads(reference, input_ids, labels)
    for other in (hf_checkpointed, model):
        loss, grads = _loss_and_grads(other, input_ids, labels)
        assert_close(loss, expected_loss, tol, "loss")
        assert grads.keys() == expected.keys() and grads
        for name, grad in grads.items():
            assert_close(grad, expected[name], tol, name)
    # a second step, so that state left by the first (e.g. offloaded buffers) cannot leak into it
    loss, grads = _loss_and_grads(model, input_ids, labels, seed=1)
    expected_loss, expected = _loss_and_grads(reference, input_ids, labels, seed=1)
    assert_close(loss, expected_loss, tol, "second loss")
    for name, grad in grads.items():
        assert_close(grad, expected[name], tol, f"second {name}")


def test_full_fine_tune_with_dropout(device):
    # attention dropout: the recomputation must draw the forward's masks again
    _compare(tiny_model("qwen3", device, attention_dropout=0.2), device)


def test_lora_on_patched_model(device):
    model = patch_model(tiny_model("qwen3", device))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"])
    model = get_peft_model(model, config)
    with torch.no_grad():  # LoRA B starts at zero: give it values so every adapter gradient is exercised
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    _compare(model, device, tol=1e-4)


def test_checkpoint_layer_passes_gradients_of_every_tensor_input(device):
    weight = torch.randn(5, 5, device=device, requires_grad=True)
    x = torch.randn(3, 5, device=device, requires_grad=True)
    y = torch.randn(3, 5, device=device, requires_grad=True)

    def layer(a, scale, b):
        return (a @ weight).tanh() * scale + b.sin()

    checkpoint_layer(layer, x, 2.0, y).square().sum().backward()
    grads = [t.grad.clone() for t in (x, y, weight)]
    for t in (x, y, weight):
        t.grad = None
    layer(x, 2.0, y).square().sum().backward()
    for got, name, t in zip(grads, "xyw", (x, y, weight), strict=True):
        assert_close(got, t.grad, 1e-6, name)


def test_no_decoder_layers_is_an_error():
    with pytest.raises(ValueError, match="no decoder layers"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.gpu
def test_offloaded_inputs_on_gpu():
    model = tiny_model("qwen3", "cuda", attention_dropout=0.2)
    _compare(model, "cuda", offload_to_cpu=True)
