"""Two costs of Triton's interpreter (`TRITON_INTERPRET=1`: the kernels on CPU tensors) that do no work, and one
way its results differ from compiled kernels', removed where the interpreter has the shape this was written
against (triton 3.6 to 3.9); elsewhere nothing changes.

* A launch swaps `triton.language`'s builtins for interpreted ones (walking the modules' members), runs the
  grid, and swaps them back. Every call of a `@triton.jit` device function inside the grid walks and swaps
  them all again, though the launch's swap is still in place: for kernels built of small device functions
  that is a quarter of a CPU run. Here a device call skips the swap when the launch in progress has already
  swapped the language modules that the function sees.
* The numpy dtype of a Triton dtype is looked up by rebuilding a table on every call (each interpreted op
  calls it); here it is cached per Triton dtype, keyed by the dtype's name (its identity).
* A cast from fp32 to bf16 (`x.to(tl.bfloat16)`) drops the low 16 bits (rounds toward zero), where compiled
  code rounds to nearest even, as torch does: a bf16 output had twice the rounding error on the CPU that it has
  on a GPU (a Qwen3.5 RMSNorm's 3.2e-3 against 1.7e-3). Here it rounds to nearest even.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import triton.language as tl


def speed_up_interpreter() -> bool:
    """Applies both (once); False where the interpreter's internals differ from the expected ones."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    needed = ("GridExecutor", "_patch_lang", "_get_np_dtype", "InterpretedFunction", "InterpreterBuilder",
              "TensorHandle")
    if not all(hasattr(interpreter, name) for name in needed):
        return False
    launch = interpreter.GridExecutor.__call__
    if getattr(launch, "_unsloth_lite", False):
        return True
    _skip_repeated_swaps(interpreter, launch)
    _cache_numpy_dtypes(interpreter)
    _round_bf16_casts_to_nearest(interpreter)
    return True


def bf16_bits_rounded_to_nearest(values: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of fp32 `values` rounded to nearest, ties to even, as `torch.bfloat16` and
    compiled kernels round; NaN stays NaN, a value past bf16's largest rounds to infinity."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    rounded = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if np.any(nan):
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _round_bf16_casts_to_nearest(interpreter) -> None:
    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = bf16_bits_rounded_to_nearest(np.asarray(src.data))
            return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _cache_numpy_dtypes(interpreter) -> None:
    lookup = interpreter._get_np_dtype
    found: dict[str, object] = {}

    def numpy_dtype(tt_dtype):
        name = getattr(tt_dtype, "name", None)  # a dtype's identity (block types: shape and element type)
        if not isinstance(name, str):
            return lookup(tt_dtype)
        if name not in found:
            found[name] = lookup(tt_dtype)
        return found[name]

    interpreter._get_np_dtype = numpy_dtype


def _skip_repeated_swaps(interpreter, launch) -> None:
    swap = interpreter._patch_lang
    swapped: list[set[int]] = []  # per launch in progress: the language modules its swaps cover

    @functools.cache
    def languages_of(fn) -> frozenset[int]:  # a function's module globals: looked up once, not at every call
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        languages = languages_of(fn)
        if swapped and languages <= swapped[-1]:
            return None  # a device function's call: its launch swapped these modules already
        if swapped:
            swapped[-1].update(languages)
        return swap(fn)

    @functools.wraps(launch)
    def run_grid(self, *args, **kwargs):
        swapped.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            swapped.pop()

    run_grid._unsloth_lite = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run_grid
