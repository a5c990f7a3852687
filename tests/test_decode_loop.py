"""The patched model's decoding loop (`models/decode_loop.py`) against Hugging Face's `generate` on the unpatched
model: the same tokens when sequences end at different steps (the stop read steps late, the steps queued after it
dropped), the same samples from the same seed, the same streamed tokens, a reused cache reset between calls;
and the requests it does not implement left to Hugging Face's `generate`, with its results.

Tiny models in fp32, dense weights (the 4-bit and adapter variants run the same loop in `test_generation.py`):
on the CPU with the patched kernels interpreted, where every step's tokens are read at once; on CUDA compiled,
with the decode step replayed as a CUDA graph and the tokens read late through pinned memory.
"""

from __future__ import annotations

import pytest
import torch
from test_generation import model_pair
from transformers.generation.streamers import BaseStreamer

from unsloth_lite.kernels.greedy_token import greedy_token
from unsloth_lite.kernels.screened_logits import screened_logits
from unsloth_lite.models import decode, decode_loop

ARCHS = ["qwen3", "qwen3_5"]
NEW_TOKENS = 12


@pytest.fixture
def loop_calls(monkeypatch):
    """How many `generate` calls ran the loop."""
    calls = []
    decode = decode_loop.decode

    def counted(model, request):
        calls.append(request)
        return decode(model, request)

    monkeypatch.setattr(decode_loop, "decode", counted)
    return calls


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def greedy_path(reference, prompt, pad: int) -> torch.Tensor:
    """The new tokens of `prompt` without an end token; `pad` must not occur in the prompt (Hugging Face would
    mask it, and take another path than the runs that have no pad token there)."""
    assert not (prompt == pad).any()
    return reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)[:, prompt.shape[1]:]


def end_tokens(path: torch.Tensor) -> tuple[int, int, int] | None:
    """(a, b, step): a token that first ends row 0 at `step` and never occurs in row 1, and one that ends row 1
    at a later step and is not in row 0 before `step`; None where the greedy path has no such pair."""
    rows = [row.tolist() for row in path]
    for step in range(1, len(rows[0]) - 2):
        first = rows[0][step]
        if first in rows[0][:step]:
            continue
        for later in range(step + 1, len(rows[1]) - 1):
            second = rows[1][later]
            if second not in rows[1][:later] and first not in rows[1] and second not in rows[0][:step]:
                return first, second, step
    return None


@pytest.mark.parametrize("choice", ["torch", "greedy_token", "screened_head"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sequences_ending_at_different_steps(arch, choice, loop_calls, monkeypatch, device):
    """End-of-sequence tokens chosen from the greedy path so that one sequence ends first and the other later
    (every sequence then has ended: the output stops there, the first padded), or only the first ends (the
    output runs to `max_new_tokens`); both against Hugging Face, streamed tokens included. The step's choice in
    PyTorch, or in one `greedy_token` launch, with the lm_head's logits screened by its int8 copy or not."""
    monkeypatch.setattr(decode_loop, "GREEDY_TOKEN_KERNEL", choice != "torch")
    monkeypatch.setattr(decode, "SCREENED_LM_HEAD", choice == "screened_head")
    screened = []
    monkeypatch.setattr(decode, "screened_logits", lambda *a, **k: screened.append(1) or screened_logits(*a, **k))
    reference, patched = model_pair(arch, "dense", device)
    for _ in range(20):  # a prompt whose greedy path has such tokens (random tiny models repeat tokens)
        prompt = torch.randint(0, 150, (2, 7), device=device)  # no pad token (150): a prompt's pads are padding
        chosen = end_tokens(greedy_path(reference, prompt, 150))
        if chosen is not None:
            break
    assert chosen is not None, "no prompt of 20 gives two distinct end tokens"
    first, second, step = chosen
    for eos in ([first, second], first):
        kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=150)
        streamers = RecordingStreamer(), RecordingStreamer()
        expected = reference.generate(prompt, streamer=streamers[0], **kwargs)
        got = patched.generate(prompt, streamer=streamers[1], **kwargs)
        assert got.shape == expected.shape and torch.equal(got, expected), (eos, got, expected)
        assert streamers[1].puts == streamers[0].puts and streamers[1].ended
        if isinstance(eos, list):
            assert expected.shape[1] < prompt.shape[1] + NEW_TOKENS  # both ended: stopped early
    assert len(loop_calls) == 2
    assert bool(screened) == (choice == "screened_head")
    assert expected.shape[1] == prompt.shape[1] + NEW_TOKENS  # one sequence never ended
    assert (got[0, prompt.shape[1] + step + 1:] == 150).all()  # padded after its end


@pytest.mark.parametrize("one_launch", [False, True], ids=["torch_choice", "greedy_token"])
def test_end_at_first_token_and_at_last_step(one_launch, loop_calls, monkeypatch, device):
    """Batch 1: an end-of-sequence token as the first new token (one step), and on the last step."""
    monkeypatch.setattr(decode_loop, "GREEDY_TOKEN_KERNEL", one_launch)
    reference, patched = model_pair("qwen3", "dense", device)
    prompt = torch.randint(1, 151, (1, 5), device=device)
    path = greedy_path(reference, prompt, 0)[0].tolist()
    for eos in {path[0], path[-1]}:
        kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos)
        assert torch.equal(patched.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
    assert loop_calls


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_draws_hugging_face_samples(arch, loop_calls, monkeypatch, device):
    """Temperature, top-k, top-p, min-p and the repetition penalty applied as Hugging Face applies them: the same
    samples from the same seed. Sampling turns the last bits of the logits into different tokens now and then,
    so both loops run the same forwards here: the unpatched model's, over a static cache of the same length."""
    reference, _ = model_pair(arch, "dense", device)
    monkeypatch.setattr(decode_loop, "CACHE_ROUNDING", 1)
    prompt = torch.randint(1, 151, (2, 6), device=device)  # no pad token (0)
    for warpers in (dict(temperature=0.7, top_k=20, top_p=0.9), dict(min_p=0.05, repetition_penalty=1.3), dict()):
        kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=True, pad_token_id=0, **warpers)
        torch.manual_seed(3)
        expected = reference.generate(prompt, cache_implementation="static", **kwargs)
        torch.manual_seed(3)
        assert torch.equal(decode_loop.generate(reference, prompt, **kwargs), expected), warpers
    assert len(loop_calls) == 3


def test_min_new_tokens_and_logits_processors(loop_calls, device):
    """`min_new_tokens` holds back the end token, after the repetition penalty; a caller's logits processor sees
    the sequences so far."""
    from transformers import LogitsProcessorList

    reference, patched = model_pair("qwen3", "dense", device)
    prompt = torch.randint(1, 151, (2, 4), device=device)
    path = greedy_path(reference, prompt, 0)
    lengths = []

    def ban_last_token(input_ids, scores):  # a processor that reads input_ids: no token twice in a row
        lengths.append(input_ids.shape[1])
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))

    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=6, eos_token_id=int(path[0, 1]), pad_token_id=0,
                  repetition_penalty=1.5, logits_processor=LogitsProcessorList([ban_last_token]))
    expected = reference.generate(prompt, **kwargs)
    expected_lengths = list(lengths)
    lengths.clear()
    got = patched.generate(prompt, **kwargs)
    assert torch.equal(got, expected)
    assert expected_lengths == list(range(4, expected.shape[1]))
    # the same calls, then at most IN_FLIGHT more for steps queued after the end
    assert lengths[: len(expected_lengths)] == expected_lengths
    assert len(lengths) - len(expected_lengths) <= decode_loop.IN_FLIGHT
    assert len(loop_calls) == 1


def test_min_new_tokens_in_one_launch(loop_calls, monkeypatch, device):
    """Greedy with `min_new_tokens` and no other processor: `greedy_token` holds the end tokens back itself (the
    first new token of each row is an end token, so without it both would stop at once)."""
    monkeypatch.setattr(decode_loop, "GREEDY_TOKEN_KERNEL", True)
    choices = []
    monkeypatch.setattr(decode_loop, "greedy_token", lambda *a, **k: choices.append(k) or greedy_token(*a, **k))
    reference, patched = model_pair("qwen3", "dense", device)
    prompt = torch.randint(1, 151, (2, 4), device=device)
    path = greedy_path(reference, prompt, 0)
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=5, eos_token_id=[int(path[0, 0]), int(path[1, 0])],
                  pad_token_id=0, do_sample=False)
    assert torch.equal(patched.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
    assert [k["suppress_eos"] for k in choices[:6]] == [True] * 5 + [False]


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_cache_is_reset(arch, loop_calls, device):
    """Calls of other prompts (and lengths) reuse the model's cache, reset: each gives Hugging Face's tokens."""
    reference, patched = model_pair(arch, "dense", device)
    caches = set()
    for length in (7, 3, 7):
        prompt = torch.randint(1, 151, (2, length), device=device)
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(patched.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
        caches.add(id(patched.__dict__[decode_loop.CACHE_ATTRIBUTE][1]))
    assert len(loop_calls) == 3 and len(caches) == 1


def test_requests_left_to_hugging_face(loop_calls, device):
    """Constraints, beams, left padding (a mask, or pad tokens in the prompt) and returned scores go to Hugging
    Face's `generate`, with its results."""
    reference, patched = model_pair("qwen3", "dense", device)
    prompt = torch.randint(1, 151, (2, 6), device=device)
    padded = torch.ones_like(prompt)
    padded[1, :2] = 0
    requests = [
        dict(bad_words_ids=[[5]]),
        dict(num_beams=2),
        dict(attention_mask=padded),
        dict(no_repeat_ngram_size=2),
        dict(stop_strings=None, max_length=prompt.shape[1] + 4, max_new_tokens=None),
    ]
    for extra in requests:
        kwargs = {**dict(max_new_tokens=6, do_sample=False, pad_token_id=0), **extra}
        assert torch.equal(patched.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)), extra
    with_pad = prompt.clone()
    with_pad[0, 2] = 0  # the pad token in a prompt without a mask: Hugging Face masks it
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(with_pad, **kwargs), reference.generate(with_pad, **kwargs))
    expected = reference.generate(prompt, max_new_tokens=4, output_scores=True, return_dict_in_generate=True)
    got = patched.generate(prompt, max_new_tokens=4, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences) and len(got.scores) == 4
    assert not loop_calls


def test_plan_reads_the_request(device):
    """What the loop takes from a call: the settings Hugging Face resolves (the model's generation config
    under the call's), the end tokens, the pad token defaulting to the first end token."""
    _, patched = model_pair("qwen3", "dense", device)
    patched.generation_config.top_k = 7
    prompt = torch.randint(0, 151, (1, 3), device=device)
    request = decode_loop.plan(patched, (prompt,), dict(max_new_tokens=5, do_sample=True, eos_token_id=[4, 9],
                                                        repetition_penalty=1.1, min_new_tokens=2))
    assert request.max_new_tokens == 5 and request.do_sample and request.pad == 4
    assert request.eos.tolist() == [4, 9]
    assert [type(p).__name__ for p in request.processors] == [
        "RepetitionPenaltyLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "TopKLogitsWarper"]
    assert request.processors[-1].top_k == 7
    greedy = decode_loop.plan(patched, (), dict(input_ids=prompt, max_new_tokens=5, temperature=0.5))
    assert not greedy.do_sample and not greedy.processors and greedy.eos is None
    assert decode_loop.plan(patched, (prompt,), dict(max_new_tokens=5, low_memory=True)) is None
    for cache in ("dynamic", "offloaded"):
        assert decode_loop.plan(patched, (prompt,), dict(max_new_tokens=5, cache_implementation=cache)) is None


def test_evaluation_during_training_frees_the_cache(device):
    """`training.generation.generate` on a model in training mode (an evaluation between steps) gives Hugging
    Face's tokens and leaves no decoding cache behind; in eval mode the cache stays for the next call."""
    from unsloth_lite import patch_model
    from unsloth_lite.training.generation import generate
    from unsloth_lite.training.tiny import build_tiny_qwen3, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    reference = build_tiny_qwen3(tokenizer).to(device).eval()
    model = patch_model(build_tiny_qwen3(tokenizer).to(device)).train()
    prompt = tokenizer("12+7=")["input_ids"]
    expected = reference.generate(torch.tensor([prompt], device=device), max_new_tokens=6, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    result = generate(model, tokenizer, prompt, max_new_tokens=6)
    assert result.new_token_ids == expected[0, len(prompt):].tolist()
    assert model.training and decode_loop.CACHE_ATTRIBUTE not in model.__dict__
    generate(model.eval(), tokenizer, prompt, max_new_tokens=6)
    assert decode_loop.CACHE_ATTRIBUTE in model.__dict__


def test_evaluation_during_training_frees_the_fp32_absmax(device):
    """A 4-bit model: decoding keeps each NF4 weight's fp32 absmax (`nf4_matvec_state.flat_absmax`) for the next
    call; an evaluation during training frees them with the cache."""
    from unsloth_lite import patch_model
    from unsloth_lite.kernels import nf4_matvec_state
    from unsloth_lite.models.quantize import quantize_linears_nf4
    from unsloth_lite.training.generation import generate
    from unsloth_lite.training.tiny import build_tiny_qwen3, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = patch_model(quantize_linears_nf4(build_tiny_qwen3(tokenizer).to(device), torch.float32))
    absmax = [id(m.weight.quant_state.absmax) for m in model.modules() if type(m).__name__ == "Linear4bit"]
    prompt = tokenizer("3+4=")["input_ids"]
    generate(model.eval(), tokenizer, prompt, max_new_tokens=2)
    assert len(absmax) == 14 and all(key in nf4_matvec_state._FLAT_ABSMAX for key in absmax)
    generate(model.train(), tokenizer, prompt, max_new_tokens=2)
    assert not any(key in nf4_matvec_state._FLAT_ABSMAX for key in absmax)
