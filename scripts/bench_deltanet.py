"""Gated DeltaNet forward+backward at Qwen3.5-27B's shapes (K2 of BENCHMARKS.md): time and gradient errors.

    python scripts/bench_deltanet.py --out bench_deltanet.json        # on a GPU: T = 2048 and 8192, bf16
    python scripts/bench_deltanet.py --seqs 2048 --profile            # and each kernel's device time
    TRITON_INTERPRET=1 python scripts/bench_deltanet.py --tiny        # on a CPU: tiny shapes, ours only

Inputs as Qwen3.5-27B's DeltaNet layer feeds them: q, k `[1, T, 16, 128]` and v `[1, T, 48, 128]` (each of the
48 value heads reads key head h // 3), g `[1, T, 48]` (log decays, -softplus of a normal draw) and beta
(sigmoid of a normal draw), bf16; q and k L2-normalised in the kernel; fp32 state. One timed call is the
forward and the backward of all five inputs from a random output gradient. Variants:
- `unsloth_lite`: `unsloth_lite.kernels.chunk_gated_delta_rule`.
- `unsloth_lite_split_values`, `unsloth_lite_one_value_kernel`: the same with the backward's value sums in two
  kernels, or in one, whatever the heads (`LAUNCH["values_split"]`; the default splits them from Dv = 128 on).
- `fla`: flash-linear-attention's `chunk_gated_delta_rule`, where installed, with its Hopper guard bypassed
  (triton < 3.7.1 miscompiles its gated backward on Hopper for some block configurations): timing only, its
  errors are reported but not to be trusted.
- `hf_torch`: transformers' `torch_chunk_gated_delta_rule` (the PyTorch path Qwen3.5 falls back to), q and k
  repeated to the value heads first, as Qwen3.5's layer does.
Errors: ||x - ref|| / ||ref|| of the output and of the gradients of q, k, v, g and beta against the float64
token-by-token recurrence from the same bf16 inputs (`--error-max-seq` bounds the sequence lengths where that
reference is computed: its autograd graph keeps every state).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F
from bench_common import bench_device, bench_ms, environment, kernel_profile, markdown_table, write_json

from unsloth_lite.kernels import gated_delta_rule
from unsloth_lite.kernels.gated_delta_rule import chunk_gated_delta_rule
from unsloth_lite.kernels.gated_delta_rule_reference import chunk_gated_delta_rule_reference

W2_HEADS = dict(key_heads=16, value_heads=48, head_dim=128)
TINY_HEADS = dict(key_heads=2, value_heads=6, head_dim=16)


def make_inputs(seq: int, key_heads: int, value_heads: int, head_dim: int, device, dtype, seed: int = 0):
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k = randn(1, seq, key_heads, head_dim), randn(1, seq, key_heads, head_dim)
    v = randn(1, seq, value_heads, head_dim)
    g = -F.softplus(randn(1, seq, value_heads).float()).to(dtype)
    beta = torch.sigmoid(randn(1, seq, value_heads).float()).to(dtype)
    grad_out = randn(1, seq, value_heads, head_dim)
    return (q, k, v, g, beta), grad_out


def ours(q, k, v, g, beta):
    return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


# Variants of ours: the `gated_delta_rule.LAUNCH` settings each runs under (forward and backward)
OURS = {"unsloth_lite": {}, "unsloth_lite_split_values": {"values_split": True},
        "unsloth_lite_one_value_kernel": {"values_split": False}}
# --tiny's heads are narrower than the split's default threshold: both forms forced, the default left out
TINY_OURS = ("unsloth_lite_split_values", "unsloth_lite_one_value_kernel")


@contextlib.contextmanager
def launch_settings(overrides: dict):
    saved = {key: gated_delta_rule.LAUNCH[key] for key in overrides}
    gated_delta_rule.LAUNCH.update(overrides)
    try:
        yield
    finally:
        gated_delta_rule.LAUNCH.update(saved)


def fla_bypassed():
    """flash-linear-attention's kernel with its Hopper guard off, or None where it is not installed."""
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError:
        return None
    chunk_o.IS_NVIDIA_HOPPER = False  # the guard's switch: timing only, see the module docstring

    def run(q, k, v, g, beta):
        return fla_rule(q, k, v, g=g.float(), beta=beta, use_qk_l2norm_in_kernel=True)[0]

    return run


def hf_torch():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    rule = getattr(rule, "__wrapped__", rule)  # the PyTorch function even where a hub kernel is bound

    def run(q, k, v, g, beta):
        # Qwen3.5's layer repeats q and k to the value heads before calling it (transformers 5.1x; later
        # releases repeat inside the function, which then sees equal head counts).
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        return rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    return run


def forward_backward(fn, inputs, grad_out):
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in leaves]


def reference(inputs, grad_out):
    wide = [x.detach().double() for x in inputs]
    leaves = [x.requires_grad_() for x in wide]
    out = chunk_gated_delta_rule_reference(*leaves, use_qk_l2norm_in_kernel=True)[0]
    out.backward(grad_out.double())
    return out.detach(), [x.grad for x in leaves]


def relative(a, r) -> float:
    a, r = a.double(), r.double()
    return float((a - r).norm() / r.norm())


def profile_kernels(call) -> dict:
    """The kernels of one more (warm) call: count, summed device time and the heaviest by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return kernel_profile(prof)


def print_profiles(rows: list[dict]) -> None:
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            print(f"\n{r['variant']} T={r['seq']}: {p['kernels_per_step']} kernels, {p['kernel_ms']:.3f} ms on the GPU")
            print(markdown_table(p["top_kernels"], ["name", "calls", "ms"]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, ours only")
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 2048,8192)")
    parser.add_argument("--variants", default="unsloth_lite,fla,hf_torch")
    parser.add_argument("--error-max-seq", type=int, default=2048, help="longest sequence to compute errors at")
    parser.add_argument("--profile", action="store_true",
                        help="also one more call per variant under torch.profiler: each kernel's device time (GPU)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bench_device(args.tiny)
    if device is None:
        return 1
    heads = TINY_HEADS if args.tiny else W2_HEADS
    seqs = [int(s) for s in (args.seqs or ("70" if args.tiny else "2048,8192")).split(",")]
    variants = list(TINY_OURS) if args.tiny else args.variants.split(",")
    runners = {"fla": None if args.tiny else fla_bypassed(), "hf_torch": hf_torch(), **dict.fromkeys(OURS, ours)}
    rows = []
    for seq in seqs:
        inputs, grad_out = make_inputs(seq, **heads, device=device, dtype=torch.bfloat16)
        expected = reference(inputs, grad_out) if seq <= args.error_max_seq else None
        for variant in variants:
            fn = runners.get(variant)
            if fn is None:
                rows.append(dict(variant=variant, seq=seq, error="not installed"))
                continue
            row = dict(variant=variant, seq=seq)
            call = lambda f=fn, x=inputs, d=grad_out: forward_backward(f, x, d)  # noqa: E731
            try:
                with launch_settings(OURS.get(variant, {})):
                    out, grads = call()
                    row["ms"] = round(bench_ms(call, device), 3)
                    if args.profile and device.type == "cuda":
                        row["profile"] = profile_kernels(call)
            except Exception as error:  # a peer that fails is reported, never a crash of the run
                rows.append(dict(row, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
                continue
            if expected is not None:
                names = ("o", "dq", "dk", "dv", "dg", "dbeta")
                for name, a, r in zip(names, (out, *grads), (expected[0], *expected[1]), strict=True):
                    row[f"err_{name}"] = f"{relative(a, r):.2e}"
            rows.append(row)
        ours_ms = {r["seq"]: r["ms"] for r in rows if r["variant"] == "unsloth_lite" and "ms" in r}
        for r in rows:
            if r["seq"] == seq and "ms" in r and seq in ours_ms:
                r["speedup_of_ours"] = round(r["ms"] / ours_ms[seq], 2)
    columns = ["variant", "seq", "ms", "speedup_of_ours", "err_o", "err_dq", "err_dk", "err_dv", "err_dg",
               "err_dbeta", "error"]
    print(markdown_table(rows, columns))
    print_profiles(rows)
    write_json(args.out, dict(environment=environment(device, ("torch", "triton", "transformers", "fla-core")),
                              heads=heads, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
