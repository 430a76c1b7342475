"""The xgrammar grammar backend (optional: ``pip install xgrammar``).

xgrammar compiles a grammar ahead of time into a pushdown automaton with token masks
precomputed for most of its states, so a mask is usually a copy (several times faster per
row than llguidance), at the cost of a longer compile and of an import that loads
``transformers`` (its tokenizer reader). It reads JSON schemas, regexes and GBNF/EBNF
grammars (not Lark: a Lark ``grammar`` is a 400 naming the field), and has no lazy rule,
so a constraint cannot follow a reasoning section (``reasoning`` is refused: use
llguidance). ``choice`` is compiled as a grammar of its quoted strings.

JSON strings: xgrammar's string rule lets raw control characters (U+0000 to U+001F) into a
string when the schema bounds its length, which is not JSON; every string schema without a
``pattern`` is given one that excludes them and bounds the length as the schema does
(xgrammar ignores ``minLength``/``maxLength`` beside a pattern), so outputs parse. Its
JSON is compact (``any_whitespace=False``), as llguidance's is here.
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

__all__ = ["XGrammarBackend"]


def _import() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(
            "structured output backend",
            "xgrammar",
            "needs the xgrammar package: pip install 'kvstep[xgrammar]'",
        ) from None
    return xgrammar


def _strings_without_controls(node: object) -> object:
    """A copy of a JSON schema whose string schemas without a ``pattern`` get a pattern
    of characters other than U+0000 to U+001F, of their min/maxLength (recursive: a
    schema nests at most 32 levels, checked upstream)."""
    if isinstance(node, list):
        return [_strings_without_controls(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strings_without_controls(value) for key, value in node.items()}
    kind = out.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    if is_string and "pattern" not in out and "enum" not in out and "const" not in out:
        # xgrammar ignores min/maxLength beside a pattern: the pattern counts them.
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        count = "*" if not low and high is None else f"{{{low},{'' if high is None else high}}}"
        out["pattern"] = f"^[^\\u0000-\\u001f]{count}$"
    return out


class _XGrammarMatcher:
    """One request's :class:`xgrammar.GrammarMatcher`."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, tokens: Sequence[int]) -> bool:
        accept = self._matcher.accept_token
        return all(accept(int(token)) for token in tokens)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    @property
    def error(self) -> str | None:
        return None  # xgrammar refuses a token without a reason


class _XGrammarGrammar:
    __slots__ = ("_compiled", "_xgr")

    def __init__(self, xgr: Any, compiled: Any) -> None:
        self._xgr = xgr
        self._compiled = compiled

    def matcher(self) -> Matcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(self._compiled))


class XGrammarBackend:
    """xgrammar over one tokenizer (its vocabulary read once through ``transformers``)."""

    name = "xgrammar"

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        xgr = _import()
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer.path)
        stop = None if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=tokenizer.vocab_size, stop_token_ids=stop
        )
        self._xgr = xgr
        # The engine caches compiled grammars itself (GrammarCompiler); one thread each.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(
        self, kind: GrammarKind, spec: str, *, reasoning: Reasoning | None = None
    ) -> CompiledGrammar:
        what = f"structured_outputs.{kind}"
        if reasoning is not None:
            raise InvalidRequestError(
                "structured_outputs.reasoning",
                reasoning,
                "is not supported by the xgrammar backend (no lazy rule for the reasoning "
                "section); use the llguidance backend",
            )
        compiler = self._compiler
        try:
            if kind in ("json", "json_object"):
                schema = _strings_without_controls(json.loads(spec))
                compiled = compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False, strict_mode=True
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "choice":
                options = " | ".join(json.dumps(option) for option in json.loads(spec))
                compiled = compiler.compile_grammar(f"root ::= {options}")
            else:
                compiled = compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = short_repr(str(exc), 300)
            raise InvalidRequestError(what, spec, f"does not compile: {reason}") from None
        return _XGrammarGrammar(self._xgr, compiled)
