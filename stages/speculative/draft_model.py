"""The draft-model proposer of speculative decoding (vLLM's ``method: "draft_model"``).

A small model with the target's vocabulary guesses each request's next tokens greedily.
Per step, for every request that gets drafts, batched: one forward pass over the tokens
the draft has not computed yet (the whole prompt the first time; then the tokens the
target kept since the last step) gives the first draft, and each further single-token
pass over the latest draft gives the next one, up to the request's limit.

The draft runs in the engine's process on its own
:class:`~stages.model.runner.ModelRunner` (its own paged KV cache, with as many blocks
as the target's), loaded with the target's dtype, device, block size and
``max_model_len``, on the target's compute thread when the target runs in the engine's
process (a second thread doing torch work slowed the target's decode 2.8x here: 65 vs
180 tok/s, the target as its own draft) and on a compute thread of its own otherwise.

Its block tables are its own: a request's blocks are taken from a free list as its
tokens grow and given back when it stops decoding. Its KV follows the request: after the
target rejected some drafts, the draft's KV of those positions is simply computed again
(the first mismatching token on), never trusted.

Load it with :meth:`DraftModelProposer.load`; :meth:`propose_batch` blocks (the ``propose`` stage
runs it off the event loop); :meth:`close` stops its runner.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.errors import InvalidConfigError
from pipeline.sampling_params import SamplingParams
from stages.model.compute_thread import Compute
from stages.model.runner import ModelRunner

__all__ = ["DraftModelProposer"]

_GREEDY = SamplingParams(temperature=0.0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@attrs.define
class _Mirror:
    """What the draft holds of one request: the tokens whose KV it computed, in order,
    and its block table."""

    token_ids: list[int] = attrs.field(factory=list)
    block_ids: list[int] = attrs.field(factory=list)
    known: bool = False  # the runner has the request's state (it was sent new=True)


class DraftModelProposer:
    """Proposes up to ``k`` drafts per request with a small model (see the module).

    Args:
        runner: The draft's runner (:meth:`load` builds it).
        k: ``num_speculative_tokens``.

    Not thread-safe: one :meth:`propose_batch` at a time (the ``propose`` stage's).
    """

    def __init__(self, runner: ModelRunner, k: int) -> None:
        self.runner = runner
        self._k = k
        self._free: list[int] = list(range(runner.num_blocks - 1, -1, -1))
        self._mirrors: dict[str, _Mirror] = {}
        self._dropped: set[str] = set()
        self._step = 0

    @property
    def k(self) -> int:
        """The most drafts per request and step."""
        return self._k

    @classmethod
    def load(
        cls,
        model: str,
        k: int,
        *,
        vocab_size: int,
        num_blocks: int,
        compute: Compute | None = None,
        **settings: Any,
    ) -> DraftModelProposer:
        """Load the draft ``model`` with the runner ``settings`` of the target (dtype,
        device, block size, ``max_model_len``, seed) and ``num_blocks`` KV blocks, on
        ``compute`` (the target's compute thread) when given.

        Raises:
            InvalidConfigError: The draft's vocabulary is not the target's
                (``vocab_size``), or the model does not load.
        """
        runner = ModelRunner.load(model, num_blocks=num_blocks, compute=compute, **settings)
        if runner.model_config.vocab_size != vocab_size:
            runner.close()
            raise InvalidConfigError(
                "speculative_config.model", model,
                f"has a vocabulary of {runner.model_config.vocab_size} tokens; the target's "
                f"is {vocab_size}: a draft model must share the target's tokenizer",
            )  # fmt: skip
        return cls(runner, k)

    def propose_batch(
        self, requests: Mapping[str, tuple[Sequence[int], int]]
    ) -> dict[str, list[int]]:
        """``{req_id: drafts}`` for ``{req_id: (its tokens so far, its limit)}``: at most
        ``min(limit, k)`` drafts each; none for a request the draft's KV cache has no
        room for. Blocks: the passes run on the draft runner's compute thread."""
        return self.runner.compute.call(self._propose, requests)

    def retain(self, live: Collection[str]) -> None:
        """Forget every request but ``live`` (those still decoding): their blocks go back
        to the free list, and the runner drops them with the next pass."""
        for req_id in [r for r in self._mirrors if r not in live]:
            mirror = self._mirrors.pop(req_id)
            self._free.extend(reversed(mirror.block_ids))
            if mirror.known:
                self._dropped.add(req_id)

    def close(self) -> None:
        """Stop the draft's runner (idempotent)."""
        self.runner.close()

    # ------------------------------------------------------------------ passes

    def _propose(self, requests: Mapping[str, tuple[Sequence[int], int]]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {req_id: [] for req_id in requests}
        limits: dict[str, int] = {}
        first: list[ScheduledRequest] = []
        for req_id, (tokens, limit) in requests.items():
            limit = min(limit, self._k)
            scheduled = self._catch_up(req_id, list(tokens), limit) if limit > 0 else None
            if scheduled is not None:
                first.append(scheduled)
                limits[req_id] = limit
        batch = first
        while batch:
            chosen = self._forward(batch)
            following: list[ScheduledRequest] = []
            for item in batch:
                token = chosen[item.req_id]
                mine = drafts[item.req_id]
                mine.append(int(token))
                if len(mine) < limits[item.req_id]:  # feed it to get the next one
                    mirror = self._mirrors[item.req_id]
                    following.append(self._scheduled(item.req_id, mirror, [token], ()))
                    mirror.token_ids.append(token)
            batch = following
        return drafts

    def _catch_up(self, req_id: str, tokens: list[int], limit: int) -> ScheduledRequest | None:
        """The first pass's share of ``req_id``: its tokens from the first one the draft
        has not computed (or computed for another token) to its last, with the blocks
        its last draft will need; ``None`` (no drafts) when the cache has no room."""
        mirror = self._mirrors.setdefault(req_id, _Mirror())
        valid = min(_common_prefix(mirror.token_ids, tokens), len(tokens) - 1)
        size = self.runner.block_size
        need = -(-(len(tokens) + limit - 1) // size) - len(mirror.block_ids)
        if need > len(self._free) or len(tokens) + limit - 1 > self.runner.max_model_len:
            return None
        new_blocks = tuple(self._free.pop() for _ in range(max(0, need)))
        mirror.block_ids.extend(new_blocks)
        del mirror.token_ids[valid:]
        scheduled = self._scheduled(req_id, mirror, tokens[valid:], new_blocks)
        mirror.token_ids.extend(tokens[valid:])
        return scheduled

    def _scheduled(
        self, req_id: str, mirror: _Mirror, feed: list[int], new_blocks: tuple[int, ...]
    ) -> ScheduledRequest:
        new = not mirror.known
        mirror.known = True
        return ScheduledRequest(
            req_id=req_id,
            token_ids=tuple(feed),
            num_computed_tokens=len(mirror.token_ids),
            block_ids=tuple(mirror.block_ids) if new else new_blocks,
            new=new,
            sampling=_GREEDY,
            sample=True,
            num_output_tokens=0,
            prefix_token_ids=tuple(mirror.token_ids) if new else (),
        )

    def _forward(self, batch: list[ScheduledRequest]) -> dict[str, int]:
        """One pass of the draft over ``batch``: each request's greedy next token."""
        self._step += 1
        dropped, self._dropped = frozenset(self._dropped), set()
        out = self.runner.execute(
            SchedulerOutput(step_id=self._step, requests=tuple(batch), finished_req_ids=dropped)
        )
        tokens = out.logits.argmax(dim=-1).tolist()
        return {req_id: int(t) for req_id, t in zip(out.req_ids, tokens, strict=True)}
