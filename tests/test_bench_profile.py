"""The profile summary of the benchmark scripts: where the device ran no kernel, and between which kernels."""

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import device_idle  # noqa: E402


@dataclass
class Event:
    label: str
    start: int
    end: int
    correlation: int = 0

    def correlation_id(self):
        return self.correlation

    def name(self):
        return self.label

    def start_ns(self):
        return self.start

    def end_ns(self):
        return self.end


def test_device_idle_counts_gaps_between_kernels_by_neighbours():
    kernels = [
        Event("gemm", 0, 1_000_000),
        Event("norm", 200_000, 500_000),  # inside the gemm: no gap after it
        Event("loss", 3_000_000, 4_000_000),  # 2 ms after the gemm
        Event("gemm", 4_500_000, 5_000_000),  # 0.5 ms after the loss
        Event("loss", 6_000_000, 7_000_000),  # 1 ms after the gemm
    ]
    copies = [
        Event("Memcpy DtoH (Device -> Pinned)", 1_500_000, 2_500_000),
        Event("Memcpy DtoH (Device -> Pinned)", 2_000_000, 2_800_000),  # overlaps the one before
        Event("Memcpy HtoD (Pinned -> Device)", 2_400_000, 3_200_000),
        Event("Memcpy DtoD (Device -> Device)", 5_100_000, 5_300_000),
    ]
    out = device_idle(kernels, copies)
    assert out["idle_ms"] == 3.5
    assert out["span_ms"] == 7.0
    # to the host during 1.5-2.8 ms, from it during 2.4-3.0 ms (the gap ends at 3.0), on the device 5.1-5.3 ms
    assert out["idle_during_copies_ms"] == {"Memcpy DtoD": 0.2, "Memcpy DtoH": 1.3, "Memcpy HtoD": 0.6}
    assert out["idle_between"] == [
        dict(after="gemm", before="loss", times=2, ms=3.0),
        dict(after="loss", before="gemm", times=1, ms=0.5),
    ]


def test_device_idle_of_back_to_back_kernels_is_zero():
    kernels = [Event("a", 0, 10), Event("b", 10, 20), Event("c", 5, 30)]
    out = device_idle(kernels)
    assert out["idle_ms"] == 0 and out["idle_between"] == [] and out["span_ms"] == 0.0
    assert device_idle([]) == {"idle_ms": None}


def test_device_idle_says_when_the_host_launched_what_ended_a_gap():
    """A gap's kernel whose launch call began after the device went idle (the host set the pace), and one whose
    call came well before (the device's own delay): the means per pair of kernels."""
    kernels = [
        Event("copy", 0, 1_000), Event("graph", 5_000, 6_000, correlation=7),  # called at 3 us, returned at 4.5
        Event("copy", 6_000, 7_000), Event("graph", 9_000, 10_000, correlation=8),  # called at 7 us, returned at 7.9
        Event("norm", 12_000, 13_000, correlation=9),  # launched long before the gap
    ]
    launches = {7: (3_000, 4_500, 11), 8: (7_000, 7_900, 11), 9: (100, 200, 12)}  # the last from another thread
    out = device_idle(kernels, launches=launches)
    assert out["idle_between"] == [
        dict(after="copy", before="graph", times=2, ms=0.006, host_late_us=1.0, after_call_us=0.8),
        dict(after="graph", before="norm", times=1, ms=0.002, host_late_us=-9.9, after_call_us=11.8),
    ]
    assert out["idle_by_launching_thread_ms"] == [0.006, 0.002]  # thread 11 launched first


def test_profile_passes_profiles_forward_then_backward_apart():
    """Each pass gets its own summary; the forward's loss is what the backward back-propagates."""
    import torch
    from torch.profiler import ProfilerActivity
    from train_timing import PASS_FIELDS, profile_passes

    weight = torch.randn(8, 8, requires_grad=True)
    calls = []

    def forward():
        calls.append("forward")
        return (torch.randn(4, 8) @ weight).square().mean()

    passes = profile_passes(forward, torch.device("cpu"), [ProfilerActivity.CPU])
    assert list(passes) == ["forward", "backward"] and calls == ["forward"]
    assert weight.grad is not None and torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0
    for summary in passes.values():
        assert set(PASS_FIELDS) <= set(summary) and summary["kernel_ms"] == 0  # no device: no kernels
        assert summary["idle_between"] == []
