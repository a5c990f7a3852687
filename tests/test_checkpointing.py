"""Gradient checkpointing through `enable_gradient_checkpointing`: the same loss and gradients as training
without checkpointing (and as Hugging Face's own checkpointing), for a full fine-tune and for LoRA, with
dropout drawing the same masks in the recomputation; the saved inputs in pinned CPU memory on a GPU."""

import copy

import pytest
import torch
from helpers import assert_close
from peft import LoraConfig, get_peft_model
from test_patch_model import batch, tiny_model

from unsloth_lite.models import patch_model
from unsloth_lite.training.checkpointing import checkpoint_layer, enable_gradient_checkpointing


def _loss_and_grads(model, loss_of, seed=0):
    """loss_of(model), and the gradients of its backward (called outside any autocast region, as the Trainer
    does and as CUDA's backward thread always is); the gradients are cleared after."""
    model.train()
    torch.manual_seed(seed)
    loss = loss_of(model)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _language_model_loss(input_ids, labels):
    return lambda model: model(input_ids=input_ids, labels=labels).loss


def _assert_same_step(step, got, expected, tol, loss_tol=None):
    """got and expected, each (loss, gradients), agree; `step` names the step in the messages."""
    (loss, grads), (expected_loss, expected_grads) = got, expected
    assert_close(loss, expected_loss, loss_tol or tol, f"step {step} loss")
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], tol, f"step {step} {name}")


def _compare(model, device, offload_to_cpu=False, cuda_graphs=False, tol=1e-5, steps=3, keep_residual=None,
             uncheckpointed_layers=0, keep_mlp_preactivations=False, mlp_preactivations_on_gpu=0,
             keep_projection_outputs=False):
    reference = copy.deepcopy(model)
    hf_checkpointed = copy.deepcopy(model)
    hf_checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_checkpointed.enable_input_require_grads()
    enable_gradient_checkpointing(
        model, offload_to_cpu=offload_to_cpu, cuda_graphs=cuda_graphs, keep_residual=keep_residual,
        uncheckpointed_layers=uncheckpointed_layers, keep_mlp_preactivations=keep_mlp_preactivations,
        mlp_preactivations_on_gpu=mlp_preactivations_on_gpu, keep_projection_outputs=keep_projection_outputs,
    )
    # Several steps on fresh batches: state left by one (offloaded buffers, a graph's static inputs) must not
    # leak into the next; with cuda_graphs the first step runs eagerly, the second captures, the third replays.
    for step in range(steps):
        loss_of = _language_model_loss(*batch(device))
        expected = _loss_and_grads(reference, loss_of, seed=step)
        for other in (hf_checkpointed, model) if step == 0 else (model,):
            _assert_same_step(step, _loss_and_grads(other, loss_of, seed=step), expected, tol)


def test_full_fine_tune_with_dropout(device):
    # attention dropout: the recomputation must draw the forward's masks again
    _compare(tiny_model("qwen3", device, attention_dropout=0.2), device)


@pytest.mark.parametrize("patched", [False, True], ids=["hf_layers", "fused_layers"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_recomputation_under_the_forwards_autocast(cuda_graphs, patched, device):
    """Under autocast the recomputation (which runs in the backward, outside the autocast region) must compute
    in the forward's precision, or its activations would differ from the forward's at bf16 rounding. With
    graphs: eager, captured and replayed steps under autocast, then steps without it (graphs of their own).
    Patched, the fused decoder layers add bf16 mixer and MLP outputs to the fp32 residual stream."""
    model = tiny_model("qwen3", device)
    if patched:
        model = patch_model(model)
    device_type = torch.device(device).type
    reference = copy.deepcopy(model)
    enable_gradient_checkpointing(model, cuda_graphs=cuda_graphs)
    for step, autocast in enumerate([True] * 3 + [False] * 3 if cuda_graphs else [True]):
        language_model_loss = _language_model_loss(*batch(device))

        def loss_of(m, autocast=autocast, language_model_loss=language_model_loss):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                return language_model_loss(m)

        expected = _loss_and_grads(reference, loss_of)
        _assert_same_step(step, _loss_and_grads(model, loss_of), expected, 1e-5, loss_tol=1e-6)
    if cuda_graphs:
        assert _graphed_layer_count(model) == 2
        signatures = model.model.layers[0].__dict__["_unsloth_lite_graphs"]
        assert sum(not isinstance(g, str) for g in signatures.values()) == 2  # one pair with autocast, one without


def test_lora_on_patched_model(device):
    _compare(_lora_model(device), device, tol=1e-4)


def _lora_model(device):
    return _with_lora(patch_model(tiny_model("qwen3", device)),
                      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _with_lora(model, targets):
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():  # LoRA B starts at zero: give it values so every adapter gradient is exercised
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def _graphed_layer_count(model) -> int:
    """Decoder layers whose forward and backward went through their graphs."""
    return sum(
        any(getattr(g, "backward_graph", None) is not None for g in m.__dict__.get("_unsloth_lite_graphs", {}).values())
        for m in model.modules()
    )


def test_graphed_layers(device):
    # Off CUDA the graphs' functions run eagerly: the static buffers and gradient routing are what is checked.
    for model, tol in ((tiny_model("qwen3", device), 1e-5), (_lora_model(device), 1e-4)):
        _compare(model, device, cuda_graphs=True, tol=tol)
        assert _graphed_layer_count(model) == 2


def test_graphed_layers_two_forwards_before_a_backward(device):
    """A second forward while the first's backward is pending runs eagerly (its static input is in use)."""
    model = tiny_model("qwen3", device)
    reference = copy.deepcopy(model)
    enable_gradient_checkpointing(model, cuda_graphs=True)
    for step in range(3):
        first, second = _language_model_loss(*batch(device)), _language_model_loss(*batch(device))

        def loss_of(m, first=first, second=second):
            return first(m) + 2 * second(m)

        _assert_same_step(step, _loss_and_grads(model, loss_of), _loss_and_grads(reference, loss_of), 1e-5)


def test_graphed_layers_refuse_dropout():
    with pytest.raises(ValueError, match="without dropout"):
        enable_gradient_checkpointing(tiny_model("qwen3", "cpu", attention_dropout=0.1), cuda_graphs=True)


def test_checkpoint_layer_passes_gradients_of_every_tensor_input(device):
    weight = torch.randn(5, 5, device=device, requires_grad=True)
    x = torch.randn(3, 5, device=device, requires_grad=True)
    y = torch.randn(3, 5, device=device, requires_grad=True)

    def layer(a, scale, b):
        return (a @ weight).tanh() * scale + b.sin()

    checkpoint_layer(layer, x, 2.0, y).square().sum().backward()
    grads = [t.grad.clone() for t in (x, y, weight)]
    for t in (x, y, weight):
        t.grad = None
    layer(x, 2.0, y).square().sum().backward()
    for got, name, t in zip(grads, "xyw", (x, y, weight), strict=True):
        assert_close(got, t.grad, 1e-6, name)


def test_no_decoder_layers_is_an_error():
    with pytest.raises(ValueError, match="no decoder layers"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.gpu
def test_offloaded_inputs_on_gpu():
    model = tiny_model("qwen3", "cuda", attention_dropout=0.2)
    _compare(model, "cuda", offload_to_cpu=True)


@pytest.mark.gpu
def test_cuda_graphs_on_gpu():
    for model, tol in ((tiny_model("qwen3", "cuda"), 1e-5), (_lora_model("cuda"), 1e-4)):
        _compare(model, "cuda", cuda_graphs=True, tol=tol, steps=4)
        assert _graphed_layer_count(model) == 2


@pytest.mark.parametrize("keep_residual", [False, True], ids=["inputs", "inputs-and-residual"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_recomputation_skips_the_projections_it_does_not_read(cuda_graphs, keep_residual, device, monkeypatch):
    """The down projection's product runs in each layer's forward but not in its recomputation (the backward
    never reads it); with the residual after attention kept, neither does the output projection's. The
    gradients stay exact (test_lora_on_patched_model, test_graphed_layers, test_kept_residual)."""
    import unsloth_lite.kernels.lora as lora_module

    model = _lora_model(device)
    enable_gradient_checkpointing(model, cuda_graphs=cuda_graphs, keep_residual=keep_residual)
    intermediate = model.config.intermediate_size
    calls = {"down": 0, "o": 0, "other": 0}
    project_all = lora_module._project_all

    def counting(x2d, projections, adapters, output_needed=True, out=None):
        if output_needed:  # the products run
            single = "down" if x2d.shape[-1] == intermediate else "o"
            calls[single if len(projections) == 1 else "other"] += 1
        return project_all(x2d, projections, adapters, output_needed, out)

    monkeypatch.setattr(lora_module, "_project_all", counting)
    layers = model.config.num_hidden_layers
    # A layer's forward runs q/k/v, o, gate/up and down; its recomputation the same but down (and o). With
    # graphs on CUDA: step 0 runs eagerly, step 1 captures (each graph's function runs twice: warm-up and
    # capture), step 2 replays (no Python runs). Off CUDA every step runs the functions.
    o_calls = layers if keep_residual else 2 * layers
    expected = [(layers, o_calls, 4 * layers)] * 3
    if cuda_graphs and torch.device(device).type == "cuda":
        expected = [(layers, o_calls, 4 * layers), (2 * layers, 2 * o_calls, 8 * layers), (0, 0, 0)]
    for step, (down, o, other) in enumerate(expected):
        calls.update(down=0, o=0, other=0)
        _loss_and_grads(model, _language_model_loss(*batch(device)))
        assert calls == {"down": down, "o": o, "other": other}, f"step {step}"


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_kept_residual(cuda_graphs, device, torch_delta_rule):
    """The residual after attention kept with each layer's input (what offloading does by default): the
    recomputation takes it in place of residual + attention output, with the same gradients. Qwen3.5's
    layers run Hugging Face's attention and DeltaNet forwards: the residual is still substituted."""
    from test_patch_model import tiny_qwen3_5

    models = [(tiny_model("qwen3", device), 1e-5), (_lora_model(device), 1e-4)]
    if not cuda_graphs:
        models.append((patch_model(tiny_qwen3_5(device, torch.float64)), 1e-9))
    for model, tol in models:
        _compare(model, device, cuda_graphs=cuda_graphs, keep_residual=True, tol=tol)
        hooked = [m for m in model.modules() if "_unsloth_lite_residual_hook" in m.__dict__]
        assert len(hooked) == model.config.num_hidden_layers


@pytest.mark.parametrize("patched", [True, False], ids=["fused_layer", "hooked_norm"])
def test_kept_residual_is_what_the_recomputation_reads(patched, device, monkeypatch):
    """Each layer's recomputation takes the kept residual (a changed one changes the gradients): in the fused
    decoder layer's norm (patched) and through the post-attention norm's hook (Hugging Face's layer)."""
    from unsloth_lite.models.layers import residual_streams

    model = tiny_model("qwen3", device)
    model = _with_lora(patch_model(model) if patched else model, ["q_proj", "o_proj", "gate_proj", "down_proj"])
    enable_gradient_checkpointing(model, keep_residual=True)
    input_ids, labels = batch(device)
    _, expected = _loss_and_grads(model, _language_model_loss(input_ids, labels))
    take, calls = residual_streams.take, []

    def doubled(name):
        value = take(name)
        if name == "kept" and value is not None:
            calls.append(value.shape)
            return 2 * value
        return value

    monkeypatch.setattr(residual_streams, "take", doubled)
    _, grads = _loss_and_grads(model, _language_model_loss(input_ids, labels))
    assert len(calls) == model.config.num_hidden_layers
    changed = [name for name, grad in grads.items() if not torch.allclose(grad, expected[name])]
    assert any("mlp" in name for name in changed)


class _HostGroup:
    """Stands in for `_OffloadedTensors` off CUDA: keeps copies, and records the order of fetches."""

    fetches: list = []
    sizes: list = []  # the number of tensors of each group, in the order of the forwards

    def __init__(self, tensors, previous, kept=None):
        self.tensors, self.previous = [t.clone() for t in tensors], previous
        _HostGroup.sizes.append(len(tensors))
        self.prefetched = False

    def prefetch(self, in_use=None):
        self.prefetched = True

    def take(self):
        _HostGroup.fetches.append(self.prefetched)
        if self.previous is not None:
            self.previous.prefetch()
        return self.tensors


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_offloaded_groups_keep_order(cuda_graphs, device, monkeypatch):
    """The offload's bookkeeping off CUDA (copies stand in for the pinned host memory): a checkpoint's input
    and residual travel as one group, come back in order, and each backward starts fetching the group of the
    layer before (all but the first-taken group were prefetched)."""
    import unsloth_lite.training.checkpointing as checkpointing

    monkeypatch.setattr(checkpointing, "_OffloadedTensors", _HostGroup)

    monkeypatch.setattr(checkpointing, "_offloadable", lambda t: True)  # what a GPU would offload
    _HostGroup.fetches = []
    model = _lora_model(device)
    _compare(model, device, offload_to_cpu=True, cuda_graphs=cuda_graphs, tol=1e-4)
    layers = model.config.num_hidden_layers
    assert _HostGroup.fetches == ([False] + [True] * (layers - 1)) * 3  # 3 steps, the last layer's group first


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_uncheckpointed_layers(cuda_graphs, device, monkeypatch):
    """The last layer kept out of checkpointing: the same losses and gradients; it keeps its activations (no
    offloaded group, no kept residual, no recomputation) while the layer before is checkpointed as usual."""
    import unsloth_lite.training.checkpointing as checkpointing

    monkeypatch.setattr(checkpointing, "_OffloadedTensors", _HostGroup)
    monkeypatch.setattr(checkpointing, "_offloadable", lambda t: True)  # what a GPU would offload
    runs = []
    real_checkpoint_layer = checkpointing.checkpoint_layer
    monkeypatch.setattr(checkpointing, "checkpoint_layer", lambda run, *args, **kwargs: (
        runs.append(run), real_checkpoint_layer(run, *args, **kwargs))[1])
    _HostGroup.fetches = []
    model = _lora_model(device)
    layers = model.config.num_hidden_layers
    _compare(model, device, offload_to_cpu=True, cuda_graphs=cuda_graphs, tol=1e-4, uncheckpointed_layers=1)
    decoder = model.get_base_model().model.layers
    assert [layer.gradient_checkpointing for layer in decoder] == [True] * (layers - 1) + [False]
    assert "_unsloth_lite_residual_hook" not in decoder[-1].__dict__
    assert len(runs) == 3 * (layers - 1)  # 3 steps, the last layer never through checkpoint_layer
    assert _HostGroup.fetches == ([False] + [True] * (layers - 2)) * 3


@pytest.mark.gpu
def test_uncheckpointed_layers_with_graphs_and_offload_on_gpu():
    _compare(_lora_model("cuda"), "cuda", cuda_graphs=True, offload_to_cpu=True, tol=1e-4, steps=4,
             uncheckpointed_layers=1)


@pytest.mark.parametrize("count", [-1, 3, 1.0, True])
def test_uncheckpointed_layers_out_of_range(count, device):
    with pytest.raises(ValueError, match=r"uncheckpointed_layers: expected a whole number from 0 to 2 \(the model's "):
        enable_gradient_checkpointing(tiny_model("qwen3", device), uncheckpointed_layers=count)


@pytest.mark.parametrize("options, message", [
    (dict(keep_mlp_preactivations=3), r"keep_mlp_preactivations: expected a whole number from 0 to 2 \(the "),
    (dict(keep_mlp_preactivations=2, uncheckpointed_layers=1), r"keep_mlp_preactivations: .* from 0 to 1 .* got 2"),
    (dict(keep_mlp_preactivations=-1), r"keep_mlp_preactivations: .* got -1"),
    (dict(mlp_preactivations_on_gpu=1), r"mlp_preactivations_on_gpu: expected a whole number from 0 to 0 \(the "),
    (dict(keep_mlp_preactivations=1, mlp_preactivations_on_gpu=2), r"mlp_preactivations_on_gpu: .* to 1 .* got 2"),
    (dict(keep_projection_outputs=3), r"keep_projection_outputs: expected a whole number from 0 to 2 \(the "),
    (dict(keep_projection_outputs=2, uncheckpointed_layers=1), r"keep_projection_outputs: .* from 0 to 1 .* got 2"),
])
def test_kept_mlp_layer_counts_out_of_range(options, message, device):
    with pytest.raises(ValueError, match=message):
        enable_gradient_checkpointing(tiny_model("qwen3", device), **options)


def test_kept_residual_hooks_come_off(device):
    model = tiny_model("qwen3", device)
    enable_gradient_checkpointing(model, keep_residual=True)
    enable_gradient_checkpointing(model, keep_residual=False)
    assert not [m for m in model.modules() if "_unsloth_lite_residual_hook" in m.__dict__]
    assert not any(m._forward_pre_hooks for m in model.modules() if m.__class__.__name__.endswith("RMSNorm"))


@pytest.mark.gpu
def test_cuda_graphs_with_offloaded_inputs_on_gpu():
    _compare(_lora_model("cuda"), "cuda", cuda_graphs=True, offload_to_cpu=True, tol=1e-4, steps=4)


def test_graphed_shapes_are_capped(device, monkeypatch):
    """Graphs are kept for the first MAX_GRAPHED_SHAPES shapes seen twice; other shapes run eagerly, with the
    same results."""
    import unsloth_lite.training.layer_graphs as layer_graphs

    monkeypatch.setattr(layer_graphs, "MAX_GRAPHED_SHAPES", 2)
    model = tiny_model("qwen3", device)
    reference = copy.deepcopy(model)
    enable_gradient_checkpointing(model, cuda_graphs=True)
    for length in (5, 7, 9, 5, 7, 9, 5, 9):
        loss_of = _language_model_loss(*batch(device, size=(2, length)))
        expected = _loss_and_grads(reference, loss_of)
        _assert_same_step(f"at length {length}", _loss_and_grads(model, loss_of), expected, 1e-5)
    for layer in model.model.layers:
        graphed = [sig for sig, g in layer.__dict__["_unsloth_lite_graphs"].items() if not isinstance(g, str)]
        assert [sig[0][1] for sig in graphed] == [(2, 5, 48), (2, 7, 48)]  # hidden states' shapes
