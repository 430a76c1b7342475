"""Grammar backends for structured outputs: compile a request's
:class:`~pipeline.structured_outputs.StructuredOutputsParams` and follow its output
with a :class:`~pipeline.grammar.backend.Matcher` (see :mod:`pipeline.grammar.backend`)."""

from pipeline.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    Matcher,
    TokenizerInfo,
    apply_bitmask,
    bitmask_words,
)

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "Matcher",
    "TokenizerInfo",
    "apply_bitmask",
    "bitmask_words",
]
