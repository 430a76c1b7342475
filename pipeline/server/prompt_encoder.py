"""Text prompts to token ids, off the event loop, refusing what cannot fit first.

A text prompt is encoded on a worker thread (long ones; short ones inline), and one that
provably cannot fit in the context is refused before it is encoded at all.

The proof (``max_token_bytes``): for a byte-level BPE tokenizer (``ByteLevel``
pre-tokenizer, a ``BPE`` model whose vocabulary holds all 256 byte symbols, no
normalizer), every byte of the UTF-8 text lands in exactly one token, and no token
covers more than ``L`` bytes, where ``L`` is the longest vocabulary entry (one symbol
is one byte) or added-token content. The post-processor only adds tokens. So a text of
``B`` bytes encodes to at least ``ceil(B / L)`` tokens, and it cannot fit when that is
``>= max_model_len``. Any other tokenizer (a normalizer may delete text, an unknown
token may swallow a whole word) gets no bound: its prompts are encoded, on a thread,
within the body cap, and the engine checks the length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from pipeline.errors import InvalidRequestError

__all__ = ["INLINE_ENCODE_BYTES", "PromptEncoder", "max_token_bytes"]

INLINE_ENCODE_BYTES = 2048


def max_token_bytes(tokenizer_json: dict[str, Any]) -> int | None:
    """The most UTF-8 bytes one token can cover, or ``None`` when no sound bound exists.

    ``tokenizer_json`` is the parsed ``tokenizer.json``; see the module doc for the rule.
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    model = tokenizer_json.get("model") or {}
    if tokenizer_json.get("normalizer") is not None:
        return None
    if pre.get("type") != "ByteLevel" or model.get("type") != "BPE":
        return None
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        return None
    if not _byte_alphabet() <= vocab.keys():
        return None  # some byte has no symbol: BPE would drop it silently
    longest = max(len(token) for token in vocab)
    for added in tokenizer_json.get("added_tokens") or ():
        longest = max(longest, len(str(added.get("content", "")).encode("utf-8")))
    return longest


def _byte_alphabet() -> set[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return set(ByteLevel.alphabet())


class PromptEncoder:
    """Encodes text prompts for one served model.

    Args:
        tokenizer: A :class:`pipeline.tokenizer.Tokenizer` (or anything with
            ``encode(text) -> list[int]`` and a ``path`` to its ``tokenizer.json``).
        max_model_len: The context length; a prompt must be shorter.
    """

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_bytes = _bound_of(tokenizer)
        self.limiter = anyio.CapacityLimiter(2)

    async def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ``InvalidRequestError`` (``prompt``) when it cannot fit."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "prompt",
                text[:40],
                "text prompts need a tokenizer (tokenizer.json) in the model directory, "
                "which this model has none of; pass the prompt as a list of token ids",
            )
        size = len(text.encode("utf-8"))  # the schema refused lone surrogates
        bound = self.max_token_bytes
        if bound is not None and math.ceil(size / bound) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"<{size} bytes>",
                f"cannot fit: it encodes to at least {math.ceil(size / bound)} tokens "
                f"(at most {bound} bytes per token) and max_model_len={self.max_model_len}",
            )
        if size <= INLINE_ENCODE_BYTES:
            ids: list[int] = self.tokenizer.encode(text)
            return ids
        encoded: list[int] = await anyio.to_thread.run_sync(
            self.tokenizer.encode, text, limiter=self.limiter
        )
        return encoded


def _bound_of(tokenizer: Any) -> int | None:
    path = getattr(tokenizer, "path", None)
    if not isinstance(path, Path) or not path.is_file():
        return None
    try:
        return max_token_bytes(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
