"""Launch-configuration sweeps behind the tile sizes of RoPE, q/k-norm+RoPE and the linear cross-entropy's
chunk height, at the K1 and L1 shapes of BENCHMARKS.md.

    python scripts/bench_sweep.py --out sweep.json                                 # on a GPU
    python scripts/bench_sweep.py --kernels qk_norm_rope                           # one op
    TRITON_INTERPRET=1 python scripts/bench_sweep.py --tiny                        # CPU smoke run

- apply_rope, qk_norm_rope: every (head vectors a program, warps) pair, each direction's kernel timed alone
  (RoPE's backward is its forward kernel with the transposed rotation, so one time stands for both; RoPE
  also in place, where only the rotary dims are touched, and each form with duplicated halves declared).
  GB/s counts the bytes the kernel must move: read and write each touched element once (the q/k-norm
  backward also reads x). The row marked `default` is the configuration the launcher picks.
- fused_linear_cross_entropy: forward+backward with a frozen weight for several chunk heights, with the
  extra peak memory beyond inputs and gradients (the bar is 256 MiB).

Configurations are swapped in by replacing the launchers' config functions for the duration of a timing.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys

import torch
from bench_common import (
    bench_device,
    bench_ms,
    copy_bandwidth_gbps,
    environment,
    graph_ms,
    markdown_table,
    write_json,
)

rope = importlib.import_module("unsloth_lite.kernels.rope")
qk = importlib.import_module("unsloth_lite.kernels.qk_norm_rope")
flce = importlib.import_module("unsloth_lite.kernels.fused_linear_cross_entropy")

ALL_KERNELS = ("apply_rope", "qk_norm_rope", "fused_linear_cross_entropy")


def _qk_inputs(shape, device, dtype):
    """((q, k, cos, sin, weight), bytes of q and k, a label) for one (batch, n_q, n_k, seq, D, R) shape."""
    batch, n_q, n_k, seq, head_dim, rotary_dim = shape
    q = torch.randn(batch, seq, n_q, head_dim, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, seq, n_k, head_dim, device=device, dtype=dtype).transpose(1, 2)
    angles = torch.rand(batch, seq, rotary_dim // 2, device=device) * 100
    angles = torch.cat([angles, angles], dim=-1)
    weight = 1 + 0.1 * torch.randn(head_dim, device=device, dtype=dtype)
    size = (q.numel() + k.numel()) * q.element_size()
    label = f"q [{batch},{n_q},{seq},{head_dim}] R={rotary_dim}"
    return (q, k, angles.cos().to(dtype), angles.sin().to(dtype), weight), size, label


def _with(module, name, function, timed):
    """`timed()` with `module.name` replaced by `function`."""
    original = getattr(module, name)
    setattr(module, name, function)
    try:
        return timed()
    finally:
        setattr(module, name, original)


def _overriding(original, block_r: int, warps: int):
    """A launch-config function returning `original`'s config with BLOCK_R and num_warps replaced."""
    def config(*args, **kwargs):
        return dict(original(*args, **kwargs), BLOCK_R=block_r, num_warps=warps)

    return config


def _sweep(kernel, label, direction, module, name, default, run, n_bytes, grid, device, copy_gbps):
    """Rows of `run` timed under each (BLOCK_R, warps) of `grid` and the launcher's own choice `default`,
    `module.name` being the config function that is swapped. Timed as a replayed CUDA graph: a RoPE kernel
    in place runs ~20 µs, less than its launch costs the host, so back-to-back calls would time the host."""
    original = getattr(module, name)
    rows = []
    for block_r, warps in sorted({*grid, (default["BLOCK_R"], default["num_warps"])}):
        ms = _with(module, name, _overriding(original, block_r, warps),
                   lambda: graph_ms(run, device) or bench_ms(run, device))
        gbps = n_bytes / ms / 1e6
        rows.append(dict(
            kernel=kernel, shape=label, direction=direction, BLOCK_R=block_r, warps=warps, ms=round(ms, 4),
            GBps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1),
            default="yes" if (block_r, warps) == (default["BLOCK_R"], default["num_warps"]) else "",
        ))
    return rows


def rope_rows(shape, grid, device, dtype, copy_gbps):
    """Both forms, with full tables and with duplicated halves declared (what the patched models run)."""
    head_dim, rotary_dim = shape[4:]
    (q, k, cos, sin, _), size, label = _qk_inputs(shape, device, dtype)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rows = []
    for halves in (False, True):
        tables = ", duplicated halves" if halves else ""
        for copy_pass in (True, False):
            out = (q_out, k_out) if copy_pass else (q, k)
            rows += _sweep(
                "apply_rope", label, ("out of place" if copy_pass else "in place") + tables, rope,
                "rope_launch_config", rope.rope_launch_config(head_dim, rotary_dim, copy_pass, halves),
                lambda out=out, copy_pass=copy_pass, halves=halves: rope._launch_rope(
                    q, k, *out, cos, sin, backward=False, duplicated_halves=halves, copy_pass=copy_pass
                ),
                2 * size * (1 if copy_pass else rotary_dim / head_dim), grid, device, copy_gbps,
            )
    return rows


def qk_rows(shape, grid, device, dtype, copy_gbps):
    head_dim, rotary_dim = shape[4:]
    (q, k, cos, sin, weight), size, label = _qk_inputs(shape, device, dtype)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    common = (grid, device, copy_gbps)
    forward, backward = (qk.launch_config(head_dim, rotary_dim, q.element_size(), b) for b in (False, True))
    return _sweep(
        "qk_norm_rope", label, "forward", qk, "launch_config", forward,
        lambda: qk._launch_forward(q, k, weight, weight, cos, sin, 1e-6, 0.0, False), 2 * size, *common,
    ) + _sweep(
        "qk_norm_rope", label, "backward", qk, "launch_config", backward,
        lambda: qk._launch_backward(dq_out, dk_out, q, k, weight, weight, cos, sin, 1e-6, 0.0, False, False),
        3 * size, *common,
    )


def flce_rows(shape, chunk_heights, device, dtype):
    n, h, v = shape
    hidden = (0.5 * torch.randn(n, h, device=device, dtype=dtype)).requires_grad_()
    weight = 0.02 * torch.randn(v, h, device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), device=device)
    labels[::7] = -100
    default = flce.chunk_rows(n, v, hidden.element_size())

    def step():
        return torch.autograd.grad(flce.fused_linear_cross_entropy(hidden, weight, labels), hidden)

    def timed():
        extra = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            grads = step()
            extra = (torch.cuda.max_memory_allocated() - before - hidden.numel() * hidden.element_size()) / 2**20
            del grads
        return bench_ms(step, device, rep_ms=1000), extra

    rows = []
    for height in sorted({*chunk_heights, default}):
        ms, extra = _with(flce, "chunk_rows", _fixed_chunk_rows(height), timed)
        rows.append(dict(kernel="fused_linear_cross_entropy", shape=f"N={n} H={h} V={v}", chunk_rows=height,
                         ms=round(ms, 3), extra_MiB=None if extra is None else round(extra, 1),
                         TFLOPs=round(4 * n * h * v / ms / 1e9, 1), default="yes" if height == default else ""))
    return rows


def _fixed_chunk_rows(height: int):
    def chunk_rows(n_rows, n_cols, element_size, trained_weight=False):
        return max(1, min(height, n_rows))

    return chunk_rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default=",".join(ALL_KERNELS), help="comma-separated subset")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, two configurations (CPU smoke run)")
    parser.add_argument("--block-rows", default="1,2,4,8,16,32", help="head vectors a program, comma-separated")
    parser.add_argument("--warps", default="1,2,4,8", help="warps a program, comma-separated")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    device = bench_device(args.tiny)
    if device is None:
        return 2
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(ALL_KERNELS))
    if unknown:
        print(f"unknown kernels {unknown}; choose from {','.join(ALL_KERNELS)}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    if args.tiny:
        qk_shapes, grid = [(1, 4, 2, 3, 32, 8)], [(1, 1), (2, 1)]
        flce_shapes, heights = [(40, 32, 300)], [8, 16]
    else:
        qk_shapes = [(8, 32, 8, 2048, 128, 128), (4, 24, 4, 2048, 256, 64)]
        grid = list(itertools.product(_ints(args.block_rows), _ints(args.warps)))
        flce_shapes, heights = [(16384, 4096, 151936), (16384, 5120, 248320)], [256, 512, 768, 1024]
    env = environment(device)
    copy_gbps = copy_bandwidth_gbps(device, gib=0.01 if args.tiny else 4.0)
    rows = []
    for shape in qk_shapes:
        if "apply_rope" in kernels:
            rows += rope_rows(shape, grid, device, dtype, copy_gbps)
        if "qk_norm_rope" in kernels:
            rows += qk_rows(shape, grid, device, dtype, copy_gbps)
    if "fused_linear_cross_entropy" in kernels:
        for shape in flce_shapes:
            rows += flce_rows(shape, heights, device, dtype)
    print(f"environment: {env}")
    print(f"device copy bandwidth (read + write): {copy_gbps:.0f} GB/s")
    tiles = [r for r in rows if "BLOCK_R" in r]
    if tiles:
        print(markdown_table(tiles, ["kernel", "shape", "direction", "BLOCK_R", "warps", "ms", "GBps", "pct_copy",
                                     "default"]))
    chunks = [r for r in rows if "chunk_rows" in r]
    if chunks:
        print(markdown_table(chunks, ["kernel", "shape", "chunk_rows", "ms", "extra_MiB", "TFLOPs", "default"]))
    write_json(args.out, dict(environment=env, copy_GBps=copy_gbps, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
