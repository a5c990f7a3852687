"""What the decoding kernels keep beside a weight's own tensors: the flat fp32 absmax of each double-quantised
weight (`nf4_matvec.FLAT_ABSMAX`: one value a quantisation block, dequantised from the nested form once and kept
while the weight's absmax is unchanged) and the word kernel's code-book tables, one row per lane of a warp.
"""

from __future__ import annotations

import weakref

import torch

from unsloth_lite.kernels.dequantize_nf4 import block_absmax
from unsloth_lite.kernels.nf4_codes import word_lookup_tables

_FLAT_ABSMAX: dict = {}  # id(absmax tensor) -> (weak reference to it, versions it was computed at, fp32 absmax)


def flat_absmax(quant_state) -> torch.Tensor | None:
    """The fp32 absmax of every quantisation block of a double-quantised weight (`block_absmax`), computed on
    first use and kept; computed again, into the same tensor, once the quant state's absmax tensors change (their
    version counters), so that a captured CUDA graph reading it stays valid. None where it is missing or stale
    while a CUDA graph is being captured (a tensor computed inside a capture holds nothing until a replay)."""
    absmax = quant_state.absmax
    key = id(absmax)
    versions = (absmax._version, quant_state.state2.absmax._version)
    kept = _FLAT_ABSMAX.get(key)
    if kept is not None and kept[0]() is not absmax:
        kept = None
    if kept is not None and kept[1] == versions:
        return kept[2]
    if absmax.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if kept is not None:
        kept[2].copy_(block_absmax(quant_state))
        _FLAT_ABSMAX[key] = (kept[0], versions, kept[2])
        return kept[2]
    weakref.finalize(absmax, _FLAT_ABSMAX.pop, key, None)
    flat = block_absmax(quant_state)
    _FLAT_ABSMAX[key] = (weakref.ref(absmax), versions, flat)
    return flat


def release_flat_absmax(quant_states) -> None:
    """Frees the kept fp32 absmax of each of `quant_states` (computed again where needed). A CUDA graph captured
    over them must go first: it reads them by address."""
    for quant_state in quant_states:
        _FLAT_ABSMAX.pop(id(quant_state.absmax), None)


_LANE_TABLES: dict = {}


def lane_tables(device: torch.device, bf16_codes: bool) -> torch.Tensor | None:
    """int32 `[32, 8]`: `word_lookup_tables` (zero-padded to 8) once for each lane of a warp, the word kernel's
    code-book registers. Each lane loads its own row, so the compiler keeps them in ordinary registers for the
    whole loop (a value every lane shares it keeps in a uniform register and copies out before each lookup: one
    more instruction a lookup in the SASS). None where they are missing while a CUDA graph is being captured
    (copied from the host, they cannot be made then)."""
    key = (device, bf16_codes)
    if key not in _LANE_TABLES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        row = word_lookup_tables(bf16_codes)
        _LANE_TABLES[key] = torch.tensor([row + [0] * (8 - len(row))] * 32, dtype=torch.int32, device=device)
    return _LANE_TABLES[key]
