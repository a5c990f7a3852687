"""`greedy_token` (a greedy decoding step's argmax, end-of-sequence handling and bookkeeping in one launch) against
its PyTorch reference, the decoding loop's own steps: ties across and within blocks, NaN and -inf logits, finished
rows, both mask forms, several steps in a row on the same tensors."""

import pytest
import torch
from helpers import dtype_id

from unsloth_lite.kernels.greedy_token import BLOCK_V, greedy_token, greedy_token_reference


def _state(batch, vocab, steps, mask_kind, eos, device, dtype):
    """The loop's tensors: ids with poisoned new columns, the next input, position, mask, unfinished, and the
    value that opens a position."""
    length = 5
    ids = torch.full((batch, length + steps), -7, dtype=torch.long, device=device)
    ids[:, :length] = torch.randint(0, vocab, (batch, length), device=device)
    next_input = torch.full((batch, 1), -7, dtype=torch.long, device=device)
    position = torch.full((batch, 1), length, dtype=torch.long, device=device)
    size = length + steps + 3
    if mask_kind == "boolean":
        mask, opened = torch.zeros((batch, 1, 1, size), dtype=torch.bool, device=device), True
    else:
        mask, opened = torch.full((batch, 1, 1, size), torch.finfo(dtype).min, dtype=dtype, device=device), 0.0
    mask[..., : length + 1] = opened
    unfinished = torch.ones(batch, dtype=torch.bool, device=device) if eos is not None else None
    return dict(ids=ids, next_input=next_input, unfinished=unfinished, position=position, mask=mask), length, opened


def _logits(batch, vocab, device, dtype, step):
    logits = torch.randn(batch, vocab, device=device).to(dtype)
    top = logits.float().max(dim=-1).values
    if batch > 1:  # a tie of the row's maximum across blocks: the first index wins
        logits[1, vocab - 1] = logits[1].float().max().to(dtype)
        logits[1, 3 + step] = logits[1, vocab - 1]
    if batch > 2:  # a NaN after the maximum's block: the NaN's index wins
        logits[2, vocab - 2] = float("nan")
        logits[2, 2] = top[2] + 1
    if batch > 3:  # every logit -inf: index 0
        logits[3] = float("-inf")
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("batch,vocab", [(1, 3 * BLOCK_V + 37), (4, 2 * BLOCK_V + 1), (8, BLOCK_V - 5)])
@pytest.mark.parametrize("mask_kind,with_eos", [("boolean", True), ("additive", False), ("additive", True)])
def test_greedy_token_steps(batch, vocab, mask_kind, with_eos, dtype, device):
    steps = 4
    eos = torch.tensor([11, 3, 29], device=device) if with_eos else None
    mine, length, opened = _state(batch, vocab, steps, mask_kind, eos, device, dtype)
    ref = {k: None if v is None else v.clone() for k, v in mine.items()}
    for step in range(steps):
        logits = _logits(batch, vocab, device, dtype, step)
        if with_eos and step == 1:  # row 0 ends at step 1: pad afterwards
            logits[0, 11] = float("inf")
        common = dict(column=length + step, eos=eos, pad=17, opened=opened, advance=step > 0,
                      suppress_eos=with_eos and step == 0)
        if with_eos and step == 0:  # an end token's logit the largest, held back (`min_new_tokens`)
            logits[0, 3] = float("inf")
        record = greedy_token(logits, **common, **mine)
        expected = greedy_token_reference(logits, **common, **ref)
        assert torch.equal(record, expected), f"step {step}: {record.tolist()} != {expected.tolist()}"
        for name, value in mine.items():
            if value is not None:
                assert torch.equal(value, ref[name]), f"step {step}: {name} differs"
    if with_eos:
        assert mine["ids"][0, length + steps - 1].item() == 17 and not mine["unfinished"][0]
    assert (mine["ids"] >= 0).all()


def test_greedy_token_all_finished(device):
    batch, vocab = 3, BLOCK_V + 9
    eos = torch.tensor([4], device=device)
    mine, length, opened = _state(batch, vocab, 1, "boolean", eos, device, torch.float32)
    mine["unfinished"][1:] = False  # rows 1 and 2 ended before; row 0 ends now
    logits = torch.randn(batch, vocab, device=device)
    logits[0, 4] = 100.0
    record = greedy_token(logits, column=length, eos=eos, pad=0, opened=opened, advance=False, **mine)
    assert record.tolist() == [4, 0, 0, 1]
    assert not mine["unfinished"].any()


def test_greedy_token_rejects_bad_shapes(device):
    mine, length, opened = _state(2, 50, 1, "boolean", None, device, torch.float32)
    with pytest.raises(ValueError, match="logits"):
        greedy_token(torch.randn(2, 1, 50, device=device), column=length, eos=None, pad=None, opened=opened,
                     advance=False, **mine)
    mine["position"] = mine["position"].int()
    with pytest.raises(ValueError, match="position"):
        greedy_token(torch.randn(2, 50, device=device), column=length, eos=None, pad=None, opened=opened,
                     advance=False, **mine)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("vocab", [151936, 248320])
def test_greedy_token_qwen_vocabularies_cuda(batch, vocab):
    """Compiled, at the Qwen3 and Qwen3.5 vocabularies, bf16 logits, several steps on the same tensors."""
    eos = torch.tensor([vocab - 1, 7], device="cuda")
    mine, length, opened = _state(batch, vocab, 3, "boolean", eos, "cuda", torch.bfloat16)
    ref = {k: v.clone() for k, v in mine.items()}
    for step in range(3):
        logits = _logits(batch, vocab, "cuda", torch.bfloat16, step)
        common = dict(column=length + step, eos=eos, pad=0, opened=opened, advance=step > 0)
        record = greedy_token(logits, **common, **mine)
        assert torch.equal(record, greedy_token_reference(logits, **common, **ref))
        assert all(torch.equal(mine[name], ref[name]) for name in mine)
