"""The tensors a checkpoint keeps beside its inputs so that its recomputation runs fewer products: the MLPs'
pre-activations (`keep_mlp_preactivations`) and the token mixers' input projections' outputs
(`keep_projection_outputs`). The same losses and gradients as training without checkpointing, the products each
leaves out of the recomputation, and their placements (on the device, offloaded, in the graphs' buffers)."""

import pytest
import torch
from test_checkpointing import (
    _compare,
    _graphed_layer_count,
    _HostGroup,
    _language_model_loss,
    _lora_model,
    _loss_and_grads,
    _with_lora,
)
from test_patch_model import batch, tiny_model

from unsloth_lite.models import patch_model
from unsloth_lite.training.checkpointing import enable_gradient_checkpointing


def _qwen3_5_lora_model(device):
    from test_patch_model import tiny_qwen3_5

    return _with_lora(patch_model(tiny_qwen3_5(device)), ["gate_proj", "up_proj", "down_proj", "q_proj", "in_proj_qkv"])


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_kept_mlp_preactivations(cuda_graphs, offload, device, monkeypatch):
    """Each checkpoint keeps its MLP's gate and up outputs (with its input: on the device, or in the offloaded
    group, stood in for off CUDA): the same losses and gradients, and the recomputation runs no gate/up
    product (each layer's forward runs one; the backward none either, it reads the kept ones)."""
    import unsloth_lite.kernels.lora as lora_module
    import unsloth_lite.training.checkpointing as checkpointing

    if offload:
        monkeypatch.setattr(checkpointing, "_OffloadedTensors", _HostGroup)
        monkeypatch.setattr(checkpointing, "_offloadable", lambda t: True)  # what a GPU would offload
        _HostGroup.fetches = []
    gate_up_products, in_static_buffers = [], []
    project_all = lora_module._project_all

    def counting(x2d, projections, adapters, output_needed=True, out=None):
        if output_needed and len(projections) == 2 and projections[0].out_features == intermediate:
            gate_up_products.append(x2d.shape[0])
            in_static_buffers.append(out is not None)
        return project_all(x2d, projections, adapters, output_needed, out)

    monkeypatch.setattr(lora_module, "_project_all", counting)
    # (Qwen3.5's MLP is the same fused module: its model, slow under the interpreter, runs in the GPU test.)
    for model in [_lora_model(device)]:
        intermediate = model.config.intermediate_size
        layers = model.config.num_hidden_layers
        gate_up_products.clear()
        _compare(model, device, offload_to_cpu=offload, cuda_graphs=cuda_graphs, tol=1e-4,
                 keep_mlp_preactivations=True)
        # 3 steps; the reference models (unpatched or not checkpointed) run theirs through other paths or
        # without recomputation: one product a layer a forward, HF's checkpointed copy two (first step only).
        checkpointed = 3 * layers
        assert len(gate_up_products) == 3 * layers + 2 * layers + checkpointed, gate_up_products
        # graphs: step 1 eager, step 2 records and sets up the static buffers, step 3 computes in them
        assert sum(in_static_buffers) == (layers if cuda_graphs else 0)
    if offload:
        assert _HostGroup.fetches[: 2] == [False, True]


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_mlp_preactivations_kept_in_some_layers_some_on_the_device(cuda_graphs, device, monkeypatch):
    """keep_mlp_preactivations=2 of 3 layers (the last two: spread evenly), one of them (the last) on the device
    with the rest offloaded: the same losses and gradients; only the first layer's recomputation runs its
    gate/up product; the offloaded groups hold input and residual, and the pre-activations of the middle
    layer only."""
    import unsloth_lite.kernels.lora as lora_module
    import unsloth_lite.training.checkpointing as checkpointing

    monkeypatch.setattr(checkpointing, "_OffloadedTensors", _HostGroup)
    monkeypatch.setattr(checkpointing, "_offloadable", lambda t: True)  # what a GPU would offload
    _HostGroup.fetches, _HostGroup.sizes = [], []
    gate_up_products = []
    project_all = lora_module._project_all

    def counting(x2d, projections, adapters, output_needed=True, out=None):
        if output_needed and len(projections) == 2 and projections[0].out_features == 88:
            gate_up_products.append(x2d.shape[0])
        return project_all(x2d, projections, adapters, output_needed, out)

    monkeypatch.setattr(lora_module, "_project_all", counting)
    model = _with_lora(patch_model(tiny_model("qwen3", device, num_hidden_layers=3)), ["gate_proj", "up_proj"])
    steps = 3 if cuda_graphs else 1  # graphs: eager, capture, replay
    _compare(model, device, offload_to_cpu=True, cuda_graphs=cuda_graphs, tol=1e-4, keep_mlp_preactivations=2,
             mlp_preactivations_on_gpu=1, steps=steps)
    assert _HostGroup.sizes == [2, 4, 2] * steps
    # as in test_kept_mlp_preactivations: forwards of the model and the not checkpointed reference (3 layers a
    # step), Hugging Face's checkpointed copy (step 1, forward and recomputation); then the model's
    # recomputations of the first layer, the one that keeps nothing
    assert len(gate_up_products) == 3 * steps + 3 * steps + 2 * 3 + steps, gate_up_products


def test_spread_places_count_evenly():
    from unsloth_lite.training.checkpointing import spread

    assert spread(2, 3) == [False, True, True]
    assert spread(0, 4) == [False] * 4 and spread(4, 4) == [True] * 4
    assert spread(3, 8) == [False, False, True, False, False, True, False, True]


def _checkpointed_step(device, **options):
    """(a LoRA model checkpointed with `options`, a batch's loss function, its gradients without changes)."""
    model = _lora_model(device)
    enable_gradient_checkpointing(model, **options)
    loss_of = _language_model_loss(*batch(device))
    return model, loss_of, _loss_and_grads(model, loss_of)[1]


def test_kept_mlp_preactivations_are_what_the_recomputation_reads(device, monkeypatch):
    """The recomputation's MLP takes the kept (gate, up): changed ones change the gradients."""
    import unsloth_lite.models.layers as layers_module

    model, loss_of, expected = _checkpointed_step(device, keep_mlp_preactivations=True)
    real = layers_module.lora_mlp
    kept = []

    def doubling(x, *projections, preactivations=None, **kwargs):
        if preactivations is not None:
            kept.append(preactivations[0].shape)
            preactivations = tuple(2 * t for t in preactivations)
        return real(x, *projections, preactivations=preactivations, **kwargs)

    monkeypatch.setattr(layers_module, "lora_mlp", doubling)
    _, grads = _loss_and_grads(model, loss_of)
    assert kept == [(22, model.config.intermediate_size)] * model.config.num_hidden_layers
    changed = [name for name, grad in grads.items() if not torch.allclose(grad, expected[name])]
    assert any("gate_proj" in name for name in changed) and any("down_proj" in name for name in changed)


def test_mlp_preactivations_not_kept_over_several_row_blocks(device, monkeypatch):
    """Where the MLP's backward runs over several row blocks (long sequences), nothing is kept: the
    recomputation runs the blocks as without the option."""
    import unsloth_lite.kernels.lora as lora_module

    monkeypatch.setattr(lora_module, "mlp_row_blocks", lambda rows, intermediate: [slice(0, 8), slice(8, rows)])
    model = _lora_model(device)
    recorded = []
    real = lora_module.LoRAMLPFunction.forward

    def forward(ctx, x, projections, output_needed, preactivations, record, *weights):
        out = real(ctx, x, projections, output_needed, preactivations, record, *weights)
        recorded.append(None if record is None else len(record))
        return out

    monkeypatch.setattr(lora_module.LoRAMLPFunction, "forward", staticmethod(forward))
    _compare(model, device, tol=1e-4, keep_mlp_preactivations=True, steps=1)
    assert recorded and set(recorded) <= {None, 0}


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_mlp_preactivations_kept_in_some_layers_some_on_the_gpu(cuda_graphs):
    """The placements on the real offload (pinned host memory, side-stream copies): 2 of 3 layers keep them, one
    of those on the GPU."""
    model = _with_lora(patch_model(tiny_model("qwen3", "cuda", num_hidden_layers=3)), ["gate_proj", "up_proj"])
    _compare(model, "cuda", cuda_graphs=cuda_graphs, offload_to_cpu=True, tol=1e-4, steps=4,
             keep_mlp_preactivations=2, mlp_preactivations_on_gpu=1)


@pytest.mark.gpu
def test_kept_mlp_preactivations_offloaded_with_graphs_on_gpu():
    for model in (_lora_model("cuda"), _qwen3_5_lora_model("cuda")):
        _compare(model, "cuda", cuda_graphs=True, offload_to_cpu=True, tol=1e-4, steps=4,
                 keep_mlp_preactivations=True)
        assert _graphed_layer_count(model) == model.config.num_hidden_layers


def _counting_projections(monkeypatch):
    """A list that records, for each product of a token mixer's input projections (three or four of one input:
    q, k, v; the Gated DeltaNet's qkv, z, b, a) that `lora_projections` computes, whether it was computed in given
    buffers."""
    import unsloth_lite.kernels.lora as lora_module

    products = []
    project_all = lora_module._project_all

    def counting(x2d, projections, adapters, output_needed=True, out=None):
        if output_needed and len(projections) >= 3:
            products.append(out is not None)
        return project_all(x2d, projections, adapters, output_needed, out)

    monkeypatch.setattr(lora_module, "_project_all", counting)
    return products


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_kept_projection_outputs(cuda_graphs, device, monkeypatch):
    """Each checkpoint keeps its attention's q, k, v outputs (on the device, with the inputs offloaded and the MLP
    pre-activations kept): the same losses and gradients, and the recomputations run no q/k/v product."""
    import unsloth_lite.training.checkpointing as checkpointing

    monkeypatch.setattr(checkpointing, "_OffloadedTensors", _HostGroup)
    monkeypatch.setattr(checkpointing, "_offloadable", lambda t: True)  # what a GPU would offload
    _HostGroup.fetches, _HostGroup.sizes = [], []
    model = _lora_model(device)
    layers = model.config.num_hidden_layers
    products = _counting_projections(monkeypatch)
    _compare(model, device, offload_to_cpu=True, cuda_graphs=cuda_graphs, tol=1e-4, keep_mlp_preactivations=True,
             keep_projection_outputs=True)
    # 3 steps: one product a layer a forward of the model and of the reference, two of Hugging Face's
    # checkpointed copy (step 1); none in the model's recomputations
    assert len(products) == 3 * layers + 3 * layers + 2 * layers, products
    # graphs: step 1 eager, step 2 records and sets up the static buffers, step 3 computes in them
    assert sum(products) == (layers if cuda_graphs else 0)
    assert set(_HostGroup.sizes) == {4}  # input, residual, gate, up: the outputs stay on the device


def test_kept_projection_outputs_are_what_the_recomputation_reads(device, monkeypatch):
    """The recomputation's projections return the kept outputs: changed ones change the gradients (through
    the attention), though each projection's own backward never reads its output."""
    import unsloth_lite.models.layers as layers_module

    model, loss_of, expected = _checkpointed_step(device, keep_projection_outputs=True)
    real = layers_module.lora_projections
    kept_shapes = []

    def doubling(x, projections, kept=None, **kwargs):
        if kept is not None:
            kept_shapes.append(tuple(t.shape[-1] for t in kept))
            kept = tuple(2 * t for t in kept)
        return real(x, projections, kept=kept, **kwargs)

    monkeypatch.setattr(layers_module, "lora_projections", doubling)
    _, grads = _loss_and_grads(model, loss_of)
    config = model.config
    widths = (config.num_attention_heads * config.head_dim,) + (config.num_key_value_heads * config.head_dim,) * 2
    assert kept_shapes == [widths] * config.num_hidden_layers
    changed = [name for name, grad in grads.items() if not torch.allclose(grad, expected[name])]
    assert any("q_proj" in name for name in changed) and any("v_proj" in name for name in changed)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_projection_outputs_kept_in_some_layers(cuda_graphs, device, monkeypatch):
    """keep_projection_outputs=2 of 3 layers (the last two: spread evenly): the same losses and gradients; only
    the first layer's recomputation runs its q/k/v product."""
    model = _with_lora(patch_model(tiny_model("qwen3", device, num_hidden_layers=3)), ["q_proj", "v_proj"])
    products = _counting_projections(monkeypatch)
    steps = 3 if cuda_graphs else 1  # graphs: eager, capture, replay
    _compare(model, device, cuda_graphs=cuda_graphs, tol=1e-4, keep_projection_outputs=2, steps=steps)
    # forwards of the model and the reference (3 layers a step), Hugging Face's checkpointed copy (step 1,
    # forward and recomputation); then the model's recomputations of the first layer only
    assert len(products) == 3 * steps + 3 * steps + 2 * 3 + steps, products


def test_kept_projection_outputs_of_qwen3_5(device, monkeypatch):
    """Qwen3.5's Gated DeltaNet (qkv, z, b, a) and gated attention (q with its gate, k, v) layers keep their
    projections' outputs: the same losses and gradients, no recomputed input projection."""
    model = _qwen3_5_lora_model(device)
    products = _counting_projections(monkeypatch)
    _compare(model, device, tol=1e-4, keep_mlp_preactivations=True, keep_projection_outputs=True, steps=1)
    # a product a layer in the model's and the reference's forwards, in Hugging Face's forward and
    # recomputation; none in our recomputations
    assert len(products) == 4 * model.config.num_hidden_layers, products


@pytest.mark.gpu
def test_kept_projection_outputs_with_graphs_and_offload_on_gpu():
    for model in (_lora_model("cuda"), _qwen3_5_lora_model("cuda")):
        _compare(model, "cuda", cuda_graphs=True, offload_to_cpu=True, tol=1e-4, steps=4,
                 keep_mlp_preactivations=True, keep_projection_outputs=True)
        assert _graphed_layer_count(model) == model.config.num_hidden_layers
