"""`unsloth_lite.Trainer`: `transformers.Trainer` with the model patched onto the fused kernels.

Same constructor and `TrainingArguments`. The loss comes from the final hidden states through the fused
linear cross-entropy (the patched causal-LM forward), so training never forms the `[tokens, vocab]` logits.
Under gradient accumulation it is normalised exactly as Hugging Face's: the Trainer passes
`num_items_in_batch`, the number of non-ignored target tokens over the accumulated batch, and each
micro-batch's loss is its sum of token losses over that count. Evaluation computes the loss without logits,
unless metrics need them (`compute_metrics` or `preprocess_logits_for_metrics`).

With `TrainingArguments.gradient_checkpointing`, the decoder layers Hugging Face checkpoints go through
`unsloth_lite.training.checkpointing` instead (from the first training step on: the Trainer enables its own
when training starts): the reentrant scheme, whose recomputation skips the MLP's down projection.
`checkpointing={"offload_to_cpu": True, "cuda_graphs": True, "uncheckpointed_layers": 4}` (a keyword of this
Trainer only) passes its options (`enable_gradient_checkpointing`'s); `gradient_checkpointing_kwargs`
(arguments of `torch.utils.checkpoint`) no longer apply.

Checkpoints are written into a staging directory and renamed into place once complete: a process killed
during a save never leaves a `checkpoint-N` that looks complete but isn't, so resuming always finds a whole
one (model, optimizer, scheduler, RNG states, data position). Under `torchrun` / `accelerate launch` every
process writes its part into the same staging directory and the main process renames it
(`unsloth_lite.training.distributed`). Resumed from the checkpoint taken at `max_steps`, training ends there,
with no further step.

Each training log line (`logging_steps`) carries `peak_gpu_gib`, the process's peak allocated GPU memory so far.

Several processes: DDP is told not to look for unused parameters (`ddp_find_unused_parameters=False` where
unset), which the reentrant checkpointing needs; FSDP (`TrainingArguments.fsdp`) refuses CUDA-graphed layers.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from unsloth_lite.models import patch_model
from unsloth_lite.training.checkpointing import (
    CHECKPOINTING_OPTIONS,
    check_checkpointing_options,
    checkpointing_layers,
    enable_gradient_checkpointing,
)
from unsloth_lite.training.distributed import barrier, is_main_process, peak_gpu_gib

STAGING_PREFIX = ".staging-"


class Trainer(transformers.Trainer):
    def __init__(self, model=None, args=None, *positional, checkpointing: dict | None = None, **kwargs):
        if model is not None:
            patch_model(model)
        self._staging_dir = None
        if args is not None and args.ddp_find_unused_parameters is None:
            # Checkpointed layers build no graph in the forward: DDP would take every parameter for unused.
            args.ddp_find_unused_parameters = False
        super().__init__(model, args, *positional, **kwargs)
        self._checkpointing = dict(checkpointing or {})
        self._checkpointing_routed = False
        if self._checkpointing:
            unknown = sorted(set(self._checkpointing) - set(CHECKPOINTING_OPTIONS))
            if unknown:
                raise ValueError(f"checkpointing: unknown option(s) {', '.join(unknown)} "
                                 f"(expected {', '.join(CHECKPOINTING_OPTIONS)})")
            if not self.args.gradient_checkpointing:
                raise ValueError("checkpointing options need TrainingArguments(gradient_checkpointing=True)")
            cuda_graphs = self._checkpointing.get("cuda_graphs", False)
            if cuda_graphs and self.is_fsdp_enabled:
                raise ValueError("checkpointing: cuda_graphs cannot replay layers that FSDP shards (it frees and "
                                 "re-gathers their weights between steps); turn one of them off")
            check_checkpointing_options(self.model, **self._checkpointing)
        if self.args.gradient_checkpointing and hasattr(self.model, "enable_input_require_grads"):
            # Frozen embeddings (LoRA) would hand the first checkpointed layer inputs without grad.
            self.model.enable_input_require_grads()
        # The patched forward takes num_items_in_batch and normalises by it (no division by the number of
        # accumulation steps afterwards), as Hugging Face's own causal-LM loss does.
        self.model_accepts_loss_kwargs = True

    def training_step(self, model, inputs, *args, **kwargs):
        if not self._checkpointing_routed:
            self._route_checkpointing()
        return super().training_step(model, inputs, *args, **kwargs)

    def _route_checkpointing(self) -> None:
        """Points the layers Hugging Face's checkpointing covers (enabled by `train()`) to ours."""
        self._checkpointing_routed = True
        checkpointed = {id(layer) for layer in checkpointing_layers(self.model) if layer.gradient_checkpointing}
        if not checkpointed:
            return
        enable_gradient_checkpointing(self.model, **self._checkpointing)
        for layer in checkpointing_layers(self.model):  # every_n_layers kept, uncheckpointed_layers too
            layer.gradient_checkpointing = layer.gradient_checkpointing and id(layer) in checkpointed

    def _run_epoch(self, *args, **kwargs):
        # Resumed from a checkpoint taken at max_steps (the last one of a run that finished, or was killed after
        # saving it), transformers' loop skips the trained batches and then trains one more step before its
        # stop check (the checks follow each step): the run would end at max_steps + 1. It has nothing to train.
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return
        return super()._run_epoch(*args, **kwargs)

    def log(self, logs: dict, *args, **kwargs):
        # The peak so far on each training log line: a run stopped early (a time limit, a crash) still shows it.
        if "loss" in logs:
            peak = peak_gpu_gib()
            if peak is not None:
                logs["peak_gpu_gib"] = peak
        super().log(logs, *args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        wants_logits = not prediction_loss_only and (
            self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None
        )
        if wants_logits or "labels" not in inputs:
            return super().prediction_step(model, {**inputs, "return_logits": True}, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach().mean(), None, None

    def _get_output_dir(self, trial):
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # One staging directory for all processes: the main process makes it, each process writes its part
        # (model and optimizer from the main one, random states from each), the main process renames it.
        staging = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        if is_main_process():
            os.makedirs(run_dir, exist_ok=True)
            for stale in glob.glob(os.path.join(run_dir, STAGING_PREFIX + "*")):  # left by a killed save
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(staging)
        barrier()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        barrier()
        target = os.path.join(run_dir, name)
        if is_main_process():
            if os.path.exists(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
            shutil.rmtree(staging)
        barrier()
        best = self.state.best_model_checkpoint
        if best and best.startswith(staging):
            self.state.best_model_checkpoint = run_dir + best[len(staging):]
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True,
            )
