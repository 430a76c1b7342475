"""``MultiMetadata``: one step's metadata of every tier, plus the blocks each tier loads.

In process it carries the tiers' metadata objects as built. On the wire
(:meth:`MultiMetadata.to_bytes`) each tier's metadata is its own ``to_bytes()`` tagged
with its class name; :meth:`MultiMetadata.from_bytes` resolves that name among modules
already imported (the worker built its tiers, so their modules are loaded) and never
imports anything or unpickles.
"""

from __future__ import annotations

import sys

import attrs
import msgspec

from connectors.base import KVConnectorMetadata
from pipeline.errors import FrameError

__all__ = ["MultiMetadata"]


class _Wire(msgspec.Struct, frozen=True):
    step_id: int
    tiers: tuple[tuple[str, bytes] | None, ...]
    load_block_ids: tuple[tuple[int, ...], ...]


def _type_name(meta: KVConnectorMetadata) -> str:
    cls = type(meta)
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type[KVConnectorMetadata]:
    module_name, _, qualname = name.partition(":")
    found: object = sys.modules.get(module_name)
    for part in qualname.split(".") if found is not None else ():
        found = getattr(found, part, None)
    if not (isinstance(found, type) and issubclass(found, KVConnectorMetadata)):
        raise FrameError(
            "multi tier metadata type", "a KVConnectorMetadata class already imported", name
        )
    return found


@attrs.frozen(kw_only=True)
class MultiMetadata(KVConnectorMetadata):
    """The metadata of every tier for one step.

    Attributes:
        step_id: The step it was built for.
        tiers: Each tier's metadata, in tier order; ``None`` where the tier's
            ``build_connector_meta`` raised (its loads are then reported as failed).
        load_block_ids: Per tier, the paged-cache blocks it loads this step (what the
            worker reports as load errors when that tier fails).
    """

    step_id: int
    tiers: tuple[KVConnectorMetadata | None, ...]
    load_block_ids: tuple[tuple[int, ...], ...]

    def __attrs_post_init__(self) -> None:
        if len(self.tiers) != len(self.load_block_ids):  # built by MultiScheduler only
            raise AssertionError("MultiMetadata: one load_block_ids entry per tier")

    def to_bytes(self) -> bytes:
        """msgpack of the step id, each tier's ``(class name, to_bytes())`` and the loads."""
        tiers = tuple(None if m is None else (_type_name(m), m.to_bytes()) for m in self.tiers)
        return msgspec.msgpack.encode(_Wire(self.step_id, tiers, self.load_block_ids))

    @classmethod
    def from_bytes(cls, data: bytes) -> MultiMetadata:
        """Decode :meth:`to_bytes`.

        Raises:
            msgspec.DecodeError: Malformed bytes.
            FrameError: A tier's class is not an imported ``KVConnectorMetadata``.
        """
        wire = msgspec.msgpack.decode(data, type=_Wire)
        tiers = tuple(
            None if item is None else _resolve(item[0]).from_bytes(item[1]) for item in wire.tiers
        )
        return cls(step_id=wire.step_id, tiers=tiers, load_block_ids=wire.load_block_ids)
