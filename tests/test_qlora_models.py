"""Patched PEFT models, dense and 4-bit NF4, against the same models unpatched; load_model and add_lora;
adapters saved and loaded in standard PEFT format."""

import copy
import importlib

import pytest
import torch
from helpers import assert_close
from peft import LoraConfig, PeftModel, get_peft_model
from test_patch_model import (
    QWEN3_5_GRADIENT_FLOOR,
    QWEN3_5_MODULES,
    assert_every_module_patched,
    batch,
    tiny_model,
    tiny_qwen3_5,
)

from unsloth_lite import add_lora, load_model, patch_model
from unsloth_lite.models.patching import ARCHITECTURES, model_config

lora_module = importlib.import_module("unsloth_lite.kernels.lora")


def randomise_adapters(model):
    """PEFT starts B at zero, which would leave every A gradient zero: give the adapters real values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn_like(param))


def count_fused_calls(monkeypatch):
    calls = {"mlp": 0, "projections": 0}
    mlp, projections = lora_module.LoRAMLPFunction.apply, lora_module.LoRAProjectionsFunction.apply

    def counted(kind, fn):
        def call(*args):
            calls[kind] += 1
            return fn(*args)

        return call

    monkeypatch.setattr(lora_module.LoRAMLPFunction, "apply", counted("mlp", mlp))
    monkeypatch.setattr(lora_module.LoRAProjectionsFunction, "apply", counted("projections", projections))
    return calls


def lora_grads(model):
    return {name: p.grad for name, p in model.named_parameters() if "lora_" in name}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_patched_peft_model_matches(arch, device, monkeypatch):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    reference = get_peft_model(tiny_model(arch, device), config)
    randomise_adapters(reference)
    patched = patch_model(copy.deepcopy(reference))
    calls = count_fused_calls(monkeypatch)
    input_ids, labels = batch(device)

    expected = reference(input_ids=input_ids, labels=labels)
    expected.loss.backward()
    out = patched(input_ids=input_ids, labels=labels)
    out.loss.backward()

    assert calls == {"mlp": 2, "projections": 4}  # per layer: the MLP, q/k/v together, o
    assert_close(out.loss, expected.loss, 1e-5, "loss")
    expected_grads = lora_grads(reference)
    for name, grad in lora_grads(patched).items():
        assert_close(grad, expected_grads[name], 1e-4, f"grad {name}")


def test_lora_dropout_keeps_peft_path(device, monkeypatch):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")
    model = patch_model(get_peft_model(tiny_model("qwen3", device), config)).eval()  # eval: dropout off
    calls = count_fused_calls(monkeypatch)
    input_ids, labels = batch(device)
    with pytest.warns(UserWarning, match="LoRA dropout > 0 runs on PEFT's"):
        lora_module_layers = importlib.import_module("unsloth_lite.models.layers")
        lora_module_layers._WARNED.clear()
        model(input_ids=input_ids, labels=labels)
    assert calls == {"mlp": 0, "projections": 0}


def save_tiny_checkpoint(arch, path):
    # Every row a whole number of 64-element quantisation blocks: bitsandbytes 0.50's AVX-512 CPU kernel
    # (the reference here) reads the wrong absmax for rows that split a block.
    if arch == "qwen3_5":
        model = tiny_qwen3_5("cpu", intermediate_size=192)
    else:
        model = tiny_model(arch, "cpu", hidden_size=64, intermediate_size=192)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_5"])
def test_4bit_lora_matches_peft(arch, tmp_path, monkeypatch, torch_delta_rule):
    """4-bit NF4 base (double quantisation) + LoRA: patched vs bitsandbytes + PEFT on the same weights."""
    if torch.cuda.is_available():
        pytest.skip("the GPU variant of this check runs in test_kernels_gpu")
    path = save_tiny_checkpoint(arch, tmp_path / "model")
    models = []
    for _ in range(2):
        model, tokenizer = load_model(path, load_in_4bit=True, dtype=torch.float32, device_map="cpu")
        assert tokenizer is None
        models.append(model)
    reference, patched = models
    # load_model patched both; the reference runs Hugging Face's forwards instead
    for module in reference.modules():
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_unsloth_lite_patched", None)
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    torch.manual_seed(0)
    reference = get_peft_model(reference, LoraConfig(**config))
    torch.manual_seed(0)
    patched = add_lora(patched, **config)
    randomise_adapters(reference)
    with torch.no_grad():
        for (name, p), (_, q) in zip(reference.named_parameters(), patched.named_parameters(), strict=True):
            if "lora_" in name:
                q.copy_(p)
    reference.train()
    patched.train()  # bitsandbytes repacks CPU weights of odd shapes in eval mode
    calls = count_fused_calls(monkeypatch)
    input_ids, labels = batch("cpu")

    expected = reference(input_ids=input_ids, labels=labels)
    expected.loss.backward()
    out = patched(input_ids=input_ids, labels=labels)
    out.loss.backward()

    assert calls["mlp"] == 2 and calls["projections"] == 4  # per layer: MLP, the mixer's inputs, its output
    if arch == "qwen3_5":
        assert_every_module_patched(patched, QWEN3_5_MODULES)
    assert_close(out.loss, expected.loss, 1e-2, "loss")
    expected_grads = lora_grads(reference)
    # Qwen3.5: gradients that cancel to a small fraction of the largest (its decay gates') are compared against
    # that fraction (QWEN3_5_GRADIENT_FLOOR): Hugging Face runs its norms in float32 whatever the model's dtype
    largest = max(float(g.norm()) for g in expected_grads.values())
    floor = QWEN3_5_GRADIENT_FLOOR * largest if arch == "qwen3_5" else 0.0
    for name, grad in lora_grads(patched).items():
        ref = expected_grads[name]
        if float(ref.norm()) >= floor:
            assert_close(grad, ref, 3e-2, f"grad {name}")
        else:
            error = float((grad.double() - ref.double()).norm()) / floor
            assert error <= 3e-2, f"grad {name}: error {error:.3e} of {floor:.2e} (the floor) > 3e-2"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_5"])
def test_patches_survive_mode_switches(arch, tmp_path):
    """transformers >= 5.25 kernelizes what `from_pretrained` loads and kernelizes it again at each `train()` or
    `eval()` that changes mode, which unbinds forwards bound on instances: the fused forwards stay bound through
    both, before and after LoRA (the Trainer calls `train()` every step)."""
    model, _ = load_model(save_tiny_checkpoint(arch, tmp_path / "model"), dtype=torch.float32, device_map="cpu")
    model.eval()
    model.train()
    model = add_lora(model, r=4, lora_alpha=8, target_modules="all-linear")
    model.eval()
    model.train()
    present = {type(module).__name__ for module in model.modules()}
    # (PEFT's LoRA wrapper of a 4-bit layer is named Linear4bit too, and keeps its own forward)
    fused = {rule.module_class for rule in ARCHITECTURES[model_config(model).model_type]} & present - {"Linear4bit"}
    assert len(fused) >= 4
    assert_every_module_patched(model, fused)


def test_adapter_round_trip(tmp_path, device):
    torch.manual_seed(1)
    model = add_lora(tiny_model("qwen3", device), r=4, lora_alpha=8)
    randomise_adapters(model)
    input_ids, _ = batch(device)
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert (tmp_path / "adapter" / "adapter_config.json").exists()

    torch.manual_seed(1)
    base = tiny_model("qwen3", device)  # the same base weights, from the same seed
    reloaded = patch_model(PeftModel.from_pretrained(base, tmp_path / "adapter"))
    with torch.no_grad():
        assert_close(reloaded(input_ids=input_ids).logits, expected, 1e-5, "logits after reload")


def test_load_model_checks_max_seq_length(tmp_path):
    path = save_tiny_checkpoint("qwen3", tmp_path / "model")
    with pytest.raises(ValueError, match="max_seq_length=100 exceeds the model's max_position_embeddings=64"):
        load_model(path, load_in_4bit=False, dtype=torch.float32, max_seq_length=100, device_map="cpu")
    model, _ = load_model(path, load_in_4bit=False, dtype=torch.float32, max_seq_length=32, device_map="cpu")
    assert model.max_seq_length == 32
    assert model.model.layers[0].mlp.__dict__.get("_unsloth_lite_patched")
