"""The CPU trainer's heap: large tensors mapped and unmapped, so freed activations leave the process.

Measured on SmolLM2-135M (30 layers, one 4029-token DPO row of 94 sides, glibc 2.36): one training
forward left autograd holding 491 MiB, yet RSS rose from 1.3 to 6.6 GB and to 7.2 GB in backward;
``mallinfo2`` showed 535 MiB in use and 4.4 GB *free* inside the heap, and ``malloc_trim`` gave it
back at once (RSS 1.47 GB). The cause is glibc's dynamic mmap threshold: the first freed mapped
block raises it (up to 32 MiB), so from then on every activation (4029 x 1536 fp32 = 24.7 MB for
each MLP buffer) is carved out of the brk heap; the long-lived pieces a checkpointed forward keeps
per layer (the layer's input, graph nodes, small tensors) split the freed space, the next layer's
buffers no longer fit in it, and the heap grows by 100-170 MB per layer: RSS that grows with the
row's length times the depth, not with what is live. A DPO row holds both sides of its pairs (up
to ``2 * max_seq_len`` tokens), so it reached the job's 8 GB limit first; a supervised 2025-token
row grew the same way to 5.1 GB.

A fixed ``M_MMAP_THRESHOLD`` turns the dynamic threshold off: blocks of at least that size are
their own mappings, returned to the kernel when the tensor dies, so RSS follows the live tensors
(the same row: 1.7 GB). Smaller blocks stay on the heap, whose fragments are then small too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger("trainer")

MMAP_THRESHOLD = 1 << 20
"""Blocks of at least this many bytes are mapped on their own (glibc's M_MMAP_THRESHOLD, fixed)."""

_M_MMAP_THRESHOLD = -3  # malloc.h
_state: dict[str, bool] = {}


def map_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process, once; return whether it is set.

    False (and nothing changed) where the C library is not glibc: other allocators have no such
    knob, or their own (a ``MALLOC_MMAP_THRESHOLD_`` in the environment also still wins at start)."""
    if "set" in _state:
        return _state["set"]
    done = False
    if platform.libc_ver()[0] == "glibc":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            done = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
        except (OSError, AttributeError):
            done = False
    _state["set"] = done
    log.info("heap: blocks of >= %d bytes mapped on their own: %s", threshold, "yes" if done else "no (not glibc)")
    return done
