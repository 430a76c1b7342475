"""``ReadPoster``: a rank's READs posted on a thread of their own, never on the step.

On host memory UCX does the whole copy inside ``transfer()``: posting a 2,048-token
READ of a 100M model holds the caller for tens to hundreds of milliseconds (NIXL
releases the GIL meanwhile). Posted on the rank's event loop, that copy would stall the
step and every decode stream in it. So the worker queues the reads of admitted peers
here, and each step hands the queue to one agent thread as one job; the worker touches
the agent again (polls, notifications, peers) only once that job is over, so no two
threads ever call the agent at once, and the event loop never waits for one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from connectors.nixl.agent import KVAgent, ReadHandle, notification
from connectors.nixl.errors import NixlError
from connectors.nixl.metadata import RemoteRead

__all__ = ["Posted", "ReadPoster"]

#: A posted read and what came of it: its handle, ``None`` (a notification only, no
#: block to read) or the error that refused it.
Posted = tuple[RemoteRead, ReadHandle | NixlError | None]
#: Claims a read's blocks from its producer before they are read (raises
#: :class:`NixlError` when the producer refuses): :func:`connectors.nixl.handshake.claim_blocks`.
Claim = Callable[[RemoteRead], None]


class ReadPoster:
    """Reads waiting to be posted, and the one posting job in flight (see the module).

    Only the rank's event loop calls this; the job runs on the poster's thread.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstep-nixl")
        self._waiting: dict[str, RemoteRead] = {}
        self._job: Future[list[Posted]] | None = None
        self._job_ids: frozenset[str] = frozenset()

    @property
    def busy(self) -> bool:
        """Whether a job is running on the agent thread (the agent is not the loop's)."""
        return self._job is not None and not self._job.done()

    def add(self, spec: RemoteRead) -> None:
        """Queue ``spec`` for the next job."""
        self._waiting[spec.req_id] = spec

    def posting(self, req_id: str) -> bool:
        """Whether ``req_id``'s read is in the running job (its blocks may be written)."""
        return req_id in self._job_ids and self.busy

    def withdraw(self, req_id: str) -> bool:
        """Take ``req_id``'s read out of the queue; whether it was there (not posted)."""
        return self._waiting.pop(req_id, None) is not None

    def harvest(self) -> list[Posted]:
        """What the finished job posted (``[]`` while it runs, or with none)."""
        job = self._job
        if job is None or not job.done():
            return []
        self._job, self._job_ids = None, frozenset()
        return job.result()

    def submit(self, agent: KVAgent, timeout_s: float, claim: Claim) -> None:
        """Hand the queued reads to the agent thread, unless a job is still running;
        each read's blocks are claimed (``claim``) right before it is posted."""
        if self.busy or self._job is not None or not self._waiting:
            return
        specs, self._waiting = list(self._waiting.values()), {}
        self._job_ids = frozenset(s.req_id for s in specs)
        self._job = self._executor.submit(_post_all, agent, specs, timeout_s, claim)

    def close(self) -> Callable[[], None]:
        """Stop taking jobs; returns what waits for the running one (call it off the
        loop: the copy in flight is bounded by its size)."""
        self._waiting.clear()
        return lambda: self._executor.shutdown(wait=True, cancel_futures=True)


def _post_all(
    agent: KVAgent, specs: list[RemoteRead], timeout_s: float, claim: Claim
) -> list[Posted]:
    """The job: claim and post each read (or only notify the producer: no block to read)."""
    out: list[Posted] = []
    for spec in specs:
        notif = notification(spec.remote_request_id, spec.ticket)
        try:
            if not spec.local_block_ids:
                agent.notify(spec.engine_id, notif)
                out.append((spec, None))
                continue
            claim(spec)
            handle = agent.start_read(
                spec.engine_id, spec.remote_block_ids, spec.local_block_ids, notif, timeout_s
            )
            out.append((spec, handle))
        except NixlError as exc:
            out.append((spec, exc))
    return out
