"""patch_model on tiny Qwen2 and Qwen3 models built from configs (random weights, no download): the patched
model computes the same loss, logits and gradients as the unpatched one."""

import copy

import pytest
import torch
from helpers import assert_close
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from unsloth_lite.models import patch_model

COMMON = dict(
    vocab_size=151, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attn_implementation="sdpa",
)


def tiny_model(arch: str, device, dtype=torch.float32, **overrides):
    settings = {**COMMON, **overrides}
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 16, **settings}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**settings))
    # Norm weights of 1 (their initial value) would hide a weight that is dropped or applied twice.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
    return model.to(device=device, dtype=dtype)


def batch(device, vocab=151, size=(2, 11)):
    input_ids = torch.randint(0, vocab, size, device=device)
    labels = input_ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    labels[1, -2:] = -100
    return input_ids, labels


# Hugging Face's Qwen3.5 runs its norms in float32 even in a float64 model (its delta rule, which does too, is bound
# to float64 references here: `helpers.bind_torch_delta_rule`), so its gradients carry float32 rounding, about 1e-7
# of the largest gradient; those that cancel to a small fraction of the largest
# (dt_bias's and A_log's, ~1e-6 of it) are compared against this floor rather than their own norm.
QWEN3_5_GRADIENT_FLOOR = 1e-3


def assert_gradients_match(patched, reference, tol, floor=1e-6):
    """Every parameter gradient of `patched` against `reference`'s, relative to the larger of its own norm and
    `floor` times the model's largest gradient norm (see QWEN3_5_GRADIENT_FLOOR)."""
    expected = dict(reference.named_parameters())
    largest = max(float(p.grad.norm()) for p in expected.values() if p.grad is not None)
    for name, param in patched.named_parameters():
        assert param.grad is not None, name
        ref = expected[name].grad
        assert bool(torch.isfinite(param.grad).all()), f"grad {name} has NaN/inf"
        scale = max(float(ref.norm()), floor * largest)
        err = float((param.grad.double() - ref.double()).norm()) / scale
        assert err <= tol, f"grad {name}: error {err:.3e} of max(||ref||, {floor:.0e} x largest) > {tol:.1e}"


def assert_patched_matches(reference, loss_tol, grad_tol, device, gradient_floor=1e-6):
    """Loss and every parameter gradient of a patched copy of `reference` against `reference` itself."""
    patched = patch_model(copy.deepcopy(reference))
    input_ids, labels = batch(device)
    expected = reference(input_ids=input_ids, labels=labels)
    expected.loss.backward()
    out = patched(input_ids=input_ids, labels=labels)
    out.loss.backward()
    assert out.logits is None  # labels given, logits not asked for: never formed
    assert_close(out.loss.float(), expected.loss.float(), loss_tol, "loss")
    assert_gradients_match(patched, reference, grad_tol, gradient_floor)
    return patched


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_patched_model_matches_unpatched(arch, device):
    assert_patched_matches(tiny_model(arch, device), 1e-5, 1e-4, device)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_patched_model_logits_without_labels(arch, device):
    reference = tiny_model(arch, device)
    patched = patch_model(copy.deepcopy(reference))
    input_ids, labels = batch(device)
    with torch.no_grad():
        assert_close(patched(input_ids=input_ids).logits, reference(input_ids=input_ids).logits, 1e-5, "logits")
        both = patched(input_ids=input_ids, labels=labels, return_logits=True)
        expected = reference(input_ids=input_ids, labels=labels)
    assert_close(both.logits, expected.logits, 1e-5, "logits with labels")
    assert_close(both.loss, expected.loss, 1e-5, "loss with logits")


def test_patched_loss_with_num_items_in_batch(device):
    """Gradient accumulation: the sum of token losses over the given count, as Hugging Face computes it."""
    reference = tiny_model("qwen3", device)
    patched = patch_model(copy.deepcopy(reference))
    input_ids, labels = batch(device)
    count = torch.tensor(37, device=device)
    with torch.no_grad():
        expected = reference(input_ids=input_ids, labels=labels, num_items_in_batch=count).loss
        got = patched(input_ids=input_ids, labels=labels, num_items_in_batch=count).loss
    assert_close(got, expected, 1e-5, "loss")


def assert_bf16_as_close_as_the_unpatched(reference, device, loss_floor=1e-3, gradient_floor=2e-2):
    """A bf16 model's patched copy against the same weights in float32 (the exact reference): its loss and each
    parameter gradient within 2x the unpatched bf16 model's own error, or the floor. Two bf16 computations of one
    model differ by their roundings, which for some random models is most of the unpatched one's error (a q_norm
    gradient 4.8e-2 from float32 where the patched model's is 2.0e-2): a bound between the two would have to
    cover the worse of them."""
    exact = copy.deepcopy(reference).float()
    patched = patch_model(copy.deepcopy(reference))
    input_ids, labels = batch(device)
    losses = {}
    for name, model in (("unpatched", reference), ("exact", exact), ("patched", patched)):
        out = model(input_ids=input_ids, labels=labels)
        out.loss.backward()
        losses[name] = out.loss.detach().double()
    assert torch.isfinite(losses["patched"])
    own_loss_error = float((losses["unpatched"] - losses["exact"]).abs() / losses["exact"].abs())
    assert_close(losses["patched"], losses["exact"], max(2 * own_loss_error, loss_floor), "loss")
    exact_grads, unpatched = dict(exact.named_parameters()), dict(reference.named_parameters())
    largest = max(float(p.grad.norm()) for p in exact_grads.values())
    for name, param in patched.named_parameters():
        assert param.grad is not None and bool(torch.isfinite(param.grad).all()), name
        expected = exact_grads[name].grad.double()
        scale = max(float(expected.norm()), 1e-6 * largest)
        error = float((param.grad.double() - expected).norm()) / scale
        own_error = float((unpatched[name].grad.double() - expected).norm()) / scale
        assert error <= max(2 * own_error, gradient_floor), (
            f"grad {name}: error {error:.3e} from float32 against the unpatched bf16 model's {own_error:.3e}")


def test_patched_bf16_model(device):
    assert_bf16_as_close_as_the_unpatched(tiny_model("qwen3", device, torch.bfloat16), device)


def test_patched_generation_matches(device):
    reference = tiny_model("qwen3", device).eval()
    patched = patch_model(copy.deepcopy(reference))
    prompt = torch.randint(0, 151, (1, 5), device=device)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def test_patch_is_idempotent_and_per_instance(device):
    model = tiny_model("qwen3", device)
    untouched = copy.deepcopy(model)
    patch_model(model)
    forwards = {name: m.forward for name, m in model.named_modules() if "forward" in m.__dict__}
    # per layer: the decoder layer, its two norms, q_norm, k_norm, attention, MLP; then the final norm and the
    # causal-LM head
    assert len(forwards) == 2 * 7 + 2
    patch_model(model)
    assert {name: m.forward for name, m in model.named_modules() if "forward" in m.__dict__} == forwards
    assert not any("forward" in m.__dict__ for m in untouched.modules())  # a second model stays unpatched


def test_patch_rejects_unsupported_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="model_type .llama.*supported: qwen2, qwen3, qwen3_5, qwen3_5_text"):
        patch_model(model)


def test_patch_names_the_missing_attribute(device):
    model = tiny_model("qwen3", device)
    del model.model.layers[0].self_attn.q_norm
    with pytest.raises(RuntimeError, match="transformers .*Qwen3Attention has no q_norm.weight"):
        patch_model(model)


QWEN3_5_MODULES = ("Qwen3_5RMSNorm", "Qwen3_5Attention", "Qwen3_5GatedDeltaNet", "Qwen3_5MLP", "Qwen3_5ForCausalLM")


def tiny_qwen3_5(device, dtype=torch.float32, **overrides):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    settings = dict(
        vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    config = Qwen3_5TextConfig(**{**settings, **overrides})
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # zero-centred: around 0
                param.copy_(0.3 * torch.randn_like(param))
    return model.to(device=device, dtype=dtype)


def assert_every_module_patched(model, module_classes) -> None:
    """Every instance of `module_classes` runs its fused forward; each class occurs."""
    seen = set()
    for name, module in model.named_modules():
        if type(module).__name__ in module_classes:
            seen.add(type(module).__name__)
            assert module.__dict__.get("_unsloth_lite_patched"), f"{name} ({type(module).__name__}) is not patched"
            assert "forward" in module.__dict__, f"{name} ({type(module).__name__}) lost its fused forward"
    assert seen == set(module_classes), f"missing {set(module_classes) - seen}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_patched_qwen3_5_matches_unpatched(dtype, device, torch_delta_rule):
    """Full fine-tune, every module on the fused path (the DeltaNet layers on our kernels). Float64 as the
    padded-batch test below (see QWEN3_5_GRADIENT_FLOOR); float32 within the fp32 tolerances."""
    patched = assert_patched_matches(
        tiny_qwen3_5(device, dtype), 1e-5, 1e-4, device, gradient_floor=QWEN3_5_GRADIENT_FLOOR
    )
    assert_every_module_patched(patched, QWEN3_5_MODULES)


def _padded_batch(device, ignore_pads=True, left=False):
    input_ids, labels = batch(device, size=(3, 13))
    lengths = [13, 9, 5]
    mask = torch.zeros(3, 13, dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        if left:
            mask[row, 13 - n:] = 1
        else:
            mask[row, :n] = 1
    if ignore_pads:
        labels = labels.masked_fill(mask == 0, -100)
    return input_ids, labels, mask


@pytest.mark.parametrize("case", ["right_padded", "pad_targets_trained", "left_padded"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_5"])
def test_padded_batch_loss_and_grads(arch, case, device, monkeypatch, torch_delta_rule):
    """Right padding with ignored pad targets trains without the mask (causal attention suffices); otherwise
    the mask is kept. Either way loss and gradients equal the unpatched model's with its mask. In float64, and
    see QWEN3_5_GRADIENT_FLOOR for Qwen3.5."""
    f64 = torch.float64
    reference = tiny_qwen3_5(device, f64) if arch == "qwen3_5" else tiny_model(arch, device, f64)
    patched = patch_model(copy.deepcopy(reference))
    ignore_pads, left = case != "pad_targets_trained", case == "left_padded"
    input_ids, labels, mask = _padded_batch(device, ignore_pads=ignore_pads, left=left)
    masks_seen = []
    inner_forward = type(patched.model).forward

    def spying_forward(self, *args, **kwargs):
        masks_seen.append(kwargs.get("attention_mask"))
        return inner_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(patched.model), "forward", spying_forward)
    expected = reference(input_ids=input_ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    out = patched(input_ids=input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert (masks_seen[-1] is None) == (case == "right_padded")
    assert_close(out.loss, expected.loss, 1e-5, "loss")
    assert_gradients_match(patched, reference, 1e-4, QWEN3_5_GRADIENT_FLOOR if arch == "qwen3_5" else 1e-6)
