"""Run by tests/test_distributed.py under `torchrun --nproc-per-node 2` (gloo, CPU, fp32): one data-parallel
training step of `unsloth_lite.Trainer` and one FSDP2 forward and backward of an NF4 + LoRA model, each next
to its single-process reference. Rank 0 writes what the test compares into OUT_DIR: `ddp.safetensors` and
`fsdp.safetensors` (the distributed results and their references)."""

import copy
import sys

import datasets
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import unsloth_lite
from unsloth_lite import add_lora
from unsloth_lite.models.quantize import quantize_linears_nf4
from unsloth_lite.training.checkpointing import enable_gradient_checkpointing
from unsloth_lite.training.distributed import shard_model
from unsloth_lite.training.packing import PackingCollator, pack_dataset
from unsloth_lite.training.tiny import arithmetic_records, build_tiny_tokenizer

ROWS_PER_RANK = 2
PACKING_TOKENS = 64


def tiny_qlora_model(vocab_size: int, quant_storage: torch.dtype):
    """A 2-layer Qwen3 of hidden size 64, NF4 linears, LoRA of rank 4 with nonzero B (so every adapter
    gradient is exercised from the first step). Seeded: the same model on every process."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )
    model = quantize_linears_nf4(Qwen3ForCausalLM(config), torch.float32, quant_storage=quant_storage)
    model = add_lora(model, r=4, lora_alpha=8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def packed_rows(tokenizer, world_size: int) -> datasets.Dataset:
    from unsloth_lite.training.data import tokenize_dataset

    records = datasets.Dataset.from_list(arithmetic_records(n=12 * world_size, seed=5))
    documents = tokenize_dataset(records, tokenizer, "chat", max_length=PACKING_TOKENS)
    rows = pack_dataset(documents, PACKING_TOKENS, seed=0)
    return rows.select(range(ROWS_PER_RANK * world_size))


class RecordingTrainer(unsloth_lite.Trainer):
    """Keeps each micro-batch's loss as the Trainer computes it (scaled for the average over processes)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


class GradientsBeforeStep(transformers.TrainerCallback):
    """The gradients the optimizer is about to apply (all-reduced by DDP)."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {name: p.grad.detach().clone() for name, p in trainable(model).items()}


def data_parallel_step(out_dir: str, rank: int, world_size: int) -> None:
    """One step of the Trainer on 2 processes (packed rows, gradient checkpointing), and the loss and
    gradients of one process on all the rows laid end to end."""
    tokenizer = build_tiny_tokenizer()
    rows = packed_rows(tokenizer, world_size)
    collator = PackingCollator(tokenizer.pad_token_id, PACKING_TOKENS)
    model = tiny_qlora_model(len(tokenizer), torch.uint8)
    reference = copy.deepcopy(model)
    args = transformers.TrainingArguments(
        output_dir=f"{out_dir}/ddp", per_device_train_batch_size=ROWS_PER_RANK, max_steps=1, learning_rate=1e-3,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, dataloader_num_workers=0,
        gradient_checkpointing=True, seed=0, max_grad_norm=0.0,  # the gradients as computed, not clipped
    )
    grads = GradientsBeforeStep()
    trainer = RecordingTrainer(model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=[grads])
    trainer.losses = []
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    # Each process's loss is its token losses' sum over all processes' target count, times the world size.
    losses = [None] * world_size
    dist.all_gather_object(losses, trainer.losses[0].item())
    if rank != 0:
        return
    batch = collator([rows[i] for i in range(len(rows))])
    expected = reference(**batch).loss
    expected.backward()
    results = {"loss": torch.tensor([sum(losses) / world_size], dtype=torch.float64),
               "reference_loss": expected.detach().to(torch.float64).reshape(1)}
    for name, param in trainable(reference).items():
        results[f"grad/{name}"] = grads.grads[name]
        results[f"reference_grad/{name}"] = param.grad
    save_file(results, f"{out_dir}/ddp.safetensors")


def sharded_step(out_dir: str, rank: int, world_size: int) -> None:
    """FSDP2 over the NF4 base (packed in fp32) and the adapters, with gradient checkpointing: each process's
    loss on its own batch, and the gradients (reduce-scattered: the mean over processes), against the
    unsharded model on each batch."""
    model = tiny_qlora_model(96, torch.float32)
    enable_gradient_checkpointing(model)
    model.train()
    reference = copy.deepcopy(model)
    shard_model(model)
    generator = torch.Generator().manual_seed(1)
    batches = torch.randint(0, 96, (world_size, 2, 24), generator=generator)
    loss = model(input_ids=batches[rank], labels=batches[rank]).loss
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in trainable(model).items()}  # collective: every process
    shard = model.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight
    local_rows, all_rows = shard.to_local().shape[0], shard.shape[0]
    losses = [None] * world_size
    dist.all_gather_object(losses, loss.item())
    if rank != 0:
        return
    results = {"losses": torch.tensor(losses, dtype=torch.float64),
               "packed_rows": torch.tensor([local_rows, all_rows])}
    reference_losses = []
    for batch in batches:
        reference_loss = reference(input_ids=batch, labels=batch).loss / world_size
        reference_loss.backward()
        reference_losses.append(reference_loss.item() * world_size)
    results["reference_losses"] = torch.tensor(reference_losses, dtype=torch.float64)
    for name, param in trainable(reference).items():
        results[f"grad/{name}"] = grads[name]
        results[f"reference_grad/{name}"] = param.grad
    save_file(results, f"{out_dir}/fsdp.safetensors")


def main(out_dir: str) -> None:
    data_parallel_step(out_dir, *_rank_and_world())
    sharded_step(out_dir, *_rank_and_world())
    dist.barrier()
    dist.destroy_process_group()


def _rank_and_world() -> tuple[int, int]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


if __name__ == "__main__":
    main(sys.argv[1])
