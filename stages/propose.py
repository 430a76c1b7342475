"""``propose``: speculative decoding's drafts for the next step, after ``update``.

The engine graph of an engine with ``speculative_config`` is
``schedule → execute → fan_in → update → propose ⟂ fail_step``: once the step's tokens
are applied, each running request that speculates
(:func:`~stages.speculative.speculates`: nothing but temperature, top-k/p and
min-p processing its logits) and
whose next step is a decode gets drafts from the proposer: up to its budget
(:class:`~stages.speculative.budget.DraftBudget`: ``num_speculative_tokens`` at first,
then one more than it kept last time, none for a while after misses), fewer when its
``max_tokens`` or ``max_model_len`` leaves less room. The
scheduler puts them after the request's token in the next step
(:mod:`stages.scheduler.policy`), the forward pass computes them, ``sample`` keeps the
ones that hold (:func:`~stages.speculative.verify_drafts`), and ``update`` takes the
rejected ones back (their KV is overwritten, never cached, saved or announced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import anyio
import attrs

from pipeline.artifacts import DraftsProposed, EngineStepOutput
from pipeline.kernel.context import StepContext
from pipeline.logger import get_logger
from stages.speculative import Proposer, no_drafts_reason
from stages.speculative.budget import DraftBudget
from stages.speculative.proposer import BatchProposer

if TYPE_CHECKING:
    from pipeline.request import Request
    from stages.scheduler.scheduler import Scheduler

__all__ = ["ProposeStage"]

log = get_logger()


@attrs.frozen
class ProposeStage:
    """Sets each speculating request's drafts for its next step; says which decoding
    requests get none, and why (:class:`~pipeline.artifacts.DraftsProposed`; a warning
    the first time each reason occurs)."""

    name: ClassVar[str] = "propose"
    requires: ClassVar[tuple[type, ...]] = (EngineStepOutput,)
    provides: ClassVar[type] = DraftsProposed

    scheduler: Scheduler
    proposer: Proposer | BatchProposer
    budget: DraftBudget
    _counted: set[str] = attrs.field(factory=set, init=False)  # requests without drafts
    _warned: set[str] = attrs.field(factory=set, init=False)  # reasons, failure types

    def _limit(self, request: Request, seen: list[str], without: dict[str, int]) -> int:
        """How many drafts ``request`` may get now (0: none)."""
        reason = no_drafts_reason(request.sampling_params)
        if reason is not None:
            if request.request_id not in self._counted:
                self._counted.add(request.request_id)
                without[reason] = without.get(reason, 0) + 1
            return 0
        seen.append(request.request_id)
        room = (
            min(
                request.sampling_params.max_tokens - request.num_output_tokens,
                self.scheduler.max_model_len - request.num_tokens,
            )
            - 1
        )  # the token after the drafts must fit too
        return max(0, min(room, self.budget.limit(request.request_id)))

    async def run(self, ctx: StepContext) -> DraftsProposed:
        self.budget.observe(self.scheduler.step_draft_outcomes)
        seen: list[str] = []
        without: dict[str, int] = {}
        failures: list[str] = []
        proposer = self.proposer
        if isinstance(proposer, BatchProposer):
            wanted: dict[str, tuple[list[int], int]] = {}

            def collect(request: Request) -> list[int]:
                limit = self._limit(request, seen, without)
                if limit:
                    wanted[request.request_id] = (list(request.all_token_ids), limit)
                return []

            self.scheduler.propose_drafts(collect)
            drafts: dict[str, list[int]] = {}
            try:
                if wanted:
                    drafts = await anyio.to_thread.run_sync(proposer.propose_batch, wanted)
                proposer.retain(seen)
            except Exception as exc:  # drafts are optional: the step goes on without
                failures.append(self._failed(exc))
                drafts = {}
            given = self.scheduler.propose_drafts(lambda r: drafts.get(r.request_id, []))
            drafted = sum(1 for d in drafts.values() if d)
        else:
            counts = [0]

            def propose(request: Request) -> list[int]:
                limit = self._limit(request, seen, without)
                try:
                    out = proposer.propose(request.all_token_ids, limit) if limit else []
                except Exception as exc:  # this request goes on without drafts
                    failures.append(self._failed(exc))
                    return []
                counts[0] += bool(out)
                return out

            given = self.scheduler.propose_drafts(propose)
            drafted = counts[0]
        self.budget.retain(seen)  # a request that is not decoding starts afresh
        if self._counted:
            self._counted.intersection_update(self.scheduler.unfinished_request_ids())
        for reason in without.keys() - self._warned:
            self._warned.add(reason)
            log.warning("speculative decoding: requests get no drafts", reason=reason,
                        counted_in="kvstep_spec_decode_requests_without_drafts_total")  # fmt: skip
        return DraftsProposed(
            num_requests=drafted,
            num_draft_tokens=given,
            without_drafts=without,
            proposer_failures=len(failures),
        )

    def _failed(self, exc: Exception) -> str:
        """Log a proposer's failure (at error level the first time its type occurs, at
        debug level after) and return its short form; its requests get no drafts."""
        kind = type(exc).__name__
        level = log.debug if f"failure:{kind}" in self._warned else log.error
        self._warned.add(f"failure:{kind}")
        level("speculative decoding: the proposer failed; no drafts this step",
              error=repr(exc), counted_in="kvstep_spec_decode_proposer_failures_total")  # fmt: skip
        return kind
