"""``propose``: speculative decoding's drafts for the next step, after ``update``.

The engine graph of an engine with ``speculative_config`` is
``schedule → execute → fan_in → update → propose ⟂ fail_step``: once the step's tokens
are applied, each running request that speculates
(:func:`~stages.speculative.speculates`: nothing but temperature, top-k/p and
min-p processing its logits, no logprobs) and
whose next step is a decode gets up to ``num_speculative_tokens`` drafts from the
proposer, fewer when its ``max_tokens`` or ``max_model_len`` leaves less room. The
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

    def _drafts(self, request: Request) -> list[int]:
        if not speculates(request.sampling_params):
            return []
        room = (
            min(
                request.sampling_params.max_tokens - request.num_output_tokens,
                self.scheduler.max_model_len - request.num_tokens,
            )
            - 1
        )  # the token after the drafts must fit too
        if room <= 0:
            return []
        return self.proposer.propose(request.all_token_ids, room)

    async def run(self, ctx: StepContext) -> None:
        self.scheduler.propose_drafts(self._drafts)
