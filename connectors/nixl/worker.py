"""``NixlWorker``: one rank's half of the nixl connector.

Per step, what :class:`NixlMetadata` says::

    register_kv_caches  register the cache with a NIXL agent; a producer serves its
                        PeerInfo on host:(port + rank)
    bind_connector_     hold the sends, queue the reads, note the cancels (so a step
      metadata          that fails before start_load_kv loses none of them)
    start_load_kv       per queued read of an admitted producer rank: hand the READ
                        to the agent thread (connectors.nixl.posting: on host
                        memory the copy happens as it is posted); of a new one:
                        queue it and start the handshake (once per
                        peer, on a thread, bounded by handshake_timeout_s) without
                        waiting (connectors.nixl.peers); a failure marks the read's
                        blocks as load errors, never wrong data
    get_finished        handshakes that ended: begin or fail their reads; reads
                        done or failed (``recving``); held sends named by a
                        consumer's notification or past their lease (``sending``);
                        cancelled reads once over (``sending``); a step with nothing
                        scheduled that finished nothing polls again after 5 ms, so
                        the engine's back-to-back pending steps do not spin a core
    get_kv_stats        tokens (counted on rank 0) and bytes of the reads that
                        get_finished reported done; no saves
    aclose              stop the handshakes (threads joined), stop serving, forget
                        peers, deregister the cache

Every call runs on the rank's event loop, which never waits for NIXL: reads are posted
on the agent thread, and the loop touches the agent only while that thread is idle.
Nothing runs on the forward thread (reads complete across steps, so the layer hooks
have nothing to wait for).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import anyio
import anyio.to_thread
import attrs
import torch

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorWorker,
    WorkerFinished,
)
from connectors.nixl.agent import KVAgent, ReadHandle
from connectors.nixl.causes import load_failure_cause
from connectors.nixl.errors import NixlError, TransferError
from connectors.nixl.handshake import HandshakeServer, claim_blocks
from connectors.nixl.metadata import NixlMetadata, RemoteRead
from connectors.nixl.options import NixlOptions
from connectors.nixl.peers import PeerHandshakes, Resolved
from connectors.nixl.posting import ReadPoster
from connectors.nixl.scheduler import model_key
from connectors.nixl.sends import HeldSends
from connectors.nixl.tickets import ClaimBook
from pipeline.artifacts import KVStats, LoadFailureCause, LoadFailures
from pipeline.logger import get_logger

__all__ = ["NixlWorker"]

log = get_logger()
_IDLE_POLL_S = 0.005  # how long a step with nothing scheduled waits for a transfer


@attrs.define
class _Read:
    spec: RemoteRead
    handle: ReadHandle


class NixlWorker(KVConnectorWorker):
    """One rank's NIXL agent and side channel; see the module docstring.

    Raises:
        InvalidConfigError: Bad options, or no fingerprint in ``context``.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.options = NixlOptions.from_options(context.options, context.engine_id)
        self.key = self.options.transfer_key()
        self.fingerprint = model_key(context)
        self.agent: KVAgent | None = None
        self.server: HandshakeServer | None = None
        self._reads: dict[str, _Read] = {}
        self._queued: dict[str, RemoteRead] = {}  # bound, not started yet
        self._seen: dict[str, float] = {}  # reads bound (oldest first): -> when
        opts = self.options  # a read is over within these: forget it after
        self._seen_for_s = opts.lease_s + opts.handshake_timeout_s + opts.read_timeout_s
        self.sends = HeldSends(self.options.lease_s)  # producer: held for consumers
        self.book = ClaimBook()  # ... and their tickets, for the side channel's claims
        self.poster = ReadPoster()  # reads of admitted peers, posted off the loop
        self.peers = PeerHandshakes(
            self.options.handshake_timeout_s, self.key, self.options.engine_id
        )
        self._stopping = threading.Event()  # ends a claim in flight at close
        self._cancelled: set[str] = set()  # reads to report in sending once over
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._idle_step = False
        self._closed = False
        self._loaded = (0, 0)  # reads done since the last get_finished: tokens, bytes
        self._stats = KVStats()  # what get_kv_stats reports for this step
        self._failed: dict[LoadFailureCause, set[int]] = {}  # blocks of failed reads, by cause
        self._failure_counts: dict[LoadFailureCause, int] = {}  # failed reads since start

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Register the cache with a NIXL agent; a producer starts its side channel.

        Raises:
            InvalidConfigError: The cache layout cannot be registered.
            HandshakeError: The side-channel port cannot be bound.
        """
        ctx = self.context
        self.agent = KVAgent(
            engine_id=self.options.engine_id,
            fingerprint=self.fingerprint,
            block_size=ctx.block_size,
            tp_rank=ctx.rank,
            tp_size=ctx.world_size,
            kv_caches=kv_caches,
            devices=self.options.ucx_devices,
        )
        if self.options.produces:
            port = self.options.port + ctx.rank
            self.server = HandshakeServer(
                self.agent.info, self.options.host, port, self.key, self.book
            )

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Bind; hold the step's sends, queue its reads, note its cancels, all at once:
        a step that fails before :meth:`start_load_kv` (or inside it) loses none of them.
        Synchronous, never blocks."""
        super().bind_connector_metadata(metadata)
        if not isinstance(metadata, NixlMetadata):
            return
        now = time.monotonic()
        for send in metadata.sends:
            if self.sends.hold(send.req_id, now, send.ticket, again=metadata.resent):
                self.book.hold(send.req_id, send.ticket, send.block_ids)
        for req_id in metadata.releases:  # its consumer refused: free it unless read
            if self.book.release_unclaimed(req_id) and self.sends.release(req_id, now):
                self._done_sending.add(req_id)
        for spec in metadata.reads:
            if spec.req_id not in self._seen:  # else resent: this rank has or had it
                self._seen[spec.req_id] = now
                self._queued[spec.req_id] = spec
        horizon = now - self._seen_for_s
        while self._seen and next(iter(self._seen.values())) < horizon:
            del self._seen[next(iter(self._seen))]
        for req_id in metadata.cancels:
            if req_id in self._reads or self.poster.posting(req_id):
                self._cancelled.add(req_id)
            else:  # over, or never started (queued, waiting for a handshake or a post)
                self._queued.pop(req_id, None)
                self.poster.withdraw(req_id)
                self.peers.drop(req_id)
                self._done_sending.add(req_id)

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        """Start the queued reads: this step's, and those of a step that failed first.
        Cancellation-safe: a read leaves the queue only once started (or failed)."""
        if not isinstance(self.connector_metadata, NixlMetadata):
            return
        self._idle_step = not ctx.scheduler_output.requests and not self._queued
        while self._queued:
            spec = next(iter(self._queued.values()))
            self._start(spec)
            self._queued.pop(spec.req_id, None)
        self._pump()

    def _start(self, spec: RemoteRead) -> None:
        agent = self.agent
        if agent is None:
            raise RuntimeError("nixl worker: start_load_kv before register_kv_caches")
        if spec.refused:  # a mismatched producer, an expired ticket: never contacted
            self._fail(spec, TransferError(spec.engine_id, spec.refused), forget_peer=False)
        elif agent.has_peer(spec.engine_id):
            self._begin(spec)
        else:  # the handshake runs off the step; _poll begins the read once it ends
            try:
                self.peers.wait(spec, spec.port + self.context.rank)
            except NixlError as exc:
                self._refuse(spec, exc)

    def _admit(self, done: Resolved) -> None:
        """Admit a peer whose handshake ended and begin its reads, or fail them."""
        assert self.agent is not None
        try:
            if done.error is not None:
                raise done.error
            assert done.info is not None
            if done.info.engine_id != done.engine_id:
                raise NixlError(f"peer {done.engine_id!r} is {done.info.engine_id!r}")
            self.agent.add_peer(done.info)
        except NixlError as exc:
            log.warning("nixl handshake failed", peer=done.engine_id, error=str(exc))
            for spec in done.reads:
                self._refuse(spec, exc)
            return
        for spec in done.reads:
            self._begin(spec)

    def _begin(self, spec: RemoteRead) -> None:
        """Queue the READ of an admitted peer (or only its notification: no block to
        read) for the agent thread (:mod:`connectors.nixl.posting`)."""
        self.poster.add(spec)

    def _pump(self) -> None:
        """Once the agent thread is free: take what it posted, hand it the queue."""
        if self.agent is None or self.poster.busy:
            return
        for spec, result in self.poster.harvest():
            if isinstance(result, NixlError):
                self._refuse(spec, result)
            elif result is not None:
                self._reads[spec.req_id] = _Read(spec, result)
        self.poster.submit(self.agent, self.options.read_timeout_s, self._claim)

    def _claim(self, spec: RemoteRead) -> None:
        """Claim ``spec``'s blocks from the producer's same rank (on the poster's
        thread, right before the read is posted).

        Raises:
            HandshakeError: The producer refused (its ticket check) or did not answer.
        """
        claim_blocks(
            spec.host,
            spec.port + self.context.rank,
            key=self.key,
            sender=self.options.engine_id,
            request_id=spec.remote_request_id,
            ticket=spec.ticket,
            block_ids=spec.remote_block_ids,
            timeout_s=self.options.handshake_timeout_s,
            stop=self._stopping,
        )

    def _refuse(self, spec: RemoteRead, exc: NixlError) -> None:
        if spec.local_block_ids:
            self._fail(spec, exc)
        else:
            log.warning("nixl notify failed", req_id=spec.req_id, error=str(exc))

    def _fail(self, spec: RemoteRead, exc: Exception, *, forget_peer: bool = True) -> None:
        """Fail ``spec``'s read: its blocks are load errors, under the cause ``exc``
        tells; the first failure of each cause is a warning, later ones debug records
        with the count (the engine counts every block by cause). ``forget_peer``: the
        peer is fetched again next time (it may have restarted)."""
        cause = (
            LoadFailureCause.PEER_MISMATCH
            if spec.refused and "differs in" in spec.refused
            else LoadFailureCause.REFUSED
            if spec.refused
            else load_failure_cause(exc)
        )
        count = self._failure_counts[cause] = self._failure_counts.get(cause, 0) + 1
        (log.warning if count == 1 else log.debug)(
            "nixl read failed",
            req_id=spec.req_id,
            peer=spec.engine_id,
            cause=str(cause),
            error=str(exc),
            failures=count,
        )
        if forget_peer and self.agent is not None and not self.poster.busy:
            self.agent.remove_peer(spec.engine_id)  # a restarted peer is fetched again
        self._load_errors.update(spec.local_block_ids)
        self._failed.setdefault(cause, set()).update(spec.local_block_ids)
        self._finish_read(spec.req_id)

    def _finish_read(self, req_id: str) -> None:
        if req_id in self._cancelled:
            self._cancelled.discard(req_id)
            self._done_sending.add(req_id)
        else:
            self._done_recving.add(req_id)

    def _poll(self) -> None:
        agent = self.agent
        if agent is None or self.poster.busy:  # the agent is the thread's: next step
            return
        self._pump()
        for resolved in self.peers.take_resolved():
            self._admit(resolved)
        for req_id, read in list(self._reads.items()):
            try:
                done = agent.poll(read.handle)
            except NixlError as exc:
                del self._reads[req_id]
                self._fail(read.spec, exc)
                continue
            if done:
                del self._reads[req_id]
                self._count_load(read.spec)
                self._finish_read(req_id)
        notified = agent.take_notifications()
        released = self.sends.take_released(notified, time.monotonic())
        for req_id in released:
            self.book.release(req_id)  # its blocks are freed: nothing more to claim
        self._done_sending.update(released)
        self._pump()  # the peers admitted above

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        """Reads that ended (``recving``), sends released (``sending``). Polls; only a
        step with nothing scheduled that finished nothing waits ``_IDLE_POLL_S`` and
        polls again. Cancellation-safe: results are kept until returned."""
        self._poll()
        if self._idle_step and not (self._done_sending or self._done_recving):
            # The engine steps back to back while transfers are pending: an idle step
            # that finished nothing waits a little instead of spinning a core.
            await anyio.sleep(_IDLE_POLL_S)
            self._poll()
        self._idle_step = False
        sending, self._done_sending = frozenset(self._done_sending), set()
        recving, self._done_recving = frozenset(self._done_recving), set()
        self._stats, self._loaded = KVStats(*self._loaded), (0, 0)
        return WorkerFinished(sending=sending, recving=recving)

    def _count_load(self, spec: RemoteRead) -> None:
        """Add a completed read (cancelled or not: its bytes moved) to the traffic.

        Every rank reads the same token positions (its shard or its own copy), but the
        ranks finish a read in different steps and fan-in merges one step's tokens with
        ``max``: only rank 0 counts tokens, so they add up once over the steps.
        """
        if self.agent is None:
            return
        info = self.agent.info  # block_bytes: one block of K (or V) of one layer
        blocks = len(spec.local_block_ids)
        tokens, nbytes = self._loaded
        self._loaded = (
            tokens + (blocks * info.block_size if info.tp_rank == 0 else 0),
            nbytes + blocks * 2 * len(info.layer_addrs) * info.block_bytes,
        )

    def get_kv_stats(self) -> KVStats:
        """``loaded_tokens`` and ``loaded_bytes`` (no saves) of the reads that completed by this
        step's :meth:`get_finished`: this rank's bytes, tokens on rank 0 only (a read
        that failed on another rank is still counted there). A failed read counts
        nothing. Sends count no saves: a consumer's notification names the request,
        not how many blocks it read. A query; the same answer until the next step's
        :meth:`get_finished`."""
        return self._stats

    def get_load_failures(self) -> LoadFailures:
        """The causes of the blocks of reads that failed since the previous call, each
        reported once (asked right after :meth:`get_block_ids_with_load_errors`, which
        reports the same blocks; a read the scheduler half refused is ``peer_mismatch``
        or, for an expired ticket, ``refused``)."""
        failed, self._failed = self._failed, {}
        return LoadFailures(blocks=failed)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks of reads that failed since the previous call, each reported once."""
        errors, self._load_errors = frozenset(self._load_errors), set()
        return errors

    async def aclose(self) -> None:
        """Stop the handshakes, stop serving, forget peers, deregister the cache;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        try:
            self.peers.close()
            await anyio.to_thread.run_sync(self.poster.close())
            if self.server is not None:
                self.server.close()
        finally:
            if self.agent is not None:
                self.agent.close()
