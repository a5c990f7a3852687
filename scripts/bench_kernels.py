"""Forward+backward time of each fused kernel against PyTorch eager, torch.compile and Liger-Kernel (K1).

    python scripts/bench_kernels.py --out bench_kernels.json      # on a GPU: the K1 shapes, bf16
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --tiny     # on a CPU: tiny shapes, ours vs eager only

Two times per variant: `device_ms`, forward+backward captured in a CUDA graph and replayed (the kernels'
own cost, host launch overhead removed: what a graph-captured training step pays), and `call_ms`, the same
called from Python (what an uncaptured step pays, Python and launch overhead included). GB/s counts each
tensor the op must touch once per pass (see `bytes` of each case) over `device_ms`; "% copy" compares that
with a device-to-device copy measured in the same run. The eager baselines are the Hugging Face Qwen
modules' own math, in the input dtype as they run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_common import (
    bench_device,
    bench_ms,
    copy_bandwidth_gbps,
    environment,
    graph_ms,
    markdown_table,
    write_json,
)

from unsloth_lite.kernels import apply_rope, qk_norm_rope, rms_norm, swiglu


def hf_rms_norm(x, weight, eps=1e-6):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def hf_rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_apply_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_out = q_rot * cos + hf_rotate_half(q_rot) * sin
    k_out = k_rot * cos + hf_rotate_half(k_rot) * sin
    return torch.cat([q_out, q_pass], dim=-1), torch.cat([k_out, k_pass], dim=-1)


def hf_qk_norm_rope(q_bshd, k_bshd, q_weight, k_weight, cos, sin, eps=1e-6):
    q = hf_rms_norm(q_bshd, q_weight, eps).transpose(1, 2)
    k = hf_rms_norm(k_bshd, k_weight, eps).transpose(1, 2)
    return hf_apply_rope(q, k, cos, sin)


def liger_ops():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return LigerRMSNormFunction, LigerRopeFunction, LigerSiLUMulFunction


@dataclasses.dataclass
class Case:
    kernel: str
    shape: str
    bytes: int
    inputs: list[torch.Tensor]  # tensors the gradient is taken for
    variants: dict[str, Callable[[], object]]


def _randn(*shape, device, dtype, requires_grad=False):
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=requires_grad)


def rms_norm_case(rows, hidden, trainable, device, dtype, liger):
    x = _randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)).requires_grad_(trainable)
    variants = {
        "unsloth_lite": lambda: rms_norm(x, w),
        "eager": lambda: hf_rms_norm(x, w),
        "compile": lambda: compiled(hf_rms_norm)(x, w),
    }
    if liger:
        variants["liger"] = lambda: liger[0].apply(x, w, 1e-6)
    label = f"{rows}x{hidden}, {'trainable' if trainable else 'frozen'} weight"
    return Case("rms_norm", label, 5 * x.numel() * x.element_size(), [x] + ([w] if trainable else []), variants)


def swiglu_case(rows, inter, device, dtype, liger):
    gate = _randn(rows, inter, device=device, dtype=dtype, requires_grad=True)
    up = _randn(rows, inter, device=device, dtype=dtype, requires_grad=True)
    variants = {
        "unsloth_lite": lambda: swiglu(gate, up),
        "eager": lambda: F.silu(gate) * up,
        "compile": lambda: compiled(lambda g, u: F.silu(g) * u)(gate, up),
    }
    if liger:
        variants["liger"] = lambda: liger[2].apply(gate, up)
    # forward reads gate, up and writes h; backward reads dh, gate, up and writes dgate, dup
    return Case("swiglu", f"{rows}x{inter}", 8 * gate.numel() * gate.element_size(), [gate, up], variants)


def _qk_views(batch, n_q, n_k, seq, head_dim, rotary_dim, device, dtype):
    q_bshd = _randn(batch, seq, n_q, head_dim, device=device, dtype=dtype, requires_grad=True)
    k_bshd = _randn(batch, seq, n_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    angles = torch.rand(batch, seq, rotary_dim // 2, device=device) * 100
    angles = torch.cat([angles, angles], dim=-1)
    return q_bshd, k_bshd, angles.cos().to(dtype), angles.sin().to(dtype)


def rope_case(batch, n_q, n_k, seq, head_dim, rotary_dim, device, dtype, liger):
    q_bshd, k_bshd, cos, sin = _qk_views(batch, n_q, n_k, seq, head_dim, rotary_dim, device, dtype)

    def views():  # taken inside each call, as attention does, so a CUDA graph captures the transpose too
        return q_bshd.transpose(1, 2), k_bshd.transpose(1, 2)

    def projected_views():  # not leaves, as a projection's output: what inplace=True takes
        return q_bshd.view_as(q_bshd).transpose(1, 2), k_bshd.view_as(k_bshd).transpose(1, 2)

    variants = {
        "unsloth_lite": lambda: apply_rope(*views(), cos, sin),
        "unsloth_lite_inplace": lambda: apply_rope(*projected_views(), cos, sin, inplace=True),
        # cos/sin as Hugging Face builds them (cat(freqs, freqs)), declared so: what the patched models run and
        # what Liger assumes of every table
        "unsloth_lite_halves": lambda: apply_rope(*views(), cos, sin, duplicated_halves=True),
        "unsloth_lite_inplace_halves": lambda: apply_rope(
            *projected_views(), cos, sin, inplace=True, duplicated_halves=True
        ),
        "eager": lambda: hf_apply_rope(*views(), cos, sin),
        "compile": lambda: compiled(hf_apply_rope)(*views(), cos, sin),
    }
    if liger:  # rotates q and k in place, like inplace=True
        variants["liger"] = lambda: liger[1].apply(*views(), cos, sin)
    label = f"q [{batch},{n_q},{seq},{head_dim}] k [{batch},{n_k},{seq},{head_dim}] R={rotary_dim}"
    size = (q_bshd.numel() + k_bshd.numel()) * q_bshd.element_size()
    return Case("apply_rope", label, 4 * size, [q_bshd, k_bshd], variants)


def qk_norm_rope_case(batch, n_q, n_k, seq, head_dim, rotary_dim, device, dtype, liger):
    q_bshd, k_bshd, cos, sin = _qk_views(batch, n_q, n_k, seq, head_dim, rotary_dim, device, dtype)
    qw = 1 + 0.1 * torch.randn(head_dim, device=device, dtype=dtype)
    kw = 1 + 0.1 * torch.randn(head_dim, device=device, dtype=dtype)
    variants = {
        "unsloth_lite": lambda: qk_norm_rope(q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), qw, kw, cos, sin),
        "unsloth_lite_halves": lambda: qk_norm_rope(
            q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), qw, kw, cos, sin, duplicated_halves=True
        ),
        "eager": lambda: hf_qk_norm_rope(q_bshd, k_bshd, qw, kw, cos, sin),
        "compile": lambda: compiled(hf_qk_norm_rope)(q_bshd, k_bshd, qw, kw, cos, sin),
    }
    if liger:
        rms, rope = liger[0], liger[1]
        variants["liger"] = lambda: rope.apply(
            rms.apply(q_bshd, qw, 1e-6).transpose(1, 2), rms.apply(k_bshd, kw, 1e-6).transpose(1, 2), cos, sin
        )
    label = f"q [{batch},{n_q},{seq},{head_dim}] k [{batch},{n_k},{seq},{head_dim}] R={rotary_dim}, frozen norms"
    size = (q_bshd.numel() + k_bshd.numel()) * q_bshd.element_size()
    # forward reads q, k and writes both outputs; backward reads dy and q, k and writes dq, dk
    return Case("qk_norm_rope", label, 5 * size, [q_bshd, k_bshd], variants)


_COMPILED: dict = {}


def compiled(fn):
    if fn.__code__ not in _COMPILED:
        _COMPILED[fn.__code__] = torch.compile(fn)
    return _COMPILED[fn.__code__]


def forward_backward(fn, inputs):
    """One forward and backward; gradients returned, not accumulated into `.grad` (no extra pass)."""
    out = fn()
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.ones_like(o) for o in outs]

    def step():
        outputs = fn()
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return torch.autograd.grad(outputs, inputs, grads)

    return step


def build_cases(tiny: bool, device, dtype, liger):
    if tiny:
        return [
            rms_norm_case(7, 96, False, device, dtype, liger),
            rms_norm_case(7, 96, True, device, dtype, liger),
            swiglu_case(5, 160, device, dtype, liger),
            rope_case(1, 4, 2, 3, 16, 16, device, dtype, liger),
            qk_norm_rope_case(1, 4, 2, 3, 32, 8, device, dtype, liger),
        ]
    return [
        rms_norm_case(16384, 4096, False, device, dtype, liger),
        rms_norm_case(16384, 5120, False, device, dtype, liger),
        rms_norm_case(16384, 4096, True, device, dtype, liger),
        swiglu_case(16384, 12288, device, dtype, liger),
        swiglu_case(16384, 17408, device, dtype, liger),
        rope_case(8, 32, 8, 2048, 128, 128, device, dtype, liger),
        rope_case(4, 24, 4, 2048, 256, 64, device, dtype, liger),
        qk_norm_rope_case(8, 32, 8, 2048, 128, 128, device, dtype, liger),
        qk_norm_rope_case(4, 24, 4, 2048, 256, 64, device, dtype, liger),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes; ours and eager only (CPU smoke run)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of variants to time")
    parser.add_argument("--kernels", default=None, help="comma-separated subset of kernels to time")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    device = bench_device(args.tiny)
    if device is None:
        return 2
    wanted = set(args.variants.split(",")) if args.variants else None
    if args.tiny and wanted is None:
        wanted = {"unsloth_lite", "unsloth_lite_inplace", "eager"}
    dtype = torch.bfloat16
    liger = liger_ops() if device.type == "cuda" else None

    env = environment(device)
    copy_gbps = copy_bandwidth_gbps(device, gib=0.01 if args.tiny else 4.0)
    rows = []
    for case in build_cases(args.tiny, device, dtype, liger):
        if args.kernels and case.kernel not in args.kernels.split(","):
            continue
        timings = {}
        for name, fn in case.variants.items():
            if wanted and name not in wanted:
                continue
            step = forward_backward(fn, case.inputs)
            call = bench_ms(step, device)
            timings[name] = (graph_ms(step, device) or call, call)
        ours_device, ours_call = timings["unsloth_lite"]
        for name, (device_ms, call_ms) in timings.items():
            gbps = case.bytes / device_ms / 1e6
            rows.append(
                dict(
                    kernel=case.kernel, shape=case.shape, variant=name, device_ms=round(device_ms, 4),
                    GBps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1),
                    device_speedup_of_ours=round(device_ms / ours_device, 2), call_ms=round(call_ms, 4),
                    call_speedup_of_ours=round(call_ms / ours_call, 2),
                )
            )
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"environment: {env}")
    print(f"device copy bandwidth (read + write): {copy_gbps:.0f} GB/s")
    columns = ["kernel", "shape", "variant", "device_ms", "GBps", "pct_copy", "device_speedup_of_ours"]
    print(markdown_table(rows, columns + ["call_ms", "call_speedup_of_ours"]))
    write_json(args.out, dict(environment=env, copy_GBps=copy_gbps, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
