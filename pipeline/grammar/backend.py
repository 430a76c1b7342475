"""What a grammar backend is: it compiles a request's
:class:`~pipeline.structured_outputs.StructuredOutputsParams` for one tokenizer into a
:class:`CompiledGrammar`, from which each request gets its own :class:`Matcher`.

A matcher follows one request's output: it fills the request's row of a packed token
bitmask (bit ``t % 32`` of word ``t // 32`` set: token ``t`` may come next) and accepts
the tokens the request samples. :func:`apply_bitmask` sets every masked-out logit of a
batch's rows to ``-inf``. Backends: llguidance (:mod:`pipeline.grammar.guidance`, the
default) and xgrammar (optional).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch

    from pipeline.structured_outputs import GrammarKind, Reasoning

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "Matcher",
    "TokenizerInfo",
    "apply_bitmask",
    "bitmask_words",
]


@attrs.frozen
class TokenizerInfo:
    """What a backend needs of a model's tokenizer.

    Attributes:
        path: The ``tokenizer.json`` (Hugging Face ``tokenizers``).
        vocab_size: The width of the model's logits (may exceed the tokenizer's
            vocabulary: the extra ids are never allowed).
        eos_token_id: The token that ends a request; allowed where the grammar may end.
    """

    path: str
    vocab_size: int
    eos_token_id: int | None


def bitmask_words(vocab_size: int) -> int:
    """Words (int32) of one row's bitmask."""
    return (vocab_size + 31) // 32


@runtime_checkable
class Matcher(Protocol):
    """One request's place in its grammar. Not thread-safe: one owner at a time."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, CPU, contiguous)."""

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance over ``tokens``; ``False`` (and :attr:`error` set) if the grammar
        refuses one: the matcher then stays in that error state."""

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` accepted tokens (speculative decoding)."""

    @property
    def is_terminated(self) -> bool:
        """Whether the output is complete: nothing but the end of the sequence may follow."""

    @property
    def error(self) -> str | None:
        """Why the matcher stopped following the output, or ``None``."""


class CompiledGrammar(Protocol):
    """A compiled grammar: immutable, shared by every request with the same spec."""

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the output."""


class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer. Thread-safe: compiles run on worker threads."""

    name: str

    def compile(
        self, kind: GrammarKind, spec: str, *, reasoning: Reasoning | None = None
    ) -> CompiledGrammar:
        """Compile ``spec`` (blocking, GIL released where the backend can); with
        ``reasoning``, the grammar lets a ``<think>...</think>`` section come first
        (see :attr:`~pipeline.structured_outputs.StructuredOutputsParams.reasoning`).

        Raises:
            InvalidRequestError: The spec does not compile; names
                ``structured_outputs.<kind>`` and the backend's reason.
        """


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[r, t]`` to ``-inf`` where ``bitmask``'s row for ``r`` clears bit
    ``t``, for each ``r`` of ``rows`` (``bitmask[i]`` is the mask of ``rows[i]``);
    columns past the mask's width (the model's padding ids) are cleared too. In place."""
    import torch

    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:  # the mask's tokenizer is narrower than the logits
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad], dim=1)
    allowed = allowed[:, :vocab].to(logits.device)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(list(rows), device=logits.device)
    part = logits.index_select(0, index)
    part.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, part)
