"""Back host KV caches with transparent huge pages before NIXL registers them.

On host memory, UCX's READ between two processes is the kernel's ``process_vm_readv``
(the ``cma`` transport), which pins the peer's pages one 4 KiB page at a time before it
copies them; over 2 MiB pages the same copy runs about 1.5x faster. So
:class:`~connectors.nixl.agent.KVAgent` asks Linux (``madvise``) to back the 2 MiB-aligned
inside of each host cache tensor with huge pages: ``MADV_HUGEPAGE``, then
``MADV_COLLAPSE`` (Linux 6.1+), which moves the pages already touched into huge pages
now, costing about one copy of the cache once. The tensors keep their addresses and
contents. Where the kernel refuses (not Linux, an older kernel, THP ``never``, no free huge
pages), the cache stays on small pages: it is only slower, never wrong.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["HUGE_PAGE", "back_with_huge_pages"]

HUGE_PAGE = 2 << 20
"""The x86-64 / arm64 (4 KiB base page) transparent huge page size."""
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    madvise: Callable[[int, int, int], int] = fn
    return madvise


def back_with_huge_pages(tensors: Sequence[torch.Tensor]) -> int:
    """Ask the kernel to back the 2 MiB-aligned inside of each CPU tensor with huge pages.

    Tensors on another device, and the ragged head and tail of each tensor, are left as
    they are. Blocks the calling thread for about one copy of the bytes collapsed; never
    raises for a refusal. Not cancellation-safe (it is plain synchronous code).

    Returns:
        The bytes the kernel collapsed into huge pages (0 where it refused).
    """
    madvise = _madvise()
    if madvise is None:
        return 0
    done = 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        addr = t.data_ptr()
        start = -(-addr // HUGE_PAGE) * HUGE_PAGE
        end = (addr + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        madvise(start, end - start, _MADV_HUGEPAGE)  # later faults, khugepaged
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
    return done
