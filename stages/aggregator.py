"""The fan-in aggregator: merges one step's ``WorkerOutput`` of every rank.

Merging is associative and order-free: sampled tokens (a sequence per request), their
logprobs (one per token) and prompt logprobs come from the driver rank (0), load-error
block ids (and their causes, per cause), failed saves and per-request errors are
unioned (a save that failed on any rank failed: its blocks are not announced), save-side
calls that raised are summed per cause, stats are merged (bytes summed, tokens counted
once: every rank moves the same tokens). A request's ``finished_sending`` /
``finished_recving`` is released to the scheduler only once **every** rank has reported
it, possibly in different steps. Unlike vLLM's ``KVOutputAggregator``, which counts
occurrences, the aggregator keeps the *set* of ranks per request, so a rank reporting
twice counts once and can never stand in for a rank that is silent.

Each pending entry has a **lease**, started by the first rank's report: ``lease_steps``
engine steps and/or ``lease_s`` seconds. An entry still incomplete when its lease runs
out is released as *expired* (``FanInOutput.expired_sending`` / ``expired_recving``,
with the silent ranks in ``missing_ranks``) and logged as a warning, so a rank that never
reports becomes an explicit failure of that request instead of a request stuck forever.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Literal

import attrs

from pipeline.artifacts import FanInOutput, KVStats, LoadFailures, SaveFailures, WorkerOutput
from pipeline.checks import check_int
from pipeline.errors import InvalidConfigError, StageError
from pipeline.logger import get_logger

__all__ = ["FanInAggregator", "TransferKind"]

_log = get_logger()

TransferKind = Literal["sending", "recving"]
_KINDS: tuple[TransferKind, TransferKind] = ("sending", "recving")


@attrs.define(slots=True)
class _Entry:
    """Ranks that reported one request's transfer, and when the first of them did."""

    ranks: set[int]
    step: int
    time: float


class FanInAggregator:
    """Tracks, per request and direction, the set of ranks that reported it finished.

    Owned by the engine's event loop: not thread-safe; no method blocks or awaits, so
    there is no cancellation point inside a call.

    Args:
        world_size: Number of ranks; a transfer is released once this many distinct
            ranks reported it.
        lease_steps: Engine steps an entry may wait after its first report, or ``None``.
            With ``lease_steps=k`` the other ranks may report up to step ``first + k``;
            at the merge of that step the entry expires if still incomplete.
        lease_s: Seconds an entry may wait after its first report, or ``None``. The
            engine uses seconds only (``EngineConfig.transfer_lease_s``): while it waits
            for transfers it runs no-forward steps back to back, so a step count says
            nothing about how long a network transfer has had.

    Raises:
        InvalidConfigError: ``world_size`` or ``lease_steps`` is not a positive integer,
            ``lease_s`` is not a positive number, or both leases are ``None``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        lease_steps: int | None = None,
        lease_s: float | None = 60.0,
    ) -> None:
        check_int("world_size", world_size, InvalidConfigError, lo=1)
        check_int("lease_steps", lease_steps, InvalidConfigError, lo=1, optional=True)
        if lease_s is not None and (
            not isinstance(lease_s, int | float) or isinstance(lease_s, bool) or not lease_s > 0
        ):
            raise InvalidConfigError("lease_s", lease_s, "must be a number > 0 or None")
        if lease_steps is None and lease_s is None:
            raise InvalidConfigError(
                "lease", None, "set lease_steps and/or lease_s (math.inf for no time limit)"
            )
        self.world_size = world_size
        self.lease_steps = lease_steps
        self.lease_s = lease_s
        self._tables: dict[TransferKind, dict[str, _Entry]] = {k: {} for k in _KINDS}
        self._ready: dict[TransferKind, set[str]] = {k: set() for k in _KINDS}
        # Aborted requests: late ``finished_recving`` reports are dropped for one lease.
        self._forgotten: dict[str, _Entry] = {}
        self._step = 0

    # ---------------------------------------------------------------- merging

    def merge(
        self, step_id: int, outputs: Iterable[WorkerOutput], *, now: float | None = None
    ) -> FanInOutput:
        """Merge one step's outputs (at most one per rank, any order) and release.

        Called once per successful step by ``fan_in``. Records every rank's finished
        transfers, releases the entries that all ranks have now reported (this step or
        earlier), then expires the incomplete entries whose lease has run out.

        Args:
            step_id: The engine step; drives ``lease_steps``.
            outputs: The ranks' ``WorkerOutput`` of this step.
            now: The current ``time.monotonic()``; drives ``lease_s`` (tests pass it).

        Raises:
            StageError: An output's rank is outside ``[0, world_size)``.
        """
        now = time.monotonic() if now is None else now
        self._step = step_id
        sampled: dict[str, tuple[int, ...]] = {}
        driver: WorkerOutput | None = None
        invalid: set[int] = set()
        failed_saves: set[str] = set()
        errors: dict[str, tuple[int, str]] = {}
        stats = KVStats()
        failures = LoadFailures()
        save_failures = SaveFailures()
        count = 0
        for out in outputs:
            self._check_rank(step_id, out.rank)
            count += 1
            if out.rank == 0:
                sampled.update(out.sampled_token_ids)
                driver = out
            invalid |= out.invalid_block_ids
            failed_saves |= out.failed_save_req_ids
            for req_id, reason in out.request_errors.items():
                if req_id not in errors or out.rank < errors[req_id][0]:
                    errors[req_id] = (out.rank, reason)
            stats = stats.merge(out.stats)
            failures = failures.merge(out.load_failures)
            save_failures = save_failures.merge(out.save_failures)
            self._absorb(out, step_id, now)
        finished = {kind: self._release_ready(kind) for kind in _KINDS}
        missing: dict[str, tuple[int, ...]] = {}
        expired = {kind: self._expire(kind, step_id, now, missing) for kind in _KINDS}
        self._purge_forgotten(step_id, now)
        return FanInOutput(
            step_id=step_id,
            sampled_token_ids=sampled,
            finished_sending=finished["sending"],
            finished_recving=finished["recving"],
            expired_sending=expired["sending"],
            expired_recving=expired["recving"],
            missing_ranks=missing,
            invalid_block_ids=frozenset(invalid),
            failed_save_req_ids=frozenset(failed_saves),
            request_errors={req_id: reason for req_id, (_, reason) in errors.items()},
            stats=stats,
            load_failures=failures,
            save_failures=save_failures,
            num_ranks=count,
            logprobs={} if driver is None else dict(driver.logprobs),
            prompt_logprobs={} if driver is None else dict(driver.prompt_logprobs),
        )

    def record(
        self, step_id: int, outputs: Iterable[WorkerOutput], *, now: float | None = None
    ) -> None:
        """Record only the finished transfers of a step that failed; release nothing.

        Called by the engine's ``fail_step`` finalizer when ``execute`` failed. The
        ranks that did answer have handed over their reports, which their connectors
        will not repeat; the entries they complete are released by the next ``merge``.
        Tokens, load errors and stats of a failed step are not kept (its requests fail).

        Raises:
            StageError: An output's rank is outside ``[0, world_size)``.
        """
        now = time.monotonic() if now is None else now
        self._step = step_id
        for out in outputs:
            self._check_rank(step_id, out.rank)
            self._absorb(out, step_id, now)

    def forget(self, req_ids: Iterable[str], *, now: float | None = None) -> None:
        """Drop the pending entries of requests that were aborted or failed.

        The ranks they had reported no longer count. For one lease, later
        ``finished_recving`` reports of these ids are dropped (the load belongs to a
        request that is gone); later ``finished_sending`` reports count afresh, since a
        finished request may still hold blocks until its KV is sent. Unknown ids are
        ignored.
        """
        now = time.monotonic() if now is None else now
        for req_id in req_ids:
            for kind in _KINDS:
                self._tables[kind].pop(req_id, None)
                self._ready[kind].discard(req_id)
            self._forgotten[req_id] = _Entry(set(), self._step, now)

    # ------------------------------------------------------------ introspection

    @property
    def num_pending(self) -> int:
        """Entries reported by some ranks and not released yet (0 when drained)."""
        return sum(len(table) for table in self._tables.values())

    def pending_ranks(self, kind: TransferKind, req_id: str) -> frozenset[int] | None:
        """The ranks that reported ``req_id``'s pending ``kind`` transfer, or ``None``."""
        entry = self._tables[kind].get(req_id)
        return None if entry is None else frozenset(entry.ranks)

    # ---------------------------------------------------------------- internals

    def _check_rank(self, step_id: int, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise StageError(
                "fan_in",
                step_id,
                f"WorkerOutput of rank {rank!r}: rank must be in [0, {self.world_size})",
            )

    def _absorb(self, out: WorkerOutput, step_id: int, now: float) -> None:
        reports: tuple[tuple[TransferKind, frozenset[str]], ...] = (
            ("sending", out.finished_sending),
            ("recving", out.finished_recving),
        )
        for kind, req_ids in reports:
            table = self._tables[kind]
            for req_id in req_ids:
                if kind == "recving" and req_id in self._forgotten:
                    _log.debug("finished_recving of a forgotten request dropped", req_id=req_id)
                    continue
                entry = table.get(req_id)
                if entry is None:
                    entry = table[req_id] = _Entry(set(), step_id, now)
                entry.ranks.add(out.rank)
                if len(entry.ranks) == self.world_size:
                    self._ready[kind].add(req_id)

    def _release_ready(self, kind: TransferKind) -> frozenset[str]:
        ready, table = self._ready[kind], self._tables[kind]
        for req_id in ready:
            del table[req_id]
        released = frozenset(ready)
        ready.clear()
        return released

    def _lease_over(self, entry: _Entry, step_id: int, now: float) -> bool:
        over_steps = self.lease_steps is not None and step_id - entry.step >= self.lease_steps
        over_time = self.lease_s is not None and now - entry.time >= self.lease_s
        return over_steps or over_time

    def _expire(
        self, kind: TransferKind, step_id: int, now: float, missing: dict[str, tuple[int, ...]]
    ) -> frozenset[str]:
        table = self._tables[kind]
        expired = [req_id for req_id, e in table.items() if self._lease_over(e, step_id, now)]
        for req_id in expired:
            entry = table.pop(req_id)
            silent = tuple(r for r in range(self.world_size) if r not in entry.ranks)
            missing[req_id] = tuple(sorted(set(missing.get(req_id, ())) | set(silent)))
            _log.warning(
                "fan-in lease expired",
                req_id=req_id,
                transfer=kind,
                missing_ranks=list(silent),
                reported_ranks=sorted(entry.ranks),
                waited_steps=step_id - entry.step,
                waited_s=round(now - entry.time, 3),
                lease_steps=self.lease_steps,
                lease_s=None if self.lease_s is None or math.isinf(self.lease_s) else self.lease_s,
            )
        return frozenset(expired)

    def _purge_forgotten(self, step_id: int, now: float) -> None:
        over = [r for r, e in self._forgotten.items() if self._lease_over(e, step_id, now)]
        for req_id in over:
            del self._forgotten[req_id]
