"""``structured``: the structured-output logits stage (issue 26's first feature built on the
logits seam).

Rows whose request has ``SamplingParams.structured_outputs`` get every token their
grammar does not allow next set to ``-inf`` (a packed bitmask per row, filled by the
row's :class:`~pipeline.grammar.backend.Matcher`); the other rows are not touched, and a
batch without a constrained row costs a scan of its params. Each matcher follows its
request's accepted tokens, read from the batch (``LogitsBatch.output_token_ids``): at
each step it first accepts the tokens it has not seen (the one sampled last step, or a
whole output after a preemption, a recompute or a worker restart: it is rebuilt from
them), then fills the mask. So its state needs no hand-over from ``sample``, and survives
whatever the scheduler does with the request.

Where the grammar is complete the mask allows only the end-of-sequence token; a request
whose grammar allows no token (an output the grammar refuses, or ``ignore_eos`` past the
end) fails alone with the reason. Only the driver rank samples, so only it holds
matchers. Grammars come from the process's
:func:`~pipeline.grammar.compiler.compiler_for` (the engine compiled them before
scheduling the request: in-process they are cache hits).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import attrs

from pipeline.artifacts import SchedulerOutput
from pipeline.grammar.backend import Matcher, TokenizerInfo, apply_bitmask, bitmask_words
from pipeline.kernel.context import StepContext
from pipeline.logits import Logits, LogitsBatch, LogitsStage
from pipeline.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from pipeline.grammar.compiler import GrammarCompiler

__all__ = ["GrammarRows", "StructuredOutputStage", "tokenizer_info"]

STAGE_NAME = "structured"


def tokenizer_info(
    model: str, vocab_size: int, eos_token_id: int | list[int] | tuple[int, ...] | None
) -> TokenizerInfo | None:
    """The grammar backends' view of ``model``'s tokenizer; ``None`` without a
    ``tokenizer.json`` (structured outputs then fail their requests)."""
    from stages.model.builtin import tokenizer_dir

    path = Path(tokenizer_dir(model)) / "tokenizer.json"
    if not path.is_file():
        return None
    if isinstance(eos_token_id, list | tuple):
        eos_token_id = eos_token_id[0] if eos_token_id else None
    return TokenizerInfo(str(path), vocab_size, eos_token_id)


class _Row:
    __slots__ = ("accepted", "matcher", "params")

    def __init__(self, params: StructuredOutputsParams, matcher: Matcher) -> None:
        self.params = params
        self.matcher = matcher
        self.accepted = 0


class GrammarRows:
    """The driver's matchers, one per constrained request it has seen (the stage's
    cross-step state, outside the frozen stage). Not thread-safe: the compute thread's."""

    def __init__(self, tokenizer: TokenizerInfo | None, backend: str = "llguidance") -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self._rows: dict[str, _Row] = {}
        self._compiler: GrammarCompiler | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from pipeline.grammar.compiler import compiler_for

            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer.json")
            self._compiler = compiler_for(self.tokenizer, self.backend)
        return self._compiler

    def matcher(
        self, req_id: str, params: StructuredOutputsParams, tokens: Iterable[int]
    ) -> Matcher:
        """``req_id``'s matcher, having accepted every token of ``tokens`` (its output
        so far); rebuilt when the output is shorter than what it accepted."""
        row = self._rows.get(req_id)
        out = list(tokens)
        if row is None or row.params != params or len(out) < row.accepted:
            grammar = self.compiler().get(params)
            row = self._rows[req_id] = _Row(params, grammar.matcher())
        new = out[row.accepted :]
        if new:
            if not row.matcher.accept(new):
                del self._rows[req_id]
                raise ValueError(f"the output left the grammar: {row.matcher.error}")
            row.accepted = len(out)
        return row.matcher

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget the matchers of ``req_ids`` (finished or preempted requests)."""
        if self._rows:
            for req_id in req_ids:
                self._rows.pop(req_id, None)


@attrs.frozen
class StructuredOutputStage(LogitsStage):
    """Masks each constrained row's logits to the tokens its grammar allows next."""

    name: ClassVar[str] = STAGE_NAME
    requires: ClassVar[tuple[type, ...]] = (Logits, SchedulerOutput)

    rows: GrammarRows = attrs.field(eq=False)

    def compute(self, ctx: StepContext) -> Logits:
        """Forget the requests that ended, then mask the constrained rows."""
        self.rows.drop(ctx.get(SchedulerOutput).finished_req_ids)
        logits = ctx.get(Logits)
        if logits.tensor is None or not any(
            p.structured_outputs is not None for p in logits.batch.params
        ):
            return logits
        return logits.amend(self.name, self.apply)

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        import torch

        rows = [i for i, p in enumerate(batch.params) if p.structured_outputs is not None]
        if not rows:
            return logits
        bitmask = torch.empty(len(rows), bitmask_words(logits.shape[-1]), dtype=torch.int32)
        for j, i in enumerate(rows):
            params = batch.params[i].structured_outputs
            assert params is not None
            matcher = self.rows.matcher(batch.req_ids[i], params, batch.output_token_ids[i])
            matcher.fill_bitmask(bitmask, j)
        empty = (bitmask == 0).all(dim=1)
        if bool(empty.any()):
            j = int(empty.nonzero()[0])
            raise ValueError(
                f"no token can continue the output of {batch.req_ids[rows[j]]!r} "
                "under its structured_outputs (the grammar allows nothing here)"
            )
        apply_bitmask(logits, bitmask, rows)
        return logits
