"""The n-gram proposer of speculative decoding (vLLM's ``method: "ngram"``, prompt lookup).

A request's next tokens are guessed from its own text: the longest suffix of its tokens
(prompt and output) of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens that occurred
before is looked up, and the tokens that followed that earlier occurrence are the drafts.
Text that repeats its input (editing, extraction, code refactoring, quoting) gets long
runs of accepted drafts; text that does not gets no match, hence no drafts and no cost.

Which occurrence: the longest n-gram wins; among the occurrences of that n-gram, the most
recent one (the latest context is the best guess of what comes next), and only one whose
continuation is at least one token long (the suffix itself never matches itself). At most
``num_speculative_tokens`` tokens are proposed, fewer when the continuation runs into
the end of the text.

Pure numpy on the caller's thread: one vectorised comparison per n-gram length over the
request's tokens (a few microseconds for a few thousand tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pipeline.errors import InvalidConfigError

__all__ = ["NgramProposer"]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(name, value, "must be a positive integer")
    return value


@attrs.frozen
class NgramProposer:
    """Proposes up to ``k`` draft tokens per request by prompt lookup.

    Args:
        k: ``num_speculative_tokens``: most drafts per request and step.
        min_n: ``prompt_lookup_min``: shortest suffix looked up.
        max_n: ``prompt_lookup_max``: longest suffix looked up (tried first).

    Raises:
        InvalidConfigError: A size that is not a positive integer, or ``min_n > max_n``,
            naming the vLLM field.
    """

    k: int
    min_n: int = 2
    max_n: int = 4

    def __attrs_post_init__(self) -> None:
        _positive("num_speculative_tokens", self.k)
        _positive("prompt_lookup_min", self.min_n)
        _positive("prompt_lookup_max", self.max_n)
        if self.min_n > self.max_n:
            raise InvalidConfigError(
                "prompt_lookup_min", self.min_n, f"must be <= prompt_lookup_max={self.max_n}"
            )

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """The drafts that follow ``token_ids`` (a request's prompt and output so far):
        at most ``k`` (default: :attr:`k`), empty when no suffix of ``min_n`` tokens or
        more occurred before. Pure; safe from any thread."""
        limit = self.k if k is None else min(k, self.k)
        tokens = np.asarray(token_ids)
        size = tokens.shape[0]
        if limit <= 0 or size <= self.min_n:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # Windows that start early enough to have a continuation: i + n <= size - 1.
            windows = sliding_window_view(tokens[: size - 1], n)
            hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in tokens[start : start + limit]]
        return []
