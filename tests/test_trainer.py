"""unsloth_lite.Trainer as a drop-in for transformers.Trainer: the same losses step by step (fp32), with
rows masking different numbers of tokens and gradient accumulation; evaluation without logits; the peak GPU
memory on each training log line."""

import copy

import pytest
import torch
import transformers
from helpers import assert_close

import unsloth_lite
from unsloth_lite.training import trainer as trainer_module
from unsloth_lite.training.data import PaddingCollator, tokenize_dataset
from unsloth_lite.training.tiny import arithmetic_records, build_tiny_qwen3, build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def dataset(tokenizer, n, seed):
    import datasets

    records = arithmetic_records(n=n, seed=seed)
    # Vary the masked prompt length from row to row: some questions padded with extra words.
    for i, record in enumerate(records):
        record["messages"][0]["content"] += " please" * (i % 3)
    return tokenize_dataset(datasets.Dataset.from_list(records), tokenizer, "chat", max_length=64)


def training_args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, seed=7, save_strategy="no",
        dataloader_num_workers=0, lr_scheduler_type="constant",
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


def step_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_losses_equal_transformers_trainer(tokenizer, tmp_path, monkeypatch):
    """Also: every training log line carries the peak GPU memory so far (faked here: no GPU)."""
    monkeypatch.setattr(trainer_module, "peak_gpu_gib", lambda: 1.25)
    model = build_tiny_qwen3(tokenizer, torch.float32, seed=3)
    train = dataset(tokenizer, 24, seed=1)
    collator = PaddingCollator(tokenizer.pad_token_id)

    reference = transformers.Trainer(
        model=copy.deepcopy(model), args=training_args(tmp_path / "hf"), train_dataset=train, data_collator=collator
    )
    reference.train()
    ours = unsloth_lite.Trainer(
        model=copy.deepcopy(model), args=training_args(tmp_path / "ul"), train_dataset=train, data_collator=collator
    )
    ours.train()

    expected, got = step_losses(reference), step_losses(ours)
    assert len(got) == len(expected) == 3
    assert [entry.get("peak_gpu_gib") for entry in ours.state.log_history if "loss" in entry] == [1.25] * 3
    assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), 1e-4, "losses")
    for (name, p), (_, q) in zip(ours.model.named_parameters(), reference.model.named_parameters(), strict=True):
        assert_close(p, q, 1e-4, f"parameter {name} after training")


def test_trainer_evaluates_without_logits(tokenizer, tmp_path):
    model = build_tiny_qwen3(tokenizer, torch.float32, seed=3)
    evaluation = dataset(tokenizer, 6, seed=2)
    collator = PaddingCollator(tokenizer.pad_token_id)
    args = training_args(tmp_path / "eval", per_device_eval_batch_size=3)
    data = dict(eval_dataset=evaluation, data_collator=collator)
    reference = transformers.Trainer(model=copy.deepcopy(model), args=args, **data)
    ours = unsloth_lite.Trainer(model=copy.deepcopy(model), args=args, **data)
    expected = reference.evaluate()["eval_loss"]
    got = ours.evaluate()["eval_loss"]
    assert abs(got - expected) <= 1e-5 * abs(expected)
    # metrics that need logits get them
    ours.compute_metrics = lambda prediction: {"logit_rows": float(prediction.predictions.shape[0])}
    assert ours.evaluate()["eval_logit_rows"] == 6


@pytest.mark.parametrize(
    "checkpointing",
    [None, {"offload_to_cpu": True, "cuda_graphs": True, "keep_mlp_preactivations": True},
     {"offload_to_cpu": True, "uncheckpointed_layers": 1}],
    ids=["default", "offload-graphs-kept-mlp", "offload-last-layer-kept"],
)
def test_trainer_with_gradient_checkpointing_and_lora(checkpointing, tokenizer, tmp_path):
    """LoRA on a frozen base with gradient checkpointing: the layers go through unsloth-lite's checkpointing
    (with the options given), and the losses and adapters equal Hugging Face's Trainer with its own."""
    from unsloth_lite import add_lora
    from unsloth_lite.training.checkpointing import checkpoint_layer, checkpointing_layers

    model = add_lora(build_tiny_qwen3(tokenizer, torch.float32, seed=3), r=4, lora_alpha=8)
    with torch.no_grad():  # PEFT starts B at zero: give it values so the first step exercises every gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    train = dataset(tokenizer, 16, seed=4)
    collator = PaddingCollator(tokenizer.pad_token_id)
    gc = dict(max_steps=2, per_device_train_batch_size=1, gradient_accumulation_steps=1, gradient_checkpointing=True,
              gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = transformers.Trainer(model=copy.deepcopy(model), args=training_args(tmp_path / "hf", **gc),
                                     train_dataset=train, data_collator=collator)
    reference.train()
    trainer = unsloth_lite.Trainer(model=model, args=training_args(tmp_path / "ul", **gc), train_dataset=train,
                                   data_collator=collator, checkpointing=checkpointing)
    trainer.train()
    kept = (checkpointing or {}).get("uncheckpointed_layers", 0)
    layers = checkpointing_layers(model)
    assert [layer.gradient_checkpointing for layer in layers] == [True] * (len(layers) - kept) + [False] * kept
    for layer in layers:
        assert layer._gradient_checkpointing_func.func is checkpoint_layer
        assert layer._gradient_checkpointing_func.keywords["cuda_graphs"] == bool((checkpointing or {}).get(
            "cuda_graphs"))
    expected, got = step_losses(reference), step_losses(trainer)
    assert len(got) == len(expected) == 2
    assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), 1e-4, "losses")
    trained = {n: p for n, p in reference.model.named_parameters() if p.requires_grad}
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert not torch.equal(param, before[name]), name
            assert_close(param, trained[name], 1e-4, f"{name} after training")


def test_resuming_from_the_checkpoint_at_max_steps_trains_no_further_step(tokenizer, tmp_path):
    """A run resumed from its last checkpoint (max_steps reached mid-epoch) ends where it was: transformers'
    own loop would train a step max_steps + 1 first."""
    model = build_tiny_qwen3(tokenizer, torch.float32, seed=3)
    train = dataset(tokenizer, 4, seed=4)  # 4 steps an epoch: max_steps ends mid-epoch
    collator = PaddingCollator(tokenizer.pad_token_id)
    args = training_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=1,
                         save_strategy="steps", save_steps=1)
    finished = unsloth_lite.Trainer(model=copy.deepcopy(model), args=args, train_dataset=train, data_collator=collator)
    finished.train()
    assert (tmp_path / "checkpoint-1").is_dir()
    resumed = unsloth_lite.Trainer(model=copy.deepcopy(model), args=args, train_dataset=train, data_collator=collator)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 1
    assert [entry["step"] for entry in resumed.state.log_history if "loss" in entry] == [1]
    assert not (tmp_path / "checkpoint-2").exists()
    for (name, p), (_, q) in zip(resumed.model.named_parameters(), finished.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_trainer_checkpointing_options_are_checked(tokenizer, tmp_path):
    model = build_tiny_qwen3(tokenizer, torch.float32, seed=3)
    with pytest.raises(ValueError, match="gradient_checkpointing=True"):
        unsloth_lite.Trainer(model=model, args=training_args(tmp_path), checkpointing={"offload_to_cpu": True})
    gc = training_args(tmp_path, gradient_checkpointing=True)
    with pytest.raises(ValueError, match=r"unknown option\(s\) offload \(expected"):
        unsloth_lite.Trainer(model=model, args=gc, checkpointing={"offload": True})
    with pytest.raises(ValueError, match=r"uncheckpointed_layers: expected a whole number from 0 to 2 \(the model's"):
        unsloth_lite.Trainer(model=model, args=gc, checkpointing={"uncheckpointed_layers": 3})
    with pytest.raises(ValueError, match=r"mlp_preactivations_on_gpu: expected a whole number from 0 to 1 \(the"):
        unsloth_lite.Trainer(model=model, args=gc,
                             checkpointing={"keep_mlp_preactivations": 1, "mlp_preactivations_on_gpu": 2})
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="without dropout"):
        unsloth_lite.Trainer(model=model, args=gc, checkpointing={"cuda_graphs": True})


def test_padding_collator_pads_to_a_multiple():
    features = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8] * 9, "labels": [8] * 9}]
    out = PaddingCollator(pad_token_id=0, pad_to_multiple_of=4)(features)
    assert out["input_ids"].shape == (2, 12)
    assert out["input_ids"][0].tolist() == [5, 6, 7] + [0] * 9
    assert out["labels"][0].tolist() == [-100, 6, 7] + [-100] * 9
    assert out["attention_mask"].sum(1).tolist() == [3, 9]
    assert PaddingCollator(pad_token_id=0)(features)["input_ids"].shape == (2, 9)
