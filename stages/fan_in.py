"""``fan_in``: await every rank's ``WorkerOutput`` with a deadline and merge them.

Merging is associative and order-free: sampled tokens come from the driver rank (0),
load-error block ids and failed saves are unioned, stats are summed. A request's
``finished_sending`` / ``finished_recving`` is released to the scheduler only once every
rank has reported it, possibly in different steps: the aggregator keeps the *set* of
ranks per request, so a rank reporting twice counts once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import anyio
import attrs

from pipeline.artifacts import FanInOutput, KVStats, PendingWorkerOutputs, WorkerOutput
from pipeline.context import StepContext
from pipeline.errors import WorkerFailedError
from pipeline.logs import get_logger

__all__ = ["FanInAggregator", "FanInStage"]

_log = get_logger()


class FanInAggregator:
    """Tracks, per request, which ranks reported its transfer finished.

    Not thread-safe; owned by the engine's event loop.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: dict[str, set[int]] = {}
        self._recving: dict[str, set[int]] = {}

    def merge(self, step_id: int, outputs: Iterable[WorkerOutput]) -> FanInOutput:
        """Merge one step's outputs (one per rank, any order)."""
        sampled: dict[str, int] = {}
        invalid: set[int] = set()
        failed_saves: set[str] = set()
        stats = KVStats()
        released_sending: set[str] = set()
        released_recving: set[str] = set()
        count = 0
        for out in outputs:
            count += 1
            if out.rank == 0:
                sampled = dict(out.sampled_token_ids)
            invalid |= out.invalid_block_ids
            failed_saves |= out.failed_save_req_ids
            stats = stats + out.stats
            released_sending |= self._record(self._sending, out.finished_sending, out.rank)
            released_recving |= self._record(self._recving, out.finished_recving, out.rank)
        return FanInOutput(
            step_id=step_id,
            sampled_token_ids=sampled,
            finished_sending=frozenset(released_sending),
            finished_recving=frozenset(released_recving),
            invalid_block_ids=frozenset(invalid),
            failed_save_req_ids=frozenset(failed_saves),
            stats=stats,
            num_ranks=count,
        )

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop pending entries of aborted or failed requests."""
        for req_id in req_ids:
            self._sending.pop(req_id, None)
            self._recving.pop(req_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._sending) + len(self._recving)

    def _record(self, table: dict[str, set[int]], req_ids: Iterable[str], rank: int) -> set[str]:
        released: set[str] = set()
        for req_id in req_ids:
            ranks = table.setdefault(req_id, set())
            ranks.add(rank)
            if len(ranks) >= self.world_size:
                del table[req_id]
                released.add(req_id)
        return released


@attrs.frozen
class FanInStage:
    """Awaits all ranks concurrently under ``timeout_s``; a failing rank fails the step.

    Each rank's worker graph runs its own finalizers whether or not another rank fails:
    when one raises, the task group cancels the others, whose ``clear`` still runs.
    """

    name: ClassVar[str] = "fan_in"
    requires: ClassVar[tuple[type, ...]] = (PendingWorkerOutputs,)
    provides: ClassVar[type] = FanInOutput

    aggregator: FanInAggregator
    timeout_s: float = 300.0

    async def run(self, ctx: StepContext) -> FanInOutput:
        pending = ctx.get(PendingWorkerOutputs)
        results: list[WorkerOutput | None] = [None] * len(pending.waiters)

        async def collect(rank: int) -> None:
            try:
                results[rank] = await pending.waiters[rank]()
            except (anyio.get_cancelled_exc_class(), WorkerFailedError):
                raise
            except Exception as exc:
                raise WorkerFailedError(rank, pending.step_id, repr(exc)) from exc

        try:
            with anyio.fail_after(self.timeout_s):
                async with anyio.create_task_group() as tg:
                    for rank in range(len(pending.waiters)):
                        tg.start_soon(collect, rank)
        except TimeoutError:
            missing = [rank for rank, out in enumerate(results) if out is None]
            raise WorkerFailedError(
                missing[0] if missing else -1,
                pending.step_id,
                f"no output within the fan-in deadline of {self.timeout_s}s (ranks {missing})",
            ) from None
        except ExceptionGroup as group:
            first = group.exceptions[0]
            raise first from group
        outputs = [out for out in results if out is not None]
        return self.aggregator.merge(pending.step_id, outputs)
