"""W2's FLOP accounting for `bench_train_27b.py`: the products a training step of the 27B executes, a token at
a time, by variant (what each variant's recomputation leaves out)."""

from __future__ import annotations

import torch
from bench_common import kept_mlp_options, uncheckpointed_suffix
from bench_train_setup import step_flops


def linear_params(c: dict) -> dict[str, int]:
    """Weights of the decoder's linears by projection name, summed over the layers (counted on a weightless
    model of config `c`: a full-attention q_proj also produces the output gate)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**c))
    counts: dict[str, int] = {}
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            kind = name.rsplit(".", 1)[-1]
            counts[kind] = counts.get(kind, 0) + module.weight.numel()
    return counts


def recompute_skipped(variant: str, all_linear: bool, offload: bool, kept_mlp: bool | None = None) -> tuple[str, ...]:
    """Projections whose product a variant's recomputation leaves out: ours always the MLP's down projection;
    with the offload (which keeps the residual after attention) the output projections that go through the
    fused LoRA path too (o_proj; out_proj only with an adapter); with the MLP's pre-activations kept (`kept_mlp`,
    default: the variant's name says so), gate and up (at W2's 2,048 tokens the MLP's backward runs as one row
    block, so they are kept)."""
    if not variant.startswith("unsloth_lite"):
        return ()
    kept_mlp = ("gate_proj", "up_proj") * ("kept_mlp" in variant if kept_mlp is None else kept_mlp)
    return ("down_proj",) + kept_mlp + (("o_proj",) + ("out_proj",) * all_linear) * offload


def flops_per_token(c: dict, seq: int, skipped: tuple[str, ...] = (), params: dict[str, int] | None = None) -> dict:
    """`bench_train_setup.step_flops` of the 27B: every decoder linear, less the recomputation's `skipped`
    projections, and attention in the full-attention layers only. The DeltaNet's chunked recurrence is left out
    (under 1% of the total at W2's shape). `params`: `linear_params(c)`, where the caller has it already."""
    params = params or linear_params(c)
    skipped_params = sum(params.get(name, 0) for name in skipped)
    full_layers = sum(t == "full_attention" for t in c["layer_types"])
    return step_flops(c, seq, sum(params.values()), skipped_params, full_layers)


def executed_flops_per_token(row: dict, c: dict, seq: int, all_linear: bool, offload: bool, params) -> float:
    """FLOPs a token of the row's variant executes; where only some layers keep their MLP pre-activations
    (`@keep=N`), the recomputations of the others' gate and up products count too. Layers left out of
    checkpointing (`:N`) are counted as recomputed: an upper bound for those variants."""
    name, kept = kept_mlp_options(uncheckpointed_suffix(row["variant"])[0])
    flops = flops_per_token(c, seq, recompute_skipped(name, all_linear, offload), params)["total"]
    keeping, layers = kept.get("keep_mlp_preactivations", False), row.get("checkpointed_layers")
    if isinstance(keeping, bool) or not layers:
        return flops
    recomputed = flops_per_token(c, seq, recompute_skipped(name, all_linear, offload, kept_mlp=False), params)["total"]
    return recomputed + (flops - recomputed) * keeping / layers
