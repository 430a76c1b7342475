"""Device synchronisation behind one small interface: CUDA streams/events, or no-ops.

The forward pass computes on the *compute* stream; a connector copies KV on the *load*
and *save* streams and orders them against compute with events, layer by layer::

    sync = make_device_sync(kv.device)
    ready = sync.record_event(layer)       # on the current (compute) stream
    with sync.save_stream():
        sync.wait_event(ready)             # save stream waits for layer's K/V
        host.copy_(kv, non_blocking=True)

On CPU every call is a no-op (torch's generic ``torch.Stream``/``torch.Event`` raise on
CPU rather than doing nothing), so the same connector code runs everywhere and CPU
connectors order their I/O with threads instead. The implementation is chosen once per
device by :func:`make_device_sync`; importing this module never touches CUDA.

It is a layer of its own below both the connectors and the stages (the ``layers``
contract in ``pyproject.toml``) and imports nothing of kvstep, so connectors and the
forward pass share it without importing each other.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Hashable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CpuDeviceSync", "CudaDeviceSync", "DeviceEvent", "DeviceSync", "make_device_sync"]


@runtime_checkable
class DeviceEvent(Protocol):
    """A point in a stream's work that other streams or the host can wait for."""

    def synchronize(self) -> None:
        """Block the calling thread until the work before the event is done."""
        ...

    def query(self) -> bool:
        """Whether the work before the event is done (never blocks)."""
        ...


@runtime_checkable
class DeviceSync(Protocol):
    """Streams and events of one device.

    Every method is thread-safe and returns without waiting for device work, except
    :meth:`synchronize` and ``DeviceEvent.synchronize``, which block the calling thread.
    """

    device: torch.device

    def compute_stream(self) -> contextlib.AbstractContextManager[None]:
        """Make the compute stream current inside the block."""
        ...

    def load_stream(self) -> contextlib.AbstractContextManager[None]:
        """Make the KV-load stream current inside the block."""
        ...

    def save_stream(self) -> contextlib.AbstractContextManager[None]:
        """Make the KV-save stream current inside the block."""
        ...

    def record_event(self, key: Hashable) -> DeviceEvent:
        """Record an event on the current stream; ``key`` (a layer index or name) labels it."""
        ...

    def wait_event(self, event: DeviceEvent) -> None:
        """Make the current stream wait for ``event`` (the host does not wait)."""
        ...

    def synchronize(self) -> None:
        """Block until all work queued on the device is done."""
        ...


class _DoneEvent:
    """The CPU event: work on CPU is done when it is queued."""

    __slots__ = ("key",)

    def __init__(self, key: Hashable) -> None:
        self.key = key

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuDeviceSync:
    """No-op streams and always-complete events for CPU tensors."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def compute_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def load_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def save_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record_event(self, key: Hashable) -> DeviceEvent:
        return _DoneEvent(key)

    def wait_event(self, event: DeviceEvent) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CudaDeviceSync:
    """CUDA streams (compute = the device's current stream at creation) and events.

    The compute stream is the stream current when the object is built (normally the
    default stream), so tensors the runner creates need no extra ordering; load and save
    get their own streams.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._compute = torch.cuda.current_stream(device)
        self._load = torch.cuda.Stream(device)
        self._save = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def _use(self, stream: Any) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield

    def compute_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._use(self._compute)

    def load_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._use(self._load)

    def save_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._use(self._save)

    def record_event(self, key: Hashable) -> DeviceEvent:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        result: DeviceEvent = event
        return result

    def wait_event(self, event: DeviceEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


_lock = threading.Lock()


@functools.cache
def _cached(device: torch.device) -> DeviceSync:
    if device.type == "cuda":
        return CudaDeviceSync(device)
    return CpuDeviceSync(device)


def make_device_sync(device: torch.device | str) -> DeviceSync:
    """The device-sync object of ``device``, created once per device and then shared.

    All callers on one device get the same object, hence the same load/save streams.
    Thread-safe.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        return _cached(dev)
