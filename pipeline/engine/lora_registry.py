"""The engine's LoRA adapters: each :class:`~pipeline.lora.LoRARequest` read and checked
once, then known by its id.

As in vLLM an id means one adapter: a request naming a known id with another name or
path is refused, as is a second id under a known name (a name is what a server serves
the adapter as). Reading is blocking (:func:`~stages.model.lora_files.resolve_adapter`):
:meth:`LoRARegistry.resolve` runs off the event loop, :meth:`LoRARegistry.get` is a
dictionary lookup. Thread-safe.
"""

from __future__ import annotations

import threading
from pathlib import Path

from pipeline.errors import InvalidRequestError
from pipeline.lora import LoRAAdapter, LoRARequest
from stages.model.config import ModelConfig
from stages.model.lora_files import resolve_adapter

__all__ = ["LoRARegistry"]


class LoRARegistry:
    """The adapters an engine has read, by id.

    Args:
        config: The base model's configuration.
        enabled: ``EngineConfig.enable_lora``; when off every adapter is refused.
        max_rank: ``EngineConfig.max_lora_rank``.
    """

    def __init__(self, config: ModelConfig, *, enabled: bool, max_rank: int) -> None:
        self._config = config
        self.enabled = enabled
        self._max_rank = max_rank
        self._by_id: dict[int, LoRAAdapter] = {}
        self._lock = threading.Lock()

    def _check(self, request: LoRARequest) -> LoRAAdapter | None:
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(
                "lora_request", type(request).__name__, "must be a LoRARequest"
            )
        if not self.enabled:
            raise InvalidRequestError(
                "lora_request", request.lora_name, "this engine was started without enable_lora"
            )
        known = self._by_id.get(request.lora_int_id)
        path = str(Path(request.lora_path).resolve())
        if known is not None and (known.name, known.path) != (request.lora_name, path):
            raise InvalidRequestError(
                "lora_int_id",
                request.lora_int_id,
                f"is adapter {known.name!r} already; an id names one adapter",
            )
        for other in self._by_id.values():
            if other.name == request.lora_name and other.int_id != request.lora_int_id:
                raise InvalidRequestError(
                    "lora_name", request.lora_name, f"is adapter id {other.int_id} already"
                )
        return known

    def get(self, request: LoRARequest) -> LoRAAdapter | None:
        """``request``'s adapter when it was read already, else ``None``.

        Raises:
            InvalidRequestError: LoRA is off, or ``request`` contradicts a known adapter.
        """
        with self._lock:
            return self._check(request)

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """``request``'s adapter, read and checked now if it is new. Blocks (file reads).

        Raises:
            InvalidRequestError: As :meth:`get`, or the adapter directory is bad.
        """
        known = self.get(request)
        if known is not None:
            return known
        adapter = resolve_adapter(request, self._config, max_rank=self._max_rank)
        with self._lock:
            known = self._check(request)  # another thread may have added it meanwhile
            if known is not None:
                return known
            self._by_id[adapter.int_id] = adapter
        return adapter

    def holds(self, adapter: LoRAAdapter) -> bool:
        """Whether ``adapter`` is one this registry resolved (and still knows)."""
        with self._lock:
            return self._by_id.get(getattr(adapter, "int_id", None)) == adapter  # type: ignore[arg-type]

    def remove(self, name: str) -> LoRAAdapter | None:
        """Forget the adapter named ``name`` (running requests keep it); the adapter, or
        ``None`` when none has that name."""
        with self._lock:
            for int_id, adapter in self._by_id.items():
                if adapter.name == name:
                    del self._by_id[int_id]
                    return adapter
        return None

    def adapters(self) -> list[LoRAAdapter]:
        """The known adapters, in the order they were added."""
        with self._lock:
            return list(self._by_id.values())
