"""Registers, spilled bytes and shared memory of the Gated DeltaNet's kernels, compiled for a GPU without one;
with `--nf4-matvec`, those of the decoding NF4 matrix-vector kernels and the instructions of their loop.

    python scripts/kernel_resources.py                                  # W2's shape, sm_90, LAUNCH as shipped
    python scripts/kernel_resources.py --precision bf16x3,tf32_rounded --launch '{"values_warps": 8}'
    python scripts/kernel_resources.py --tiny                           # seconds: the test's run
    python scripts/kernel_resources.py --nf4-matvec                     # W3's projection shapes, every decoding kernel

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

`--nf4-matvec`: `nf4_matvec` at every decoder projection shape of W3's models (bf16, one row, flat absmax as shipped;
`--matvec-shapes` for others), through the blocked kernel, the word kernel (`WORD_KERNEL`; also with
`REGISTER_PREFETCH`, `words_prefetch`; and its walk in Gluon, `words_gluon`, where the shape fits
`nf4_matvec_gluon.gluon_walk_fits`, also with down_proj's epilogue, `words_gluon_adapted`) and the gate-and-up kernel
(`nf4_gated_matvec`, the shape as both weights' and the instructions per weight over both; on the blocked walk and on
the word walk, `gated_words`, also prefetched), each at its tile as shipped, and (without `--matvec-shapes`)
`nf4_grouped_matvec` at W3's groups of projections of one input (both walks); the SASS (`cuobjdump -sass`) gives the
instructions of the kernel and of its loop over K (the longest backward branch), and of the loop per eight weights of
a thread (`per_8_weights`: the loop's instructions over the weights a thread decodes in one step, times 8). Launched
from a CPU, the kernels are compiled without programmatic dependent launch.

`--decode-kernels`: `decode_attention` at the W3 models' attention shapes (bf16, batch 1, a boolean mask,
Qwen3.5's gate), a cache of 256 positions (W3's) and one of 4,096 (and at 256 with the norm and RoPE),
`delta_rule_gated_step` at the 27B's DeltaNet
shape and `rms_norm_lora_down_rows` at both models' hidden sizes (three rank-16 adapters), as shipped (the
attention's splits as a launch without a GPU chooses them: on a GPU they follow its SM count).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
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
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from unsloth_lite.kernels import (  # noqa: E402
    decode_attention,
    deltanet_decode_gated,
    gated_delta_rule,
    greedy_token,
    lora_down,
    nf4_gated_matvec,
    nf4_grouped_matvec,
    nf4_matvec,
    nf4_matvec_checks,
    nf4_matvec_gluon,
    screened_logits,
)

dequantize_module = importlib.import_module("unsloth_lite.kernels.dequantize_nf4")  # the function shadows it

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
    source = (GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource)(
        kernel, signature, constexprs=constants, attrs=attributes)
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


@contextlib.contextmanager
def compiled_on_cpu():
    """CPU tensors taken by the launchers that check for CUDA (the launches are captured, never run)."""
    saved = {module: module.check_kernel_device
             for module in (nf4_matvec_checks, dequantize_module, decode_attention, deltanet_decode_gated, lora_down,
                            greedy_token)}
    replaced = [(nf4_gated_matvec, "gated_matvec_supported"), (nf4_grouped_matvec, "grouped_matvec_supported"),
                (nf4_matvec_gluon, "gluon_device")]
    supported = [getattr(module, name) for module, name in replaced]
    try:
        for module in saved:
            module.check_kernel_device = lambda _name, _tensor: None
        for module, name in replaced:
            setattr(module, name, lambda *_: True)
        yield
    finally:
        for module, check in saved.items():
            module.check_kernel_device = check
        for (module, name), function in zip(replaced, supported, strict=True):
            setattr(module, name, function)


def nf4_weight(n_out: int, n_in: int):
    """A CPU bf16 NF4 weight `[n_out, n_in]` of uninitialised bytes and an fp32 absmax a 64-weight block (the form
    the kernels read with `FLAT_ABSMAX`); only its layout matters to a compilation."""
    from bitsandbytes.functional import QuantState

    packed = torch.empty(n_out * n_in // 2, 1, dtype=torch.uint8)
    state = QuantState(absmax=torch.empty(n_out * n_in // 64), shape=torch.Size((n_out, n_in)),
                       code=torch.empty(16), blocksize=64, quant_type="nf4", dtype=torch.bfloat16)
    return packed, state


def loop_instructions(sass: str) -> tuple[int, int]:
    """(instructions of the kernel, of its longest loop: the span of its longest backward branch)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);", sass)
    addresses = [int(address, 16) for address, _, _ in lines]
    longest = 0
    for address, (_, op, operands) in zip(addresses, lines, strict=True):
        target = re.search(r"0x([0-9a-f]+)", operands)
        if op == "BRA" and target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            longest = max(longest, sum(start <= a <= address for a in addresses))
    return len(lines), longest


def nf4_param(n_out: int, n_in: int) -> torch.nn.Parameter:
    """`nf4_weight` as a frozen `Params4bit`-like parameter carrying its quant state (what the fused launches
    take)."""
    packed, state = nf4_weight(n_out, n_in)
    weight = torch.nn.Parameter(packed, requires_grad=False)
    weight.quant_state = state
    return weight


def launch_figures(launches, arch: int, weights_a_program_step: int = 1) -> dict:
    """Registers, stack, shared memory and SASS instructions (the kernel's and its loop's, and the loop's per
    eight weights of a thread) of the one captured launch, compiled for `arch`. `weights_a_program_step`: the
    weights a program decodes per tile, in tiles of one weight (2 for gate and up together)."""
    (kernel, kernel_args, kernel_kwargs), = launches
    compiled = compile_launch(kernel, kernel_args, kernel_kwargs, arch)
    registers, stack = resource_usage(compiled)
    total, loop = loop_instructions(sass_of(compiled))
    features, along_k = step_tile(kernel_kwargs)
    per_thread = weights_a_program_step * features * along_k / (32 * kernel_kwargs["num_warps"])
    return dict(registers=registers, stack_bytes=stack, shared_bytes=compiled.metadata.shared, instructions=total,
                loop=loop, per_8_weights=round(8 * loop / per_thread, 1))


def tile_name(tile) -> str:
    return f"{tile[0]}x{tile[1]}/{tile[2]}w"


def step_tile(kwargs) -> tuple[int, int]:
    """(features, weights along K) a program of a captured matrix-vector launch takes a step: the Triton kernels'
    tile, or the Gluon kernel's (`WORDS_PER_THREAD` words a thread, the warps side by side along K)."""
    if "WORDS_PER_THREAD" in kwargs:
        return kwargs["BLOCK_N"], 8 * kwargs["WORDS_PER_THREAD"] * 32 * kwargs["num_warps"]
    return kwargs["BLOCK_N"], kwargs["BLOCKS_PER_TILE"] * kwargs["BLOCKSIZE"]


def launch_tile(launches) -> str:
    """The tile of the one captured launch, as `tile_name` writes it (the launch's own, whichever table chose it)."""
    (_, _, kwargs), = launches
    return tile_name((*step_tile(kwargs), kwargs["num_warps"]))


def matvec_rows(shapes, arch: int) -> list[dict]:
    """One row per (projection shape, kernel): `nf4_matvec`'s launches compiled for `arch` (module docstring)."""
    rows = []
    for n_out, n_in in shapes:
        packed, state = nf4_weight(n_out, n_in)
        x = torch.empty(1, n_in, dtype=torch.bfloat16)
        kernels = [("blocked", False), ("words", True), ("words_prefetch", True), ("gated", False),
                   ("gated_words", True), ("gated_words_prefetch", True)]
        if n_in % nf4_matvec_gluon.step_weights() == 0 and n_out % nf4_matvec_gluon.BLOCK_N == 0:
            kernels += [("words_gluon", True), ("words_gluon_adapted", True), ("words_gluon_first", True),
                        ("gated_gluon", True), ("gated_gluon_adapted", True)]
        for name, words in kernels:
            saved = (nf4_matvec.WORD_KERNEL, nf4_matvec.REGISTER_PREFETCH, nf4_matvec.GLUON_WALK,
                     nf4_gated_matvec.GLUON_GATED, nf4_matvec.GLUON_FIRST_PRODUCTS)
            try:
                nf4_matvec.WORD_KERNEL, nf4_matvec.REGISTER_PREFETCH = words, name.endswith("prefetch")
                nf4_matvec.GLUON_WALK = nf4_gated_matvec.GLUON_GATED = nf4_matvec.GLUON_FIRST_PRODUCTS = (
                    "gluon" in name)
                with compiled_on_cpu(), torch.no_grad(), Captured() as launches:
                    if name == "gated_gluon_adapted":  # as the 8B MLP's: t given for both, the down shares
                        weight = nf4_param(n_out, n_in)
                        adapters = [(torch.empty(n_out, 16), torch.empty(1, 16), 2.0) for _ in range(2)]
                        nf4_gated_matvec.nf4_gated_matvec(x, weight, weight, None, None, *adapters, down_shares=(
                            torch.empty(16, n_out, dtype=x.dtype), torch.empty(16, 1, 16)))
                    elif name.startswith("gated"):  # gate and up: two weights a program
                        weight = nf4_param(n_out, n_in)
                        nf4_gated_matvec.nf4_gated_matvec(x, weight, weight)
                    elif name == "words_gluon_adapted":  # as down_proj's: the residual, t in 16 parts of rank 16
                        residual = torch.empty(1, n_out, dtype=x.dtype)
                        nf4_matvec.nf4_matvec(x, packed, quant_state=state, lora_b=torch.empty(n_out, 16),
                                              lora_t=torch.empty(16, 1, 16), residual=residual)
                    elif name == "words_gluon_first":  # as o_proj's: the residual, t = x Aᵀ in the launch
                        residual = torch.empty(1, n_out, dtype=x.dtype)
                        nf4_matvec.nf4_matvec(x, packed, quant_state=state, lora_a=torch.empty(16, n_in),
                                              lora_b=torch.empty(n_out, 16), residual=residual)
                    else:
                        nf4_matvec.nf4_matvec(x, packed, quant_state=state)
            finally:
                (nf4_matvec.WORD_KERNEL, nf4_matvec.REGISTER_PREFETCH, nf4_matvec.GLUON_WALK,
                 nf4_gated_matvec.GLUON_GATED, nf4_matvec.GLUON_FIRST_PRODUCTS) = saved
            rows.append(dict(out=n_out, **{"in": n_in}, kernel=name, tile=launch_tile(launches),
                             **launch_figures(launches, arch, 2 if name.startswith("gated") else 1)))
    return rows


def grouped_rows(groups, arch: int) -> list[dict]:
    """One row per group of projections of one input ((widths, input width)) and walk: `nf4_grouped_matvec`
    compiled for `arch`, without adapters; walked in Gluon where the group fits, also with rank-16 adapters on
    all (t given, as the norm's launch writes it)."""
    rows = []
    for widths, n_in in groups:
        weights = [nf4_param(n_out, n_in) for n_out in widths]
        x = torch.empty(1, n_in, dtype=torch.bfloat16)
        kernels = [("grouped", False), ("grouped_words", True)]
        if n_in % nf4_matvec_gluon.step_weights() == 0 and all(n % nf4_matvec_gluon.BLOCK_N == 0 for n in widths):
            kernels += [("grouped_gluon", True), ("grouped_gluon_adapted", True)]
        for name, words in kernels:
            saved = nf4_matvec.WORD_KERNEL, nf4_matvec.GLUON_WALK, nf4_grouped_matvec.GLUON_GROUPED
            try:
                nf4_matvec.WORD_KERNEL = words
                nf4_matvec.GLUON_WALK = nf4_grouped_matvec.GLUON_GROUPED = "gluon" in name
                adapted = name.endswith("adapted")
                loras = [(torch.empty(n_out, 16), 2.0) if adapted else None for n_out in widths]
                with compiled_on_cpu(), torch.no_grad(), Captured() as launches:
                    nf4_grouped_matvec.nf4_grouped_matvec(x, weights, [None] * len(weights), loras, lora_t=(
                        torch.empty(1, 16 * len(widths)) if adapted else None))
            finally:
                nf4_matvec.WORD_KERNEL, nf4_matvec.GLUON_WALK, nf4_grouped_matvec.GLUON_GROUPED = saved
            rows.append(dict(out="/".join(map(str, widths)), **{"in": n_in}, kernel=name, tile=launch_tile(launches),
                             **launch_figures(launches, arch)))
    return rows


# (model, query heads, KV heads, head size, gated) of W3's attention layers
DECODE_ATTENTION_SHAPES = (("qwen3_8b", 32, 8, 128, False), ("qwen3_5_27b", 24, 4, 256, True))


def decode_kernel_rows(arch: int) -> list[dict]:
    """One row per (W3 model, cache length): `decode_attention`'s launch compiled for `arch`; one for
    `delta_rule_gated_step` at the 27B's DeltaNet shape (16 key and 48 value heads of 128); one per model for
    `rms_norm_lora_down_rows`."""
    rows = []
    for model, q_heads, kv_heads, head_dim, gated in DECODE_ATTENTION_SHAPES:
        rotary = head_dim // 4 if gated else head_dim  # Qwen3.5's partial rotary
        norm_rope = (torch.empty(head_dim, dtype=torch.bfloat16),) * 2 + (torch.empty(1, 1, rotary),) * 2 + (1e-6, 0.0)
        for cache_len, with_norm_rope in ((256, False), (4096, False), (4096, True), (256, True)):
            query = torch.empty(1, q_heads, 1, head_dim, dtype=torch.bfloat16)
            key = torch.empty(1, kv_heads, 1, head_dim, dtype=torch.bfloat16)
            cache = torch.empty(1, kv_heads, cache_len, head_dim, dtype=torch.bfloat16)
            mask = torch.empty(1, 1, 1, cache_len, dtype=torch.bool)
            gate = torch.empty(1, 1, q_heads, head_dim, dtype=torch.bfloat16) if gated else None
            with compiled_on_cpu(), torch.no_grad(), Captured() as launches:
                decode_attention.decode_attention(query, key, key, cache, cache, torch.zeros((), dtype=torch.int64),
                                                  mask, None, gate, norm_rope if with_norm_rope else None)
            kernel_kwargs = launches[0][2]
            name = "decode_attention" + (", norm_rope" if with_norm_rope else "")
            rows.append(dict(kernel=name, model=model,
                             cache=cache_len,
                             splits=kernel_kwargs["SPLITS"], positions_a_step=kernel_kwargs["BLOCK_L"],
                             **compiled_figures(launches, arch)))
    q = torch.empty(1, 16, 128, dtype=torch.bfloat16)
    v = torch.empty(1, 48, 128, dtype=torch.bfloat16)
    a = torch.empty(1, 48, dtype=torch.bfloat16)
    with compiled_on_cpu(), torch.no_grad(), Captured() as launches:
        deltanet_decode_gated.delta_rule_gated_step(q, q, v, a, a, torch.empty(48), torch.empty(48),
                                                    torch.empty(1, 48, 128, 128), v, torch.empty(128))
    rows.append(dict(kernel="delta_rule_gated_step", model="qwen3_5_27b", **compiled_figures(launches, arch)))
    for model, hidden in (("qwen3_8b", 4096), ("qwen3_5_27b", 5120)):  # the norm with q/k/v's rank-16 adapters
        x = torch.empty(1, hidden, dtype=torch.bfloat16)
        with compiled_on_cpu(), torch.no_grad(), Captured() as launches:
            lora_down.rms_norm_lora_down_rows(x, torch.empty(hidden, dtype=torch.bfloat16), 1e-6, 0.0,
                                              [torch.empty(16, hidden)] * 3)
        rows.append(dict(kernel="rms_norm_lora_down", model=model, **compiled_figures(launches, arch)))
    for model, vocab in (("qwen3_8b", 151936), ("qwen3_5_27b", 248320)):  # greedy, min_new_tokens, one eos id
        logits = torch.empty(1, vocab, dtype=torch.bfloat16)
        ids, tokens = torch.empty(1, 300, dtype=torch.int64), torch.empty(1, 1, dtype=torch.int64)
        with compiled_on_cpu(), torch.no_grad(), Captured() as launches:
            greedy_token.greedy_token(logits, ids, 200, tokens, torch.empty(1, dtype=torch.bool),
                                      torch.empty(1, dtype=torch.int64), 0, tokens.clone(),
                                      torch.empty(1, 1, 1, 512, dtype=torch.bool), True, True, True)
        rows.append(dict(kernel="greedy_token", model=model, **compiled_figures(launches, arch)))
        hidden = {"qwen3_8b": 4096, "qwen3_5_27b": 5120}[model]
        weight = torch.empty(vocab, hidden, dtype=torch.bfloat16)
        with compiled_on_cpu(), torch.no_grad(), Captured() as launches:
            screened_logits.screened_logits(torch.empty(1, hidden, dtype=torch.bfloat16), weight,
                                            torch.empty(vocab, hidden, dtype=torch.int8), torch.empty(vocab))
        for launch in launches:
            rows.append(dict(kernel=launch[0].fn.__name__, model=model, **compiled_figures([launch], arch)))
    return rows


def compiled_figures(launches, arch: int) -> dict:
    """Registers, stack, shared memory and SASS instructions (the kernel's and its longest loop's) of the one
    captured launch, compiled for `arch`."""
    (kernel, kernel_args, kernel_kwargs), = launches
    compiled = compile_launch(kernel, kernel_args, kernel_kwargs, arch)
    registers, stack = resource_usage(compiled)
    total, loop = loop_instructions(sass_of(compiled))
    return dict(registers=registers, stack_bytes=stack, shared_bytes=compiled.metadata.shared, instructions=total,
                loop=loop)


def sass_of(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", cubin.name],
                              capture_output=True, text=True, check=True).stdout


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
    parser.add_argument("--nf4-matvec", action="store_true",
                        help="the NF4 matrix-vector kernels instead of the DeltaNet's (module docstring)")
    parser.add_argument("--matvec-shapes", default=None,
                        help="with --nf4-matvec: comma-separated OUTxIN (default: W3's projection shapes)")
    parser.add_argument("--matvec-groups", default=None,
                        help="with --nf4-matvec: comma-separated N1/N2/...xIN groups of projections of one input "
                             "(default: W3's, without --matvec-shapes; none with it)")
    parser.add_argument("--decode-kernels", action="store_true",
                        help="decode_attention and delta_rule_gated_step at W3's shapes instead")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    return parser.parse_args(argv)


def matvec_shapes(text: str | None) -> list[tuple[int, int]] | None:
    """The projection shapes of `--matvec-shapes` (None where one is not OUTxIN with IN a multiple of 64)."""
    if text is None:
        from bench_nf4_matvec import projection_shapes

        return sorted({key for shape in ("qwen3_8b", "qwen3_5_27b") for key in projection_shapes(shape, False)})
    shapes = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)x(\d+)", item.strip())
        if match is None or int(match.group(2)) % 64 or not int(match.group(1)):
            return None
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes


def matvec_groups(text: str | None) -> list[tuple[list[int], int]] | None:
    """The groups of `--matvec-groups` ([] without; None where one is not N1/N2/...xIN with 2 to 4 widths and IN a
    multiple of 64)."""
    groups = []
    for item in filter(None, (text or "").split(",")):
        match = re.fullmatch(r"(\d+(?:/\d+){1,3})x(\d+)", item.strip())
        if match is None or int(match.group(2)) % 64:
            return None
        groups.append(([int(n) for n in match.group(1).split("/")], int(match.group(2))))
    return groups


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.decode_kernels:
        rows = decode_kernel_rows(args.arch)
        print(markdown_table(rows, ["kernel", "model", "cache", "splits", "positions_a_step", "registers",
                                    "stack_bytes", "shared_bytes", "instructions", "loop"]))
        write_json(args.out, dict(arch=args.arch, triton=triton.__version__, rows=rows))
        return 0
    if args.nf4_matvec:
        shapes = matvec_shapes(args.matvec_shapes)
        if shapes is None:
            print(f"kernel_resources.py: --matvec-shapes {args.matvec_shapes!r}: expected OUTxIN,... with IN a "
                  "multiple of 64", file=sys.stderr)
            return 2
        groups = matvec_groups(args.matvec_groups)
        if groups is None:
            print(f"kernel_resources.py: --matvec-groups {args.matvec_groups!r}: expected N1/N2/...xIN,... with 2 to "
                  "4 widths and IN a multiple of 64", file=sys.stderr)
            return 2
        rows = matvec_rows(shapes, args.arch)
        if args.matvec_shapes is None and args.matvec_groups is None:  # W3's groups of projections of one input
            from bench_nf4_matvec import projection_groups

            groups = [(widths, n_in) for _, _, widths, n_in, _ in projection_groups(["qwen3_8b", "qwen3_5_27b"],
                                                                                     False)]
        rows += grouped_rows(groups, args.arch)
        print(markdown_table(rows, ["out", "in", "kernel", "tile", "registers", "stack_bytes", "shared_bytes",
                                    "instructions", "loop", "per_8_weights"]))
        write_json(args.out, dict(arch=args.arch, triton=triton.__version__, rows=rows))
        return 0
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
