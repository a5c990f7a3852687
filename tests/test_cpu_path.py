"""4-bit + LoRA models on the CPU compute what they compute on the GPU, with our NF4 dequantisation, before and
after an evaluation: bitsandbytes' CPU kernels (whose eval-mode forward repacks the weights for `gemv_4bit`,
which has no autograd, and whose dequantisation misplaces absmax blocks in rows that split a block) never run.

Each check runs in this process (on the CPU under Triton's interpreter when there is no CUDA, as conftest sets
it) and in a subprocess without the interpreter, where the PyTorch references run; the `gpu` tests on CUDA.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

from unsloth_lite import add_lora, load_model
from unsloth_lite.kernels import dequantize_nf4
from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference
from unsloth_lite.kernels.utils import INTERPRET
from unsloth_lite.training.tiny import build_tiny_qwen3, build_tiny_tokenizer

# The NF4 code book of the QLoRA paper (bitsandbytes' table, as float32 literals).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# Targets leaving the down projections without adapters: the MLP then runs PEFT's forwards (PEFT calls the 4-bit
# base layers of gate and up) and a bare 4-bit down projection; the attention stays fused.
PARTIAL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj"
TESTS_DIR = pathlib.Path(__file__).parent
REPO_ROOT = TESTS_DIR.parent


def tiny_4bit_qwen3(path: pathlib.Path, device: str, **sizes):
    """The tiny recipe's Qwen3 (optionally resized), saved and loaded back in NF4 with double quantisation."""
    tokenizer = build_tiny_tokenizer()
    base = build_tiny_qwen3(tokenizer, seed=0)
    if sizes:
        config = base.config
        for key, value in sizes.items():
            setattr(config, key, value)
        base = type(base)(config)
    base.save_pretrained(path)
    tokenizer.save_pretrained(path)
    device_map = "cpu" if device == "cpu" else {"": torch.cuda.current_device()}
    model, _ = load_model(str(path), load_in_4bit=True, dtype=torch.float32, device_map=device_map)
    return model, tokenizer


def with_lora(model, targets: str):
    targets = targets if targets == "all-linear" else targets.split(",")
    model = add_lora(model, r=8, lora_alpha=16, target_modules=targets)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # PEFT starts B at zero, which would leave every A gradient zero
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def lora_gradients(model, input_ids, labels) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=input_ids, labels=labels).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if "lora_" in name}


def packed_weights(model) -> dict[str, torch.Tensor]:
    import bitsandbytes as bnb

    return {
        name: module.weight.data.clone() for name, module in model.named_modules()
        if isinstance(module, bnb.nn.Linear4bit)
    }


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_evaluation_keeps_gradients(path: str, device: str, targets: str) -> None:
    """Train step, `generate` in eval mode, train step on the same batch: the same LoRA gradients, the same
    packed weights, and nothing from bitsandbytes (no warning, no log record) in between."""
    model, tokenizer = tiny_4bit_qwen3(pathlib.Path(path), device)
    model = with_lora(model, targets)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, len(tokenizer) - 1, (2, 16), generator=generator).to(device)
    labels = input_ids.clone()
    labels[:, :4] = -100
    weights = packed_weights(model)
    assert weights, "the model has no 4-bit layers"

    bnb_log = _Records()
    logging.getLogger("bitsandbytes").addHandler(bnb_log)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = lora_gradients(model, input_ids, labels)
            model.eval()
            with torch.no_grad():
                model.generate(
                    input_ids=input_ids[:1, :8], max_new_tokens=4, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                )
            after = lora_gradients(model, input_ids, labels)
    finally:
        logging.getLogger("bitsandbytes").removeHandler(bnb_log)

    suspicious = [str(w.message) for w in caught if any(
        word in str(w.message) for word in ("bitsandbytes", "gemv", "autograd kernel", "Linear4bit")
    )]
    assert not suspicious, suspicious
    assert not bnb_log.messages, bnb_log.messages
    assert before.keys() == after.keys() and before
    num = sum(float((after[k].double() - before[k].double()).norm()) ** 2 for k in before) ** 0.5
    den = sum(float(before[k].double().norm()) ** 2 for k in before) ** 0.5
    assert den > 0
    assert num <= 1e-6 * den, f"LoRA gradients changed by the evaluation: relative {num / den:.3e}"
    for name, packed in packed_weights(model).items():
        assert torch.equal(packed, weights[name]), f"{name}: packed NF4 weight changed"
        assert not getattr(model.get_submodule(name).weight.quant_state, "packing_format_for_cpu", False), name


def nf4_float_reference(weight) -> torch.Tensor:
    """A weight's NF4 decoding in float64 from the code book above: nibbles high first, one absmax per flat block
    of the whole tensor (double-quantised absmax decoded from the state's 8-bit table), no bitsandbytes code."""
    qs = weight.quant_state
    n = qs.shape.numel()
    packed = weight.data.reshape(-1).view(torch.uint8).to(torch.int64)
    nibbles = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n]
    if qs.nested:
        blocks = torch.arange(qs.absmax.numel(), device=packed.device) // qs.state2.blocksize
        absmax = qs.state2.code.double()[qs.absmax.long()] * qs.state2.absmax.double()[blocks] + qs.offset.double()
    else:
        absmax = qs.absmax.double()
    code = torch.tensor(NF4_CODE, dtype=torch.float64, device=packed.device)
    return (code[nibbles] * absmax[torch.arange(n, device=packed.device) // qs.blocksize]).reshape(tuple(qs.shape))


def check_odd_width_layers(path: str, device: str) -> None:
    """4-bit layers of 96 and 160 inputs (rows that split 64-element blocks): our dequantisation is the NF4 code
    book's, and each layer's forward and input gradient are those of that weight, in training and in eval mode."""
    import bitsandbytes as bnb

    model, _ = tiny_4bit_qwen3(
        pathlib.Path(path), device, hidden_size=96, intermediate_size=160, num_attention_heads=3,
        num_key_value_heads=1,
    )
    layers = {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert {m.in_features for m in layers.values()} == {96, 160}
    generator = torch.Generator().manual_seed(2)
    for name, layer in layers.items():
        reference = nf4_float_reference(layer.weight)
        ours = dequantize_nf4_reference(layer.weight.data, layer.weight.quant_state)
        torch.testing.assert_close(ours.double(), reference, rtol=1e-6, atol=1e-7, msg=name)
        if device == "cuda" or INTERPRET:
            torch.testing.assert_close(dequantize_nf4(layer.weight).double(), reference, rtol=1e-6, atol=1e-7)
        packed = layer.weight.data.clone()
        x = torch.randn(2, 5, layer.in_features, generator=generator, dtype=torch.float64).to(device)
        dy = torch.randn(2, 5, layer.out_features, generator=generator, dtype=torch.float64).to(device)
        expected = x @ reference.T
        for training in (True, False):
            layer.train(training)
            x32 = x.float().requires_grad_(training)
            with torch.set_grad_enabled(training):
                y = layer(x32)
            torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4, msg=f"{name} train={training}")
            if training:
                y.backward(dy.float())
                torch.testing.assert_close(x32.grad.double(), dy @ reference, rtol=1e-4, atol=1e-4, msg=name)
        assert torch.equal(layer.weight.data, packed), f"{name}: packed NF4 weight changed"


def run_without_interpreter(check: str, *args) -> None:
    """`check(*args)` in a fresh Python without TRITON_INTERPRET (this session sets it when there is no CUDA),
    on the CPU; its stderr must not mention bitsandbytes' autograd-less CPU kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")])
    code = f"import test_cpu_path as t; t.{check}(*{args!r})"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for word in ("gemv_4bit", "autograd kernel was not registered"):
        assert word not in result.stderr, result.stderr[-6000:]


@pytest.mark.parametrize("targets", ["all-linear", PARTIAL_TARGETS])
def test_evaluation_keeps_gradients_cpu(targets, tmp_path):
    run_without_interpreter("check_evaluation_keeps_gradients", str(tmp_path / "model"), "cpu", targets)


@pytest.mark.parametrize("targets", ["all-linear", PARTIAL_TARGETS])
def test_evaluation_keeps_gradients_cpu_interpreted(targets, tmp_path):
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest when there is no CUDA)")
    check_evaluation_keeps_gradients(str(tmp_path / "model"), "cpu", targets)


@pytest.mark.gpu
@pytest.mark.parametrize("targets", ["all-linear", PARTIAL_TARGETS])
def test_evaluation_keeps_gradients_cuda(targets, tmp_path):
    check_evaluation_keeps_gradients(str(tmp_path / "model"), "cuda", targets)


def test_odd_width_layers_cpu(tmp_path):
    run_without_interpreter("check_odd_width_layers", str(tmp_path / "model"), "cpu")


def test_odd_width_layers_cpu_interpreted(tmp_path):
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest when there is no CUDA)")
    check_odd_width_layers(str(tmp_path / "model"), "cpu")


@pytest.mark.gpu
def test_odd_width_layers_cuda(tmp_path):
    check_odd_width_layers(str(tmp_path / "model"), "cuda")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_5"])
def test_every_4bit_layer_takes_our_forward(arch, tmp_path):
    """Qwen2, Qwen3 and Qwen3.5 (Gated DeltaNet and gated attention projections included): every bitsandbytes
    4-bit layer runs `linear4bit_forward`, before and after PEFT wraps it; PEFT's LoRA layers keep theirs."""
    import bitsandbytes as bnb
    from test_patch_model import tiny_model, tiny_qwen3_5

    from unsloth_lite.models.layers import linear4bit_forward

    base = tiny_qwen3_5("cpu") if arch == "qwen3_5" else tiny_model(arch, "cpu", hidden_size=64, intermediate_size=96)
    base.save_pretrained(tmp_path / "model")
    model, _ = load_model(str(tmp_path / "model"), load_in_4bit=True, dtype=torch.float32, device_map="cpu")
    model = add_lora(model, r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"])
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) > 4
    for layer in layers:
        assert getattr(layer.forward, "__func__", None) is linear4bit_forward, type(layer)
        assert not layer.support_avx512bf16_for_cpu
    wrappers = [m for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    assert wrappers and all(getattr(w.forward, "__func__", None) is not linear4bit_forward for w in wrappers)
