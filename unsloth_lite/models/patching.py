"""Declarative patching: each architecture lists, in a small table, which Hugging Face module classes take
which fused forward; one routine walks a model and rebinds `forward` on the matching instances.

Forwards are bound on instances, never on classes, so an unpatched model in the same process stays
unpatched. What a fused forward reads of its module (attribute names) is checked when patching, so that a
transformers release that renames something fails loudly at `patch_model`, naming the version, instead of
giving wrong results later.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import torch
import transformers

PATCHED_FLAG = "_unsloth_lite_patched"


@dataclasses.dataclass(frozen=True)
class Rule:
    """Instances of the Hugging Face class named `module_class` run `forward` (called with the module as
    `self`); `requires` are the attributes that forward reads."""

    module_class: str
    forward: Callable
    requires: tuple[str, ...] = ()
    check: Callable[[torch.nn.Module], str | None] | None = None  # returns why the module can't take it
    on_patch: Callable[[torch.nn.Module], None] | None = None  # prepares a module that takes the forward


ARCHITECTURES: dict[str, tuple[Rule, ...]] = {}


def register(model_type: str, rules: tuple[Rule, ...]) -> None:
    ARCHITECTURES[model_type] = rules


def model_config(model: torch.nn.Module):
    """The Hugging Face config under any PEFT wrapping."""
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "get_base_model"):
        config = model.get_base_model().config
    if config is None:
        raise ValueError(f"patch_model needs a Hugging Face model with a config, got {type(model).__name__}")
    return config


def _attribute_missing(module: torch.nn.Module, dotted: str) -> bool:
    target = module
    for part in dotted.split("."):
        if not hasattr(target, part):
            return True
        target = getattr(target, part)
    return False


def patch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Route every supported module of a Hugging Face Qwen2/Qwen3/Qwen3.5 causal LM (plain, 4-bit, PEFT-wrapped)
    through the fused kernels, in place; returns `model`. Patching twice changes nothing."""
    model_type = model_config(model).model_type
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"patch_model does not support model_type {model_type!r}; supported: {supported}")
    rules = {rule.module_class: rule for rule in ARCHITECTURES[model_type]}
    _stop_hub_kernelization(model)
    for module in model.modules():
        rule = rules.get(type(module).__name__)
        if rule is None or getattr(module, PATCHED_FLAG, False):
            continue
        missing = [name for name in rule.requires if _attribute_missing(module, name)]
        if missing:
            raise RuntimeError(
                f"transformers {transformers.__version__}: {type(module).__name__} has no {', '.join(missing)}, "
                "which unsloth_lite's fused forward reads; this transformers release is not supported"
            )
        reason = rule.check(module) if rule.check else None
        if reason:
            continue  # this instance keeps Hugging Face's forward
        if rule.on_patch:
            rule.on_patch(module)
        module.forward = types.MethodType(rule.forward, module)
        setattr(module, PATCHED_FLAG, True)
    _prefer_static_cache(model)
    return model


def _stop_hub_kernelization(model: torch.nn.Module) -> None:
    """Since transformers 5.25 `from_pretrained` kernelizes models through the `kernels` library by default, and
    every later `train()`/`eval()` that changes mode kernelizes them again: that drops any `forward` bound on an
    instance of a hub-kernelizable class (the norms, Qwen3.5's DeltaNet layers), silently putting Hugging Face's
    forwards back under the patched model. Resetting kernelization restores the classes' own forwards and
    switches it off, so the forwards bound next stay bound."""
    for module in model.modules():
        if getattr(module, "use_kernels", False) is True and hasattr(module, "reset_kernels"):
            module.reset_kernels()


def _prefer_static_cache(model: torch.nn.Module) -> None:
    """`generate` never compiles the patched forward (its kernels are Triton's already, and on CUDA the decode
    step is replayed as a CUDA graph of its own, which Hugging Face's compiled CUDA graphs would conflict with);
    on CUDA it defaults to a static cache: only its decode step has the fixed shapes and addresses that the
    graph replays (`decode_graph.py`), a dynamic cache runs every step eagerly. An explicit
    `cache_implementation` (in the call or already in the generation config) wins."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    for module in model.modules():
        config = getattr(module, "generation_config", None)
        if config is None:
            continue
        config.disable_compile = True
        if on_cuda and getattr(config, "cache_implementation", "unset") is None:
            config.cache_implementation = "static"
