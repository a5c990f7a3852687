"""One variant's training steps timed (`measure`), and the search for the longest sequence that trains
(`search_max_seq`): the workers of `bench_train.py`, `bench_train_27b.py` and `bench_packing.py` share them."""

from __future__ import annotations

import gc
import time
import traceback

import torch
from bench_common import kernel_profile
from bench_train_setup import SEED, SEQ_MULTIPLE


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, model, optimizer, device, batch: int, seq: int, vocab: int, warmup: int, steps: int,
            profile: bool, seed: int = SEED) -> dict:
    """Trains `warmup` + `steps` steps of `[batch, seq]` (docstring); times the last `steps`. Batch i is drawn
    from `seed + i` (a data-parallel process passes its own seed, hence its own rows)."""
    cuda = device.type == "cuda"
    out = {}
    batches = []
    for i in range(warmup + steps + int(profile)):
        generator = torch.Generator().manual_seed(seed + i)
        batches.append(torch.randint(0, vocab, (batch, seq), generator=generator).to(device))

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    warmup_start = time.perf_counter()
    for i in range(warmup):
        losses.append(step(batches[i]))
    _sync(device)
    out["warmup_s"] = round(time.perf_counter() - warmup_start, 1)
    peak_warmup = torch.cuda.max_memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup, warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step(batches[i]))
        _sync(device)
        times.append(time.perf_counter() - t0)
    if cuda:
        peak_measured = torch.cuda.max_memory_allocated(device)
        out["peak_gib"] = max(peak_warmup, peak_measured) / 2**30
        out["peak_measured_gib"] = peak_measured / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        out.update(_reserved_by_pool(device))
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CUDA] + [ProfilerActivity.CPU] * args.host_profile
        with profiler(activities=activities) as prof:
            step(batches[-1])
            _sync(device)
        out.update(kernel_profile(prof))
        ids = batches[-1]
        out["passes"] = profile_passes(lambda: model(input_ids=ids, labels=ids).loss, device, activities)
        optimizer.zero_grad(set_to_none=True)
    losses = [float(loss) for loss in losses]
    out.update(
        step_s=sum(times) / len(times) if times else None, step_s_min=min(times, default=None),
        step_s_max=max(times, default=None), first_loss=losses[0] if losses else None, losses=losses,
    )
    return out


PASS_FIELDS = ("kernel_ms", "idle_ms", "span_ms", "idle_during_copies_ms")


def profile_passes(forward, device, activities, top_gaps: int = 3) -> dict:
    """One more step's forward (`forward()`, returning the loss) and backward, each profiled apart with the
    device synchronised between them: per pass its kernel time, idle time, span, idle while copies ran and the
    `top_gaps` costliest gaps (`bench_common.device_idle`), so that a step's idle time is placed in the pass
    that waits. (The synchronisation takes away the overlap of the forward's last copies with the backward's
    start: the passes' spans add up to a little more than a step.)"""
    from torch.profiler import profile as profiler

    passes = {}
    with profiler(activities=activities) as prof:
        loss = forward()
        _sync(device)
    passes["forward"] = prof
    with profiler(activities=activities) as prof:
        loss.backward()
        _sync(device)
    passes["backward"] = prof
    out = {}
    for name, prof in passes.items():
        summary = kernel_profile(prof)
        out[name] = {key: summary.get(key) for key in PASS_FIELDS}
        out[name]["idle_between"] = summary.get("idle_between", [])[:top_gaps]
    return out


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _error(error: BaseException) -> dict:
    if _is_oom(error):
        return dict(oom=True, error="OOM")
    message = str(error).strip().splitlines()
    return dict(error=f"{type(error).__name__}: {message[0] if message else ''}"[:300])


def one_step_probe(args, model, optimizer, device: torch.device, vocab: int):
    """`probe(seq)` for `search_max_seq`: True if one batch-1 step of `seq` tokens trains, False if it runs
    out of memory, None for any other error (printed). Memory is freed after each probe."""
    def probe(seq: int) -> bool | None:
        try:
            measure(args, model, optimizer, device, 1, seq, vocab, 0, 1, profile=False)
            return True
        except (Exception, SystemExit) as error:
            if not _error(error).get("oom"):
                traceback.print_exc()
                return None
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()

    return probe


def search_max_seq(probe, start: int, ceiling: int, max_probes: int) -> dict:
    """Longest multiple of SEQ_MULTIPLE <= ceiling for which `probe(seq)` is True (fits), None if even the
    shortest fails: doubling from `start` (halving while nothing fits yet), then bisection, at most
    `max_probes` probes. `probe` returns None for a failure other than running out of memory, which ends
    the search."""
    probes = []
    good, bad = None, None

    def attempt(seq: int) -> bool | None:
        ok = probe(seq)
        probes.append(dict(seq=seq, ok=bool(ok)))
        return ok

    seq = min(ceiling, max(SEQ_MULTIPLE, start // SEQ_MULTIPLE * SEQ_MULTIPLE))
    while len(probes) < max_probes:
        ok = attempt(seq)
        if ok is None:
            return dict(max_seq=good, probes=probes)
        if ok:
            good = seq
            if bad is not None or seq >= ceiling:
                break
            seq = min(ceiling, 2 * seq)
        else:
            bad = seq
            if good is not None or seq <= SEQ_MULTIPLE:
                break
            seq = max(SEQ_MULTIPLE, seq // 2 // SEQ_MULTIPLE * SEQ_MULTIPLE)
    while good is not None and bad is not None and bad - good > SEQ_MULTIPLE and len(probes) < max_probes:
        mid = (good + bad) // 2 // SEQ_MULTIPLE * SEQ_MULTIPLE
        ok = attempt(mid)
        if ok is None:
            break
        good, bad = (mid, bad) if ok else (good, mid)
    return dict(max_seq=good, first_failure=bad, probes=probes)


def _reserved_by_pool(device) -> dict:
    """Memory the caching allocator holds now, in GiB: its default pool, and private pools (CUDA graphs')."""
    reserved = {"reserved_default_pool_gib": 0.0, "reserved_private_pools_gib": 0.0}
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", device.index or 0) != (device.index or 0):
            continue
        default_pool = tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)
        key = "reserved_default_pool_gib" if default_pool else "reserved_private_pools_gib"
        reserved[key] += segment["total_size"] / 2**30
    return reserved
