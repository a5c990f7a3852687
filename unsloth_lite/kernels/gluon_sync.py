"""Synchronisation the Gluon launches share: programmatic dependent launch's two instructions (Hopper and later)
and a CTA's barrier under both triton versions the library runs on."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# A CTA's barrier: `thread_barrier` in triton 3.6, `barrier` since.
_thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _gdc_wait():
    """Wait until the launch before has finished and its writes are visible (`griddepcontrol.wait`)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    """Let the launch after start (`griddepcontrol.launch_dependents`)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
