"""`decode.FOLDED_NORMS` in decoding steps (`decoder_layer.py`): the greedy tokens with the norms folded, the
decoder layers linked to the next one outside the module tree, and the guards of a fold (an input no fused
product read raises; x̃ handed on only to the rows it was written for)."""

import pytest
import torch
from test_generation import assert_same_greedy_tokens, set_fused_launches
from test_patch_model import tiny_model

from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.lora_down import rms_norm_lora_down_rows
from unsloth_lite.models import decode, decoder_layer, patch_model
from unsloth_lite.models.patching import NEXT_LAYER


@pytest.mark.parametrize("arch,shares", [("qwen3", False), ("qwen3_5", True), ("qwen2", False)])
def test_greedy_tokens_match_with_folded_norms(arch, shares, device, monkeypatch):
    """`decode.FOLDED_NORMS` (with the residual in the products, the grouped and gate-and-up launches and, for the
    tiny Qwen3.5, the down adapter's shares, which its o_proj and out_proj zero): no norm launch in a decoding
    step but the first layer's input norm; the greedy tokens those of the unpatched model."""
    fused = ["FOLDED_NORMS", "RESIDUAL_IN_PRODUCTS", "NORM_FIRST_PRODUCTS", "GROUPED_MATVEC", "GATED_MATVEC"]
    set_fused_launches(monkeypatch, on=(*fused, "MLP_SHARES") if shares else fused)
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    norms, folded = [], []
    monkeypatch.setattr(decoder_layer, "rms_norm_lora_down_rows",
                        lambda *args, **kwargs: norms.append(1) or rms_norm_lora_down_rows(*args, **kwargs))
    original = decode.normed_input
    monkeypatch.setattr(decode, "normed_input", lambda *args: folded.append(1) or original(*args))
    patched = assert_same_greedy_tokens(arch, "4bit+lora", "static", 3, device, prompt_shape=(2, 4))
    layers_count = patched.config.num_hidden_layers
    # each forward (the prompt's 8 rows are decoding rows too): the first layer's input norm launched, the other
    # 2L - 1 folded
    assert folded and len(folded) == (2 * layers_count - 1) * len(norms), (len(folded), len(norms))


def test_patching_links_each_decoder_layer_to_the_next_outside_the_module_tree():
    model = tiny_model("qwen3", "cpu")
    names, state = [name for name, _ in model.named_modules()], list(model.state_dict())
    patch_model(model)
    stack = model.model.layers
    assert len(stack) > 1
    assert [layer.__dict__[NEXT_LAYER] for layer in stack] == [*list(stack)[1:], None]
    assert [name for name, _ in model.named_modules()] == names and list(model.state_dict()) == state


def test_a_fold_whose_input_no_fused_product_reads_raises():
    x, h = torch.randn(1, 8), torch.randn(1, 8)
    with pytest.raises(RuntimeError, match="folded RMSNorm"), decode.normed_input(x, h, 1e-6):
        torch.nn.functional.linear(x, torch.randn(4, 8))  # a reader off the fused path
    with decode.normed_input(x, h, 1e-6):
        assert decode._norm_in_for(x.clone()) is None  # another tensor is not the folded input
        assert decode._norm_in_for(x) == (h, 1e-6)


def test_a_handed_norm_is_taken_only_with_its_rows_and_once():
    h, normed = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    decode.hand_on_norm(h, normed)
    assert decode.take_handed_norm(h.clone()) is None
    assert decode.take_handed_norm(h) is None  # the mismatch above dropped it
    decode.hand_on_norm(h, normed)
    assert decode.take_handed_norm(h) is normed and decode.take_handed_norm(h) is None
