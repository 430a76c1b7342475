"""The logits seam: the step's logits between ``forward`` and ``sample``, and the stages
that change them.

The default worker graph is ``… → forward → logits → structured → sample → …``:
``forward`` provides the model's raw logits (:class:`~pipeline.artifacts.ModelOutput`),
the built-in ``logits`` stage turns them into a :class:`Logits` artifact with the
built-in adjustments applied (``min_tokens``, ``logit_bias``, the repetition, frequency
and presence penalties), ``structured`` masks the rows of requests with
``structured_outputs`` to their grammar (:mod:`stages.structured`), and ``sample`` draws
each row's token from the last version of it. A :class:`LogitsStage`
inserted after ``logits`` *amends* the artifact (it requires and provides
:class:`Logits`): amenders run in declaration order, each on the previous one's
logits::

    @attrs.frozen
    class ForceToken(LogitsStage):
        name: ClassVar[str] = "force_token"

        def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
            for row, params in enumerate(batch.params):
                if (token := params.extra_args.get("force")) is not None:
                    logits[row] = float("-inf")
                    logits[row, token] = 0.0
            return logits

    LLM(config, worker_graph=lambda g: g.insert_after("logits", ForceToken()))

Logits stages are compute stages (:mod:`pipeline.kernel.compute`): ``apply`` is
synchronous and runs on the model runner's compute thread, in the same hand-over as the
forward pass and the sampling. A stage that raises fails the rows it was applied to and
only those: the batch is retried row by row, and each row that still raises fails its
request alone, with the stage's name in the request's failure; the other rows go on.
Logprobs are of the raw logits (as vLLM's default), whatever the stages did.

Only the driver rank samples: on the other ranks of a tensor-parallel group the batch is
empty and no stage's ``apply`` is called.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, overload

import attrs

from pipeline.errors import short_repr
from pipeline.kernel.compute import ComputeStage
from pipeline.kernel.context import StepContext

if TYPE_CHECKING:
    import torch

    from pipeline.sampling_params import SamplingParams

__all__ = ["Logits", "LogitsBatch", "LogitsStage", "TokenColumn", "TokenView"]


class TokenView(Sequence[int]):
    """A read-only window ``tokens[start:stop]`` of a request's tokens, without a copy.

    The worker's history of a request grows every step; a view keeps the bounds it was
    made with, so it stays the tokens as they were at that step.
    """

    __slots__ = ("_start", "_stop", "_tokens")

    def __init__(self, tokens: Sequence[int], start: int = 0, stop: int | None = None) -> None:
        self._tokens = tokens
        self._start = start
        self._stop = len(tokens) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return [self._tokens[i] for i in range(self._start, self._stop)[index]]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"token index {index} out of range for {n} tokens")
        return self._tokens[self._start + (index % n)]

    def __iter__(self) -> Iterator[int]:
        tokens = self._tokens
        return (tokens[i] for i in range(self._start, self._stop))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenView({list(self)!r})" if len(self) <= 16 else f"TokenView(<{len(self)}>)"


class TokenColumn(Sequence[Sequence[int]]):
    """One :class:`TokenView` per row, made when a row is read: a step whose stages read
    no tokens makes none.

    Args:
        histories: Each row's tokens so far (prompt then output).
        outputs: Each row's number of output tokens (the last ones of its history).
        part: ``"output"`` or ``"prompt"``: which end of each history a row shows.
    """

    __slots__ = ("_histories", "_outputs", "_prompt")

    def __init__(
        self, histories: Sequence[Sequence[int]], outputs: Sequence[int], part: str
    ) -> None:
        self._histories = histories
        self._outputs = outputs
        self._prompt = part == "prompt"

    def __len__(self) -> int:
        return len(self._histories)

    @overload
    def __getitem__(self, index: int) -> Sequence[int]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Sequence[int]]: ...

    def __getitem__(self, index: int | slice) -> Sequence[int] | Sequence[Sequence[int]]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        tokens = self._histories[index]
        cut = max(0, len(tokens) - self._outputs[index])
        return TokenView(tokens, 0, cut) if self._prompt else TokenView(tokens, cut)


@attrs.frozen
class LogitsBatch:
    """Who the rows of a step's logits belong to. Row ``i`` is request ``req_ids[i]``.

    Attributes:
        req_ids: The request of each row.
        params: Each row's :class:`~pipeline.sampling_params.SamplingParams` (its
            ``extra_args`` carry per-request arguments to custom stages).
        output_token_ids: Each row's generated tokens so far (the token this row
            samples comes next).
        prompt_token_ids: Each row's prompt.
    """

    req_ids: tuple[str, ...] = ()
    params: tuple[SamplingParams, ...] = ()
    output_token_ids: Sequence[Sequence[int]] = ()
    prompt_token_ids: Sequence[Sequence[int]] = ()

    def __len__(self) -> int:
        return len(self.req_ids)

    def rows(self, rows: Sequence[int]) -> LogitsBatch:
        """The sub-batch of ``rows``, in that order."""
        return LogitsBatch(
            req_ids=tuple(self.req_ids[i] for i in rows),
            params=tuple(self.params[i] for i in rows),
            output_token_ids=tuple(self.output_token_ids[i] for i in rows),
            prompt_token_ids=tuple(self.prompt_token_ids[i] for i in rows),
        )


@attrs.frozen(eq=False)
class Logits:
    """The step's logits on their way to ``sample`` (an artifact that logits stages amend).

    Attributes:
        tensor: ``[rows, vocab]`` float logits, row ``i`` for ``batch.req_ids[i]``;
            ``None`` when the batch is empty (a step that samples nothing, or a rank
            that does not sample).
        batch: Who the rows are.
        failed: Request id → why a logits stage failed its row; ``sample`` gives those
            rows no token and their requests fail alone.
    """

    tensor: torch.Tensor | None = None
    batch: LogitsBatch = LogitsBatch()
    failed: Mapping[str, str] = attrs.field(factory=dict)

    def amend(
        self, stage: str, apply: Callable[[torch.Tensor, LogitsBatch], torch.Tensor]
    ) -> Logits:
        """The logits after ``apply`` (a stage named ``stage``); rows it fails on fail alone.

        ``apply`` gets the whole batch first. If it raises (or returns something that is
        not a tensor of the same shape), it is called again on each row that has not
        failed yet, alone, and the rows that still fail are added to :attr:`failed`
        (their logits are kept as they were). A stage that changes ``logits`` in place
        and then raises leaves those changes in the rows it is then called on again
        alone (no copy is made on the common path, where nothing raises): write a stage
        that checks before it writes. Blocks: runs on the compute thread.

        ``apply`` runs under ``torch.inference_mode()``, as the forward pass that made
        the logits (an inference tensor): it may change them in place.
        """
        tensor = self.tensor
        if tensor is None or not len(self.batch):
            return self
        import torch

        with torch.inference_mode():
            try:
                return Logits(
                    _checked(stage, apply(tensor, self.batch), tensor), self.batch, self.failed
                )
            except Exception:
                pass  # find the rows that fail on their own
            return self._row_by_row(stage, apply, tensor)

    def _row_by_row(
        self,
        stage: str,
        apply: Callable[[torch.Tensor, LogitsBatch], torch.Tensor],
        tensor: torch.Tensor,
    ) -> Logits:
        """:meth:`amend`'s second pass: each row alone; the rows that fail are failed."""
        rows, failed = [], dict(self.failed)
        for i, req_id in enumerate(self.batch.req_ids):
            if req_id in failed:
                rows.append(tensor[i : i + 1])
                continue
            try:
                part = apply(tensor[i : i + 1].clone(), self.batch.rows([i]))
                rows.append(_checked(stage, part, tensor[i : i + 1]))
                continue
            except _ShapeError as exc:
                failed[req_id] = str(exc)
            except Exception as exc:
                failed[req_id] = f"logits stage {stage!r} failed: {short_repr(exc, 200)}"
            rows.append(tensor[i : i + 1])
        import torch

        return Logits(torch.cat(rows), self.batch, failed)


class _ShapeError(TypeError):
    """A logits stage returned something that is not logits of the batch's shape."""


def _checked(stage: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` if it is a tensor shaped like ``like``; a ``TypeError`` naming ``stage``."""
    shape = getattr(value, "shape", None)
    if shape is None or tuple(shape) != tuple(like.shape) or not hasattr(value, "dtype"):
        got = f"shape {tuple(shape)}" if shape is not None else short_repr(value, 60)
        raise _ShapeError(
            f"logits stage {stage!r} returned {got}; it must return a tensor of shape "
            f"{tuple(like.shape)}"
        )
    return value


class LogitsStage(ComputeStage):
    """A stage that changes the step's logits before ``sample``; subclass and insert it
    after ``logits`` (``g.insert_after("logits", MyStage())``).

    Set ``name`` (a class attribute) and implement :meth:`apply`. Per-request arguments
    come in each row's ``params.extra_args``. See the module docstring.
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[type, ...]] = (Logits,)
    provides: ClassVar[type] = Logits

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        """Return the logits for ``batch`` (``[len(batch), vocab]``): ``logits`` changed in
        place, or a new tensor of its shape.

        Synchronous, on the compute thread, once per step that samples; not called for
        an empty batch. Raising fails the rows (see :meth:`Logits.amend`).
        """

    def compute(self, ctx: StepContext) -> Logits:
        """:meth:`apply` to the step's :class:`Logits`, each failing row failing alone."""
        return ctx.get(Logits).amend(self.name, self.apply)
