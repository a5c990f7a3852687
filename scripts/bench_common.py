"""Timing, ceilings and reporting shared by the `bench_*.py` scripts.

On CUDA, times are medians of CUDA-event timings (`triton.testing.do_bench`). On CPU (the tiny mode that
keeps the scripts from rotting, kernels through the Triton interpreter) a plain wall clock over one run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time

import torch


def report_unknown(kind: str, chosen, known) -> bool:
    """Whether `chosen` names anything `known` lacks; if so, says which on stderr, with the choices."""
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        print(f"unknown {kind} {unknown}; choose from {','.join(known)}", file=sys.stderr)
    return bool(unknown)


def shape_run_parser(doc: str, shapes) -> argparse.ArgumentParser:
    """The argument parser of a W3-shape kernel benchmark: `--tiny` (the CPU smoke run), `--shapes` (a subset of
    `shapes`, all by default) and `--out` (JSON); the script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (the tiny models' shapes, interpreter)")
    parser.add_argument("--shapes", default=",".join(shapes), help=f"comma-separated subset of {','.join(shapes)}")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


KEPT_MLP_KEYS = {"keep": "keep_mlp_preactivations", "gpu": "mlp_preactivations_on_gpu",
                 "proj": "keep_projection_outputs", "sets": "kept_sets", "lead": "offload_lead",
                 "gather": "device_gather", "res": "fused_residuals", "join": "adapters_in_products"}
KEPT_MLP_SUFFIX = "'@keep=N/gpu=G/proj=P/sets=S/lead=L/gather=0|1/res=0|1/join=0|1'"  # the keys' form, for errors


def uncheckpointed_suffix(variant: str) -> tuple[str, int | None]:
    """(the variant without it, N) of a variant named "NAME:N" (its last N decoder layers not checkpointed);
    (variant, None) without one."""
    head, colon, layers = variant.rpartition(":")
    return (head, int(layers)) if colon and layers.isdigit() else (variant, None)


def kept_mlp_options(variant: str) -> tuple[str, dict]:
    """A variant name and the checkpointing options of its `@` suffix: ("unsloth_lite_kept_mlp",
    {"keep_mlp_preactivations": 48, "mlp_preactivations_on_gpu": 8}) of "unsloth_lite_kept_mlp@keep=48/gpu=8"
    (48 layers keep their MLP pre-activations, 8 of them on the GPU; `proj=P`: P layers keep their projections'
    outputs, `keep_projection_outputs`; `sets`, `lead`, `gather`, `res`, `join`:
    module settings, see `apply_module_settings`); a kept_mlp variant without a suffix keeps them in every
    checkpointed layer, offloaded ({"keep_mlp_preactivations": True}); others keep none ({}).
    Raises ValueError for a suffix on another variant or an unknown key."""
    name, _, suffix = variant.partition("@")
    if "kept_mlp" not in name:
        if suffix:
            raise ValueError(f"{variant}: only the kept_mlp variants take {KEPT_MLP_SUFFIX}")
        return name, {}
    options = {"keep_mlp_preactivations": True}
    for item in filter(None, suffix.split("/")):
        key, _, value = item.partition("=")
        if key not in KEPT_MLP_KEYS or not value.isdigit():
            raise ValueError(f"{variant}: expected {KEPT_MLP_SUFFIX} (whole numbers), got {item!r}")
        options[KEPT_MLP_KEYS[key]] = int(value)
    return name, options


# The module settings a kept_mlp variant's `@` suffix may carry: option -> (module, attribute, least value).
MODULE_SETTINGS = {
    "kept_sets": ("unsloth_lite.training.layer_graphs", "KEPT_SETS", 1),
    "offload_lead": ("unsloth_lite.training.checkpointing", "MAX_PENDING_OFFLOADS", 1),
    "device_gather": ("unsloth_lite.models.host_embeddings", "DEVICE_GATHER", 0),
    "fused_residuals": ("unsloth_lite.models.decoder_layer", "FUSED_RESIDUALS", 0),
    "adapters_in_products": ("unsloth_lite.kernels.lora", "ADAPTERS_IN_PRODUCTS", 0),
}


def setting_in_range(value: int, least: int) -> bool:
    """Whether `value` suits a module setting of least value `least` (0: a switch, 0 or 1)."""
    return value >= least and (least > 0 or value <= 1)


def set_module_settings(values: dict, table: dict) -> None:
    """Sets each `values[key]` as the module attribute `table[key]` names ((module, attribute, least value)), a
    switch (least 0) as a bool; ValueError for a value out of range."""
    for key, value in values.items():
        module, attribute, least = table[key]
        if not setting_in_range(value, least):
            raise ValueError(f"{key}={value}: " + ("0 or 1" if least == 0 else f"at least {least}"))
        setattr(importlib.import_module(module), attribute, bool(value) if least == 0 else value)


def apply_module_settings(options: dict) -> dict:
    """`options` without the module settings a variant's `@` suffix may carry, which it sets in this worker so
    that one run compares them: "kept_sets" (`@sets=S`: `layer_graphs.KEPT_SETS`, the graphed layers' sets of
    kept-tensor buffers), "offload_lead" (`@lead=L`: `checkpointing.MAX_PENDING_OFFLOADS`, offloads the host may
    queue ahead) and "device_gather" (`@gather=0|1`: `host_embeddings.DEVICE_GATHER`, the host table's rows read
    by the GPU)."""
    options = dict(options)
    set_module_settings({key: options.pop(key) for key in MODULE_SETTINGS if key in options}, MODULE_SETTINGS)
    return options


def drop_missing_unsloth(variants: list[str], chosen: bool, unsloth_site: str | None) -> list[str]:
    """`variants` less `unsloth` where it came with the defaults (not `chosen`), no `--unsloth-site` was given
    and unsloth does not import here; says so."""
    if "unsloth" in variants and not chosen and not unsloth_site and importlib.util.find_spec("unsloth") is None:
        print("unsloth is not importable (--unsloth-site): its variant is left out")
        return [v for v in variants if v != "unsloth"]
    return variants


def bench_ms(fn, device: torch.device, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    # CPU runs are smoke runs (the interpreter compiles nothing to warm up): one timed call.
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def timed_row(fn, device: torch.device, moved_bytes: float, bandwidth_gbps: float, **keys) -> dict:
    """`keys` with the device time of `fn` (`graph_ms` on a GPU, else `bench_ms`) in us, the rate at which it
    moves `moved_bytes` and that rate's fraction of the copy bandwidth; the keys alone where no time came."""
    ms = graph_ms(fn, device) if device.type == "cuda" else bench_ms(fn, device)
    row = dict(keys)
    if ms is not None:
        row.update(us=round(1e3 * ms, 2), gb_per_s=round(moved_bytes / ms / 1e6, 1),
                   copy_fraction=round(moved_bytes / ms / 1e6 / bandwidth_gbps, 3))
    return row


def graph_ms(fn, device: torch.device) -> float | None:
    """Device time of `fn` alone: its kernels captured in a CUDA graph and replayed, so the host's launch
    overhead drops out. None where the graph can't be captured (or on CPU)."""
    if device.type != "cuda":
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        print(f"graph capture failed: {str(error).splitlines()[0]}")
        return None
    return bench_ms(graph.replay, device)


def bench_device(tiny: bool) -> torch.device | None:
    """CUDA for a full run, the CPU for `--tiny`; None (after saying why) for a full run without CUDA."""
    if tiny:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    print("no CUDA device: pass --tiny (with TRITON_INTERPRET=1) for the CPU smoke run", file=sys.stderr)
    return None


def copy_bandwidth_gbps(device: torch.device, gib: float = 4.0) -> float:
    """Device-to-device copy of `gib` GiB of bf16, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * n * 2 / ms / 1e6


def matmul_tflops(device: torch.device, size: int = 8192) -> float:
    """bf16 `size`³ matrix product on random data."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, device)
    return 2 * size**3 / ms / 1e9


def host_link_gbps(device: torch.device, mib: int = 128) -> dict:
    """Copy rates between pinned host memory and the GPU, GB/s each way (`mib` MiB a copy, median time)."""
    gpu = torch.randn(mib * 2**19, device=device, dtype=torch.bfloat16)
    host = torch.empty(gpu.shape, dtype=gpu.dtype, pin_memory=True)
    rates = {}
    for name, copy in (("device_to_host", lambda: host.copy_(gpu, non_blocking=True)),
                       ("host_to_device", lambda: gpu.copy_(host, non_blocking=True))):
        ms = bench_ms(copy, device)
        rates[name] = round(gpu.numel() * gpu.element_size() / ms / 1e6, 1)
    return rates


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def source_revision() -> str:
    """$UNSLOTH_LITE_REVISION when set (a copy of the tree may carry a .git of another commit), else the
    checkout's commit (with "+changes" when the tracked files differ from it), else "unknown"."""
    if os.environ.get("UNSLOTH_LITE_REVISION"):
        return os.environ["UNSLOTH_LITE_REVISION"]
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True).returncode != 0
        return commit + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_id(device: torch.device) -> str:
    """The GPU's UUID (the card itself, not its model), or the host's name for a CPU run."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return platform.node()


def environment(device: torch.device, packages=("torch", "triton", "transformers", "liger-kernel")) -> dict:
    env = {
        "date": datetime.date.today().isoformat(),
        "revision": source_revision(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "machine": machine_id(device),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    env.update({name: _version(name) for name in packages})
    return env


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def resumed_run(path: str | None, env: dict, settings: dict) -> dict:
    """The JSON of the run in `path` to continue (empty where there is none yet), if it was measured with the same
    environment as `env` (the date aside: same GPU, code and versions) and the same top-level `settings`; a
    ValueError naming what differs otherwise."""
    if not path:
        raise ValueError("needs --out (the run to continue)")
    try:
        with open(path) as f:
            run = json.load(f)
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    before = run.get("environment", {})
    for key in sorted(set(env) - {"date"}):
        if before.get(key) != env[key]:
            raise ValueError(f"{path} was measured with {key} {before.get(key)!r}, this run has {env[key]!r}")
    for key, value in settings.items():
        if run.get(key) != value:
            raise ValueError(f"{path} was measured with {key} {run.get(key)!r}, this run has {value!r}")
    return run


def parse_results(lines: list[str], prefix: str) -> list[dict]:
    """The JSON objects printed after `prefix`. The prefix may come mid-line: where several processes share one
    output pipe, another's progress bar (written without a newline) can precede it."""
    return [json.loads(line[line.index(prefix) + len(prefix):]) for line in lines if prefix in line]


def run_worker_process(cmd: list[str], env: dict, cwd, result_prefix: str, timeout_s: float, label: str,
                       verbose: bool = False) -> tuple[list[dict], list[str], int]:
    """Runs a benchmark worker process, killed after `timeout_s`; returns the JSON objects it printed on lines
    starting with `result_prefix`, all its output lines (stdout and stderr; echoed with `label` when
    `verbose`), and its return code."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
    )
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if verbose:
                print(f"{label} {line}", end="", flush=True)
        proc.wait()
    finally:
        timer.cancel()
    results = parse_results(lines, result_prefix)
    return results, lines, proc.returncode


def worker_failure(returncode: int) -> str:
    """Why a worker of `run_worker_process` left no result: killed at its timeout (SIGKILL), or its exit code."""
    return "timed out" if worker_timed_out(returncode) else f"exited with {returncode}"


def worker_timed_out(returncode: int) -> bool:
    return returncode in (-9, 137)


TOP_KERNELS = 40


def kernel_profile(prof, top: int = TOP_KERNELS) -> dict:
    """Kernels launched in the profiled region: their number, summed time (ms), and the `top` names
    with the most time (name shortened, calls, ms), to show where a step's device time goes."""
    try:
        events = list(prof.profiler.kineto_results.events())
    except Exception as error:
        print(f"could not read the profile: {error}", file=sys.stderr)
        return dict(kernels_per_step=None, kernel_ms=None)
    kernels = [e for e in events if hasattr(e, "activity_type") and e.activity_type() == "kernel"]
    if not kernels:  # older kineto bindings: device events that are not copies or memsets
        kernels = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA
                   and not e.name().startswith(("Memcpy", "Memset"))]
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name()[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += e.duration_ns() / 1e6
    heaviest = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    out = dict(
        kernels_per_step=len(kernels), kernel_ms=sum(e.duration_ns() for e in kernels) / 1e6,
        top_kernels=[dict(name=name, calls=calls, ms=round(ms, 2)) for name, (calls, ms) in heaviest],
    )
    copies = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA
              and e.name().startswith("Memcpy")]
    # the host's launch calls (cudaLaunchKernel, cudaGraphLaunch, ...) by the correlation id their kernels carry
    launches = {e.correlation_id(): (e.start_ns(), e.end_ns(), e.start_thread_id()) for e in events
                if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("cu")
                and e.correlation_id()}
    out.update(device_idle(kernels, copies, launches=launches))
    host_ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    if host_ops:
        host_ops.sort(key=lambda e: -e.self_cpu_time_total)
        out["top_host_ops"] = [
            dict(name=e.key[:80], calls=e.count, ms=round(e.self_cpu_time_total / 1e3, 2))
            for e in host_ops[:top]
        ]
    return out


def device_idle(kernels, copies=(), top: int = 10, launches: dict | None = None) -> dict:
    """Where the device ran no kernel between the first kernel's start and the last one's end: `idle_ms` in
    all; `idle_during_copies_ms`, of it, the time while a copy of each kind was in flight (`copies` by the
    first two words of their names, e.g. "Memcpy DtoD": a device-to-device copy occupies the device's memory
    as a kernel would; the offload's copies to and from the host run beside kernels); and the `top` pairs
    (kernel that ended, kernel that started next) by the idle time between them, with how often each occurred.
    Events need `name()`, `start_ns()` and `end_ns()`. With `launches` (correlation id -> (start, end) ns and
    thread of the host call that launched the kernel, `correlation_id()` of each kernel; a graph's kernels carry
    its launch's), each pair also gets `host_late_us`, the mean time from the gap's start to the start of the
    host call that launched the kernel ending it (positive: the host had not yet called it when the device went
    idle, so the host set the pace), and `after_call_us`, the mean from that call's end to the kernel's start;
    and `idle_by_launching_thread_ms` splits the idle time by the thread that launched each gap's ending kernel,
    in the order the threads first launched one (a training step: the forward's thread, then the autograd
    engine's, which runs the backward)."""
    spans = sorted((e.start_ns(), e.end_ns(), e.name()[:80], _launch_of(e, launches)) for e in kernels)
    if not spans:
        return dict(idle_ms=None)
    gaps, by_pair, by_thread = [], {}, {}
    for *_, launch in spans:  # threads in the order they first launched a kernel
        if launch is not None:
            by_thread.setdefault(launch[2], 0)
    busy_until, last_name = spans[0][1], spans[0][2]
    for start, end, name, launch in spans[1:]:
        if start > busy_until:
            gaps.append((busy_until, start))
            entry = by_pair.setdefault((last_name, name), [0, 0, [], []])
            entry[0] += 1
            entry[1] += start - busy_until
            if launch is not None:
                entry[2].append(launch[0] - busy_until)
                entry[3].append(start - launch[1])
                by_thread[launch[2]] += start - busy_until
        if end > busy_until:
            busy_until, last_name = end, name
    copy_spans: dict[str, list] = {}
    for e in copies:
        copy_spans.setdefault(" ".join(e.name().split()[:2]), []).append((e.start_ns(), e.end_ns()))
    during_copies = {kind: round(sum(_overlap_ns(gap, sorted(spans)) for gap in gaps) / 1e6, 3)
                     for kind, spans in sorted(copy_spans.items())}
    worst = sorted(by_pair.items(), key=lambda item: -item[1][1])[:top]
    return dict(
        idle_ms=round(sum(end - start for start, end in gaps) / 1e6, 3),
        span_ms=round((busy_until - spans[0][0]) / 1e6, 3),
        idle_during_copies_ms=during_copies,
        idle_between=[dict(after=after, before=before, times=times, ms=round(ns / 1e6, 3),
                           **_launch_timing(late, after_call))
                      for (after, before), (times, ns, late, after_call) in worst],
        **({"idle_by_launching_thread_ms": [round(ns / 1e6, 3) for ns in by_thread.values()]} if by_thread else {}),
    )


def _launch_of(kernel, launches: dict | None):
    """(start, end) ns of the host call that launched `kernel`, where `launches` has it."""
    if not launches:
        return None
    return launches.get(kernel.correlation_id())


def _launch_timing(late: list[int], after_call: list[int]) -> dict:
    if not late:
        return {}
    return dict(host_late_us=round(sum(late) / len(late) / 1e3, 1),
                after_call_us=round(sum(after_call) / len(after_call) / 1e3, 1))


def _overlap_ns(gap: tuple[int, int], spans: list[tuple[int, int]]) -> int:
    """Nanoseconds of `gap` covered by the union of `spans` (sorted by start)."""
    covered, cursor = 0, gap[0]
    for start, end in spans:
        if start >= gap[1]:
            break
        start, end = max(start, cursor), min(end, gap[1])
        if end > start:
            covered += end - start
            cursor = end
    return covered


def memory_peak_report(step, device: torch.device, top: int = 20) -> dict:
    """Runs `step()` once with the CUDA allocator's history recorded and returns what was live at its peak:
    the bytes allocated before it, the peak over those, and the live blocks grouped by the innermost frame of
    the project (or, failing that, of transformers / peft / torch), largest first."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, current, peak, peak_live = {}, 0, 0, {}
    for event in snapshot["device_traces"][device.index or 0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, peak_live = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    groups: dict[str, int] = {}
    for event in peak_live.values():
        key = _allocation_site(event.get("frames", []))
        groups[key] = groups.get(key, 0) + event["size"]
    ranked = sorted(groups.items(), key=lambda item: -item[1])[:top]
    return dict(allocated_before_gib=before / 2**30, peak_over_before_gib=peak / 2**30,
                live_at_peak=[dict(site=site, mib=round(size / 2**20, 1)) for site, size in ranked])


def _allocation_site(frames: list[dict]) -> str:
    for marker in ("unsloth_lite", "transformers", "peft", "torch"):
        for frame in frames:
            if marker in frame["filename"]:
                path = frame["filename"].split("site-packages/")[-1]
                return f"{path}:{frame['line']} {frame['name']}"
    return "?"
