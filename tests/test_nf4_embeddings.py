"""The input embedding and lm_head in NF4 (`quantize_embeddings_nf4`): the row gather and row-range
dequantisation against the dequantised table, the fused cross-entropy with an NF4 weight against the dense
dequantised weight, and tiny Qwen3 / Qwen3.5 models (LoRA) against the same models holding the dense
dequantised matrices. The `gpu` tests run at Qwen3.5-27B's shape (V = 248,320, H = 5,120, 2,048 tokens)."""

import copy
import gc
import importlib
import warnings
import weakref

import pytest
import torch
from helpers import TOLERANCE, assert_close, dtype_id
from peft import LoraConfig, get_peft_model
from test_patch_model import batch, tiny_model, tiny_qwen3_5
from test_qlora_models import randomise_adapters, save_tiny_checkpoint

from unsloth_lite.kernels import dequantize_nf4, fused_linear_cross_entropy
from unsloth_lite.kernels.dequantize_nf4 import (
    dequantize_nf4_reference,
    dequantize_nf4_row_range,
    dequantize_nf4_rows,
    dequantize_nf4_rows_reference,
)
from unsloth_lite.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_reference
from unsloth_lite.models import NF4Embedding, load_model, patch_model, quantize_embeddings_nf4
from unsloth_lite.recipes import load_recipe

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import bitsandbytes as bnb

flce_nf4 = importlib.import_module("unsloth_lite.kernels.fused_linear_cross_entropy_nf4")

REDUCTIONS = ["mean", "sum", "none"]
IGNORE = -100


def nf4(dense: torch.Tensor, device, nested=True):
    """A bitsandbytes NF4 `Params4bit` of `dense` (block 64), quantised on `device` as `quantize_embeddings_nf4`
    does."""
    p = bnb.nn.Params4bit(
        dense.detach().to(device), requires_grad=False, quant_type="nf4", compress_statistics=nested, blocksize=64
    )
    return p.to(device)


def assert_equal(actual, expected, name):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    assert not torch.isnan(actual).any(), f"{name}: NaN (unwritten) elements"
    assert torch.equal(actual, expected), f"{name}: {int((actual != expected).sum())} elements differ"


# ----------------------------------------------------------------------------------------------------------
# Dequantising rows


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("n_cols", [128, 192, 100])  # 100: rows that split quantisation blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gather_rows_match_dequantised_table(dtype, n_cols, nested, device):
    vocab = 301  # odd; > 256 absmax values at 128 columns: several nested absmax blocks
    p = nf4(torch.randn(vocab, n_cols, dtype=dtype), device, nested)
    table = dequantize_nf4(p)
    ids = torch.randint(0, vocab, (3, 7), device=device)
    ids[0, :3] = torch.tensor([0, vocab - 1, 0])  # first and last rows, a repeat
    assert_equal(dequantize_nf4_rows(p, ids), table[ids], "gather")
    assert_equal(dequantize_nf4_rows_reference(p.data, p.quant_state, ids), table[ids], "gather reference")
    assert_equal(dequantize_nf4_rows(p, ids[0, 1]), table[vocab - 1], "one id (0-d)")


def test_gather_rows_out_of_range_give_zeros(device):
    p = nf4(torch.randn(65, 128), device)
    rows = dequantize_nf4_rows(p, torch.tensor([3, -1, 65, 64], device=device))
    assert bool((rows[1:3] == 0).all())
    assert_equal(rows[[0, 3]], dequantize_nf4(p)[[3, 64]], "in range")


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_row_range_matches_dequantised_table(dtype, nested, device):
    p = nf4(torch.randn(301, 192, dtype=dtype), device, nested)
    table = dequantize_nf4(p)
    buffer = torch.full((64, 192), float("nan"), dtype=dtype, device=device)
    for first, count in [(0, 64), (5, 17), (256, 45), (300, 1)]:  # (256, 45): the partial last block of a walk
        assert_equal(dequantize_nf4_row_range(p, first, buffer[:count]), table[first:first + count], f"rows {first}")
    with pytest.raises(ValueError, match=r"rows \[290, 302\) are not within"):
        dequantize_nf4_row_range(p, 290, buffer[:12])
    with pytest.raises(ValueError, match="not whole quantization blocks"):
        dequantize_nf4_row_range(nf4(torch.randn(9, 100), device), 0, torch.empty(2, 100, device=device))


# ----------------------------------------------------------------------------------------------------------
# Fused linear cross-entropy with an NF4 weight


def _inputs(n, h, v, dtype, device, ignore_frac=0.25, logit_std=2.0):
    weight = nf4(logit_std / h**0.5 * torch.randn(v, h, dtype=dtype), device)
    hidden = torch.randn(n, h, dtype=dtype, device=device)
    labels = torch.randint(0, v, (n,), device=device)
    labels[torch.rand(n, device=device) < ignore_frac] = IGNORE
    return hidden, weight, labels


def check_nf4_flce(hidden, weight, labels, reduction="mean", softcap=None, bias=None, ignore_index=IGNORE, tol=None):
    """Loss and dhidden with the NF4 weight against the float64 reference on the dense dequantised weight (the
    same values); the reference given the NF4 weight itself must agree exactly."""
    tol = TOLERANCE[hidden.dtype] if tol is None else tol
    dense = dequantize_nf4(weight)
    h = hidden.detach().clone().requires_grad_()
    h64 = hidden.detach().double().requires_grad_()
    kwargs = dict(ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    loss = fused_linear_cross_entropy(h, weight, labels, bias=bias, **kwargs)
    b64 = None if bias is None else bias.double()
    ref = fused_linear_cross_entropy_reference(h64, dense.double(), labels, bias=b64, **kwargs)
    with torch.no_grad():
        ref_nf4 = fused_linear_cross_entropy_reference(h64, weight, labels, bias=b64, **kwargs)
    assert torch.equal(ref_nf4, ref), "the reference's NF4 path dequantises to the same weight"
    assert loss.dtype == torch.float32
    assert_close(loss, ref, tol, "loss")
    upstream = torch.randn(loss.shape, device=loss.device)
    loss.backward(upstream)
    ref.backward(upstream.double())
    assert h.grad.dtype == h.dtype
    assert_close(h.grad, h64.grad, tol, "dhidden")
    with torch.no_grad():  # the loss alone (no gradient work) is the same
        assert_close(fused_linear_cross_entropy(h, weight, labels, bias=bias, **kwargs), ref, tol, "loss, no grad")
    return loss, h.grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_nf4_flce_matches_dense_dequantised(dtype, reduction, device):
    # V = 301: 5 vocabulary blocks of the interpreter's 64 rows, the last partial
    check_nf4_flce(*_inputs(37, 128, 301, dtype, device), reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nf4_flce_several_chunks_softcap_and_frozen_bias(reduction, device, monkeypatch):
    n, h, v = 37, 192, 257
    monkeypatch.setattr(flce_nf4, "NF4_CHUNK_BYTES", 12 * (64 * 4 + h * 8))  # 12 rows fit: chunks of 8, the last of 5
    assert flce_nf4.nf4_chunk_rows(n, h, 64, 4, need_dh=True) == 8
    hidden, weight, labels = _inputs(n, h, v, torch.float32, device, logit_std=4.0)
    bias = 0.5 * torch.randn(v, device=device)
    check_nf4_flce(hidden, weight, labels, reduction, softcap=3.0, bias=bias)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nf4_flce_all_labels_ignored(reduction, device):
    loss, dh = check_nf4_flce(*_inputs(9, 64, 50, torch.bfloat16, device, ignore_frac=1.0), reduction)
    assert bool((loss == 0).all()) and bool((dh == 0).all())


def test_nf4_flce_other_ignore_index(device):
    hidden, weight, labels = _inputs(37, 128, 129, torch.float32, device, ignore_frac=0.0)
    labels[::3] = 7  # a real class used as the ignore index
    check_nf4_flce(hidden, weight, labels, "sum", ignore_index=7)


def test_nf4_flce_nf4_weight_equals_dense_path(device):
    """The NF4 path and the (tuned) dense path on the dequantised weight agree in fp32."""
    hidden, weight, labels = _inputs(37, 128, 301, torch.float32, device)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h1, weight, labels)
    dense_loss = fused_linear_cross_entropy(h2, dequantize_nf4(weight), labels)
    loss.backward()
    dense_loss.backward()
    assert_close(loss, dense_loss, 1e-5, "loss")
    assert_close(h1.grad, h2.grad, 1e-5, "dhidden")


def test_nf4_flce_argument_errors(device):
    hidden, weight, labels = _inputs(5, 128, 65, torch.float32, device)
    with pytest.raises(ValueError, match="dequantises to torch.float32; they must match"):
        fused_linear_cross_entropy(hidden.bfloat16(), weight, labels)
    with pytest.raises(ValueError, match="must be frozen"):
        fused_linear_cross_entropy(hidden.requires_grad_(), weight, labels, bias=torch.zeros(65, requires_grad=True))
    odd = nf4(torch.randn(65, 96), device)
    with pytest.raises(ValueError, match=r"needs H \(96\) to be a multiple of its blocksize \(64\)"):
        fused_linear_cross_entropy(torch.randn(5, 96, device=device), odd, labels)


# ----------------------------------------------------------------------------------------------------------
# Models


def dense_dequantised_copy(reference, quantised):
    """`reference` with its embedding and lm_head replaced by the dense dequantised NF4 matrices of `quantised`."""
    dense = copy.deepcopy(reference)
    with torch.no_grad():  # the reference (bit-identical to the kernel): these tests also run without Triton
        for name in ("input", "output"):
            weight = getattr(quantised, f"get_{name}_embeddings")().weight
            dense_weight = dequantize_nf4_reference(weight.data, weight.quant_state)
            getattr(dense, f"get_{name}_embeddings")().weight.copy_(dense_weight)
    return dense


def lora_models(reference, device):
    """(quantised, dense) PEFT models with the same random adapters, both patched."""
    quantised = quantize_embeddings_nf4(copy.deepcopy(reference))
    dense = dense_dequantised_copy(reference, quantised)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    quantised, dense = (patch_model(get_peft_model(m, config)) for m in (quantised, dense))
    randomise_adapters(dense)
    with torch.no_grad():
        for (name, q), (_, d) in zip(quantised.named_parameters(), dense.named_parameters(), strict=True):
            if "lora_" in name:
                q.copy_(d)
    return quantised, dense


def assert_same_loss_and_lora_grads(quantised, dense, device, loss_tol=1e-5, grad_tol=1e-4):
    input_ids, labels = batch(device)
    losses = []
    for model in (quantised, dense):
        out = model(input_ids=input_ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    assert_close(losses[0], losses[1], loss_tol, "loss")
    expected = dict(dense.named_parameters())
    lora = [(name, p) for name, p in quantised.named_parameters() if "lora_" in name]
    assert lora
    for name, p in lora:
        assert p.grad is not None, name
        assert_close(p.grad, expected[name].grad, grad_tol, f"grad {name}")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_qwen3_quantized_embeddings_match_dense(checkpointing, device):
    reference = tiny_model("qwen3", device, hidden_size=64)
    quantised, dense = lora_models(reference, device)
    base = quantised.get_base_model()
    assert isinstance(base.get_input_embeddings(), NF4Embedding)
    assert type(base.lm_head).__name__ == "Linear4bit"
    assert base.__dict__.get("_unsloth_lite_patched"), "the NF4 lm_head keeps the fused causal-LM forward"
    assert not any("lora_" in name for name, _ in base.lm_head.named_parameters()), "no LoRA on the lm_head"
    if checkpointing:
        # Reentrant checkpoints need an input that requires grad: enable_input_require_grads' hook on the
        # NF4 embedding provides it (without it the LoRA gradients would be None).
        for model in (quantised, dense):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
            model.train()
        assert base.get_input_embeddings()(torch.tensor([[1, 2]], device=device)).requires_grad
    assert_same_loss_and_lora_grads(quantised, dense, device)


def test_qwen3_5_quantized_embeddings_match_dense(device, torch_delta_rule):
    quantised, dense = lora_models(tiny_qwen3_5(device), device)
    assert_same_loss_and_lora_grads(quantised, dense, device)


def test_quantized_embeddings_logits_and_generation(device):
    reference = tiny_model("qwen3", device, hidden_size=64).eval()
    quantised = patch_model(quantize_embeddings_nf4(copy.deepcopy(reference)))
    dense = patch_model(dense_dequantised_copy(reference, quantised))
    input_ids, labels = batch(device)
    with torch.no_grad():
        assert_close(quantised(input_ids=input_ids).logits, dense(input_ids=input_ids).logits, 1e-5, "logits")
        both = quantised(input_ids=input_ids, labels=labels, return_logits=True)
        expected = dense(input_ids=input_ids, labels=labels, return_logits=True)
    assert_close(both.logits, expected.logits, 1e-5, "logits with labels")
    assert_close(both.loss, expected.loss, 1e-5, "loss with logits")
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    prompt = input_ids[:1, :5]
    assert torch.equal(quantised.generate(prompt, **kwargs), dense.generate(prompt, **kwargs))


def test_tied_embeddings_share_one_nf4_matrix(device):
    reference = tiny_model("qwen3", device, hidden_size=64, tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    quantised = patch_model(quantize_embeddings_nf4(copy.deepcopy(reference)))
    assert quantised.lm_head.weight is quantised.model.embed_tokens.weight
    dense = patch_model(dense_dequantised_copy(reference, quantised))
    input_ids, labels = batch(device)
    with torch.no_grad():
        expected = dense(input_ids=input_ids, labels=labels).loss
        assert_close(quantised(input_ids=input_ids, labels=labels).loss, expected, 1e-5, "loss")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _matrix_bytes(module) -> int:
    """Bytes of a module's weight, its quantisation state included."""
    weight = module.weight
    state = getattr(weight, "quant_state", None)
    if state is None:
        return _bytes([weight])
    extra = [state.absmax, state.code]
    if state.nested:
        extra += [state.state2.absmax, state.state2.code, state.offset]
    return _bytes([weight.data] + extra)


def test_quantized_embeddings_memory(device):
    model = tiny_model("qwen3", device, torch.bfloat16, vocab_size=4099, hidden_size=128, num_hidden_layers=1)
    dense_refs = [weakref.ref(model.get_input_embeddings().weight), weakref.ref(model.lm_head.weight)]
    before = _matrix_bytes(model.get_input_embeddings()) + _matrix_bytes(model.lm_head)
    params_before = _bytes(model.parameters())
    quantize_embeddings_nf4(model)
    gc.collect()
    assert all(ref() is None for ref in dense_refs), "the dense weights are freed"
    after = _matrix_bytes(model.get_input_embeddings()) + _matrix_bytes(model.lm_head)
    assert before / after > 3.5, f"embedding + lm_head: {before} -> {after} bytes"
    assert params_before - _bytes(model.parameters()) > 0.7 * before
    assert not any(p.requires_grad for p in model.get_input_embeddings().parameters())
    assert not any(p.requires_grad for p in model.lm_head.parameters())


def test_load_model_quantize_embeddings(tmp_path):
    path = save_tiny_checkpoint("qwen3", tmp_path / "model")
    model, _ = load_model(path, load_in_4bit=False, dtype=torch.float32, device_map="cpu", quantize_embeddings=True)
    assert isinstance(model.get_input_embeddings(), NF4Embedding)
    assert type(model.lm_head).__name__ == "Linear4bit" and model.__dict__.get("_unsloth_lite_patched")
    input_ids, labels = batch("cpu")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=input_ids, labels=labels).loss)


def test_recipe_quantize_embeddings_key():
    assert load_recipe("tiny_qwen").model.quantize_embeddings is False
    assert load_recipe("tiny_qwen", ["model.quantize_embeddings=true"]).model.quantize_embeddings is True


# ----------------------------------------------------------------------------------------------------------
# Qwen3.5-27B's shape, compiled on a GPU


QWEN3_5_27B = dict(vocab=248320, hidden=5120, tokens=2048)


@pytest.fixture
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _27b_inputs():
    torch.manual_seed(0)
    v, h, n = QWEN3_5_27B["vocab"], QWEN3_5_27B["hidden"], QWEN3_5_27B["tokens"]
    weight = nf4(torch.randn(v, h, dtype=torch.bfloat16, device="cuda") / h**0.5 * 2, "cuda")
    hidden = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[: n // 4] = IGNORE  # a prompt
    return hidden, weight, labels


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_nf4_flce_27b_shape_matches_dense(reduction):
    hidden, weight, labels = _27b_inputs()
    dense = dequantize_nf4(weight)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h1, weight, labels, reduction=reduction)
    dense_loss = fused_linear_cross_entropy(h2, dense, labels, reduction=reduction)
    upstream = torch.rand(loss.shape, device="cuda")
    loss.backward(upstream)
    dense_loss.backward(upstream)
    # both bf16 paths against fp32 math on the same values, on a sample of rows
    rows = torch.arange(0, QWEN3_5_27B["tokens"], 16, device="cuda")
    if reduction == "mean":
        assert_close(loss, dense_loss, 2e-3, "loss against the dense path")
    else:
        assert_close(loss, dense_loss, 2e-3, "row losses against the dense path")
        ref = fused_linear_cross_entropy_reference(hidden[rows].float(), dense, labels[rows], reduction="none")
        assert_close(loss[rows], ref, 1e-3, "row losses against fp32")
    assert_close(h1.grad, h2.grad, 1e-2, "dhidden against the dense path")
    hidden.requires_grad_()  # dh formed in the forward; timed without the backward's rescaling
    times = [_milliseconds(lambda w=w: fused_linear_cross_entropy(hidden, w, labels)) for w in (weight, dense)]
    print(f"forward + dh, {reduction}: NF4 {times[0]:.2f} ms, dense {times[1]:.2f} ms ({times[0] / times[1]:.2f}x)")


def _milliseconds(fn, repeats=5):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
def test_gpu_nf4_flce_27b_shape_extra_memory():
    """Peak memory of forward + backward beyond the inputs and the returned dhidden: the NF4 path's buffers
    (a 4,096-row weight block, the chunk's logits block and fp32 accumulator, the label rows), about 140 MiB;
    never the 2.5 GB dense weight."""
    hidden, weight, labels = _27b_inputs()
    hidden.requires_grad_()
    fused_linear_cross_entropy(hidden, weight, labels).backward()  # compiles, and cuBLAS takes its workspace
    hidden.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    torch.cuda.synchronize()
    dh_bytes = hidden.numel() * hidden.element_size()
    extra = torch.cuda.max_memory_allocated() - start - dh_bytes
    print(f"extra peak memory of the NF4 cross-entropy: {extra / 2**20:.0f} MiB")
    assert extra < 384 * 2**20, f"{extra / 2**20:.0f} MiB beyond inputs and dhidden"
    dense_bytes = QWEN3_5_27B["vocab"] * QWEN3_5_27B["hidden"] * 2
    assert weight.data.numel() < dense_bytes / 3.5


@pytest.mark.gpu
@pytest.mark.usefixtures("_free_gpu_memory")
def test_gpu_nf4_embedding_lookup_27b_shape():
    _, weight, labels = _27b_inputs()
    ids = labels.clamp(min=0).view(4, -1)
    rows = dequantize_nf4_rows(weight, ids)
    expected = torch.empty(ids.shape + (QWEN3_5_27B["hidden"],), dtype=torch.bfloat16, device="cuda")
    for i, row in enumerate(ids.reshape(-1).tolist()[:64]):  # a sample of rows, dequantised alone
        dequantize_nf4_row_range(weight, row, expected.view(-1, QWEN3_5_27B["hidden"])[i:i + 1])
    assert torch.equal(rows.view(-1, QWEN3_5_27B["hidden"])[:64], expected.view(-1, QWEN3_5_27B["hidden"])[:64])
