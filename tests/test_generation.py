"""Generation through the patched model's `generate`: the same greedy tokens as the unpatched model's, tiny
Qwen2, Qwen3 and Qwen3.5 in fp32 on the CPU, dense or 4-bit base, with or without a LoRA adapter, through the
patched model's own decoding loop over its static cache (`models/decode_loop.py`: the default and
`cache_implementation="static"`) and through Hugging Face's loop over a dynamic cache (asked for by name).

The 4-bit models' reference is the unpatched model with each NF4 layer replaced by a dense layer holding the
dequantised weight (bitsandbytes' own CPU kernels are not a reference: see test_cpu_path). The 64-token runs
take the PyTorch references (a subprocess without Triton's interpreter); in this process the decoding kernels
themselves run for a few tokens (interpreted on the CPU), and on CUDA in bf16 with the CUDA graph.
"""

from __future__ import annotations

import copy
import importlib
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from helpers import assert_close, assert_counters_settled
from peft import LoraConfig, get_peft_model
from test_patch_model import tiny_model, tiny_qwen3_5

from unsloth_lite.kernels import nf4_matvec as nf4_matvec_module
from unsloth_lite.kernels.decode_attention import decode_attention
from unsloth_lite.kernels.deltanet_decode_gated import delta_rule_gated_step
from unsloth_lite.kernels.dequantize_nf4 import dequantize_nf4_reference
from unsloth_lite.kernels.lora_down import lora_down_rows, rms_norm_lora_down_rows
from unsloth_lite.kernels.nf4_gated_matvec import nf4_gated_matvec
from unsloth_lite.kernels.nf4_grouped_matvec import nf4_grouped_matvec
from unsloth_lite.models import decode, decoder_layer, layers, patch_model, qwen3_5_layers
from unsloth_lite.models.decode_graph import GRAPHS_ATTRIBUTE
from unsloth_lite.models.quantize import quantize_linears_nf4

TESTS_DIR = pathlib.Path(__file__).parent
ARCHS = ["qwen2", "qwen3", "qwen3_5"]


def tiny(arch, device, dtype):
    # Room for the 7-token prompt and 64 new tokens.
    if arch == "qwen3_5":
        return tiny_qwen3_5(device, dtype, max_position_embeddings=128)
    return tiny_model(arch, device, dtype, max_position_embeddings=128)


def dequantised_copy(model, dtype: torch.dtype | None = None):
    """`model` with every bitsandbytes 4-bit layer replaced by an `nn.Linear` of its dequantised weight (in the
    layer's compute dtype, or `dtype`: float32 keeps the exact code x absmax values, which bf16 rounds)."""
    dense = copy.deepcopy(model)
    for name, module in list(dense.named_modules()):
        if type(module).__name__ != "Linear4bit":
            continue
        quant_state = copy.copy(module.weight.quant_state)
        quant_state.dtype = dtype or quant_state.dtype
        weight = dequantize_nf4_reference(module.weight.data, quant_state)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None)
        linear = linear.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        parent, _, child = name.rpartition(".")
        setattr(dense.get_submodule(parent), child, linear)
    return dense


def with_adapter(model, seed: int):
    """LoRA on every linear layer, initialised at random (B too), so the adapter changes the outputs."""
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, config)


def model_pair(arch, variant, device="cpu", dtype=torch.float32):
    """(reference, patched): the unpatched model and a patched copy of the same weights. Variants: dense or
    `4bit` base, `+lora`."""
    reference, patched, _ = _models(arch, variant, device, dtype, with_exact=False)
    return reference, patched


def model_trio(arch, variant, device, dtype):
    """`model_pair`'s (reference, patched) and the exact model in float32: the reference's weights, except that
    a 4-bit layer's are dequantised in float32 (the reference's bf16 weights are those values rounded, the
    patched model's kernels have their own rounding: each is measured against the exact values)."""
    return _models(arch, variant, device, dtype, with_exact=True)


def _models(arch, variant, device, dtype, with_exact: bool):
    base = tiny(arch, device, dtype).eval()
    exact = None
    if variant.startswith("4bit"):
        base = quantize_linears_nf4(base, dtype)
        reference = dequantised_copy(base)
        exact = dequantised_copy(base, torch.float32) if with_exact else None
    else:
        reference = copy.deepcopy(base)
    if variant.endswith("+lora"):
        base, reference = with_adapter(base, 0), with_adapter(reference, 0)
    if with_exact and exact is None:
        exact = copy.deepcopy(reference)
    elif exact is not None and variant.endswith("+lora"):
        exact = with_adapter(exact, 0)
        adapters = dict(reference.named_parameters())
        with torch.no_grad():  # the reference's adapters exactly (PEFT casts them to each base layer's dtype)
            for name, param in exact.named_parameters():
                if "lora_" in name:
                    param.copy_(adapters[name])
    return reference.eval(), patch_model(base).eval(), None if exact is None else exact.float().eval()


def assert_same_greedy_tokens(
    arch, variant, cache_implementation, new_tokens, device="cpu", dtype=torch.float32, prompt_shape=(2, 7)
):
    reference, patched = model_pair(arch, variant, device, dtype)
    prompt = torch.randint(0, 151, prompt_shape, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if cache_implementation:
        kwargs["cache_implementation"] = cache_implementation
    expected = reference.generate(prompt, **kwargs)
    got = patched.generate(prompt, **kwargs)
    assert got.shape == (prompt_shape[0], prompt_shape[1] + new_tokens)
    mismatch = (got != expected).nonzero().tolist()
    assert not mismatch, f"{arch} {variant} {cache_implementation}: first differing token at {mismatch[0]}"
    return patched


# variant, cache implementation (None: the default; "dynamic": Hugging Face's loop)
LONG_RUNS = [("dense", "static"), ("dense+lora", "dynamic"), ("4bit+lora", None)]


def check_64_tokens() -> None:
    from helpers import bind_torch_delta_rule

    bind_torch_delta_rule()  # no CUDA in this process
    torch.manual_seed(0)
    for arch in ARCHS:
        for variant, cache_implementation in LONG_RUNS:
            assert_same_greedy_tokens(arch, variant, cache_implementation, 64)


def test_64_greedy_tokens_match_without_interpreter():
    """Every architecture and variant, one subprocess (the imports are paid once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR), env.get("PYTHONPATH", "")])
    code = "import test_generation as t; t.check_64_tokens()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def count_decode_calls(monkeypatch):
    """Counts the decoding kernels' calls where the models' forwards call them."""
    calls = {}
    targets = {
        "unsloth_lite.models.decode": ["nf4_matvec"],
        "unsloth_lite.models.layers": ["grouped_attention"],
        "unsloth_lite.models.qwen3_5_layers": ["conv_state_update", "delta_rule_step"],
    }

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for module_name, names in targets.items():
        module = importlib.import_module(module_name)
        for name in names:
            calls[name] = 0
            monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


# The interpreter is slow: the kernels run for a few tokens, each architecture with one cache kind.
KERNEL_RUNS = [("qwen2", "static"), ("qwen3", "dynamic"), ("qwen3_5", None)]
# `models.decode`'s switches of the fused decoding launches (most on by default).
FUSED_LAUNCHES = ("GATED_MATVEC", "GROUPED_MATVEC", "DECODE_ATTENTION", "GATED_DELTANET_STEP",
                  "RESIDUAL_IN_PRODUCTS", "NORM_FIRST_PRODUCTS", "NORM_ROPE_IN_ATTENTION", "MLP_SHARES")


def set_fused_launches(monkeypatch, on=()):
    """Each fused decoding launch on where `on` names it, off otherwise: one path under test, whatever the
    defaults."""
    for setting in FUSED_LAUNCHES:
        monkeypatch.setattr(decode, setting, setting in on)


@pytest.mark.parametrize("arch,cache_implementation", KERNEL_RUNS, ids=lambda v: str(v))
def test_greedy_tokens_match_on_decoding_kernels(arch, cache_implementation, device, monkeypatch):
    """A 4-bit base with an adapter, the unfused decoding kernels run (interpreted on the CPU), every one
    called."""
    set_fused_launches(monkeypatch)
    calls = count_decode_calls(monkeypatch)
    assert_same_greedy_tokens(arch, "4bit+lora", cache_implementation, 3, device, prompt_shape=(2, 4))
    assert calls["nf4_matvec"] and calls["grouped_attention"]
    if arch == "qwen3_5":
        assert calls["conv_state_update"] and calls["delta_rule_step"]


def test_greedy_tokens_match_with_the_gated_mlp_kernel(device, monkeypatch):
    """`decode.GATED_MATVEC`: each MLP's gate and up products and SwiGLU in one `nf4_gated_matvec` launch, the
    greedy tokens those of the unpatched model (the tiny Qwen3.5: its MLP's input, 64 wide, holds whole blocks)."""
    set_fused_launches(monkeypatch, on=("GATED_MATVEC",))
    calls = []
    monkeypatch.setattr(decode, "nf4_gated_matvec",
                        lambda *args, **kwargs: calls.append(1) or nf4_gated_matvec(*args, **kwargs))
    assert_same_greedy_tokens("qwen3_5", "4bit+lora", "static", 3, device, prompt_shape=(2, 4))
    assert calls


def test_greedy_tokens_match_with_grouped_projections(device, monkeypatch):
    """`decode.GROUPED_MATVEC`: the projections of one input (the DeltaNet's four, q/k/v, gate/up) in one
    `nf4_grouped_matvec` launch each, the greedy tokens those of the unpatched model."""
    set_fused_launches(monkeypatch, on=("GROUPED_MATVEC",))
    groups = []
    monkeypatch.setattr(decode, "nf4_grouped_matvec",
                        lambda x, weights, *args: groups.append(len(weights)) or nf4_grouped_matvec(x, weights, *args))
    assert_same_greedy_tokens("qwen3_5", "4bit+lora", "static", 3, device, prompt_shape=(2, 4))
    assert {4, 3, 2} <= set(groups)


@pytest.mark.parametrize("in_attention", [False, True], ids=["norm_rope_apart", "norm_rope_in_attention"])
@pytest.mark.parametrize("arch,cache_implementation", [("qwen3", "static"), ("qwen3_5", None)])
def test_greedy_tokens_match_with_fused_decode_attention(arch, cache_implementation, in_attention, device,
                                                         monkeypatch):
    """`decode.DECODE_ATTENTION`: each full-attention layer's cache update, attention and (Qwen3.5) output gate
    in one `decode_attention` launch over the static cache, with `decode.NORM_ROPE_IN_ATTENTION` the q/k norm and
    RoPE too; the greedy tokens those of the unpatched model."""
    set_fused_launches(monkeypatch, on=("DECODE_ATTENTION", "NORM_ROPE_IN_ATTENTION") if in_attention
                       else ("DECODE_ATTENTION",))
    calls = []
    monkeypatch.setattr(decode, "decode_attention", lambda *args: calls.append(args[8:]) or decode_attention(*args))
    assert_same_greedy_tokens(arch, "4bit+lora", cache_implementation, 3, device, prompt_shape=(2, 4))
    assert calls and all((gate is not None) == (arch == "qwen3_5") for gate, _ in calls)
    assert all((norm_rope is not None) == in_attention for _, norm_rope in calls)


@pytest.mark.parametrize("arch,cache_implementation", [("qwen2", "static"), ("qwen3_5", None)])
def test_greedy_tokens_match_with_the_residual_in_the_products(arch, cache_implementation, device, monkeypatch):
    """`decode.RESIDUAL_IN_PRODUCTS`: each decoder layer's two residual adds in its output projections'
    epilogues, the greedy tokens those of the unpatched model; every output projection took its residual."""
    set_fused_launches(monkeypatch, on=("RESIDUAL_IN_PRODUCTS",))
    taken = []
    original = decode.output_rows

    def output_rows(projection, x):
        pending = getattr(decode._PENDING_RESIDUAL, "pending", None)
        taken.append(pending is not None and not pending["taken"])
        return original(projection, x)

    monkeypatch.setattr(layers, "output_rows", output_rows)  # the token mixers'
    monkeypatch.setattr(decode, "output_rows", output_rows)  # the MLPs' (`decode.mlp_rows`)
    assert_same_greedy_tokens(arch, "4bit+lora", cache_implementation, 3, device, prompt_shape=(2, 4))
    assert taken and all(taken)


@pytest.mark.parametrize("arch,cache_implementation", [("qwen3", "static"), ("qwen3_5", None)])
def test_greedy_tokens_match_with_norms_and_first_products_in_one_launch(arch, cache_implementation, device,
                                                                         monkeypatch):
    """`decode.NORM_FIRST_PRODUCTS`: each decoder layer's norms in one launch with the first products of the
    adapters after them, taken by those projections instead of their own launch; the greedy tokens those of the
    unpatched model. (With `FIRST_PRODUCTS_IN_LAUNCH` the projections' launches take them instead: off here.)"""
    set_fused_launches(monkeypatch, on=("NORM_FIRST_PRODUCTS",))
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", False)
    launches = []
    monkeypatch.setattr(decode, "lora_down_rows", lambda x, lora_as: launches.append(len(lora_as)) or
                        lora_down_rows(x, lora_as))
    fused = []
    monkeypatch.setattr(decoder_layer, "rms_norm_lora_down_rows",
                        lambda *args: fused.append(len(args[-1])) or rms_norm_lora_down_rows(*args))
    assert_same_greedy_tokens(arch, "4bit+lora", cache_implementation, 3, device, prompt_shape=(2, 4))
    # left to their own launches: o's and down's one adapter, the DeltaNet's four (more than one launch takes)
    assert fused and all(count in (1, 4) for count in launches), (fused, launches)


def test_greedy_tokens_match_with_the_down_projections_first_product_from_the_gated_launch(device, monkeypatch):
    """`decode.MLP_SHARES` (with the gate-and-up launch and the norms with the first products): the down
    projection's adapter takes its first product from the gate-and-up launch, in stripes the norm's launch
    zeroed, instead of a `lora_down_rows` launch; the greedy tokens those of the unpatched model (the tiny
    Qwen3.5, whose MLP takes the gate-and-up launch)."""
    set_fused_launches(monkeypatch, on=("GATED_MATVEC", "NORM_FIRST_PRODUCTS", "MLP_SHARES", "RESIDUAL_IN_PRODUCTS"))
    shared = []
    monkeypatch.setattr(decode, "nf4_gated_matvec", lambda *args, **kwargs: shared.append(
        kwargs.get("down_shares") is not None) or nf4_gated_matvec(*args, **kwargs))
    assert_same_greedy_tokens("qwen3_5", "4bit+lora", "static", 3, device, prompt_shape=(2, 4))
    assert shared and all(shared)


@pytest.mark.parametrize("t_early", [False, True], ids=["t_in_epilogue", "t_before_walk"])
def test_greedy_tokens_match_with_every_fused_launch(t_early, device, monkeypatch):
    """Every fused decoding launch at once (the tiny Qwen3.5: gated attention and DeltaNet layers), the output
    projections' first products in their own launches, the given t loaded in the epilogues or before the walks
    (`matvec_epilogue.T_BEFORE_WALK`), the greedy tokens those of the unpatched model."""
    from unsloth_lite.kernels import matvec_epilogue

    set_fused_launches(monkeypatch, on=FUSED_LAUNCHES)
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", t_early)
    assert_same_greedy_tokens("qwen3_5", "4bit+lora", "static", 3, device, prompt_shape=(2, 4))
    assert_counters_settled(device)


def test_greedy_tokens_match_with_the_gated_deltanet_step(device, monkeypatch):
    """`decode.GATED_DELTANET_STEP`: each DeltaNet layer's gates, step and gated norm in one
    `delta_rule_gated_step` launch, the greedy tokens those of the unpatched model."""
    set_fused_launches(monkeypatch, on=("GATED_DELTANET_STEP",))
    calls = []
    monkeypatch.setattr(qwen3_5_layers, "delta_rule_gated_step",
                        lambda *args, **kwargs: calls.append(1) or delta_rule_gated_step(*args, **kwargs))
    assert_same_greedy_tokens("qwen3_5", "4bit+lora", None, 3, device, prompt_shape=(2, 4))
    assert calls


def test_sampling_runs_and_is_reproducible(device):
    _, patched = model_pair("qwen3", "dense+lora", device)
    prompt = torch.randint(0, 151, (1, 5), device=device)
    kwargs = dict(max_new_tokens=3, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    torch.manual_seed(1)
    first = patched.generate(prompt, **kwargs)
    torch.manual_seed(1)
    assert torch.equal(patched.generate(prompt, **kwargs), first)


def captured_decode_steps(model) -> int:
    return sum(
        step.graph is not None
        for module in model.modules()
        for step in module.__dict__.get(GRAPHS_ATTRIBUTE, {}).values()
    )


class FollowTokens:
    """A logits processor that records the model's logits at each step, then forces the next token to the
    given sequence's: the model decodes along another model's greedy path, through its own cache."""

    def __init__(self, tokens: torch.Tensor, prompt_length: int):
        self.tokens, self.prompt_length, self.logits = tokens, prompt_length, []

    def __call__(self, input_ids, scores):
        self.logits.append(scores.float().clone())
        step = input_ids.shape[1] - self.prompt_length
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.tokens[:, step:step + 1], 0.0)


def forced_logits(model, prompt, tokens, **kwargs) -> torch.Tensor:
    """`model`'s logits `[steps, B, V]` (fp32) decoding `tokens` after `prompt` through its own cache."""
    from transformers import LogitsProcessorList

    follow = FollowTokens(tokens, prompt.shape[1])
    out = model.generate(prompt, logits_processor=LogitsProcessorList([follow]), **kwargs)
    assert torch.equal(out[:, prompt.shape[1]:], tokens)
    return torch.stack(follow.logits)


def assert_greedy_path_followed(arch, variant, cache_implementation, new_tokens, device, dtype):
    """In bf16 two computations of one model agree on greedy tokens only where the best logit leads the next by
    more than their rounding differences, and random weights give near-ties (leads of 1e-3 against bf16
    differences of 4e-3), so tokens alone cannot be compared. Instead the patched model decodes along the
    unpatched model's greedy path (teacher forcing, through its own cache and decode path), as does the same
    unpatched model in float32 with 4-bit weights dequantised in float32 (the exact reference, `model_trio`),
    and the patched model's logits over the whole path must be as close to the exact ones as the unpatched
    model's own bf16 logits are (within 2x, 4x with the GPU's bf16 pair products of 4-bit weights, or 1e-2)."""
    from helpers import relative_error

    reference, patched, exact = model_trio(arch, variant, device, dtype)
    prompt = torch.randint(0, 151, (2, 7), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  cache_implementation=cache_implementation)
    expected = reference.generate(prompt, output_logits=True, return_dict_in_generate=True, **kwargs)
    path = expected.sequences[:, prompt.shape[1]:]
    exact_logits = forced_logits(exact, prompt, path, **kwargs)
    ours = forced_logits(patched, prompt, path, **kwargs)
    assert ours.shape == exact_logits.shape == (new_tokens, 2, 151)
    # On the GPU the word walk rounds each word's products in bf16 (`nf4_matvec.BF16_PAIR_PRODUCTS`): about 1.5x
    # Hugging Face's error a product (docs/benchmarks.md, "The word walk's products in bf16 pairs"); along a path
    # at Qwen3.5 with adapters two random seeds measured 2.5x and 2.6x Hugging Face's (2026-12-07): 4x for them.
    pair_products = device == "cuda" and variant.startswith("4bit") and nf4_matvec_module.BF16_PAIR_PRODUCTS
    factor = 4 if pair_products else 2
    bound = max(factor * relative_error(torch.stack(expected.logits).float(), exact_logits), 1e-2)
    assert_close(ours, exact_logits, bound, f"{arch} {variant} {cache_implementation}: logits along the path")
    return patched


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dense", "4bit+lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_greedy_path_matches_cuda(arch, variant, torch_delta_rule):
    """bf16 on CUDA, random weights, 32 new tokens along the reference's greedy path (see
    `assert_greedy_path_followed`): the patched model's loop over its static cache (the decode step replayed as
    a CUDA graph), and Hugging Face's loop over a dynamic cache (eager decode steps). The unpatched models run
    Hugging Face's own PyTorch DeltaNet, the float32 reference, not flash-linear-attention's kernels where those
    are installed."""
    patched = assert_greedy_path_followed(arch, variant, "static", 32, "cuda", torch.bfloat16)
    assert captured_decode_steps(patched) == 1
    assert_greedy_path_followed(arch, variant, "dynamic", 32, "cuda", torch.bfloat16)


def test_bf16_greedy_path_check_runs_on_cpu():
    """The bf16 check above on the CPU, a few tokens (the CUDA graph is CUDA only)."""
    assert_greedy_path_followed("qwen3", "4bit+lora", "static", 4, "cpu", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("setting,arch", [
    ("GATED_MATVEC", "qwen3_5"), ("GROUPED_MATVEC", "qwen3_5"), ("DECODE_ATTENTION", "qwen3_5"),
    ("DECODE_ATTENTION", "qwen3"), ("GATED_DELTANET_STEP", "qwen3_5"), ("RESIDUAL_IN_PRODUCTS", "qwen3_5"),
    ("RESIDUAL_IN_PRODUCTS", "qwen3"), ("NORM_FIRST_PRODUCTS", "qwen3"), (None, "qwen3"), (None, "qwen3_5"),
], ids=["gated_mlp", "grouped_projections", "decode_attention_gated", "decode_attention", "gated_deltanet_step",
        "residual_hybrid", "residual", "norm_first_products", "unfused", "unfused_hybrid"])
def test_bf16_greedy_path_matches_cuda_with_the_fused_launches(setting, arch, torch_delta_rule, monkeypatch):
    """Each fused decoding launch alone (`decode.GATED_MATVEC`, `decode.GROUPED_MATVEC`, `decode.DECODE_ATTENTION`,
    `decode.GATED_DELTANET_STEP`, `decode.RESIDUAL_IN_PRODUCTS`, `decode.NORM_FIRST_PRODUCTS`), or none: 32 bf16
    tokens along the reference's greedy path through the captured step (the tiny Qwen3.5, whose projections of a
    64-wide input hold whole blocks and whose attention is gated; the tiny Qwen3's attention ungated)."""
    set_fused_launches(monkeypatch, on=(setting,))
    patched = assert_greedy_path_followed(arch, "4bit+lora", "static", 32, "cuda", torch.bfloat16)
    assert captured_decode_steps(patched) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("screened", [False, True], ids=["full_head", "screened_head"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_greedy_tokens_match_cuda_with_the_one_launch_choice(arch, screened, torch_delta_rule, monkeypatch):
    """`decode_loop.GREEDY_TOKEN_KERNEL`, with `decode.SCREENED_LM_HEAD` or without: fp32 on CUDA, the decode step
    captured, the greedy tokens those of the unpatched model."""
    from unsloth_lite.models import decode_loop

    monkeypatch.setattr(decode_loop, "GREEDY_TOKEN_KERNEL", True)
    monkeypatch.setattr(decode, "SCREENED_LM_HEAD", screened)
    assert_same_greedy_tokens(arch, "4bit+lora", "static", 32, "cuda", prompt_shape=(2, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_bf16_greedy_path_matches_cuda_with_norm_rope_in_attention(arch, torch_delta_rule, monkeypatch):
    """`decode.NORM_ROPE_IN_ATTENTION` (in `decode.DECODE_ATTENTION`'s launch): 32 bf16 tokens along the
    reference's greedy path through the captured step (Qwen3's full rotary, Qwen3.5's partial and gated)."""
    set_fused_launches(monkeypatch, on=("DECODE_ATTENTION", "NORM_ROPE_IN_ATTENTION"))
    patched = assert_greedy_path_followed(arch, "4bit+lora", "static", 32, "cuda", torch.bfloat16)
    assert captured_decode_steps(patched) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_bf16_greedy_path_matches_cuda_with_the_down_adapters_shares(arch, torch_delta_rule, monkeypatch):
    """`decode.MLP_SHARES` (with the gate-and-up and norm launches that write and zero the stripes, and the
    fused attention): 32 bf16 tokens along the reference's greedy path through the captured step."""
    set_fused_launches(monkeypatch, on=("DECODE_ATTENTION", "RESIDUAL_IN_PRODUCTS", "GATED_MATVEC",
                                        "NORM_FIRST_PRODUCTS", "MLP_SHARES"))
    patched = assert_greedy_path_followed(arch, "4bit+lora", "static", 32, "cuda", torch.bfloat16)
    assert captured_decode_steps(patched) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("t_early", [False, True], ids=["t_in_epilogue", "t_before_walk"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_bf16_greedy_path_matches_cuda_with_every_fused_launch(arch, t_early, torch_delta_rule, monkeypatch):
    """Every fused decoding launch on at once, the small kernels and `lora_down` (split along K) as programmatic
    dependent launches, the given t loaded in the epilogues or before the walks (`matvec_epilogue.
    T_BEFORE_WALK`): 32 bf16 tokens along the reference's greedy path through the captured step."""
    from unsloth_lite.kernels import lora_down, matvec_epilogue, utils

    set_fused_launches(monkeypatch, on=FUSED_LAUNCHES)
    monkeypatch.setattr(nf4_matvec_module, "FIRST_PRODUCTS_IN_LAUNCH", True)
    monkeypatch.setattr(matvec_epilogue, "T_BEFORE_WALK", t_early)
    monkeypatch.setattr(utils, "DECODE_PDL", True)
    monkeypatch.setattr(lora_down, "SPLIT_K", True)
    monkeypatch.setattr(lora_down, "PDL", True)
    patched = assert_greedy_path_followed(arch, "4bit+lora", "static", 32, "cuda", torch.bfloat16)
    assert captured_decode_steps(patched) == 1


@pytest.mark.gpu
def test_cuda_graph_replays_match_eager_steps():
    """fp32 on CUDA: 64 tokens with the graph (two batch sizes, a second generate over a reused cache) against
    the unpatched model."""
    for batch in (1, 3):
        reference, patched = model_pair("qwen3_5", "4bit+lora", "cuda")
        prompt = torch.randint(0, 151, (batch, 7), device="cuda")
        kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
                      cache_implementation="static")
        expected = reference.generate(prompt, **kwargs)
        for _ in range(2):
            assert torch.equal(patched.generate(prompt, **kwargs), expected)
        assert captured_decode_steps(patched) == 1
