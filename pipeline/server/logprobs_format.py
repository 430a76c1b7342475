"""Logprobs in the OpenAI (and vLLM) response shapes, from :class:`TokenLogprob` entries.

A token's text is its id decoded alone (special tokens kept, as vLLM does); without a
tokenizer it is a space and the id (``" 17"``, as :func:`decode_ids_text` writes output).
A logprob of ``-inf`` (a token the model rules out) is written as ``-9999.0``, vLLM's
stand-in, since JSON has no infinity.

- Completions (``logprobs: k``): ``{tokens, token_logprobs, top_logprobs, text_offset}``;
  each ``top_logprobs`` entry maps token text to logprob for the chosen token and the
  ``k`` most likely (so up to ``k + 1`` entries, as OpenAI documents). A token without an
  entry (the first prompt token of an echo) has ``null`` logprob and ``null`` top.
- Chat (``logprobs: true, top_logprobs: k``): ``{"content": [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}] * k}]}``, ``bytes`` the token text's UTF-8.
- vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then for each token an
  object of token id (a string) to ``{logprob, rank, decoded_token}``: the prompt token
  first, then the ``k`` most likely (ranks 1 to k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pipeline.logprobs import TokenLogprob

__all__ = [
    "TokenTexts",
    "chat_logprobs",
    "completion_logprobs",
    "json_logprob",
    "prompt_logprobs_json",
]

#: What a logprob of ``-inf`` (or NaN) is written as.
FLOOR = -9999.0

#: One token of a choice: its id and its logprob entry (``None``: not computed).
Entry = tuple[int, TokenLogprob | None]


def json_logprob(value: float) -> float:
    """``value`` fit for JSON: ``-inf`` and NaN become :data:`FLOOR`."""
    return max(value, FLOOR) if math.isfinite(value) else FLOOR


class TokenTexts:
    """Each token id's text alone, decoded once per response. Not thread-safe.

    Args:
        tokenizer: Anything with ``decode(ids, skip_special_tokens=...)``, or ``None``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f" {token_id}"
            else:
                text = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text


def completion_logprobs(
    entries: Sequence[Entry], top: int, texts: TokenTexts, offset: int = 0
) -> dict[str, list[Any]]:
    """A completions choice's ``logprobs`` for ``entries``; ``offset`` is where their
    text starts in the choice's text (the first ``text_offset``)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in entries:
        token = texts(token_id)
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(json_logprob(entry.logprob))
        alternatives = {token: json_logprob(entry.logprob)}
        for alt_id, alt_logprob in entry.top[:top]:
            alternatives.setdefault(texts(alt_id), json_logprob(alt_logprob))
        top_logprobs.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(entries: Sequence[Entry], top: int, texts: TokenTexts) -> list[dict[str, Any]]:
    """A chat choice's ``logprobs.content`` for ``entries`` (``top`` alternatives each)."""
    content = []
    for token_id, entry in entries:
        token = texts(token_id)
        item: dict[str, Any] = {"token": token, "logprob": FLOOR, "bytes": _bytes(token)}
        if entry is None:
            item["top_logprobs"] = []
        else:
            item["logprob"] = json_logprob(entry.logprob)
            item["top_logprobs"] = [
                {"token": texts(i), "logprob": json_logprob(lp), "bytes": _bytes(texts(i))}
                for i, lp in entry.top[:top]
            ]
        content.append(item)
    return content


def prompt_logprobs_json(
    prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None, texts: TokenTexts
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` of a prompt (``None`` when none were computed)."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt_ids, entries, strict=False):
        if entry is None:
            out.append(None)
            continue
        one = {str(token_id): _prompt_entry(entry.logprob, entry.rank, texts(token_id))}
        for rank, (alt_id, alt_logprob) in enumerate(entry.top, start=1):
            one.setdefault(str(alt_id), _prompt_entry(alt_logprob, rank, texts(alt_id)))
        out.append(one)
    return out


def _prompt_entry(logprob: float, rank: int, token: str) -> dict[str, Any]:
    return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": token}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
