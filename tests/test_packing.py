"""Padding-free packing: documents packed into one row (positions restarting at 0 at each) train exactly as
the same documents padded apart, on Qwen2, Qwen3 and Qwen3.5 (attention, DeltaNet and conv state kept within
each document); the collator's layout; gradient accumulation over packed micro-batches through the Trainer.
On CUDA (tests marked `gpu`) the same in bfloat16 through torch's `varlen_attn`."""

import copy
import functools

import datasets
import pytest
import torch
import transformers
from helpers import assert_close
from peft import LoraConfig, get_peft_model
from test_patch_model import tiny_model, tiny_qwen3_5

import unsloth_lite
from unsloth_lite.models import causal_lm, patch_model
from unsloth_lite.models import layers as model_layers
from unsloth_lite.models.packing import block_diagonal_causal_mask, packed_sequence_kwargs, varlen_attention
from unsloth_lite.training.data import PaddingCollator
from unsloth_lite.training.packing import IGNORE_INDEX, PackingCollator, pack_dataset, pack_documents

ARCHS = ["qwen2", "qwen3", "qwen3_5"]
LENGTHS = (9, 4, 13, 6)  # odd and uneven, one shorter than Qwen3.5's conv kernel is wide plus one
PAD = 0


def lora_model(arch, device, dtype=torch.float32, **overrides):
    """A tiny model with LoRA on every linear layer, B initialised non-zero so every A gets a gradient."""
    base = tiny_qwen3_5(device, dtype) if arch == "qwen3_5" else tiny_model(arch, device, dtype, **overrides)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config)


def documents(lengths=LENGTHS, vocab=151):
    """Token ids and labels per document, the first two tokens of each a prompt that is not trained on."""
    docs = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,)).tolist()
        docs.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]})
    return docs


def lora_gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def loss_and_gradients(model, batch, device):
    model.zero_grad(set_to_none=True)
    out = model(**{key: value.to(device) for key, value in batch.items()})
    out.loss.backward()
    return out.loss.detach(), lora_gradients(model)


def assert_gradients_close(got, expected, tol):
    assert got.keys() == expected.keys() and got
    for name in expected:
        assert_close(got[name], expected[name], tol, f"grad {name}")


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_batch_equals_documents_padded(arch, device, monkeypatch, torch_delta_rule):
    """Loss and every LoRA gradient of the documents packed into one row (with padding at its tail) equal
    those of the same documents in a padded batch, run through the unpatched model in float64 (fp32: loss 1e-5,
    gradients 1e-4). The patched model's attention goes through `varlen_attention`."""
    reference = lora_model(arch, device)
    patched = patch_model(copy.deepcopy(reference))
    reference.double()
    docs = documents()
    packed = PackingCollator(PAD, max_tokens=40)(docs)
    padded = PaddingCollator(PAD)(docs)
    calls = []
    monkeypatch.setattr(model_layers, "varlen_attention", lambda *a, **k: calls.append(1) or varlen_attention(*a, **k))

    expected_loss, expected_grads = loss_and_gradients(reference, padded, device)
    loss, grads = loss_and_gradients(patched, packed, device)
    assert calls, "the packed batch did not take varlen_attention"
    assert_close(loss, expected_loss, 1e-5, "loss")
    assert_gradients_close(grads, expected_grads, 1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_document_loss_does_not_depend_on_its_neighbours(arch, device):
    """A document's loss is the same alone in a row and packed beside others (whose labels are ignored)."""
    model = patch_model(lora_model(arch, device))
    docs = documents()
    alone = PackingCollator(PAD, max_tokens=16)([docs[2]])
    others = [{**d, "labels": [IGNORE_INDEX] * len(d["labels"])} for d in docs]
    beside = PackingCollator(PAD, max_tokens=40)([{"input_ids": sum((d["input_ids"] for d in docs), []),
                                                  "labels": sum((d["labels"] for d in others[:2]), [])
                                                  + docs[2]["labels"] + others[3]["labels"],
                                                  "position_ids": sum((list(range(n)) for n in LENGTHS), [])}])
    with torch.no_grad():
        expected = model(**{k: v.to(device) for k, v in alone.items()}).loss
        got = model(**{k: v.to(device) for k, v in beside.items()}).loss
    assert_close(got, expected, 1e-5, "loss of the document packed beside others")


def test_gradient_accumulation_over_packed_micro_batches(device):
    """Two packed micro-batches (different numbers of targets) accumulated with `num_items_in_batch`, the
    count the Trainer takes from `labels[..., 1:]`, give the loss and gradients of one packed batch of all."""
    model = patch_model(lora_model("qwen3", device))
    docs = documents((9, 4, 13, 6, 11))
    collate = PackingCollator(PAD, max_tokens=24)
    micro = [collate(docs[:2]), collate(docs[2:])]
    count = sum(int((b["labels"][..., 1:] != IGNORE_INDEX).sum()) for b in micro)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in micro:
        loss = model(**{k: v.to(device) for k, v in batch.items()}, num_items_in_batch=torch.tensor(count)).loss
        loss.backward()
        total += loss.detach()
    accumulated = lora_gradients(model)
    whole_loss, whole = loss_and_gradients(model, collate(docs), device)
    assert_close(total, whole_loss, 1e-5, "accumulated loss")
    assert_gradients_close(accumulated, whole, 1e-4)


def _args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1,
        learning_rate=0.5, optim="sgd", max_grad_norm=0.0, report_to="none", use_cpu=True, save_strategy="no",
        dataloader_num_workers=0, lr_scheduler_type="constant", logging_steps=1, seed=3,
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Trainer runs on the CPU here")
def test_trainer_accumulates_packed_batches_as_one(tmp_path):
    """Through unsloth_lite.Trainer (SGD, one optimiser step): two packed rows as two accumulated
    micro-batches move the weights exactly as the same rows in one micro-batch; the Trainer's
    `num_items_in_batch` normalises both over the step's real targets."""
    model = lora_model("qwen3", "cpu")
    rows = pack_dataset(datasets.Dataset.from_list(documents((9, 4, 13, 6, 11, 3))), max_tokens=16)
    assert len(rows) >= 2
    rows = rows.select(range(2))
    collator = PackingCollator(PAD, max_tokens=16)
    trained = {}
    for name, args in {"accumulated": _args(tmp_path / "a"),
                       "one batch": _args(tmp_path / "b", per_device_train_batch_size=2,
                                          gradient_accumulation_steps=1)}.items():
        trainer = unsloth_lite.Trainer(model=copy.deepcopy(model), args=args, train_dataset=rows,
                                       data_collator=collator)
        trainer.train()
        trained[name] = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    for name, weight in trained["one batch"].items():
        assert_close(trained["accumulated"][name] - before[name], weight - before[name], 1e-4, f"update {name}")


def test_collator_layout():
    """One row of batch dimension 1 and a fixed shape; positions restart at 0 at each document and at the
    padding; first-token and padding labels ignored; each packed feature padded to the budget."""
    docs = documents((5, 3, 4))
    rows = [{"input_ids": docs[0]["input_ids"] + docs[1]["input_ids"],
             "labels": docs[0]["labels"] + docs[1]["labels"], "position_ids": [0, 1, 2, 3, 4, 0, 1, 2]},
            {"input_ids": docs[2]["input_ids"], "labels": [7, 8, 9, 10]}]  # a plain document: its own row
    batch = PackingCollator(pad_token_id=PAD, max_tokens=10)(rows)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (1, 20) for k in ("input_ids", "labels",
                                                                                   "position_ids")}
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert batch["input_ids"][0, 8:10].tolist() == [PAD, PAD] and batch["input_ids"][0, 14:].eq(PAD).all()
    labels = batch["labels"][0].tolist()
    assert labels[:8] == [IGNORE_INDEX] * 2 + docs[0]["input_ids"][2:] + [IGNORE_INDEX] * 2 + docs[1]["input_ids"][2:]
    assert labels[8:10] == [IGNORE_INDEX] * 2 and labels[10:14] == [IGNORE_INDEX, 8, 9, 10]
    assert labels[14:] == [IGNORE_INDEX] * 6
    with pytest.raises(ValueError, match="exceeds the packing budget of 4"):
        PackingCollator(PAD, max_tokens=4)(rows)


def test_pack_documents_fills_rows_within_budget():
    lengths = [int(n) for n in torch.randint(1, 50, (300,))] + [50, 0]
    rows = pack_documents(lengths, max_tokens=64, seed=1)
    assert sorted(i for row in rows for i in row) == [i for i, n in enumerate(lengths) if n]
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert len(rows) <= -(-sum(lengths) // 64) * 1.1  # nearly full rows
    assert rows == pack_documents(lengths, max_tokens=64, seed=1)
    with pytest.raises(ValueError, match="document 300 has 50 tokens, more than the packing budget of 49"):
        pack_documents(lengths, max_tokens=49)


def test_pack_dataset_rows():
    docs = documents((5, 3, 4, 7))
    rows = pack_dataset(datasets.Dataset.from_list(docs), max_tokens=10)
    assert sum(len(r["input_ids"]) for r in rows) == 19 and all(len(r["input_ids"]) <= 10 for r in rows)
    for row in rows:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"])
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        pieces = [row["input_ids"][a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
        assert all(piece in [d["input_ids"] for d in docs] for piece in pieces)


def test_packed_sequence_kwargs_and_mask():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    packed = packed_sequence_kwargs(positions)
    assert packed["cu_seq_lens_q"].dtype == torch.int32
    assert packed["cu_seq_lens_q"].tolist() == packed["cu_seq_lens_k"].tolist() == [0, 3, 5, 9]
    assert packed["max_length_q"] == packed["max_length_k"] == 4
    for unpacked in (None, torch.arange(6)[None], torch.tensor([[2, 3, 0, 1]]), torch.tensor([[0, 1, 0], [0, 1, 2]])):
        assert packed_sequence_kwargs(unpacked) is None
    mask = block_diagonal_causal_mask(packed["cu_seq_lens_q"], 9)
    expected = torch.zeros(9, 9, dtype=torch.bool)
    for a, b in ((0, 3), (3, 5), (5, 9)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    static = packed_sequence_kwargs(positions, static_shapes=True)  # 3 documents: room for 4, the row's length
    assert static["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 9] and static["max_length_q"] == 9
    assert torch.equal(block_diagonal_causal_mask(static["cu_seq_lens_q"], 9), expected)
    five = packed_sequence_kwargs(torch.tensor([[0, 0, 0, 0, 0, 1]]), static_shapes=True)
    assert five["cu_seq_lens_q"].tolist() == [0, 1, 2, 3, 4, 6, 6, 6, 6]
    # a long row keeps a slot per 128 tokens whatever its documents: 1,024 tokens in 3 documents, room for 8
    long_row = torch.cat([torch.arange(500), torch.arange(24), torch.arange(500)])[None]
    offsets = packed_sequence_kwargs(long_row, static_shapes=True)["cu_seq_lens_q"].tolist()
    assert offsets == [0, 500, 524, 1024, 1024, 1024, 1024, 1024, 1024]


def test_static_shapes_change_nothing(device, monkeypatch):
    """Qwen3.5 (attention, conv and DeltaNet all read the offsets): a packed batch whose offsets end in empty
    documents (`static_shapes`, the CUDA default; 5 documents with the padding: room for 8) gives the loss and
    gradients of the exact offsets."""
    model = patch_model(lora_model("qwen3_5", device))
    packed = PackingCollator(PAD, max_tokens=24)(documents((9, 4, 6, 3)))
    exact_loss, exact_grads = loss_and_gradients(model, packed, device)
    static = functools.partial(packed_sequence_kwargs, static_shapes=True)
    monkeypatch.setattr(causal_lm, "packed_sequence_kwargs", static)
    loss, grads = loss_and_gradients(model, packed, device)
    assert_close(loss, exact_loss, 1e-6, "loss")
    assert_gradients_close(grads, exact_grads, 1e-6)


def assert_bf16_packed_as_accurate_as_padded(arch, device):
    """bfloat16: the packed row through the patched model against the padded batch through the unpatched model
    in float32 (the same weights), measured next to Hugging Face's own bf16 error on the padded batch. A LoRA
    gradient of q or k passes through the softmax's backward, where bf16 rounding alone moves it by 5-20%
    (measured), so each gradient may be off by at most 3x Hugging Face's error on it (at least 2e-2)."""
    from helpers import relative_error

    # Qwen2's tiny head size (48 / 4 = 12) is no multiple of 8, which flash attention needs: 64 / 4 = 16.
    exact = lora_model(arch, device, **({"hidden_size": 64} if arch == "qwen2" else {}))
    hugging_face = copy.deepcopy(exact).to(torch.bfloat16)
    patched = patch_model(copy.deepcopy(hugging_face))
    docs = documents((37, 5, 120, 64, 2, 200))
    packed = PackingCollator(PAD, max_tokens=512)(docs)
    padded = PaddingCollator(PAD)(docs)
    exact_loss, exact_grads = loss_and_gradients(exact, padded, device)
    hf_loss, hf_grads = loss_and_gradients(hugging_face, padded, device)
    loss, grads = loss_and_gradients(patched, packed, device)
    assert_close(loss.float(), exact_loss, 1e-2, "loss")
    assert grads.keys() == exact_grads.keys()
    for name, expected in exact_grads.items():
        bound = max(3 * relative_error(hf_grads[name].float(), expected), 2e-2)
        assert_close(grads[name].float(), expected, bound, f"grad {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_bf16_on_cuda_through_varlen_attn(arch, torch_delta_rule):
    """bfloat16 on CUDA: the packed row goes through torch's `varlen_attn` (with grouped KV heads); its loss and
    gradients as accurate as Hugging Face's on the padded batch (`assert_bf16_packed_as_accurate_as_padded`).
    The unpatched models run Hugging Face's PyTorch DeltaNet: flash-linear-attention's backward, where
    installed, refuses Hopper GPUs with triton < 3.7.1."""
    from unsloth_lite.models.packing import _uses_varlen_attn

    assert _uses_varlen_attn(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16), 0.0)
    assert_bf16_packed_as_accurate_as_padded(arch, "cuda")


@pytest.mark.gpu
def test_head_sizes_flash_attention_cannot_take_fall_back_on_cuda():
    """Flash attention takes head sizes that are multiples of 8 up to 256; others go through the SDPA path."""
    from unsloth_lite.models.packing import _uses_varlen_attn

    for head_dim, expected in ((12, False), (128, True), (256, True), (512, False)):
        query = torch.empty(1, 2, 5, head_dim, device="cuda", dtype=torch.bfloat16)
        assert _uses_varlen_attn(query, 0.0) is expected, head_dim
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, 2, 5, 12, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    out = varlen_attention(q, k, v, {"cu_seq_lens_q": cu, "max_length_q": 3}, 0.3)
    expected = varlen_attention(q.float(), k.float(), v.float(), {"cu_seq_lens_q": cu, "max_length_q": 3}, 0.3)
    assert_close(out.float(), expected, 1e-2, "output")


@pytest.mark.gpu
def test_varlen_attention_matches_fallback_on_cuda():
    """The varlen_attn path against the block-diagonal SDPA fallback (float32 on the same device), forward and
    gradients, with grouped KV heads."""
    lengths = [17, 1, 130, 64, 300]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = {"cu_seq_lens_q": cu, "max_length_q": max(lengths)}
    total = sum(lengths)
    q = torch.randn(1, 8, total, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, total, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    out = varlen_attention(q, k, v, packed, 64**-0.5)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = varlen_attention(*leaves, packed, 64**-0.5)  # float32: the SDPA fallback
    expected_grads = torch.autograd.grad(expected.square().sum(), leaves)
    assert_close(out.float(), expected, 1e-2, "output")
    for name, got, ref in zip("qkv", grads, expected_grads, strict=True):
        assert_close(got.float(), ref, 2e-2, f"grad {name}")
