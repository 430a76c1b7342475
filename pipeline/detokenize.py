"""Incremental detokenization: a stream's text deltas in O(1) decode work per token.

Shared by the engine (:mod:`pipeline.engine.output_text` makes ``RequestOutput.text``)
and the server, which must not import each other's layers.

Re-decoding a request's whole output on every chunk costs O(n) per chunk and O(n²) per
stream. :class:`Detokenizer` decodes only a bounded window, as vLLM's incremental
detokenizer and text-generation-inference do: ``prefix_offset`` marks where the window
starts (tokens already emitted, kept as context so a decoder that strips or merges at a
token boundary sees the same neighbour it would in the full decode), ``read_offset``
where the emitted text ends. Each call decodes ``ids[prefix_offset:]`` and emits what
it adds to ``decode(ids[prefix_offset:read_offset])``; text ending in U+FFFD (a UTF-8
character split across tokens) is held back until its last byte arrives. The window
then slides to the new read offset, so it spans the tokens since the last emission
plus the previous window: bounded by the longest run of held-back tokens.

On the last output the held text is flushed as the full decode has it. For byte-level
BPE tokenizers the concatenated deltas equal ``decode(all ids)`` exactly (the window
always starts on a UTF-8 boundary: text is emitted only when it does not end in a
split character); ``tests/pipeline/test_server_hardening.py`` checks it on random ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.request import RequestOutput

__all__ = ["Detokenizer", "decode_ids_text"]

_REPLACEMENT = "\ufffd"


def decode_ids_text(token_ids: Sequence[int]) -> str:
    """The text of ``token_ids`` without a tokenizer: `` <id>`` per token."""
    return "".join(f" {t}" for t in token_ids)


class Detokenizer:
    """Turns one request's growing token list into text deltas. Not thread-safe.

    Args:
        tokenizer: Anything with ``decode(ids, skip_special_tokens=True) -> str``, or
            ``None``: each token is then written as a space and its id.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._prefix_offset = 0
        self._read_offset = 0

    def delta(self, out: RequestOutput) -> str:
        """The text ``out`` adds to the request's output (flushed when it is finished)."""
        if self._tokenizer is None:
            return decode_ids_text(out.new_token_ids)
        return self.step(out.token_ids, final=out.finished)

    def step(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """The new text of ``token_ids`` (all output ids so far, a growing sequence)."""
        if len(token_ids) <= self._read_offset and not final:
            return ""
        window = list(token_ids[self._prefix_offset :])
        prefix_len = self._read_offset - self._prefix_offset
        decode = self._tokenizer.decode
        prefix_text = decode(window[:prefix_len], skip_special_tokens=True) if prefix_len else ""
        new_text = decode(window, skip_special_tokens=True)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # nothing yet, or a character still split across tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(token_ids)
        return str(new_text[len(prefix_text) :])
