"""Forward+backward time and extra memory of the fused linear cross-entropy (LM head + loss, L1) against PyTorch
eager, torch.compile, Liger-Kernel and Apple's Cut Cross-Entropy.

    python scripts/bench_loss.py --out bench_loss.json        # on a GPU: the L1 shapes, bf16
    TRITON_INTERPRET=1 python scripts/bench_loss.py --tiny    # on a CPU: tiny shapes, ours vs torch only

Workload L1: N = 16384 tokens in bf16, 1/7 of the labels ignored (-100), (H, V) = (4096, 151936) and
(5120, 248320), mean reduction; the weight frozen (LoRA) or trainable. One step is the loss forward plus
`torch.autograd.grad` of it with respect to hidden (and weight when trainable): no `.grad` accumulation.

Variants: `unsloth_lite` (this package); `torch` (bf16 logits = hidden @ weight.T, then `F.cross_entropy` on
`logits.float()`); `compile` (`torch.compile` of that function); `liger` (`LigerFusedLinearCrossEntropyLoss`);
`cut_cross_entropy` (`linear_cross_entropy` with its defaults, which include gradient filtering,
`filter_eps="high"`). Variants whose import fails are skipped; one that runs out of memory is reported as OOM.

Columns: `ms`, median time of one step called from Python (CUDA events); `extra_MiB`, the peak of
`torch.cuda.max_memory_allocated()` during one step (peak stats reset first) minus the memory allocated before
it, minus the size of the returned gradients (dhidden, and dweight when trainable), which every variant must
produce: what a variant needs beyond its inputs and outputs; `TFLOPs`, 4·N·H·V (frozen: logits and dhidden)
or 6·N·H·V (trainable: and dweight) FLOPs over `ms`, so a variant that recomputes the logits in its backward
does more work than is credited; `pct_peak`, that rate as a percentage of a bf16 8192³ matmul measured in the
same run; `speedup_of_ours`, the variant's time over ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

import torch
import torch.nn.functional as F
from bench_common import bench_device, bench_ms, environment, markdown_table, matmul_tflops, write_json

from unsloth_lite.kernels import fused_linear_cross_entropy

IGNORE_INDEX = -100
ALL_VARIANTS = ("unsloth_lite", "torch", "compile", "liger", "cut_cross_entropy")


def torch_loss(hidden, weight, labels):
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)


_COMPILED = {}


def compiled_loss(hidden, weight, labels):
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(torch_loss)
    return _COMPILED["fn"](hidden, weight, labels)


def variant_functions(device: torch.device, wanted: set[str]) -> dict:
    """name -> loss(hidden, weight, labels), for the variants wanted whose imports succeed."""
    fns = {
        "unsloth_lite": lambda h, w, y: fused_linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX),
        "torch": torch_loss,
        "compile": compiled_loss,
    }
    if "liger" in wanted:
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
            fns["liger"] = lambda h, w, y: liger(w, h, y)
        except ImportError as error:
            print(f"skipping liger: {error}")
    if "cut_cross_entropy" in wanted:
        try:
            from cut_cross_entropy import linear_cross_entropy

            fns["cut_cross_entropy"] = lambda h, w, y: linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX)
        except ImportError as error:
            print(f"skipping cut_cross_entropy: {error}")
    return {name: fn for name, fn in fns.items() if name in wanted}


@dataclasses.dataclass
class Case:
    tokens: int
    hidden: int
    vocab: int
    trainable: bool

    @property
    def label(self) -> str:
        return f"N={self.tokens} H={self.hidden} V={self.vocab}, {'trainable' if self.trainable else 'frozen'} weight"

    @property
    def flops(self) -> float:
        return (6 if self.trainable else 4) * self.tokens * self.hidden * self.vocab


def make_inputs(case: Case, device, dtype):
    hidden = torch.randn(case.tokens, case.hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(case.vocab, case.hidden, device=device) / case.hidden**0.5).to(dtype)
    weight.requires_grad_(case.trainable)
    labels = torch.randint(0, case.vocab, (case.tokens,), device=device)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


def make_step(fn, hidden, weight, labels, trainable: bool):
    inputs = [hidden, weight] if trainable else [hidden]

    def step():
        return torch.autograd.grad(fn(hidden, weight, labels), inputs)

    return step


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def extra_peak_mib(step, grad_bytes: int, device) -> float | None:
    """Peak allocated during one step, beyond what was allocated before it and the returned gradients."""
    if device.type != "cuda":
        return None
    _free(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    grads = step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del grads
    return (peak - before - grad_bytes) / 2**20


def run_variant(name, fn, case, device, dtype, peak_tflops):
    hidden, weight, labels = make_inputs(case, device, dtype)
    grad_bytes = hidden.numel() * hidden.element_size()
    if case.trainable:
        grad_bytes += weight.numel() * weight.element_size()
    step = make_step(fn, hidden, weight, labels, case.trainable)
    row = dict(case=case.label, variant=name)
    try:
        step()  # compile / autotune outside the timed region
        row["extra_MiB"] = extra_peak_mib(step, grad_bytes, device)
        ms = bench_ms(step, device, rep_ms=2000)  # a median of ~30 steps: ratios of 1% must be resolved
    except torch.cuda.OutOfMemoryError:
        row.update(ms="OOM", extra_MiB="OOM")
        return row
    finally:
        del step, hidden, weight, labels
        _free(device)
    tflops = case.flops / ms / 1e9
    row.update(ms=round(ms, 3), TFLOPs=round(tflops, 1), pct_peak=round(100 * tflops / peak_tflops, 1))
    if row["extra_MiB"] is not None:
        row["extra_MiB"] = round(row["extra_MiB"], 1)
    return row


def build_cases(tiny: bool) -> list[Case]:
    if tiny:
        return [Case(48, 32, 300, False), Case(48, 32, 300, True)]
    shapes = [(4096, 151936), (5120, 248320)]
    return [Case(16384, h, v, trainable) for trainable in (False, True) for h, v in shapes]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes; ours and torch only (CPU smoke run)")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(ALL_VARIANTS)}")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    device = bench_device(args.tiny)
    if device is None:
        return 2
    if args.variants:
        wanted = set(args.variants.split(","))
    else:
        wanted = {"unsloth_lite", "torch"} if args.tiny else set(ALL_VARIANTS)
    wanted.add("unsloth_lite")  # the reference point of speedup_of_ours
    dtype = torch.bfloat16

    env = environment(device, packages=("torch", "triton", "liger-kernel", "cut-cross-entropy"))
    matmul_size = 256 if args.tiny else 8192
    peak_tflops = matmul_tflops(device, size=matmul_size)
    fns = variant_functions(device, wanted)
    rows = []
    for case in build_cases(args.tiny):
        case_rows = [run_variant(name, fn, case, device, dtype, peak_tflops) for name, fn in fns.items()]
        ours = next(r["ms"] for r in case_rows if r["variant"] == "unsloth_lite")
        for row in case_rows:
            if isinstance(row["ms"], float) and isinstance(ours, float):
                row["speedup_of_ours"] = round(row["ms"] / ours, 3)
        rows.extend(case_rows)

    print(f"environment: {env}")
    print(f"bf16 matmul rate ({matmul_size}^3, measured in this run): {peak_tflops:.1f} TFLOP/s")
    columns = ["case", "variant", "ms", "extra_MiB", "TFLOPs", "pct_peak", "speedup_of_ours"]
    print(markdown_table(rows, columns))
    write_json(args.out, dict(environment=env, matmul_size=matmul_size, matmul_TFLOPs=peak_tflops, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
