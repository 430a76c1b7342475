"""The llguidance grammar backend (the default; extra ``kvstep[structured]``).

llguidance builds its token masks lazily from the grammar (no ahead-of-time automaton
over the vocabulary): a compile is a parse of the spec and a check against the
tokenizer, a mask one walk of the token trie per row (~15 µs for a JSON schema on a
small vocabulary). JSON schemas are compiled with llguidance's JSON defaults (compact
separators: ``{"a":1}``, as xgrammar's default); ``additionalProperties`` is as the schema
says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.errors import InvalidRequestError, short_repr
from pipeline.grammar.backend import CompiledGrammar, Matcher, TokenizerInfo

if TYPE_CHECKING:
    import torch

    from pipeline.structured_outputs import GrammarKind, Reasoning

__all__ = ["GuidanceBackend"]


def _import() -> Any:
    try:
        import llguidance
    except ImportError:
        raise InvalidRequestError(
            "structured_outputs",
            "llguidance",
            "needs the llguidance package: pip install 'kvstep[structured]'",
        ) from None
    return llguidance


class _GuidanceMatcher:
    """One request's :class:`llguidance.LLMatcher`."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def accept(self, tokens: Sequence[int]) -> bool:
        return bool(self._matcher.consume_tokens(list(tokens)))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self._matcher.get_error()) if self._matcher.is_error() else None


class _GuidanceGrammar:
    """A validated grammar and a template matcher that new matchers are copied from."""

    __slots__ = ("_template",)

    def __init__(self, template: Any) -> None:
        self._template = template

    def matcher(self) -> Matcher:
        return _GuidanceMatcher(self._template.deep_copy())


def _after_reasoning(grammar: str, reasoning: Reasoning) -> str:
    """``grammar`` (llguidance's Lark text or its JSON of grammars) after a reasoning
    section: free text up to ``</think>`` (a lazy rule: it ends at the first
    ``</think>``), then ``grammar`` as a sub-grammar."""
    if grammar.lstrip().startswith("{"):
        entries = list(json.loads(grammar)["grammars"])
    else:
        entries = [{"lark_grammar": grammar}]
    entries[0] = {**entries[0], "name": "constrained"}
    if reasoning == "required":
        start = 'start: "<think>"? think @constrained'
    else:
        start = 'start: ("<think>" think)? @constrained'
    main = f'{start}\nthink[stop="</think>"]: /(?s:.*)/\n'
    return json.dumps({"grammars": [{"lark_grammar": main}, *entries]})


class GuidanceBackend:
    """llguidance over one tokenizer (built once per tokenizer: ~10 ms)."""

    name = "llguidance"

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        llguidance = _import()
        with open(tokenizer.path, encoding="utf-8") as f:
            text = f.read()
        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(
            text, n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_token_id
        )

    def compile(
        self, kind: GrammarKind, spec: str, *, reasoning: Reasoning | None = None
    ) -> CompiledGrammar:
        llg, what = self._llg, f"structured_outputs.{kind}"
        try:
            if kind in ("json", "json_object"):
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    spec, defaults={"whitespace_flexible": False}
                )
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = llg.grammar_from("choice", spec)
            else:
                grammar = llg.grammar_from("grammar", spec)
            if reasoning is not None:
                grammar = _after_reasoning(grammar, reasoning)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(what, spec, f"does not compile: {exc}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise InvalidRequestError(what, spec, f"does not compile: {short_repr(error, 300)}")
        template = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            reason = short_repr(template.get_error(), 300)
            raise InvalidRequestError(what, spec, f"does not compile: {reason}")
        return _GuidanceGrammar(template)
