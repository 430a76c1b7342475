"""Every request's tokens so far, kept by a worker: penalties and logits stages read them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.logits import LogitsBatch, TokenColumn

__all__ = ["TokenHistories"]


class TokenHistories:
    """Every token so far of each request.

    A new request starts from its ``prefix_token_ids`` (the cached tokens) and its
    chunk; later chunks extend it. A new request whose prefix is not the length of its
    cached context gets no history: its penalty rows fail alone at sampling, and
    logits stages see no tokens for it. Not thread-safe: owned by one
    :class:`~stages.model.runner.ModelRunner`.
    """

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def track(self, scheduler_output: SchedulerOutput) -> None:
        """Follow the step's scheduled tokens."""
        tokens = self._tokens
        for r in scheduler_output.requests:
            if r.new:
                tokens.pop(r.req_id, None)
                if len(r.prefix_token_ids) == r.num_computed_tokens:
                    tokens[r.req_id] = [*r.prefix_token_ids, *r.token_ids]
            elif r.req_id in tokens:
                tokens[r.req_id].extend(r.token_ids)

    def rows(self, scheduled: Sequence[ScheduledRequest]) -> list[list[int] | None] | None:
        """Each request's tokens (``None`` without a history); ``None`` when none has one."""
        if not self._tokens:
            return None
        return [self._tokens.get(r.req_id) for r in scheduled]

    def batch(self, scheduled: Sequence[ScheduledRequest]) -> LogitsBatch:
        """The :class:`~pipeline.logits.LogitsBatch` of rows ``scheduled`` (each samples
        after this step's chunk): their params, and views of their output and prompt
        tokens (made when read, no copies)."""
        empty: list[int] = []
        get = self._tokens.get
        histories = [get(r.req_id, empty) for r in scheduled]
        outputs = [r.num_output_tokens for r in scheduled]
        return LogitsBatch(
            req_ids=tuple([r.req_id for r in scheduled]),  # a list first: one call, not n
            params=tuple([r.sampling for r in scheduled]),
            output_token_ids=TokenColumn(histories, outputs, "output"),
            prompt_token_ids=TokenColumn(histories, outputs, "prompt"),
        )

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget ``req_ids``; unknown ids are ignored."""
        if self._tokens:
            for req_id in req_ids:
                self._tokens.pop(req_id, None)

    def clear(self) -> None:
        """Forget every request."""
        self._tokens.clear()
