"""Training on several GPUs (or CPU processes) through the engines people already launch with: `torchrun` /
`accelerate launch` start one process per device, `transformers.Trainer` (through accelerate) wraps the model
in PyTorch DDP or, with `TrainingArguments.fsdp`, shards it with FSDP2.

Data parallel (DDP). Nothing here replaces DDP; the fused path fits it as it is:

* Gradient checkpointing (`unsloth_lite.training.checkpointing`) is the reentrant scheme: a layer's forward
  builds no autograd graph, so DDP must not look for unused parameters after the forward (it would find all of
  them unused, then see each one's gradient arrive in the backward: "marked ready twice").
  `unsloth_lite.Trainer` sets `ddp_find_unused_parameters=False` where left unset (the fused LoRA path uses
  every adapter in every step). Each parameter's gradient still arrives exactly once, from its layer's
  recomputation or graph replay, and DDP's reducer hooks all-reduce its bucket while the backward goes on
  to the layers below: the communication overlaps the backward. CUDA graphs are captured per process on its
  own device (each keeps its own pool and side stream).
* Packed rows: every process packs the same rows (`pack_dataset` is seeded by the recipe), and accelerate's
  sampler gives each process its own rows, hence its own documents. With `average_tokens_across_devices`
  (the default) the Trainer sums the target counts of all processes into `num_items_in_batch`, so one step
  on N processes is the step of one process on the N micro-batches laid end to end.
* Checkpoints are written once: every process writes its part (the model and optimizer on the main process,
  each process its random states) into one staging directory that the main process renames into place
  (`unsloth_lite.Trainer`); every process loads them when resuming.

FSDP2 QLoRA (`TrainingArguments(fsdp=..., fsdp_config={"version": 2, ...})`, or `shard_model` in a hand-written
loop): `torch.distributed.fsdp.fully_shard` shards every parameter along dim 0 as a DTensor and all-gathers a
module's parameters before its forward. The NF4 base is sharded as its packed storage: bitsandbytes' `Params4bit`
stored in the compute dtype (`quant_storage`, so mixed precision never casts the packed bytes and the storage
joins the all-gather of the layer's other parameters). The quantisation state is not sharded: a Python object
(absmax, nested absmax and code tables, about 3% of the packed bytes with double quantisation) kept whole on
every process, on its `Linear4bit` (`layer.quant_state`); the fused forward pairs it with the gathered storage
(`unsloth_lite.models.layers.quantized_weight`) and `dequantize_nf4` reads the whole gathered weight. LoRA
parameters, their gradients (reduce-scattered) and the optimiser state are sharded like any other parameter.
CUDA-graphed layers are refused: FSDP2 frees and re-gathers the storage their graphs would have captured.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

FLOAT_STORAGE = (torch.float32, torch.bfloat16, torch.float16)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main_process() -> bool:
    return not is_distributed() or dist.get_rank() == 0


def barrier() -> None:
    """Waits for every process (nothing to wait for in a single process)."""
    if is_distributed():
        dist.barrier()


def finish() -> None:
    """At the end of a run: waits for every process, then tears the process group down. A process that exits
    with the group still up while another is still writing the run's files may abort in the communication
    backend's teardown (seen with gloo on two CPU processes)."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def main_process_first():
    """The main process runs the block first (it writes what the others then read), the others after it."""
    if not is_main_process():
        barrier()
    try:
        yield
    finally:
        if is_main_process():
            barrier()


def fsdp_enabled(training: dict) -> bool:
    """Whether a recipe's `training` section asks for FSDP (`fsdp: full_shard ...`, or `true` with newer
    transformers)."""
    value = training.get("fsdp")
    return bool(value) and value not in ("", [], "no", "false")


def quant_storage(training: dict, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype NF4 weights are packed in: the compute dtype under FSDP (module docstring), bytes otherwise."""
    return compute_dtype if fsdp_enabled(training) else torch.uint8


def check_shardable(model: torch.nn.Module) -> None:
    """Raises ValueError where FSDP2 cannot shard the model's 4-bit weights: packed in bytes (bitsandbytes'
    default) rather than in a floating dtype, which mixed precision would cast, destroying the bits."""
    for name, param in model.named_parameters():
        if type(param).__name__ == "Params4bit" and param.dtype not in FLOAT_STORAGE:
            raise ValueError(
                f"{name} is a 4-bit weight packed as {param.dtype}; sharding it needs the packed storage in the "
                "compute dtype: load_model(..., quant_storage=dtype) or quantize_linears_nf4(..., quant_storage=dtype)"
            )


def shard_model(model: torch.nn.Module, mesh=None, mp_policy=None, reshard_after_forward: bool = True):
    """FSDP2 over `model` in place, as accelerate's FSDP2 preparation does it: each decoder layer its own unit,
    then the root (embeddings, final norm, lm_head); returns `model`. The NF4 base must be packed in a floating
    dtype (`check_shardable`). For hand-written loops and benchmarks; the Trainer shards through accelerate."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from unsloth_lite.training.checkpointing import checkpointing_layers

    check_shardable(model)
    options = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in checkpointing_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    return model


def peak_gpu_gib() -> float | None:
    """This process's peak allocated GPU memory in GiB since the last reset, or None without CUDA."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def gathered_peak_memory_gib() -> list[float]:
    """Each process's peak allocated GPU memory in GiB, in rank order (on every process)."""
    peak = peak_gpu_gib() or 0.0
    if not is_distributed():
        return [peak]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, peak)
    return values
