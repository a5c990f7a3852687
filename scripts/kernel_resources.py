"""Registers, spilled bytes and shared memory of the Gated DeltaNet's kernels, compiled for a GPU without one.

    python scripts/kernel_resources.py                                  # W2's shape, sm_90, LAUNCH as shipped
    python scripts/kernel_resources.py --precision bf16x3,tf32_rounded --launch '{"values_warps": 8}'
    python scripts/kernel_resources.py --tiny                           # seconds: the test's run

The library's launchers run on CPU tensors with every Triton launch captured instead of run; each captured launch
is compiled by Triton's own toolchain (ptxas included in its wheel) for the target architecture, and
`cuobjdump -res-usage` reads the registers a thread and the stack (spilled) bytes of the cubin. A launch whose
shared memory passes the card's limit (227 KB a block on Hopper) would fail there with "out of resource".
Before a kernel change reaches a GPU, this shows whether it spills or runs out of shared memory at the
shipped launch settings; the figures are those of the installed Triton (the GPU image runs triton 3.6: put a
3.6 install first on PYTHONPATH to read its figures). A launch is specialised as Triton's JIT specialises it
(integer arguments equal to 1, such as the batch size, become constants): so compiled with triton 3.6 at 6a99c7f,
every DeltaNet kernel's registers and shared memory equal those the H200 reported in the same launch settings
(`docs/results/deltanet_launch_sweep_2026-12-02b.json`, rounded products).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels must be compiled, not interpreted
    sys.exit("kernel_resources.py compiles kernels: run it without TRITON_INTERPRET=1")

import triton  # noqa: E402
from bench_common import markdown_table, write_json  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from unsloth_lite.kernels import gated_delta_rule  # noqa: E402

ARGUMENT_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                  torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8", torch.float64: "fp64"}
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class Captured:
    """Triton launches recorded instead of run, while it is entered."""

    def __enter__(self):
        self.launches = []
        self.original = JITFunction.__getitem__
        launches = self.launches

        def capture(kernel, grid):
            return lambda *args, **kwargs: launches.append((kernel, args, kwargs))

        JITFunction.__getitem__ = capture
        return self.launches

    def __exit__(self, *exc):
        JITFunction.__getitem__ = self.original


def compile_launch(kernel: JITFunction, args, kwargs, arch: int):
    """The captured launch compiled for `arch`, specialised as a launch would be (pointers and multiples of 16
    marked 16-divisible, integers equal to 1 made constants)."""
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    signature, constants, attributes = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params, strict=True)):
        value = args[i] if i < len(args) else kwargs[name]
        if param.is_constexpr:
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], attributes[(i,)] = "*" + ARGUMENT_TYPES[value.dtype], [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and value == 1:  # a launch specialises 1 as a constant, as Triton's JIT does
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value != 0 and value % 16 == 0:
                attributes[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(value).__name__}")
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attributes)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resource_usage(compiled) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread) of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", cubin.name],
                                capture_output=True, text=True, check=True).stdout
    registers, stack = re.search(r"REG:(\d+)", report), re.search(r"STACK:(\d+)", report)
    return int(registers.group(1)), int(stack.group(1))


def deltanet_launches(seq, key_heads, value_heads, head_dim, dtype):
    """Every launch of one forward and backward of `chunk_gated_delta_rule` (fixed length, L2 in the kernel,
    the forward's scratch kept), through the library's own launchers on CPU tensors."""
    g = gated_delta_rule
    q = torch.empty(1, seq, key_heads, head_dim, dtype=dtype)
    v = torch.empty(1, seq, value_heads, head_dim, dtype=dtype)
    gate = torch.empty(1, seq, value_heads, dtype=dtype)
    lay = g._Layout(q, None)
    scratch = (value_heads, lay.NCH)
    w = torch.empty(*scratch, g.CHUNK, head_dim)
    tm = torch.empty(*scratch, g.CHUNK, g.CHUNK)
    states = torch.empty(*scratch, head_dim, head_dim)
    with Captured() as launches:
        g._prepare(q, q, v, gate, gate, lay, True, store_t=True)
        g._forward_states(q, q, gate, w, w, None, lay, 0.1, True, compute_o=False, store_final=False,
                          store_states=True, v_dtype=dtype)
        g._output(q, q, gate, states, w, lay, 0.1, True, dtype, 1, head_dim)
        g._backward_states(q, q, gate, v, w, None, lay, 0.1, True, False)
        g._backward_inputs(q, q, v, gate, gate, v, tm, states, torch.empty_like(states), w, torch.empty_like(w),
                           lay, 0.1, True)
    return launches


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="128 tokens, 1 key / 3 value heads of 16, one precision")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=48)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    parser.add_argument("--precision", default=None,
                        help="comma-separated LAUNCH['precision'] values for bf16 inputs (default: as shipped)")
    parser.add_argument("--launch", default="{}", help="JSON of LAUNCH overrides, e.g. '{\"values_warps\": 8}'")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        overrides = json.loads(args.launch)
    except json.JSONDecodeError as exc:
        print(f"kernel_resources.py: --launch is not JSON: {exc}", file=sys.stderr)
        return 2
    unknown = sorted(set(overrides) - set(gated_delta_rule.LAUNCH))
    if unknown:
        print(f"kernel_resources.py: --launch names unknown settings {unknown}; known: "
              f"{sorted(gated_delta_rule.LAUNCH)}", file=sys.stderr)
        return 2
    shape = (128, 1, 3, 16) if args.tiny else (args.seq, args.key_heads, args.value_heads, args.head_dim)
    precisions = args.precision.split(",") if args.precision else [gated_delta_rule.LAUNCH["precision"]]
    shipped = dict(gated_delta_rule.LAUNCH)
    rows = []
    try:
        for precision in precisions:
            gated_delta_rule.LAUNCH.update(overrides, precision=precision)
            for kernel, kernel_args, kernel_kwargs in deltanet_launches(*shape, torch.bfloat16):
                compiled = compile_launch(kernel, kernel_args, kernel_kwargs, args.arch)
                registers, stack = resource_usage(compiled)
                label = precision if isinstance(precision, str) else "as shipped (by kernel)"
                rows.append(dict(precision=label, kernel=kernel.__name__, registers=registers,
                                 stack_bytes=stack, shared_bytes=compiled.metadata.shared,
                                 warps=compiled.metadata.num_warps))
    finally:
        gated_delta_rule.LAUNCH.clear()
        gated_delta_rule.LAUNCH.update(shipped)
    print(markdown_table(rows, ["precision", "kernel", "registers", "stack_bytes", "shared_bytes", "warps"]))
    write_json(args.out, dict(arch=args.arch, triton=triton.__version__, seq=shape[0], key_heads=shape[1],
                              value_heads=shape[2], head_dim=shape[3], launch=overrides, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
