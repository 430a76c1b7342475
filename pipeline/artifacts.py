"""The typed artifacts that flow along the edges of the step graphs.

Stages declare which of these types they require and the one they provide; the graph
wires them by type. Everything that crosses the engine/worker boundary
(:class:`SchedulerOutput`, :class:`WorkerOutput`) is a frozen attrs class of plain
values that msgspec encodes without pickle.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from pipeline.config import SamplingParams
from pipeline.errors import short_repr
from pipeline.logprobs import TokenLogprob
from pipeline.lora import LoRAAdapter
from pipeline.request import RequestOutput

__all__ = [
    "PLACEHOLDER_TOKEN",
    "EngineStepOutput",
    "FanInOutput",
    "KVStats",
    "LoadStarted",
    "MetadataBound",
    "ModelOutput",
    "RankOutputs",
    "SaveFailureCause",
    "SaveFailures",
    "SaveResult",
    "SampledTokens",
    "ScheduledRequest",
    "SchedulerOutput",
    "SpecDecodeStats",
    "DraftsProposed",
    "TokenIds",
    "WorkerOutput",
]


PLACEHOLDER_TOKEN = -1
"""In a step scheduled ahead (async scheduling), the last entry of a request's
``ScheduledRequest.token_ids`` when that token is the one the step before samples. The
engine replaces it with the sampled token before the step reaches a worker; a worker
never sees it."""

TokenIds = tuple[int, ...]
"""The tokens one request sampled in one step, in order (one without speculative
decoding; the accepted drafts and one more with it)."""


def _token_sequences(value: Mapping[str, int | Sequence[int]]) -> dict[str, TokenIds]:
    """``value`` with a tuple of tokens per request; a bare ``int`` is a one-token
    sequence (a list becomes a tuple). The mapping itself is copied only when an entry
    changes (the hot path hands over tuples already).

    Raises:
        TypeError: An entry is neither an ``int`` nor a tuple or list of them.
    """
    for tokens in value.values():  # a loop, not all(genexpr): this runs thrice a step
        if type(tokens) is not tuple:
            break
    else:
        return value if type(value) is dict else dict(value)  # type: ignore[arg-type]
    out: dict[str, TokenIds] = {}
    for req_id, tokens in value.items():
        if type(tokens) is tuple:
            out[req_id] = tokens
        elif isinstance(tokens, int) and not isinstance(tokens, bool):
            out[req_id] = (tokens,)
        elif isinstance(tokens, list):
            out[req_id] = tuple(tokens)
        else:
            raise TypeError(
                f"sampled tokens of {req_id!r}: {short_repr(tokens, 80)}; must be an int "
                "(one token) or a tuple or list of token ids"
            )
    return out


def _logprob_sequences(
    value: Mapping[str, TokenLogprob | Sequence[TokenLogprob]],
) -> dict[str, tuple[TokenLogprob, ...]]:
    """``value`` with a tuple of logprobs per request (one per sampled token); a bare
    :class:`TokenLogprob` is a one-entry sequence (a list becomes a tuple).

    Raises:
        TypeError: An entry is neither a ``TokenLogprob`` nor a tuple or list of them.
    """
    for entries in value.values():
        if type(entries) is not tuple:
            break
    else:
        return value if type(value) is dict else dict(value)  # type: ignore[arg-type]
    out: dict[str, tuple[TokenLogprob, ...]] = {}
    for req_id, entries in value.items():
        if type(entries) is tuple:
            out[req_id] = entries
        elif isinstance(entries, TokenLogprob):
            out[req_id] = (entries,)
        elif isinstance(entries, list):
            out[req_id] = tuple(entries)
        else:
            raise TypeError(
                f"sampled-token logprobs of {req_id!r}: {short_repr(entries, 80)}; must be "
                "a TokenLogprob (one token) or a tuple or list of them, one per token"
            )
    return out


@attrs.frozen(kw_only=True)
class ScheduledRequest:
    """One request's share of a step, as the worker needs it.

    Attributes:
        req_id: The request id.
        token_ids: The tokens to compute this step, i.e.
            ``all_token_ids[num_computed_tokens : num_computed_tokens + len(token_ids)]``.
        num_computed_tokens: Position of ``token_ids[0]``; the KV of every earlier
            position is already in the request's blocks.
        block_ids: When ``new``: the request's whole block table. Otherwise: the blocks
            appended to its table since the previous step (often empty).
        new: The worker (re)creates this request's state: first schedule, or resumed
            after preemption.
        sampling: The request's sampling parameters (always sent; small and immutable).
        sample: Whether a token is sampled after this chunk (it reaches the last known
            token); ``False`` for a non-final prefill chunk.
        num_output_tokens: Tokens generated so far: the index of the token that a sample
            produces, which seeds per-request sampling deterministically.
        prefix_token_ids: When ``new``: the tokens before ``num_computed_tokens`` (whose
            KV came from a cache, or was computed before a preemption), so that the
            worker knows the whole sequence (penalties and logits stages read it).
            Empty otherwise.
        prompt_logprob_targets: When the request still needs prompt logprobs
            (``SamplingParams.prompt_logprobs``): the target of each prompt position of
            this chunk that has one, from the first: position ``p`` scores prompt token
            ``p + 1``, so these are the prompt tokens after ``num_computed_tokens``, up
            to the chunk's end + 1 (the next chunk's first token) and at most to the
            prompt's end. Empty otherwise.
        draft_token_ids: Speculative tokens scheduled after ``token_ids`` (the step
            computes them too, at the positions that follow, and verifies them); only
            when ``sample``. The scheduler's budget and KV slots count them; those a
            step rejects are taken back from the request's computed tokens, and their
            KV is never cached. Empty without speculative decoding.
        lora: The LoRA adapter the request runs with (always sent, as ``sampling``),
            or ``None`` for the base model.
        num_prompt_tokens: The length of the request's prompt (always sent; outputs
            recomputed after a preemption do not count). A ``longrope`` model rotates
            by it (:class:`~stages.model.rope.LongRope`); 0 when unknown, which
            rotates by position alone.
    """

    req_id: str
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    new: bool
    sampling: SamplingParams
    sample: bool
    num_output_tokens: int
    prefix_token_ids: tuple[int, ...] = ()
    prompt_logprob_targets: tuple[int, ...] = ()
    draft_token_ids: tuple[int, ...] = ()
    lora: LoRAAdapter | None = None
    num_prompt_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        """Known tokens computed this step (``len(token_ids)``; drafts not counted)."""
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed this step: ``token_ids`` and ``draft_token_ids``."""
        return len(self.token_ids) + len(self.draft_token_ids)


@attrs.frozen(kw_only=True)
class SchedulerOutput:
    """What the scheduler decided for one step; the input of every worker graph.

    Attributes:
        step_id: Monotonic step number of this engine.
        requests: The scheduled requests, in batch order.
        finished_req_ids: Requests that ended (finished, aborted, preempted) since the
            previous step; workers drop their per-request state.
        kv_connector_metadata: The connector's metadata for this step, or ``None``
            without a connector. Encoded to bytes when it crosses a process boundary.
    """

    step_id: int
    requests: tuple[ScheduledRequest, ...] = ()
    finished_req_ids: frozenset[str] = frozenset()
    kv_connector_metadata: Any = None

    @functools.cached_property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens the step computes over every request, drafts included (the budget);
        computed once (several stages of a step read it)."""
        return sum(len(r.token_ids) + len(r.draft_token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@attrs.frozen
class MetadataBound:
    """Marker: the connector metadata of this step is bound on this rank."""

    bound: bool = False


@attrs.frozen
class LoadStarted:
    """Marker: the connector's loads for this step have been started on this rank."""

    started: bool = False


@attrs.frozen(kw_only=True)
class ModelOutput:
    """Logits of the rows to sample, in the order of ``req_ids``.

    ``prompt_logits`` holds the raw logits of the prompt positions whose logprobs a
    request asked for (``ScheduledRequest.prompt_logprob_targets``): for each request
    of ``prompt_req_ids`` in order, ``len(prompt_logprob_targets)`` rows. ``None``
    when no request of the step asked.

    ``draft_logits`` holds the raw logits at the draft tokens of speculative decoding
    (``ScheduledRequest.draft_token_ids``): for each request of ``draft_req_ids`` in
    order, one row per draft, row ``i`` the distribution after draft ``i`` (what draft
    ``i + 1``, or the token after the last draft, is verified against). A request's row
    in ``logits`` is the distribution after its last known token, which its first
    draft is verified against. ``None`` when no request of the step has drafts.

    ``save_error`` is what the connector's ``save_kv_layer`` raised in this forward pass
    (the first raise; the pass went on without further saves), or ``None``: a save-side
    failure costs the step's caching, never its logits.
    """

    req_ids: tuple[str, ...]
    logits: Any  # torch.Tensor [len(req_ids), vocab]; Any keeps this module torch-free
    num_tokens: int = 0
    prompt_req_ids: tuple[str, ...] = ()
    prompt_logits: Any = None  # torch.Tensor [rows, vocab] or None
    draft_req_ids: tuple[str, ...] = ()
    draft_logits: Any = None  # torch.Tensor [drafts, vocab] or None
    save_error: Exception | None = None


@attrs.frozen(kw_only=True)
class SampledTokens:
    """The tokens each request that sampled this step got, as a sequence per request.

    Without speculative decoding a sequence holds one token; a bare ``int`` given to the
    constructor is taken as that one-token sequence (and a bare ``TokenLogprob`` as a
    one-entry ``logprobs``), so ``SampledTokens(token_ids={"a": 5})`` holds ``(5,)``.

    Attributes:
        token_ids: Request id → its sampled tokens, in order.
        errors: Request id → why its row could not be sampled (it has no token and
            fails alone, ``finish_reason="error"``).
        logprobs: Request id → the logprob of each of its sampled tokens (one entry per
            token of ``token_ids``), for the requests that set ``SamplingParams.logprobs``.
        prompt_logprobs: Request id → the logprobs of this chunk's prompt targets
            (one per ``ScheduledRequest.prompt_logprob_targets``), in order.
    """

    token_ids: dict[str, TokenIds] = attrs.field(factory=dict, converter=_token_sequences)
    errors: dict[str, str] = attrs.field(factory=dict)
    logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.field(
        factory=dict, converter=_logprob_sequences
    )
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.field(factory=dict)


class KVStats(NamedTuple):
    """Connector traffic of one step on one rank: what a connector's ``get_kv_stats()``
    returns and ``WorkerOutput.stats`` carries; fan-in merges the ranks' with :meth:`merge`.

    A named tuple: read it by field (``stats.saved_bytes``); it still unpacks, indexes and
    compares as the 4-tuple ``(loaded_tokens, loaded_bytes, saved_tokens, saved_bytes)``
    that ``get_kv_stats()`` returned before it had names. ``+`` adds field by field (it is
    not tuple concatenation). On the wire (msgspec) it is that 4-array.

    Tokens are positions of the sequence, bytes what moved: when several ranks load the
    same tokens (each its tensor-parallel shard, or each its own copy), the step loaded
    those tokens once and the bytes of every rank.

    Attributes:
        loaded_tokens: Tokens whose KV this rank loaded from the connector this step
            (counted in the step whose loads completed).
        loaded_bytes: Bytes of KV this rank loaded this step.
        saved_tokens: Tokens whose KV this rank saved to the connector this step.
        saved_bytes: Bytes of KV this rank saved this step.
    """

    loaded_tokens: int = 0
    loaded_bytes: int = 0
    saved_tokens: int = 0
    saved_bytes: int = 0

    def __add__(self, other: KVStats) -> KVStats:  # type: ignore[override]
        """Traffic of two steps (or two pieces of one rank's step): everything adds."""
        return KVStats(
            loaded_tokens=self.loaded_tokens + other.loaded_tokens,
            loaded_bytes=self.loaded_bytes + other.loaded_bytes,
            saved_tokens=self.saved_tokens + other.saved_tokens,
            saved_bytes=self.saved_bytes + other.saved_bytes,
        )

    def merge(self, other: KVStats) -> KVStats:
        """Two ranks' traffic of the same step: the most tokens either moved, all bytes.

        Associative and commutative (max and sum), so fan-in's merge stays order-free.
        """
        return KVStats(
            loaded_tokens=max(self.loaded_tokens, other.loaded_tokens),
            loaded_bytes=self.loaded_bytes + other.loaded_bytes,
            saved_tokens=max(self.saved_tokens, other.saved_tokens),
            saved_bytes=self.saved_bytes + other.saved_bytes,
        )


class LoadFailureCause(enum.StrEnum):
    """Why a block's KV failed to load, as far as its connector can tell.

    ``handshake``: the peer could not be reached or did not answer the handshake;
    ``peer_mismatch``: the peer's KV is another model's or layout's (never read);
    ``refused``: the peer (or this engine's checks) refused the transfer;
    ``read_error``: the read failed (transport or I/O error, peer gone mid-read);
    ``read_timeout``: the read did not complete within its deadline;
    ``missing``: the store no longer holds the value;
    ``corrupt``: the stored value failed verification (header, checksum, signature);
    ``unknown``: the connector reported the block without a cause.
    """

    HANDSHAKE = "handshake"
    PEER_MISMATCH = "peer_mismatch"
    REFUSED = "refused"
    READ_ERROR = "read_error"
    READ_TIMEOUT = "read_timeout"
    MISSING = "missing"
    CORRUPT = "corrupt"
    UNKNOWN = "unknown"


def _block_sets(
    value: Mapping[LoadFailureCause, Iterable[int]],
) -> dict[LoadFailureCause, frozenset[int]]:
    return {LoadFailureCause(cause): frozenset(blocks) for cause, blocks in value.items() if blocks}


@attrs.frozen(kw_only=True)
class LoadFailures:
    """Why the blocks of ``get_block_ids_with_load_errors`` failed to load: the cause of
    each (``KVConnectorWorker.get_load_failures``), merged over ranks by fan-in.

    A block named under no cause has cause ``unknown``; a block named under several (two
    ranks that failed it differently) counts under the first in
    :class:`LoadFailureCause`'s order.

    Attributes:
        blocks: Cause → block ids of the paged cache (no empty entry).
    """

    blocks: Mapping[LoadFailureCause, frozenset[int]] = attrs.field(
        factory=dict, converter=_block_sets
    )

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def merge(self, other: LoadFailures) -> LoadFailures:
        """Two ranks' (or two calls') causes: the union per cause. Associative and
        commutative, so fan-in's merge stays order-free."""
        if not other.blocks:
            return self
        if not self.blocks:
            return other
        causes = self.blocks.keys() | other.blocks.keys()
        empty: frozenset[int] = frozenset()
        return LoadFailures(
            blocks={c: self.blocks.get(c, empty) | other.blocks.get(c, empty) for c in causes}
        )

    def cause_of(self, block_id: int) -> LoadFailureCause:
        """The cause of ``block_id`` (``unknown`` when no cause names it)."""
        for cause in LoadFailureCause:
            if block_id in self.blocks.get(cause, ()):
                return cause
        return LoadFailureCause.UNKNOWN

    def count(self, invalid: Iterable[int]) -> dict[LoadFailureCause, int]:
        """Blocks of ``invalid`` (the step's load errors) per cause, each counted once;
        no entry for a cause with none."""
        counts: dict[LoadFailureCause, int] = {}
        for block_id in invalid:
            cause = self.cause_of(block_id)
            counts[cause] = counts.get(cause, 0) + 1
        return counts


class SaveFailureCause(enum.StrEnum):
    """Which save-side connector call raised on a rank (a fixed set: the label of
    ``kvstep_kv_save_failures_total``).

    ``save_kv_layer``, ``wait_for_save``, ``get_finished``: that call raised;
    ``timeout``: any of them raised ``TimeoutError`` (a connector's own deadline).
    """

    SAVE_KV_LAYER = "save_kv_layer"
    WAIT_FOR_SAVE = "wait_for_save"
    GET_FINISHED = "get_finished"
    TIMEOUT = "timeout"

    @classmethod
    def of(cls, call: SaveFailureCause, error: BaseException) -> SaveFailureCause:
        """The cause of ``error`` raised by ``call``: ``timeout`` for a ``TimeoutError``."""
        return cls.TIMEOUT if isinstance(error, TimeoutError) else call


def _save_counts(value: Mapping[SaveFailureCause, int]) -> dict[SaveFailureCause, int]:
    return {SaveFailureCause(cause): int(n) for cause, n in value.items() if n}


@attrs.frozen(kw_only=True)
class SaveFailures:
    """Save-side connector calls that raised (``save_kv_layer``, ``wait_for_save``,
    ``get_finished``), counted by cause; merged over ranks by fan-in.

    A save-side failure costs caching, never tokens: the step's requests keep what they
    sampled, their saves of the step count as failed (``failed_save_req_ids``), so their
    blocks are neither reported stored nor announced. Each raise counts once on the rank
    it happened on.

    Attributes:
        counts: Cause → calls that raised (no zero entry).
        errors: Cause → the ``repr`` of one of its errors (for the first log record).
    """

    counts: Mapping[SaveFailureCause, int] = attrs.field(factory=dict, converter=_save_counts)
    errors: Mapping[SaveFailureCause, str] = attrs.field(factory=dict)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def add(self, call: SaveFailureCause, error: BaseException) -> SaveFailures:
        """These failures and one more: ``error`` raised by ``call``."""
        cause = SaveFailureCause.of(call, error)
        return self.merge(SaveFailures(counts={cause: 1}, errors={cause: short_repr(error)}))

    def merge(self, other: SaveFailures) -> SaveFailures:
        """Two ranks' (or two calls') failures: counts summed per cause, the first error
        kept. Associative, so fan-in's merge stays order-free (up to which error is kept)."""
        if not other.counts:
            return self
        if not self.counts:
            return other
        counts = dict(self.counts)
        for cause, n in other.counts.items():
            counts[cause] = counts.get(cause, 0) + n
        return SaveFailures(counts=counts, errors={**other.errors, **self.errors})


@attrs.frozen(kw_only=True)
class SaveResult:
    """Marker + data: ``wait_for_save`` returned (or raised, counted) on this rank.

    Attributes:
        failed_req_ids: Requests whose save failed this step on this rank: those
            ``wait_for_save`` returned, and every request of the step when a save-side
            call raised.
        failures: The save-side calls that raised so far in the step (the forward's
            ``save_kv_layer``, ``wait_for_save``).
        wait_raised: ``wait_for_save`` itself raised: the step's ``get_finished`` is
            not called (it follows a completed ``wait_for_save``); the connector reports
            its completions in a later step's call.
    """

    failed_req_ids: frozenset[str] = frozenset()
    failures: SaveFailures = attrs.field(factory=SaveFailures)
    wait_raised: bool = False


@attrs.frozen(kw_only=True)
class WorkerOutput:
    """One rank's result of one step.

    Attributes:
        rank: The rank that produced it.
        step_id: The step it belongs to.
        sampled_token_ids: Tokens sampled this step, a sequence per request (driver rank
            only; others empty). A bare ``int`` is taken as a one-token sequence.
        finished_sending: Requests whose KV this rank finished sending.
        finished_recving: Requests whose KV this rank finished receiving.
        invalid_block_ids: Blocks whose KV failed to load on this rank.
        failed_save_req_ids: Requests whose KV failed to save on this rank.
        request_errors: Requests that failed alone on this rank this step (a row that
            could not be sampled), with why; the engine ends each with ``"error"``.
        stats: Connector traffic of this step on this rank.
        load_failures: Why the blocks of ``invalid_block_ids`` failed (those the
            connector named a cause for).
        save_failures: Save-side connector calls that raised on this rank this step
            (their requests are in ``failed_save_req_ids``).
        logprobs: Logprobs of the sampled tokens whose request asked, one per token of
            its sequence (driver only).
        prompt_logprobs: Logprobs of each request's prompt targets this step
            (``SampledTokens.prompt_logprobs``; driver only).
    """

    rank: int
    step_id: int
    sampled_token_ids: dict[str, TokenIds] = attrs.field(factory=dict, converter=_token_sequences)
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    failed_save_req_ids: frozenset[str] = frozenset()
    request_errors: dict[str, str] = attrs.field(factory=dict)
    stats: KVStats = attrs.field(factory=KVStats)
    load_failures: LoadFailures = attrs.field(factory=LoadFailures)
    save_failures: SaveFailures = attrs.field(factory=SaveFailures)
    logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.field(
        factory=dict, converter=_logprob_sequences
    )
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class RankOutputs:
    """Every rank's ``WorkerOutput`` of one step, as ``execute`` collected them.

    Attributes:
        step_id: The step.
        outputs: One output per rank, in rank order (rank 0, the driver, first).
        request_errors: Requests the executor left out of the step because they could
            not be sent to the workers (e.g. not encodable), with why; each fails alone.
    """

    step_id: int
    outputs: tuple[WorkerOutput, ...]
    request_errors: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class FanInOutput:
    """All ranks' outputs of one step merged (associative, order-free).

    Attributes:
        step_id: The step.
        sampled_token_ids: Tokens sampled this step, a sequence per request (from the
            driver rank 0). A bare ``int`` is taken as a one-token sequence.
        finished_sending: Requests whose KV every rank has now reported sent (each is
            released once, possibly steps after the first rank's report).
        finished_recving: Requests whose KV every rank has now reported received.
        expired_sending: Requests whose send some rank never reported within the
            transfer lease; the scheduler frees their delayed blocks.
        expired_recving: Requests whose load some rank never reported within the
            transfer lease; the scheduler fails them (``finish_reason="error"``).
        missing_ranks: For each expired request, the ranks that never reported it.
        invalid_block_ids: Blocks that failed to load on any rank (union).
        failed_save_req_ids: Requests whose save failed on any rank (union).
        request_errors: Requests that failed alone this step (on any rank, or in the
            executor before the step was sent), with why (union; the lowest rank's
            reason when several ranks name a request).
        stats: Connector traffic of this step, merged over ranks (bytes summed, tokens once).
        load_failures: Why the blocks of ``invalid_block_ids`` failed (union per cause).
        save_failures: Save-side connector calls that raised, over every rank (summed
            per cause).
        num_ranks: How many ranks' outputs were merged.
        logprobs: Logprobs of the sampled tokens, one per token of each sequence (from
            the driver rank 0).
        prompt_logprobs: Logprobs of the prompt targets (from the driver rank 0).
    """

    step_id: int
    sampled_token_ids: dict[str, TokenIds] = attrs.field(factory=dict, converter=_token_sequences)
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    expired_sending: frozenset[str] = frozenset()
    expired_recving: frozenset[str] = frozenset()
    missing_ranks: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    invalid_block_ids: frozenset[int] = frozenset()
    failed_save_req_ids: frozenset[str] = frozenset()
    request_errors: dict[str, str] = attrs.field(factory=dict)
    stats: KVStats = attrs.field(factory=KVStats)
    load_failures: LoadFailures = attrs.field(factory=LoadFailures)
    save_failures: SaveFailures = attrs.field(factory=SaveFailures)
    num_ranks: int = 1
    logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.field(
        factory=dict, converter=_logprob_sequences
    )
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class SpecDecodeStats:
    """Speculative decoding's drafts and what became of them, over one step or many
    (``+`` adds two); vLLM's ``SpecDecodingStats``.

    Attributes:
        num_drafts: Requests that had drafts verified (one draft sequence each per step).
        num_draft_tokens: Drafts verified.
        num_accepted_tokens: Of those, the ones kept.
        accepted_per_position: How often the draft at each position (0: the first after
            the request's token) was kept; its length is the longest draft sequence seen.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(cls, outcomes: Iterable[tuple[int, int]]) -> SpecDecodeStats:
        """The counts of ``(drafted, accepted)`` pairs, one per drafted request."""
        stats = cls()
        for drafted, accepted in outcomes:
            stats = stats.with_draft(drafted, accepted)
        return stats

    def with_draft(self, drafted: int, accepted: int) -> SpecDecodeStats:
        """These counts plus one request's ``drafted`` drafts, of which the first
        ``accepted`` were kept."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"{accepted} drafts accepted of {drafted}")
        return self + SpecDecodeStats(
            num_drafts=1,
            num_draft_tokens=drafted,
            num_accepted_tokens=accepted,
            accepted_per_position=(1,) * accepted + (0,) * (drafted - accepted),
        )

    def __add__(self, other: SpecDecodeStats) -> SpecDecodeStats:
        """Two counts together (positions added one by one; the shorter padded)."""
        mine, theirs = self.accepted_per_position, other.accepted_per_position
        size = max(len(mine), len(theirs))
        mine += (0,) * (size - len(mine))
        theirs += (0,) * (size - len(theirs))
        return SpecDecodeStats(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_position=tuple(a + b for a, b in zip(mine, theirs, strict=True)),
        )

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted (``None`` without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a drafted request got per step: one plus its kept drafts, on average
        (vLLM's mean acceptance length; ``None`` without drafts)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@attrs.frozen(kw_only=True)
class DraftsProposed:
    """What speculative decoding's ``propose`` stage did in a step.

    Attributes:
        num_requests: Requests given drafts for the next step.
        num_draft_tokens: Drafts given.
        without_drafts: Requests seen decoding for the first time that get no drafts,
            by reason (:func:`~stages.speculative.no_drafts_reason`); each request is
            counted once.
        proposer_failures: Proposer calls that raised this step (their requests went
            on without drafts).
    """

    num_requests: int = 0
    num_draft_tokens: int = 0
    without_drafts: Mapping[str, int] = attrs.field(factory=dict)
    proposer_failures: int = 0


@attrs.frozen(kw_only=True)
class EngineStepOutput:
    """The engine's result of one step: an output for every request that advanced,
    the step's connector traffic (``stats``) and, when requests had speculative drafts
    verified, what became of them (``spec_decode``)."""

    step_id: int
    outputs: tuple[RequestOutput, ...] = ()
    num_scheduled_tokens: int = 0
    num_requests: int = 0
    stats: KVStats = attrs.field(factory=KVStats)
    spec_decode: SpecDecodeStats | None = None
