"""What ``propose`` asks of a drafts' proposer (:class:`Proposer`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["BatchProposer", "Proposer"]


@runtime_checkable
class Proposer(Protocol):
    """Guesses a request's next tokens for speculative decoding.

    Called by :class:`~stages.propose.ProposeStage` on the event loop, once per
    speculating request and step, so it must be quick (the n-gram proposer takes
    microseconds). Its guesses never change a request's tokens, only how many steps they
    take: the target model verifies every draft.
    """

    @property
    def k(self) -> int:
        """The most drafts it proposes per request and step (``num_speculative_tokens``)."""
        ...

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to ``k`` drafts to follow ``token_ids`` (a request's prompt and output so
        far); empty when it has no guess."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that guesses for the step's requests together and blocks while it
    does (a draft model's forward passes): ``propose`` runs it off the event loop."""

    @property
    def k(self) -> int:
        """The most drafts it proposes per request and step."""
        ...

    def propose_batch(
        self, requests: Mapping[str, tuple[Sequence[int], int]]
    ) -> dict[str, list[int]]:
        """``{req_id: drafts}`` for ``{req_id: (its tokens so far, its limit)}``."""
        ...

    def retain(self, live: Collection[str]) -> None:
        """Forget every request but ``live`` (those still decoding)."""
        ...
