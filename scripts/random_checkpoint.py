"""Random-weight checkpoints of the benchmark shapes, for the peers that only load from disk (Unsloth): written
shard by shard, each tensor drawn on the GPU, at most one shard in host memory; the decoder linears optionally
pre-quantised in bitsandbytes NF4, as Unsloth's published 4-bit checkpoints are (the 27B: ~16 GB on disk
instead of 54). `weightless_model` builds a config's model on the meta device (names and shapes, no memory)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from bench_train_setup import _tokenizer

CHECKPOINT_MARKER = "bench_generate_checkpoint.json"  # written last: the checkpoint is complete
SHARD_BYTES = 4 * 2**30


def weightless_model(shape: str, c: dict):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        if shape == "qwen3_8b":
            return Qwen3ForCausalLM(Qwen3Config(**c))
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**c))


def _quantized_entries(name: str, tensor: torch.Tensor) -> dict:
    """A weight in bitsandbytes' serialised NF4 form, as `Linear4bit` saves it and `from_pretrained` loads it:
    the packed bytes under `name`, the quantisation state's tensors under `name.<key>`."""
    import bitsandbytes.functional as bnb_functional

    packed, state = bnb_functional.quantize_4bit(tensor, blocksize=64, compress_statistics=True, quant_type="nf4",
                                                 quant_storage=torch.uint8)
    entries = {name: packed}
    entries.update({f"{name}.{key}": value for key, value in state.as_dict(packed=True).items()})
    return {key: value.cpu() for key, value in entries.items()}


def write_checkpoint_in_shards(shape: str, c: dict, path: Path, device: torch.device, dtype: torch.dtype,
                               shard_bytes: int = SHARD_BYTES, quantized: bool = False) -> Path:
    """A random-weight safetensors checkpoint of config `c`, written shard by shard: each tensor drawn on
    `device`, at most one shard held in host memory. Reused when complete. `quantized`: the decoder linears
    stored pre-quantised in bitsandbytes NF4 (double quantisation, block 64, compute dtype `dtype`) with the
    config's `quantization_config`, as the 4-bit checkpoints Unsloth publishes are: a quarter of the bf16
    bytes on disk (the 27B: ~16 GB instead of 54), loaded without quantising again."""
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig

    if (path / CHECKPOINT_MARKER).exists():
        print(f"checkpoint: reusing {path}")
        return path
    start = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    model = weightless_model(shape, c)
    params = model.state_dict()
    four_bit = set()
    if quantized:  # what transformers' bitsandbytes integration converts: every linear but the output head
        four_bit = {f"{n}.weight" for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    element = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]  # planned from the shapes, so each shard is written as soon as it is drawn
    size = 0
    for name, param in params.items():
        nbytes = param.numel() * (0.5 if name in four_bit else element)
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    generator = torch.Generator(device=device).manual_seed(0)
    index = {}
    for i, names in enumerate(shards):
        tensors = {}
        for name in names:
            tensor = torch.empty(params[name].shape, dtype=dtype, device=device)
            if tensor.dim() >= 2:
                tensor.normal_(0.0, 0.02, generator=generator)
            else:
                tensor.fill_(1.0)  # norm weights (Qwen3.5's zero-centred ones then scale by 2: harmless for timing)
            tensors.update(_quantized_entries(name, tensor) if name in four_bit else {name: tensor.cpu()})
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, path / file, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    model.config.torch_dtype = dtype
    if quantized:
        model.config.quantization_config = json.loads(BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        ).to_json_string())
    model.config.save_pretrained(path)
    _tokenizer(c).save_pretrained(path)
    (path / CHECKPOINT_MARKER).write_text(json.dumps(dict(config=c, dtype=str(dtype), quantized=quantized), indent=2))
    print(f"checkpoint: wrote {path} in {time.perf_counter() - start:.0f} s")
    return path
