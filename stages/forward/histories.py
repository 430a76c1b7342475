"""The tokens of the requests whose sampling reads them (penalties), kept by a worker."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pipeline.artifacts import ScheduledRequest, SchedulerOutput

__all__ = ["TokenHistories"]


class TokenHistories:
    """Every token so far of each request with a penalty (``needs_history``).

    A new request starts from its ``prefix_token_ids`` (the cached tokens) and its
    chunk; later chunks extend it. A new request whose prefix is not the length of its
    cached context gets no history: its penalty rows fail alone at sampling. Not
    thread-safe: owned by one :class:`~stages.forward.runner.ModelRunner`.
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
                if r.sampling.needs_history and len(r.prefix_token_ids) == r.num_computed_tokens:
                    tokens[r.req_id] = [*r.prefix_token_ids, *r.token_ids]
            elif r.req_id in tokens:
                tokens[r.req_id].extend(r.token_ids)

    def rows(self, scheduled: Sequence[ScheduledRequest]) -> list[list[int] | None] | None:
        """Each request's tokens (``None`` without a history); ``None`` when none has one."""
        if not self._tokens:
            return None
        return [self._tokens.get(r.req_id) for r in scheduled]

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget ``req_ids``; unknown ids are ignored."""
        if self._tokens:
            for req_id in req_ids:
                self._tokens.pop(req_id, None)

    def clear(self) -> None:
        """Forget every request."""
        self._tokens.clear()
