"""`bench_train_27b.py --check-gradients`: the 27B's first-step loss and LoRA gradients through Hugging Face's
forwards (its PyTorch delta rule) and through the patched model, both in bf16, and both against the same 4-bit
model computing in float32 (float64 for an fp32 model), which tells bf16's rounding noise apart from a
difference of the patched path."""

from __future__ import annotations

import contextlib
import sys

import torch
from bench_train_27b import ATTENTION_MLP, LORA_ALPHA, LORA_R, SEED, build_model


class _DequantizedLinear(torch.autograd.Function):
    """x Wᵀ with the NF4 weight dequantised (unsloth-lite's dequantisation) and cast to x's dtype; the backward
    dequantises it again rather than keep it, so the reference's memory is that of its activations alone."""

    @staticmethod
    def forward(ctx, x, layer):
        from unsloth_lite.kernels import dequantize_nf4

        ctx.layer = layer
        return torch.nn.functional.linear(x, dequantize_nf4(layer.weight).to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        from unsloth_lite.kernels import dequantize_nf4

        return grad @ dequantize_nf4(ctx.layer.weight).to(grad.dtype), None


@contextlib.contextmanager
def in_precision(model, dtype: torch.dtype):
    """`model` computing in `dtype` throughout: every floating parameter and buffer cast to it (restored after)
    and every 4-bit linear's product taken in it from the same dequantised weights."""
    import bitsandbytes as bnb

    tensors = _floating_tensors(model)
    dtypes = [t.dtype for t in tensors]
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for t in tensors:
        t.data = t.data.to(dtype)
    for m in quantized:
        m.forward = lambda x, m=m: _DequantizedLinear.apply(x.to(dtype), m) + (0 if m.bias is None else m.bias)
    try:
        yield model
    finally:
        for m in quantized:
            del m.forward
        for t, original in zip(tensors, dtypes, strict=True):
            t.data = t.data.to(original)


def _floating_tensors(model) -> list[torch.Tensor]:
    return [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]


def compute_in(model, dtype: torch.dtype):
    """`model` (built in bf16, its decoder linears NF4) made to compute in `dtype` on the same 4-bit weights: its
    floating parameters and buffers cast, every 4-bit linear computing and dequantising in `dtype`. Building in
    bf16 keeps a float32 27B from holding 108 GB of dense weights before they are quantised."""
    import bitsandbytes as bnb

    for t in _floating_tensors(model):
        t.data = t.data.to(dtype)
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.compute_dtype = dtype
            m.weight.quant_state.dtype = dtype
    return model


def _relative_errors(grads: dict, reference: dict) -> dict:
    """Each gradient's ||g - ref|| / ||ref||, the whole set's (all gradients as one vector) and the worst one."""
    errors = {n: float((grads[n].double() - g.double()).norm() / g.double().norm()) for n, g in reference.items()}
    total = sum(float((grads[n].double() - g.double()).norm()) ** 2 for n, g in reference.items()) ** 0.5
    total /= sum(float(g.double().norm()) ** 2 for g in reference.values()) ** 0.5
    worst = max(errors, key=errors.get)
    return dict(all=total, max=errors[worst], worst=worst)


def check_gradients(c: dict, device: torch.device, dtype: torch.dtype, seq: int) -> dict:
    """One model, one batch: the loss and every LoRA gradient of Hugging Face's forwards (its PyTorch delta
    rule) against the same model patched, both in `dtype` (the model built in bf16 and its 4-bit weights kept:
    `compute_in`); and both against the same model computing in a
    higher precision (float32 for bf16, float64 for float32), which tells the rounding noise of `dtype` apart
    from a difference of the patched path. The adapters' B start random (PEFT's zeros would leave every A
    gradient zero)."""
    sys.modules["fla"] = None
    from peft import LoraConfig, get_peft_model

    import unsloth_lite

    torch.manual_seed(SEED)
    model = get_peft_model(compute_in(build_model(c, device, torch.bfloat16), dtype), LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=ATTENTION_MLP, bias="none",
        task_type="CAUSAL_LM",
    ))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    model.train()
    ids = torch.randint(0, c["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(SEED)).to(device)

    def loss_and_grads():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), grads

    # Hugging Face's non-reentrant checkpointing for all three passes: the same values, and a float32 27B's
    # activations of 64 layers would not fit the GPU
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    with in_precision(model, torch.float64 if dtype == torch.float32 else torch.float32):
        precise_loss, precise = loss_and_grads()
    reference_loss, reference = loss_and_grads()
    unsloth_lite.patch_model(model)
    loss, grads = loss_and_grads()
    patched, hugging_face = _relative_errors(grads, precise), _relative_errors(reference, precise)
    direct = _relative_errors(grads, reference)
    return dict(
        loss=loss, reference_loss=reference_loss, precise_loss=precise_loss,
        loss_rel_diff=abs(loss - reference_loss) / abs(reference_loss),
        loss_rel_err=abs(loss - precise_loss) / abs(precise_loss),
        reference_loss_rel_err=abs(reference_loss - precise_loss) / abs(precise_loss),
        lora_grads=len(reference), grad_rel_err_all=direct["all"], grad_rel_err_max=direct["max"],
        grad_worst=direct["worst"],
        precise_grad_rel_err_all=patched["all"], precise_grad_rel_err_max=patched["max"],
        precise_grad_worst=patched["worst"],
        reference_precise_grad_rel_err_all=hugging_face["all"], reference_precise_grad_rel_err_max=hugging_face["max"],
        reference_precise_grad_worst=hugging_face["worst"],
    )
