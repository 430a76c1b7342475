"""``NixlScheduler``: the scheduler half of the nixl connector (prefill/decode split).

Producer: a request whose ``kv_transfer_params`` say ``do_remote_decode`` finishes
(normally) with its blocks held (``delay_free``) and answers the params a consumer
needs (``do_remote_prefill``, where to read, which blocks, and the model's fingerprint,
block size and TP size). The blocks are freed when the producer's workers report the
request in ``sending``: the consumer's notification arrived, or the lease ran out.

Consumer: a request whose params say ``do_remote_prefill`` is matched for its whole
prompt blocks but the one holding the last prompt token (``load_async``); once its
blocks are allocated, the next step's :class:`NixlMetadata` tells each worker to read
them, and the request waits in ``WAITING_FOR_REMOTE_KVS`` until every rank reports
the read in ``recving``. A request whose params name a producer of another model, block
size or TP size never loads its KV: the read is refused (``RemoteRead.refused``), its
blocks are reported as load errors, and the request recomputes or fails alone per
``load_failure_policy``, as when a worker's handshake finds the mismatch.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from connectors.base import (
    ConnectorContext,
    KVConnectorOutput,
    KVConnectorScheduler,
    MatchResult,
    ModelFingerprint,
    RequestFinishedResult,
)
from connectors.nixl.errors import PeerMismatchError
from connectors.nixl.metadata import HeldSend, NixlMetadata, RemoteRead
from connectors.nixl.options import NixlOptions, RemotePrefill
from connectors.nixl.tickets import EXPIRED, Ticket, check_ticket, issue_ticket, prompt_digest
from pipeline.errors import InvalidConfigError, InvalidRequestError
from pipeline.logger import get_logger
from pipeline.request import RequestStatus
from pipeline.transfer_params import MAX_TRANSFER_ENTRIES

if TYPE_CHECKING:
    from pipeline.artifacts import SchedulerOutput
    from pipeline.request import Request

__all__ = ["NixlScheduler", "model_key"]

log = get_logger()
# The answer's block ids, with room for its other 10 keys, within the entries a
# consumer's ``check_transfer_params`` accepts.
_MAX_ANSWER_BLOCKS = MAX_TRANSFER_ENTRIES - 16


def model_key(context: ConnectorContext) -> str:
    """The model's fingerprint key, the same on every rank (``tp_rank`` set to 0).

    Raises:
        InvalidConfigError: ``context`` has no fingerprint.
    """
    fingerprint: ModelFingerprint | None = context.fingerprint
    if fingerprint is None:
        raise InvalidConfigError("nixl connector", None, "needs the model's fingerprint")
    return attrs.evolve(fingerprint, tp_rank=0).key()


@attrs.frozen
class _Match:
    remote: RemotePrefill
    start: int  # first block to load (the local prefix hit ends there)
    count: int  # blocks to load
    refused: str = ""  # why the read is refused (a mismatch), or ""


class NixlScheduler(KVConnectorScheduler):
    """Decides which requests are held (producer) and read (consumer); see the module.

    Raises:
        InvalidConfigError: Bad options, or no fingerprint in ``context``.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.options = NixlOptions.from_options(context.options, context.engine_id)
        self.key = self.options.transfer_key()
        self.fingerprint = model_key(context)
        self.block_size = context.block_size
        self.tp_size = context.world_size
        self._matches: dict[str, _Match] = {}
        self._reads: list[RemoteRead] = []
        self._sends: list[HeldSend] = []
        # checked remote prefills (consumer), and why their read is refused ("": it is not)
        self._admitted: dict[str, tuple[RemotePrefill, str]] = {}
        self._cancels: list[str] = []
        self._releases: list[str] = []
        self._tickets: dict[str, str] = {}  # held (producer) -> the ticket answered
        self.loading: set[str] = set()  # reads in flight (consumer)
        self.loaded: set[str] = set()  # reads done: never read again (consumer)
        self.held: set[str] = set()  # blocks held for a consumer, or until a read is over
        self._unacked: NixlMetadata | None = None  # built, its step's output not yet back

    def check_request(self, request: Request) -> None:
        """A consumer admits a remote prefill only under a valid ticket from a
        producer it may connect to (see :mod:`connectors.nixl.tickets`).

        Raises:
            InvalidRequestError: Malformed ``do_remote_prefill`` params; a producer that
                is not one of ``peers`` (by default: not on this host); a ticket that
                does not sign these params and this prompt. (A genuine ticket that has
                expired is no attack: its read is refused, and the request recomputes
                or fails alone per ``load_failure_policy``.)
        """
        if not self.options.consumes:
            return
        remote = RemotePrefill.parse(request.kv_transfer_params)
        if remote is None:
            return
        field = "kv_transfer_params"
        refused = self.options.allows(remote.host, remote.port)
        if refused:
            raise InvalidRequestError(f"{field}['remote_host']", remote.host, refused)
        fields = remote.signed_fields(
            prompt_digest(request.prompt_token_ids, request.hash_extra_keys)
        )
        refused = check_ticket(self.key, fields, remote.ticket)
        if refused and refused != EXPIRED:
            raise InvalidRequestError(f"{field}['ticket']", "<hidden>", refused)
        self._admitted[request.request_id] = (remote, refused)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """A remote prefill's whole blocks past the local hit, but the last prompt
        token's block; ``(0, False)`` for other requests. Never blocks.

        Raises:
            InvalidRequestError: Malformed ``do_remote_prefill`` params (fails alone).
        """
        req_id = request.request_id
        self._matches.pop(req_id, None)
        if not self.options.consumes or req_id in self.loaded or req_id in self.loading:
            return MatchResult(0, False)
        if req_id not in self._admitted:  # a request admitted around the engine's door
            self.check_request(request)
        admitted = self._admitted.get(req_id)
        if admitted is None:
            return MatchResult(0, False)
        remote, refused = admitted
        refused = self._mismatch(remote) or refused  # a mismatch says more than expiry
        bs = self.block_size
        start = num_computed_tokens // bs
        end = min((request.num_prompt_tokens - 1) // bs, len(remote.block_ids))
        count = max(0, end - start)  # 0: nothing to read, still notify the producer
        if refused:
            log.warning("nixl remote prefill refused", req_id=req_id, error=refused)
            if not count:  # nothing would be loaded: compute the prompt here
                return MatchResult(0, False)
        self._matches[req_id] = _Match(remote, start, count, refused)
        return MatchResult(count * bs, count > 0)

    def _mismatch(self, remote: RemotePrefill) -> str:
        """Why KV of ``remote``'s producer must not be loaded here, or ``""``."""
        for field, mine, theirs in (  # the fingerprint holds both: the others say more
            ("block_size", self.block_size, remote.block_size),
            ("tp_size", self.tp_size, remote.tp_size),
            ("fingerprint", self.fingerprint, remote.fingerprint),
        ):
            if mine != theirs:
                return str(PeerMismatchError(remote.engine_id, field, mine, theirs))
        return ""

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Queue the read of a matched request into its newly allocated blocks (of no
        block when nothing is to be read: the producer is still told to free its own)."""
        req_id = request.request_id
        match = self._matches.pop(req_id, None)
        if match is None:
            return
        count = min(match.count, num_external_tokens // self.block_size)
        blocks = slice(match.start, match.start + count)
        remote = match.remote
        self._reads.append(
            RemoteRead(
                req_id,
                remote.engine_id,
                remote.host,
                remote.port,
                remote.request_id,
                remote.block_ids[blocks],
                tuple(block_ids[blocks]),
                match.refused,
                remote.ticket,
            )
        )
        if count:
            self.loading.add(req_id)
        else:  # the read of no block only tells the producer to free its blocks
            self.loaded.add(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlMetadata:
        """The reads, held sends and cancels queued since the previous step; when that
        step's output never came back (it failed, maybe before its workers were bound),
        also its instructions that still stand, marked ``resent``."""
        reads, sends, cancels = self._reads, self._sends, self._cancels
        releases = self._releases
        prev = self._unacked
        if prev is not None:
            reading = self.loading | self.loaded
            reads = [r for r in prev.reads if r.req_id in reading] + reads
            sends = [s for s in prev.sends if s.req_id in self.held] + sends
            cancels = [c for c in prev.cancels if c in self.held] + cancels
            releases = [r for r in prev.releases if r in self.held] + releases
        meta = NixlMetadata(
            reads=tuple(reads),
            sends=tuple(sends),
            cancels=tuple(cancels),
            releases=tuple(releases),
            resent=prev is not None,
        )
        self._reads, self._sends, self._cancels, self._releases = [], [], [], []
        standing = meta.reads or meta.sends or meta.cancels or meta.releases
        self._unacked = meta if standing else None
        return meta

    def release_transfer(self, kv_transfer_params: dict[str, Any]) -> bool:
        """Free a finished prefill's held blocks now: the consumer refused the request
        these params (this producer's answer) were for. Only the held request that the
        params name under its own ticket is freed, by the ranks no consumer is reading
        from; anything else is ignored (``False``)."""
        params = kv_transfer_params
        req_id, ticket = params.get("remote_request_id"), params.get("ticket")
        if (
            not self.options.produces
            or params.get("remote_engine_id") != self.options.engine_id
            or not isinstance(req_id, str)
            or not isinstance(ticket, str)
        ):
            return False
        held = self._tickets.get(req_id)
        if held is None or not hmac.compare_digest(held, ticket):
            return False
        if req_id not in self._releases:
            self._releases.append(req_id)
        return True

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> RequestFinishedResult:
        """Hold a finished prefill's blocks for its consumer (producer), or a
        request's blocks while its read is still writing into them (consumer)."""
        req_id = request.request_id
        self._matches.pop(req_id, None)
        self._admitted.pop(req_id, None)
        self.loaded.discard(req_id)
        if req_id in self.loading:
            self.loading.discard(req_id)
            self._reads = [r for r in self._reads if r.req_id != req_id]
            self.held.add(req_id)
            self._cancels.append(req_id)
            return RequestFinishedResult(delay_free=True)
        params = request.kv_transfer_params
        normal = request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        if not (self.options.produces and normal and params and params.get("do_remote_decode")):
            return RequestFinishedResult()
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        if not block_ids or len(block_ids) < num_blocks:
            return RequestFinishedResult()
        if num_blocks > _MAX_ANSWER_BLOCKS:  # the answer would not pass a consumer's door
            log.warning(
                "nixl prefill too long to hand over; blocks freed",
                req_id=req_id,
                blocks=num_blocks,
                limit=_MAX_ANSWER_BLOCKS,
            )
            return RequestFinishedResult()
        held = tuple(block_ids[:num_blocks])
        opts = self.options
        fields = Ticket(
            engine_id=opts.engine_id,
            host=opts.host,
            port=opts.port,
            request_id=req_id,
            block_ids=held,
            prompt_digest=prompt_digest(request.prompt_token_ids, request.hash_extra_keys),
            expires_at=round(time.time() + opts.lease_s, 3),
        )
        ticket = issue_ticket(self.key, fields)
        self.held.add(req_id)
        self._tickets[req_id] = ticket
        self._sends.append(HeldSend(req_id, ticket, held))
        answer: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": opts.engine_id,
            "remote_host": opts.host,
            "remote_port": opts.port,
            "remote_request_id": req_id,
            "remote_block_ids": list(held),
            "fingerprint": self.fingerprint,
            "block_size": self.block_size,
            "tp_size": self.tp_size,
            "ticket": ticket,
            "expires_at": fields.expires_at,
        }
        return RequestFinishedResult(delay_free=True, kv_transfer_params=answer)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Forget held requests once sent or expired, and reads once done or expired;
        the step's instructions reached the workers."""
        self._unacked = None
        for req_id in output.finished_sending | output.expired_sending:
            self.held.discard(req_id)
            self._tickets.pop(req_id, None)
        for req_id in output.finished_recving:
            if req_id in self.loading:
                self.loading.discard(req_id)
                self.loaded.add(req_id)
        for req_id in output.expired_recving:
            self.loading.discard(req_id)

    def has_pending_work(self) -> bool:
        """While blocks are held or reads are in flight."""
        return bool(self.held or self.loading)
