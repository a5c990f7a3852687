"""The model and its loading for `bench_train.py`'s QLoRA training step (workload W1 of BENCHMARKS.md): its
configs, the FLOP accounting behind its MFU and HFU columns, the random-weight checkpoint and each variant's
loader.

Model: the Qwen3-8B shape (`qwen3`: hidden 4096, 36 layers, 32 q / 8 KV heads of 128, intermediate 12288,
vocab 151,936, untied, rope theta 1e6) with random weights (speed and memory don't depend on their values).
The parent builds it once on the meta device, fills it with N(0, 0.02) matrices and unit norms, and writes it
with a stand-in word-level tokenizer (Unsloth's loader needs one) as safetensors under `--workdir`, reused when
present. Every variant loads that checkpoint through its own loading path, decoder linears in bitsandbytes NF4
(double quant, block 64, bf16 compute), embeddings and lm_head bf16; LoRA r=16, alpha=16, dropout 0 on
q,k,v,o,gate,up,down; gradient checkpointing; torch AdamW (lr 1e-4) over the LoRA weights.

Each variant's loading path:
- `hf`: `AutoModelForCausalLM` (sdpa) + `peft.get_peft_model`. `peft.prepare_model_for_kbit_training` is not
  used: it upcasts every non-quantised weight (embeddings, lm_head, norms) to fp32, which is not what the
  other variants train with; `enable_input_require_grads` and non-reentrant checkpointing instead.
- `hf_liger`: the same after `apply_liger_kernel_to_qwen3(rope, rms_norm, swiglu, fused_linear_cross_entropy)`.
- `unsloth`: `FastLanguageModel.from_pretrained` / `get_peft_model(use_gradient_checkpointing="unsloth")`,
  imported first, from `--unsloth-site` (prepended to the worker's PYTHONPATH).
- `unsloth_lite`: `unsloth_lite.load_model` + `add_lora` + `unsloth_lite.training.checkpointing.
  enable_gradient_checkpointing(model, offload_to_cpu=True, cuda_graphs=True)`: the saved layer inputs and
  residuals after attention in pinned CPU memory, each layer's forward and recompute-and-backward replayed as
  CUDA graphs (captured in the second step: keep `--warmup` at 2 or more).
- only when named in `--variants`: `unsloth_lite_hf_ckpt` (the same with Hugging Face's checkpointing, as
  for `hf`), `unsloth_lite_ckpt` (`enable_gradient_checkpointing` without offload or graphs),
  `unsloth_lite_offload` (offload only), `unsloth_lite_graphs` (graphs only), `unsloth_lite_inputs_only`
  (graphs and offload, `keep_residual=False`: the recomputation runs the attention's output projection).

`MFU` = 4 x N x tokens/s / peak, with N all parameters of the model (embeddings and lm_head included, 8.19B
for W1; 4N: forward and input-gradient backward of a frozen base), peak = the bf16 8192^3 matmul rate measured
by the parent in the same run. `HFU` = executed FLOPs per token x tokens/s / peak, with, per token,
    6 x P_dec - 2 x P_skip    decoder linears: forward, recomputed forward (checkpointing), input-gradient backward;
                              P_skip the parameters of the projections whose product the variant's recomputation
                              skips (ours: the MLP's down projection, and with the offload the attention's output
                              projection, 36 x 50.3M and 36 x 16.8M for W1)
  + 4 x H x V                 lm_head: forward and input-gradient backward (not checkpointed)
  + 9 x S x n_heads x d x L   causal attention: QK^T and PV over S/2 keys on average is 2 x S x n_heads x d
                              FLOPs per layer forward; forward + recomputed forward + backward (5 matmuls, the
                              flash backward recomputes QK^T: 2.5 x forward) = 4.5 x forward
where P_dec is the decoder linears' parameter count (6.95B), H the hidden size, V the vocabulary, S the sequence
length, d the head dim, L the layers: 46.9 GFLOP/token for W1 at S = 2048 (42.0 for unsloth_lite, which skips
both projections), all computed from the config.
LoRA's own FLOPs (0.35 GFLOP/token at r=16) are left out, as in BENCHMARKS.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

MARKER = "bench_train_checkpoint.json"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA, LR = 16, 16, 1e-4
SEED = 1234
SEQ_MULTIPLE = 256

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-8B's shape; the three special tokens (end of text, im_start, im_end) are the last ids of the vocabulary.
W1 = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=False, hidden_act="silu", bos_token_id=None, pad_token_id=151933, eos_token_id=151935,
)
TINY = dict(
    W1, vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=254, eos_token_id=256,
)


# ----------------------------------------------------------------------------------------------------------
# FLOP accounting (from the config)


def decoder_linear_params(c: dict) -> int:
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return per_layer * c["num_hidden_layers"]


def total_params(c: dict) -> int:
    h, v = c["hidden_size"], c["vocab_size"]
    embeddings = v * h * (1 if c["tie_word_embeddings"] else 2)
    norms = c["num_hidden_layers"] * (2 * h + 2 * c["head_dim"]) + h  # 2 decoder norms, q_norm, k_norm; final
    return decoder_linear_params(c) + embeddings + norms


# Projections whose product a variant's recomputation skips: ours always skips the MLP's down projection, and
# with the offload (which keeps the residual after attention) the attention's output projection too.
RECOMPUTE_SKIPPED = {
    "unsloth_lite": ("down", "o"), "unsloth_lite_ckpt": ("down",), "unsloth_lite_offload": ("down", "o"),
    "unsloth_lite_graphs": ("down",), "unsloth_lite_inputs_only": ("down",),
}


def projection_params(c: dict, name: str) -> int:
    """Parameters of one layer's `down` or `o` projection."""
    if name == "down":
        return c["hidden_size"] * c["intermediate_size"]
    return c["num_attention_heads"] * c["head_dim"] * c["hidden_size"]


def step_flops(c: dict, seq: int, decoder_params: int, skipped_params: int, attention_layers: int) -> dict:
    """Executed FLOPs per token of one training step with gradient checkpointing and a frozen base (docstring):
    the decoder's products three times less the recomputation's skipped ones, the lm_head's twice, and causal
    attention in `attention_layers` layers."""
    decoder = 6 * decoder_params - 2 * skipped_params
    lm_head = 4 * c["hidden_size"] * c["vocab_size"]
    attention = 9 * seq * c["num_attention_heads"] * c["head_dim"] * attention_layers
    return dict(decoder=decoder, lm_head=lm_head, attention=attention, total=decoder + lm_head + attention)


def flops_per_token(c: dict, seq: int, skipped: tuple[str, ...] = ()) -> dict:
    """`step_flops` of a Qwen2/Qwen3 config, less the recomputation's `skipped` projections."""
    skipped_params = sum(projection_params(c, name) for name in skipped) * c["num_hidden_layers"]
    return step_flops(c, seq, decoder_linear_params(c), skipped_params, c["num_hidden_layers"])


# ----------------------------------------------------------------------------------------------------------
# The checkpoint, written once


def _tokenizer(c: dict):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {c["pad_token_id"]: "<|endoftext|>", c["vocab_size"] - 2: "<|im_start|>"}
    specials[c["eos_token_id"]] = "<|im_end|>"
    vocab = {specials.get(i, f"t{i}"): i for i in range(c["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML  # so the checkpoint also trains through the recipes' instruction formats
    return tokenizer


def ensure_checkpoint(c: dict, workdir: str, dtype: torch.dtype, device: torch.device, name: str) -> Path:
    """Directory of a random-weight checkpoint of config `c` in `dtype`, written on first use."""
    key = hashlib.sha256(json.dumps(dict(c, dtype=str(dtype)), sort_keys=True).encode()).hexdigest()[:12]
    path = Path(workdir) / f"{name}-{key}"
    if (path / MARKER).exists():
        print(f"checkpoint: reusing {path}")
        return path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    start = time.perf_counter()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**c))
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.fill_(1.0)  # RMSNorm weights
    model = model.to("cpu")
    model.save_pretrained(tmp)
    _tokenizer(c).save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(dict(config=c, dtype=str(dtype)), indent=2))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    print(f"checkpoint: wrote {path} in {time.perf_counter() - start:.0f} s")
    return path


# ----------------------------------------------------------------------------------------------------------
# Loaders: one per variant


def _device_map(device: torch.device):
    return "cpu" if device.type == "cpu" else {"": torch.cuda.current_device()}


def _bnb_config(dtype):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
    )


def _enable_checkpointing(model) -> None:
    """Non-reentrant gradient checkpointing of the decoder layers; the embeddings' output made to require grad
    (frozen embeddings otherwise give the first checkpointed layer inputs without grad)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.config.use_cache = False


def load_hf(path, device, dtype, seq, liger=False):
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=_bnb_config(dtype), device_map=_device_map(device),
        attn_implementation="sdpa",
    )
    _enable_checkpointing(model)
    torch.manual_seed(SEED)  # LoRA A's initial values, as for unsloth_lite
    config = LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES, bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config), {}


def load_unsloth_lite(path, device, dtype, seq, checkpointing="hf", uncheckpointed_layers=0,
                      keep_mlp_preactivations: bool | int = False, mlp_preactivations_on_gpu: int = 0):
    """`checkpointing`: "hf" (Hugging Face's non-reentrant), "ours" (`enable_gradient_checkpointing`),
    "offload" (the same with the saved layer inputs in pinned CPU memory), "graphs" (with CUDA graphs),
    "graphs_offload" (both) or "graphs_offload_inputs_only" (both, `keep_residual=False`); with ours, the last
    `uncheckpointed_layers` layers are not checkpointed, and `keep_mlp_preactivations`,
    `mlp_preactivations_on_gpu` place the kept MLP pre-activations."""
    import unsloth_lite
    from unsloth_lite.training.checkpointing import enable_gradient_checkpointing

    kwargs = {"device_map": "cpu"} if device.type == "cpu" else {}
    model, _ = unsloth_lite.load_model(path, load_in_4bit=True, dtype=dtype, max_seq_length=seq, **kwargs)
    if checkpointing == "hf":
        _enable_checkpointing(model)
    torch.manual_seed(SEED)
    model = unsloth_lite.add_lora(model, r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES)
    if checkpointing != "hf":
        enable_gradient_checkpointing(
            model, offload_to_cpu="offload" in checkpointing, cuda_graphs="graphs" in checkpointing,
            keep_residual=False if "inputs_only" in checkpointing else None,
            uncheckpointed_layers=uncheckpointed_layers,
            keep_mlp_preactivations=keep_mlp_preactivations, mlp_preactivations_on_gpu=mlp_preactivations_on_gpu,
        )
    return model, {}


def load_unsloth(path, device, dtype, seq, targets=TARGET_MODULES):
    import unsloth  # before transformers: it patches it on import
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(path), max_seq_length=seq, dtype=dtype, load_in_4bit=True,
    )
    model = FastLanguageModel.get_peft_model(
        model, r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0, target_modules=targets, bias="none",
        use_gradient_checkpointing="unsloth", random_state=SEED,
    )
    if hasattr(FastLanguageModel, "for_training"):
        FastLanguageModel.for_training(model)
    versions = {"unsloth": getattr(unsloth, "__version__", "?")}
    try:
        import unsloth_zoo

        versions["unsloth_zoo"] = getattr(unsloth_zoo, "__version__", "?")
    except ImportError:
        pass
    return model, {"versions": versions}


LOADERS = {
    "hf": load_hf,
    "hf_liger": functools.partial(load_hf, liger=True),
    "unsloth": load_unsloth,
    "unsloth_lite": functools.partial(load_unsloth_lite, checkpointing="graphs_offload"),
    "unsloth_lite_hf_ckpt": load_unsloth_lite,
    "unsloth_lite_ckpt": functools.partial(load_unsloth_lite, checkpointing="ours"),
    "unsloth_lite_offload": functools.partial(load_unsloth_lite, checkpointing="offload"),
    "unsloth_lite_graphs": functools.partial(load_unsloth_lite, checkpointing="graphs"),
    "unsloth_lite_inputs_only": functools.partial(load_unsloth_lite, checkpointing="graphs_offload_inputs_only"),
    "unsloth_lite_kept_mlp": functools.partial(load_unsloth_lite, checkpointing="graphs_offload",
                                               keep_mlp_preactivations=True),
}


def _checkpointed_layers(model) -> int | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    # Unsloth sets the flag to the string "unsloth"
    return sum(isinstance(m, GradientCheckpointingLayer) and bool(m.gradient_checkpointing) for m in model.modules())
