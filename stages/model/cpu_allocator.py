"""The C allocator of a CPU engine's process: freed memory kept for the next step.

A CPU forward pass allocates its activations afresh every step (a prefill's are several
megabytes each: ``[tokens, intermediate]`` projections, float32 copies inside the norms).
With glibc's defaults a block that large is either mapped on its own and unmapped when
freed, or freed to the top of a heap that is then trimmed: each step the kernel hands the
pages back zeroed, one page fault per 4 KiB. Measured on a 2-core Xeon (AMX) in bfloat16,
8 prompts of 384 tokens through an 8-layer 512-wide Llama: 7,700 to 26,000 page faults per
prefill and a median prefill of 174 to 194 ms; with the settings below, 9 to 146 faults and
164 to 169 ms. Under ``vllm bench serve`` at saturation (``benchmarks/vs_vllm_serve.py``,
``--kvstep-arg=--no-keep-freed-memory`` for the default allocator): 573 output tokens/s
without, 768 with. vLLM's CPU worker gets the same from preloading tcmalloc.

:func:`keep_freed_memory` raises glibc's thresholds with ``mallopt`` so freed blocks stay
in the process for reuse: blocks up to :data:`MMAP_THRESHOLD` come from the heaps instead
of their own mappings, a heap is trimmed only when :data:`TRIM_THRESHOLD` is free at its
top, and a heap grows :data:`TOP_PAD` at a time. It changes the whole process, which is why
``EngineConfig.keep_freed_memory`` can turn it off (an engine embedded in a process whose
memory must shrink back after bursts). The memory kept is what the engine's largest step
used, and it is used again by the next such step. Other C libraries (musl) are left as they
are: nothing is called, and :func:`keep_freed_memory` says so.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Final

__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "keep_freed_memory"]

#: Blocks below this size come from the heaps (glibc's largest allowed value: half a
#: thread arena's 64 MiB heap).
MMAP_THRESHOLD: Final = 32 << 20
#: A heap is trimmed only when this much is free at its top.
TRIM_THRESHOLD: Final = 1 << 30
#: Extra bytes a heap grows by when it must grow.
TOP_PAD: Final = 32 << 20

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD: Final = -1
_M_TOP_PAD: Final = -2
_M_MMAP_THRESHOLD: Final = -3

_lock = threading.Lock()
_applied: list[bool] = []


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return False


def _apply() -> bool:
    if not _glibc():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)


def keep_freed_memory() -> bool:
    """Set this process's glibc ``malloc`` to keep freed memory (the thresholds above);
    once per process, whoever calls it first (later calls return the first answer).

    Returns:
        Whether the settings are in effect: ``False`` on a C library that is not glibc,
        or if glibc refused one of them.

    Thread-safe. Call it before the engine's first large allocations; blocks already
    mapped on their own are unaffected until freed.
    """
    with _lock:
        if not _applied:
            _applied.append(_apply())
        return _applied[0]
