"""An adapter's first product t = x Aᵀ inside a Gluon product's own launch (`nf4_matvec_gluon`'s word launch), for
one row of x: the protocol of `lora_down`'s first-product programs (`nf4_matvec.FIRST_PRODUCTS_IN_LAUNCH`) in
Gluon. No backward (inference only):

    t[j] = Σ_k x[k] · A[j, k]        (fp32 sums of x's and A's elements widened to fp32)

The launch's first `width` programs write t, a column each: each thread loads its elements of the whole row of A
and of x at once (eight a load, every load in flight together: one round trip, where the Triton programs walk K
in steps and so split it over several programs), sums them, and the program stores t[j] and counts it on the
launch's ready flag (a release at GPU scope after a barrier: every thread's part is in the store). The product's
programs walk their weights meanwhile and await the flag only before their epilogue (a plain acquire load, spun
on), then count themselves as readers on `lora_down`'s grouped counters, the last group's count setting every
counter and the flag back to 0 for the next launch. The writers have the launch's lowest program ids, so they are
scheduled before any program that waits, and wait for nothing of their launch.

PDL: A, which no kernel writes, is loaded before `griddepcontrol.wait`; x after it.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from unsloth_lite.kernels.gluon_sync import _gdc_wait, _thread_barrier
from unsloth_lite.kernels.lora_down import READER_GROUP

_READER_GROUP = gl.constexpr(READER_GROUP)
_COUNTER_STRIDE = gl.constexpr(32)  # int32s: each group's counter on its own 128-byte line, as `lora_down`'s


def row_block(n_in: int) -> int:
    """The elements of x's row a first-product program loads at once: K, rounded up to a power of two."""
    return triton.next_power_of_2(n_in)


@gluon.jit
def _first_product_column(j, x_ptr, a_ptr, t_ptr, flags_ptr, n_in, BLOCK_K: gl.constexpr,
                          NUM_WARPS: gl.constexpr, PDL: gl.constexpr):
    """Column j of t = x Aᵀ (x `[K]`, A `[width, K]` contiguous, both any float dtype) stored at t_ptr[j], then
    counted on `flags_ptr[0]` (released at GPU scope)."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [NUM_WARPS], [0])
    k = gl.arange(0, BLOCK_K, layout=layout)
    inside = k < n_in
    a = gl.load(a_ptr + j.to(gl.int64) * n_in + k, mask=inside, other=0.0).to(gl.float32)
    if PDL:
        _gdc_wait()
    x = gl.load(x_ptr + k, mask=inside, other=0.0).to(gl.float32)
    gl.store(t_ptr + j, gl.sum(x * a, axis=0))
    _thread_barrier()  # every thread's part of the sum in the store before the release
    gl.atomic_add(flags_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _await_first_products(flags_ptr, width):
    """Spin until the launch's first-product programs have written every column of t (`flags_ptr[0]` = width,
    acquired at GPU scope by a plain load: a launch's readers read it together, and read-modify-writes of one
    address would queue them in L2)."""
    ready = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flags_ptr], dtype=gl.int32,
                                      is_pure=False, pack=1)
    while ready < width:
        ready = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flags_ptr],
                                          dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _count_reader(flags_ptr, reader, readers):
    """Count reader `reader` of the launch's `readers` programs that read t, as `lora_down._count_reader`: on its
    group's counter, the group's last on `flags_ptr[1]`; the last group's count sets every counter and the ready
    flag back to 0."""
    group = reader // _READER_GROUP
    groups = (readers + _READER_GROUP - 1) // _READER_GROUP
    in_group = gl.minimum(readers - group * _READER_GROUP, _READER_GROUP)
    group_counter = flags_ptr + (group + 1) * _COUNTER_STRIDE
    done = gl.atomic_add(group_counter, 1, sem="relaxed", scope="gpu")
    if done == in_group - 1:
        gl.atomic_xchg(group_counter, 0, sem="relaxed", scope="gpu")
        groups_done = gl.atomic_add(flags_ptr + 1, 1, sem="relaxed", scope="gpu")
        if groups_done == groups - 1:
            gl.atomic_xchg(flags_ptr, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(flags_ptr + 1, 0, sem="relaxed", scope="gpu")
