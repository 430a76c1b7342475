"""``propose``: speculative decoding's drafts for the next step, after ``update``.

The engine graph of an engine with ``speculative_config`` is
``schedule → execute → fan_in → update → propose ⟂ fail_step``: once the step's tokens
are applied, each running request that speculates
(:func:`~stages.speculative.speculates`: nothing but temperature, top-k/p and
min-p processing its logits, no logprobs) and
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

import attrs

from pipeline.artifacts import EngineStepOutput
from pipeline.kernel.context import StepContext
from stages.speculative import Proposer, speculates
from stages.speculative.budget import DraftBudget

if TYPE_CHECKING:
    from pipeline.request import Request
    from stages.scheduler.scheduler import Scheduler

__all__ = ["ProposeStage"]


@attrs.frozen
class ProposeStage:
    """Sets each speculating request's drafts for its next step."""

    name: ClassVar[str] = "propose"
    requires: ClassVar[tuple[type, ...]] = (EngineStepOutput,)
    provides: ClassVar[None] = None

    scheduler: Scheduler
    proposer: Proposer
    budget: DraftBudget

    def _drafts(self, request: Request, seen: list[str]) -> list[int]:
        if not speculates(request.sampling_params):
            return []
        seen.append(request.request_id)
        room = (
            min(
                request.sampling_params.max_tokens - request.num_output_tokens,
                self.scheduler.max_model_len - request.num_tokens,
            )
            - 1
        )  # the token after the drafts must fit too
        limit = min(room, self.budget.limit(request.request_id))
        if limit <= 0:
            return []
        return self.proposer.propose(request.all_token_ids, limit)

    async def run(self, ctx: StepContext) -> None:
        self.budget.observe(self.scheduler.step_draft_outcomes)
        seen: list[str] = []
        self.scheduler.propose_drafts(lambda request: self._drafts(request, seen))
        self.budget.retain(seen)  # a request that is not decoding starts afresh
