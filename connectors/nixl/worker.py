"""``NixlWorker``: one rank's half of the nixl connector.

Per step, what :class:`NixlMetadata` says::

    register_kv_caches  register the cache with a NIXL agent; a producer serves its
                        PeerInfo on host:(port + rank)
    start_load_kv       per read: handshake with the producer once (in a thread,
                        bounded), then start the READ; a failure marks the read's
                        blocks as load errors, never wrong data
    get_finished        reads done or failed (``recving``); held sends named by a
                        consumer's notification or past their lease (``sending``);
                        cancelled reads once over (``sending``); a step with nothing
                        scheduled that finished nothing polls again after 5 ms, so
                        the engine's back-to-back pending steps do not spin a core
    aclose              stop serving, forget peers, deregister the cache

Every call runs on the rank's event loop; nothing runs on the forward thread (reads
complete across steps, so the layer hooks have nothing to wait for).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import anyio.to_thread
import attrs
import torch

from connectors.base import ConnectorContext, ForwardContext, KVConnectorWorker, WorkerFinished
from connectors.nixl.agent import NOTIF_PREFIX, KVAgent, ReadHandle
from connectors.nixl.errors import NixlError
from connectors.nixl.handshake import HandshakeServer, fetch_peer_info
from connectors.nixl.metadata import NixlMetadata, RemoteRead
from connectors.nixl.options import NixlOptions
from connectors.nixl.scheduler import model_key
from pipeline.logs import get_logger

__all__ = ["NixlWorker"]

log = get_logger()
_MAX_EARLY = 4096  # notifications kept for sends this rank has not been told of yet
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
        self.options = NixlOptions.from_options(context.options)
        self.fingerprint = model_key(context)
        self.agent: KVAgent | None = None
        self.server: HandshakeServer | None = None
        self._reads: dict[str, _Read] = {}
        self._held: dict[str, float] = {}  # producer: req id -> lease deadline
        self._early: dict[str, float] = {}  # notifications before their send: -> time
        self._cancelled: set[str] = set()  # reads to report in sending once over
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._idle_step = False
        self._closed = False

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
        )
        if self.options.produces:
            port = self.options.port + ctx.rank
            self.server = HandshakeServer(self.agent.info, self.options.host, port)

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        """Start this step's reads; hold its sends; note its cancels. Cancellation-safe:
        a read is recorded as soon as it is started."""
        meta = self.connector_metadata
        if not isinstance(meta, NixlMetadata):
            return
        self._idle_step = not ctx.scheduler_output.requests and not meta.reads
        now = time.monotonic()
        for req_id in meta.sends:
            self._held[req_id] = now + self.options.lease_s
        for req_id in meta.cancels:
            if req_id in self._reads:
                self._cancelled.add(req_id)
            else:
                self._done_sending.add(req_id)
        for spec in meta.reads:
            await self._start(spec)

    async def _start(self, spec: RemoteRead) -> None:
        agent = self.agent
        if agent is None:
            raise RuntimeError("nixl worker: start_load_kv before register_kv_caches")
        rank, opts = self.context.rank, self.options
        try:
            if not agent.has_peer(spec.engine_id):
                info = await anyio.to_thread.run_sync(
                    fetch_peer_info, spec.host, spec.port + rank, opts.handshake_timeout_s
                )
                if info.engine_id != spec.engine_id:
                    raise NixlError(f"peer at {spec.host} is {info.engine_id!r}")
                agent.add_peer(info)
            notif = NOTIF_PREFIX + spec.remote_request_id.encode()
            if not spec.local_block_ids:  # nothing to read: only free the producer's
                agent.notify(spec.engine_id, notif)
                return
            handle = agent.start_read(
                spec.engine_id,
                spec.remote_block_ids,
                spec.local_block_ids,
                notif,
                opts.read_timeout_s,
            )
        except NixlError as exc:
            if spec.local_block_ids:
                self._fail(spec, exc)
            else:
                log.warning("nixl notify failed", req_id=spec.req_id, error=str(exc))
            return
        self._reads[spec.req_id] = _Read(spec, handle)

    def _fail(self, spec: RemoteRead, exc: Exception) -> None:
        log.warning("nixl read failed", req_id=spec.req_id, peer=spec.engine_id, error=str(exc))
        if self.agent is not None:
            self.agent.remove_peer(spec.engine_id)  # a restarted peer is fetched again
        self._load_errors.update(spec.local_block_ids)
        self._finish_read(spec.req_id)

    def _finish_read(self, req_id: str) -> None:
        if req_id in self._cancelled:
            self._cancelled.discard(req_id)
            self._done_sending.add(req_id)
        else:
            self._done_recving.add(req_id)

    def _poll(self) -> None:
        agent = self.agent
        if agent is None:
            return
        for req_id, read in list(self._reads.items()):
            try:
                done = agent.poll(read.handle)
            except NixlError as exc:
                del self._reads[req_id]
                self._fail(read.spec, exc)
                continue
            if done:
                del self._reads[req_id]
                self._finish_read(req_id)
        now = time.monotonic()
        self._early.update(dict.fromkeys(agent.take_notifications(), now))
        for req_id in [r for r in self._early if r in self._held]:
            del self._early[req_id], self._held[req_id]
            self._done_sending.add(req_id)
        for req_id, deadline in list(self._held.items()):
            if now > deadline:
                log.warning("nixl send lease expired; blocks freed", req_id=req_id)
                del self._held[req_id]
                self._done_sending.add(req_id)
        for req_id in [r for r, t in self._early.items() if now - t > self.options.lease_s]:
            del self._early[req_id]
        while len(self._early) > _MAX_EARLY:
            del self._early[next(iter(self._early))]

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
        return WorkerFinished(sending=sending, recving=recving)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Blocks of reads that failed since the previous call, each reported once."""
        errors, self._load_errors = frozenset(self._load_errors), set()
        return errors

    async def aclose(self) -> None:
        """Stop serving, forget peers, deregister the cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.server is not None:
                self.server.close()
        finally:
            if self.agent is not None:
                self.agent.close()
