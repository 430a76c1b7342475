"""Per-request block tables on the scheduler side, shared by the offload and store
connectors: which blocks a request may match, and which become full in a step.

Plain functions over :class:`RequestTracker`; every one runs on the event loop and never
blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from pipeline.logger import get_logger

if TYPE_CHECKING:
    from pipeline.artifacts import ScheduledRequest
    from pipeline.request import Request

__all__ = [
    "RequestTracker",
    "cdiv",
    "leading_run",
    "match_candidates",
    "new_full_blocks",
    "track_scheduled",
    "unsaved_at_finish",
]

log = get_logger()


@attrs.define
class RequestTracker:
    """A request's block table as the workers have it, the live request (hashes), and
    the first block :func:`new_full_blocks` has not offered for a save yet."""

    request: Request
    block_ids: list[int]
    next_block: int = 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def match_candidates(
    request: Request, num_computed_tokens: int, block_size: int
) -> tuple[int, tuple[bytes, ...]]:
    """The first block index past ``num_computed_tokens`` and the hashes of the blocks
    from there that a connector may match: whole blocks, never the last prompt token.
    No candidates when ``num_computed_tokens`` is not block aligned."""
    if num_computed_tokens % block_size:
        return 0, ()
    start = num_computed_tokens // block_size
    stop = min((request.num_tokens - 1) // block_size, len(request.block_hashes))
    return start, tuple(request.block_hashes[start:stop])


def leading_run(found: Sequence[bool]) -> int:
    """How many entries of ``found`` are true before the first false one."""
    for count, here in enumerate(found):
        if not here:
            return count
    return len(found)


def track_scheduled(
    trackers: dict[str, RequestTracker], item: ScheduledRequest, connector: str
) -> RequestTracker | None:
    """Apply ``item``'s new blocks to its tracker (a new request replaces its table);
    ``None`` (logged at debug) for a request that is not tracked."""
    tracker = trackers.get(item.req_id)
    if tracker is None:
        log.debug(f"{connector}: scheduled request without a tracker", req_id=item.req_id)
        return None
    if item.new:
        tracker.block_ids = list(item.block_ids)
    else:
        tracker.block_ids.extend(item.block_ids)
    return tracker


def new_full_blocks(tracker: RequestTracker, item: ScheduledRequest, block_size: int) -> range:
    """The block indexes of ``item``'s request whose KV is complete once this step ran
    and that have both a block id and a hash: those that become full in this step, and
    those that became full in an earlier step with tokens not known then (speculative
    drafts, kept since; a token still in flight), which had no hash until now. A block
    filled with a draft later rejected never gets a hash from it: its position is
    computed again before the block is offered."""
    first = item.num_computed_tokens // block_size
    if not item.new:
        first = min(first, tracker.next_block)
    end = item.num_computed_tokens + len(item.token_ids)
    stop = min(end // block_size, len(tracker.block_ids), len(tracker.request.block_hashes))
    tracker.next_block = max(first, stop)
    return range(first, stop)


_WARNED_UNSAVED: set[str] = set()


def unsaved_at_finish(tracker: RequestTracker | None, block_size: int, connector: str) -> int:
    """How many full blocks of a finishing request were never offered for a save: those
    speculative drafts filled in its last step (offered only the step after, which never
    comes). Logged at warning level the first time per connector, at debug after: a
    cache miss later, never a wrong block."""
    if tracker is None:
        return 0
    request = tracker.request
    full = min(request.num_computed_tokens // block_size, len(tracker.block_ids),
               len(request.block_hashes))  # fmt: skip
    missed = max(0, full - tracker.next_block)
    if missed:
        level = log.debug if connector in _WARNED_UNSAVED else log.warning
        _WARNED_UNSAVED.add(connector)
        level(f"{connector}: blocks filled by speculative drafts in a request's last step "
              "are not saved", req_id=request.request_id, blocks=missed)  # fmt: skip
    return missed
