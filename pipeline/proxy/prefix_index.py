"""``PrefixIndex``: which replica holds which KV blocks, as their KV events tell.

A router fed with every replica's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events keeps, per block hash, the set of replicas that hold it (a
bit mask over the replicas' slots). Since a block's hash chains its whole prefix
(:func:`~pipeline.block_hashes.hash_request_tokens`), a replica's cached prefix of a
prompt is the run of the prompt's block hashes it holds from the first one on:
:meth:`PrefixIndex.match` walks the prompt's hashes once, for all replicas at a time.

A router also tells the index what it *expects* a replica to hold: the blocks of a
request it just sent there (:meth:`PrefixIndex.expect`), which the replica announces
only once it has computed them, a prefill later. Until then, or until ``until`` passes,
:meth:`PrefixIndex.match` counts them as held there, so a second request of the same
prefix follows the first instead of being sent blind elsewhere; the replica's own
``BlockStored`` (or ``BlockRemoved``, or a clear) ends the expectation.

The index also knows how many blocks each replica's cache holds once the replica has
evicted one (:meth:`PrefixIndex.capacity`: the most it was credited with at once since
it was last cleared): a cache evicts only when full.

Memory is bounded twice: a replica is credited with at most ``max_blocks_per_replica``
hashes (past it, the further hashes it announces are not indexed and are counted in
:attr:`PrefixIndex.refused`: a real replica's cache is smaller than the bound, so only a
broken or hostile one reaches it, and then it cannot crowd the others out), and past
``max_blocks`` hashes in all the oldest stored are forgotten. Either way the index then
under-estimates a hit, never invents one. Only the event loop's thread touches an
index; nothing here blocks, and a match costs one dict lookup per prompt block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from pipeline.checks import check_int
from pipeline.errors import InvalidConfigError
from pipeline.kv_events.events import ExternalBlockHash

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Block hashes held by each of ``replicas`` (see the module).

    Args:
        replicas: The replicas' names (e.g. base URLs), each given a slot.
        max_blocks: The most distinct hashes kept.
        max_blocks_per_replica: The most hashes one replica is credited with
            (``None``: only ``max_blocks`` bounds them).

    Attributes:
        refused: Per replica, the hashes it announced past ``max_blocks_per_replica``.
        forgotten: Hashes dropped to stay within ``max_blocks``.
        clears: Per replica, how many times :meth:`cleared` was called.
        expected: Per replica, the hashes :meth:`expect` was told of.
        confirmed: Per replica, of those, the ones its events announced in time.

    Raises:
        InvalidConfigError: No replica, a name twice, or a bound below 1.
    """

    def __init__(
        self,
        replicas: Sequence[str],
        max_blocks: int = 1 << 20,
        max_blocks_per_replica: int | None = None,
    ) -> None:
        if not replicas or len(set(replicas)) != len(replicas):
            raise InvalidConfigError("replicas", tuple(replicas), "distinct names, at least one")
        self.max_blocks = check_int("max_blocks", max_blocks, InvalidConfigError, lo=1)
        self.max_blocks_per_replica: int | None = None
        if max_blocks_per_replica is not None:
            self.max_blocks_per_replica = check_int(
                "max_blocks_per_replica", max_blocks_per_replica, InvalidConfigError, lo=1
            )
        self.refused = dict.fromkeys(replicas, 0)
        self.replicas = tuple(replicas)
        self._bit = {name: 1 << slot for slot, name in enumerate(self.replicas)}
        self._held: dict[ExternalBlockHash, int] = {}  # hash -> mask of the replicas holding it
        self._counts = dict.fromkeys(self.replicas, 0)
        self.forgotten = 0
        # expected, not yet announced: hash -> mask, and when each (bit, hash) lapses
        self._pending: dict[ExternalBlockHash, int] = {}
        self._until: dict[tuple[int, ExternalBlockHash], float] = {}
        self._lapses: deque[tuple[float, int, tuple[ExternalBlockHash, ...]]] = deque()
        self._peak = dict.fromkeys(self.replicas, 0)
        self._evicted = dict.fromkeys(self.replicas, False)
        self.clears = dict.fromkeys(self.replicas, 0)
        self.expected = dict.fromkeys(self.replicas, 0)
        self.confirmed = dict.fromkeys(self.replicas, 0)

    def __len__(self) -> int:
        """Distinct hashes held by some replica."""
        return len(self._held)

    def num_blocks(self, replica: str) -> int:
        """How many blocks ``replica`` holds, as far as the index knows."""
        return self._counts[replica]

    def capacity(self, replica: str) -> int | None:
        """How many blocks ``replica``'s cache holds: the most the index credited it
        with at once, once it has evicted a block since it was last cleared (a cache
        evicts only when full); ``None`` before."""
        return self._peak[replica] if self._evicted[replica] else None

    def expect(
        self, replica: str, hashes: Iterable[ExternalBlockHash], until: float, now: float
    ) -> None:
        """``replica`` was sent a request of ``hashes``: count them as held there until
        its events announce them, or until ``until`` (the clock of ``now``) passes."""
        self._lapse(now)
        bit, pending, lapsing = self._bit[replica], self._pending, self._until
        held = self._held
        added = tuple(h for h in hashes if not held.get(h, 0) & bit)
        for block_hash in added:
            if (bit, block_hash) not in lapsing:
                self.expected[replica] += 1
            pending[block_hash] = pending.get(block_hash, 0) | bit
            lapsing[bit, block_hash] = until
        if added:
            self._lapses.append((until, bit, added))
        while len(lapsing) > self.max_blocks:  # bounded like the index: the oldest go
            self._forget_expected(*self._lapses.popleft()[1:])

    def stored(self, replica: str, hashes: Iterable[ExternalBlockHash]) -> None:
        """``replica`` now holds each of ``hashes`` (those past its bound are refused)."""
        bit, held, counts = self._bit[replica], self._held, self._counts
        cap = self.max_blocks_per_replica
        for block_hash in hashes:
            if self._unexpect(bit, block_hash):
                self.confirmed[replica] += 1
            mask = held.get(block_hash, 0)
            if not mask & bit:
                if cap is not None and counts[replica] >= cap:
                    self.refused[replica] += 1
                    continue
                counts[replica] += 1
            held.pop(block_hash, None)  # re-inserted: the newest last
            held[block_hash] = mask | bit
        self._peak[replica] = max(self._peak[replica], counts[replica])
        while len(held) > self.max_blocks:
            self._drop(next(iter(held)))

    def removed(self, replica: str, hashes: Iterable[ExternalBlockHash]) -> None:
        """``replica`` no longer holds ``hashes`` (unknown ones are ignored)."""
        bit, held = self._bit[replica], self._held
        for block_hash in hashes:
            self._unexpect(bit, block_hash)
            mask = held.get(block_hash, 0)
            if mask & bit:
                self._evicted[replica] = True
                self._counts[replica] -= 1
                if mask == bit:
                    del held[block_hash]
                else:
                    held[block_hash] = mask & ~bit

    def cleared(self, replica: str) -> None:
        """``replica`` holds nothing (its ``AllBlocksCleared``, a restart, a gap in its
        events that cannot be replayed, or its death)."""
        bit, held = self._bit[replica], self._held
        self.clears[replica] += 1
        for bit_of, block_hash in [k for k in self._until if k[0] == bit]:
            self._unexpect(bit_of, block_hash)
        self._peak[replica] = 0
        self._evicted[replica] = False
        if not self._counts[replica]:
            return
        for block_hash, mask in list(held.items()):
            if mask & bit:
                if mask == bit:
                    del held[block_hash]
                else:
                    held[block_hash] = mask & ~bit
        self._counts[replica] = 0

    def match(
        self, hashes: Sequence[ExternalBlockHash], now: float | None = None
    ) -> dict[str, int]:
        """For each replica, how many of ``hashes`` it holds from the first one on (its
        cached prefix of the prompt, in blocks); with ``now``, the blocks it is
        expected to hold by then (:meth:`expect`) count too."""
        depth = dict.fromkeys(self.replicas, 0)
        alive = (1 << len(self.replicas)) - 1
        held = self._held
        pending: dict[ExternalBlockHash, int] = {}
        if now is not None:
            self._lapse(now)
            pending = self._pending
        for index, block_hash in enumerate(hashes):
            still = alive & (held.get(block_hash, 0) | pending.get(block_hash, 0))
            if still != alive:
                self._settle(depth, alive & ~still, index)
                alive = still
                if not alive:
                    return depth
        self._settle(depth, alive, len(hashes))
        return depth

    def _settle(self, depth: dict[str, int], mask: int, value: int) -> None:
        for slot, name in enumerate(self.replicas):
            if mask >> slot & 1:
                depth[name] = value

    def _lapse(self, now: float) -> None:
        """Forget the expectations whose time passed."""
        lapses = self._lapses
        while lapses and lapses[0][0] <= now:
            until, bit, hashes = lapses.popleft()
            for block_hash in hashes:
                if self._until.get((bit, block_hash)) == until:  # not renewed since
                    self._unexpect(bit, block_hash)

    def _forget_expected(self, bit: int, hashes: tuple[ExternalBlockHash, ...]) -> None:
        for block_hash in hashes:
            self._unexpect(bit, block_hash)

    def _unexpect(self, bit: int, block_hash: ExternalBlockHash) -> bool:
        """End the expectation of ``block_hash`` on the replica of ``bit``; whether
        there was one."""
        if self._until.pop((bit, block_hash), None) is None:
            return False
        mask = self._pending.get(block_hash, 0) & ~bit
        if mask:
            self._pending[block_hash] = mask
        else:
            self._pending.pop(block_hash, None)
        return True

    def _drop(self, block_hash: ExternalBlockHash) -> None:
        mask = self._held.pop(block_hash)
        self.forgotten += 1
        for slot, name in enumerate(self.replicas):
            if mask >> slot & 1:
                self._counts[name] -= 1
