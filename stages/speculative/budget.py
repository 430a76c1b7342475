"""How many drafts each request gets next step: k adapts to what its drafts achieved.

A draft costs a forward-pass row whether it is kept or not, and a request whose text does
not repeat keeps none. So, per request (:class:`DraftBudget`):

- **k follows acceptance.** After a step in which a request kept ``a`` of its ``d``
  drafts, its next limit is ``a + 1`` (one more than what held; all of them held: one
  more than it had), never above ``num_speculative_tokens``. It starts at
  ``num_speculative_tokens``.
- **Misses back off.** A drafted step with nothing kept is a miss. From the second miss
  in a row the request proposes nothing for ``2 ** (misses - 1)`` steps (2, 4, 8, at
  most :data:`MAX_PAUSE` steps), then tries again with one draft; a step with a kept draft
  ends the run of misses. A request that never speculates well thus costs a draft row
  about once every ``MAX_PAUSE`` steps; one whose text starts repeating is back at full k
  within a few steps.

Steps in which the proposer had no guess (no n-gram match) change nothing: they cost
nothing. vLLM's n-gram proposer keeps k fixed (it can turn speculation off above a batch
size); SGLang adapts its draft length to acceptance; this is the per-request form of
the latter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import attrs

__all__ = ["MAX_PAUSE", "DraftBudget"]

#: The most steps a request goes without drafts after misses.
MAX_PAUSE: Final = 16


@attrs.define
class _Budget:
    limit: int
    misses: int = 0
    paused: int = 0


@attrs.define
class DraftBudget:
    """Per-request draft limits (see the module).

    Args:
        k: ``num_speculative_tokens``: the most drafts a request ever gets.

    Not thread-safe: owned by the ``propose`` stage, used on the event loop.
    """

    k: int
    _budgets: dict[str, _Budget] = attrs.field(factory=dict, init=False)

    def limit(self, req_id: str) -> int:
        """The most drafts ``req_id`` may get this step (0: none, it is paused); counts
        one paused step when it is 0."""
        budget = self._budgets.get(req_id)
        if budget is None:
            return self.k
        if budget.paused:
            budget.paused -= 1
            return 0
        return budget.limit

    def observe(self, outcomes: Mapping[str, tuple[int, int]]) -> None:
        """Account a step's ``{req_id: (drafts verified, drafts kept)}``."""
        for req_id, (drafted, kept) in outcomes.items():
            if drafted <= 0:
                continue
            budget = self._budgets.setdefault(req_id, _Budget(limit=self.k))
            if kept:
                budget.misses = 0
                budget.limit = min(self.k, kept + 1)
                continue
            budget.misses += 1
            budget.limit = 1
            if budget.misses >= 2:
                budget.paused = min(MAX_PAUSE, 2 ** (budget.misses - 1))

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the budgets of ``req_ids`` (finished requests); unknown ids are ignored."""
        for req_id in req_ids:
            self._budgets.pop(req_id, None)

    def retain(self, live: Iterable[str]) -> None:
        """Drop every budget but those of ``live``."""
        keep = set(live)
        for req_id in [r for r in self._budgets if r not in keep]:
            del self._budgets[req_id]

    def __len__(self) -> int:
        return len(self._budgets)
