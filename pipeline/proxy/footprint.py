"""``Footprint``: the prefixes a router sent each replica lately, and the blocks they take.

A replica's prefix cache evicts its least recently used blocks once full, so what it
will still hold is, roughly, the prefixes it was sent most recently that fit in it. A
:class:`Footprint` keeps that model per replica: for each *prefix* (the first block
hash of a prompt: every prompt that shares any cached block with another shares its
first one) the blocks of the last prompt of it routed there, most recent last, trimmed
to the replica's capacity when it is known (:meth:`PrefixIndex.capacity`).

The kv-aware policy asks it two things: how many blocks a replica would have to evict,
of prefixes it was sent lately, to take a prompt that misses there (:meth:`overflow`),
and how many blocks the replica's recent prefixes take (:meth:`blocks`), so that a new
prefix goes where the least is. Only the event loop's thread touches a footprint;
nothing here blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = ["Footprint"]

MAX_PREFIXES = 4096
"""The most prefixes remembered per replica (the oldest go first)."""


class Footprint:
    """Recent prefixes per replica and their blocks (see the module).

    Args:
        replicas: The replicas' names (e.g. base URLs).
    """

    def __init__(self, replicas: Sequence[str]) -> None:
        self._prefixes: dict[str, OrderedDict[Hashable, int]] = {r: OrderedDict() for r in replicas}
        self._blocks = dict.fromkeys(replicas, 0)

    def __repr__(self) -> str:
        return f"Footprint({self._blocks})"

    def blocks(self, replica: str) -> int:
        """Blocks the prefixes lately sent to ``replica`` take there."""
        return self._blocks[replica]

    def prefixes(self, replica: str) -> int:
        """How many prefixes ``replica`` was sent lately."""
        return len(self._prefixes[replica])

    def overflow(self, replica: str, key: Hashable, blocks: int, capacity: int | None) -> int:
        """Blocks of other recent prefixes ``replica`` would evict to hold a prompt of
        prefix ``key`` and ``blocks`` blocks: 0 while its ``capacity`` is unknown."""
        if capacity is None:
            return 0
        others = self._blocks[replica] - self._prefixes[replica].get(key, 0)
        return max(0, others + blocks - capacity)

    def routed(self, replica: str, key: Hashable, blocks: int, capacity: int | None) -> None:
        """A prompt of prefix ``key`` and ``blocks`` blocks was sent to ``replica``: it
        becomes the most recent there; the oldest prefixes that no longer fit in
        ``capacity`` (when known) are forgotten, as the replica evicts them."""
        prefixes = self._prefixes[replica]
        self._blocks[replica] += blocks - prefixes.pop(key, 0)
        prefixes[key] = blocks
        limit = capacity if capacity is not None else None
        while len(prefixes) > 1 and (
            len(prefixes) > MAX_PREFIXES or (limit is not None and self._blocks[replica] > limit)
        ):
            _, dropped = prefixes.popitem(last=False)
            self._blocks[replica] -= dropped

    def cleared(self, replica: str) -> None:
        """``replica`` holds nothing any more (restarted, dead, or its events lost)."""
        self._prefixes[replica].clear()
        self._blocks[replica] = 0
