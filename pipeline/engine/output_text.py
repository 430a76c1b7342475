"""Output text: incremental detokenization, stop strings and hold-back, per request.

The engine core (:class:`~pipeline.engine.core.EngineCore`) passes every step's outputs,
and those of aborts, through one :class:`OutputText`, which fills
``RequestOutput.text``, ``new_text`` and, when a stop string matches,
``finish_reason="stop"`` and ``stop_reason``, as vLLM's output processor does:

* the text is the incremental detokenization of the output tokens
  (:class:`~pipeline.detokenize.Detokenizer`), so a step costs O(1) decode work;
* stop strings are searched only in the new characters, incrementally
  (:class:`StopMatcher`: a Knuth-Morris-Pratt automaton per stop string, fed each
  character once), so a step costs O(new characters x stop strings) however long
  the stop strings are (16 of 512 characters cost 1.2 ms per output when each step
  searched the text near the end and tried every partial match); a stop string split
  over several tokens is found when its last character arrives; the earliest match
  wins (:func:`find_stop` gives the same answer from scratch). Only once more than
  ``min_tokens`` tokens were generated, as vLLM;
* while the end of the text is a proper prefix of a stop string, that part is held
  back (neither in ``text`` nor ``new_text``), so a stream never emits text that a
  later match would cut off; it is flushed when the request ends for another reason
  (the automata know its length: :func:`held_back` from scratch);
* on a match the text ends just before the stop string (or just after it, with
  ``include_stop_str_in_output``), and the request is stopped in the scheduler at once
  (``stop_requests``: its blocks are freed, it generates nothing more); its
  ``token_ids`` keep the token that completed the match;
* a request stopped by a stop token or EOS does not detokenize that token (unless
  ``include_stop_str_in_output``), as vLLM.

A request gets a :class:`TextTracker` only when the engine has a tokenizer and its
``detokenize`` is on; the others pass through unchanged (``text=None``). A finished
request's tracker is dropped with its final output. Not thread-safe: the engine's
event loop only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import attrs

from pipeline.config import SamplingParams
from pipeline.detokenize import Detokenizer
from pipeline.errors import InvalidRequestError
from pipeline.logger import get_logger
from pipeline.request import RequestOutput

__all__ = ["OutputText", "StopMatcher", "TextTracker", "TextUpdate", "find_stop", "held_back"]

_log = get_logger()

#: Finish reasons whose final text is still searched for stop strings (an abort or an
#: error ends the request as it is).
_SEARCHED_AT_END = frozenset({"stop", "length"})


class TextUpdate(NamedTuple):
    """What one output of a request adds to its text.

    Attributes:
        text: The text emitted so far (cumulative).
        new_text: What this update adds to ``text``.
        stop: The stop string that matched, or ``None``.
    """

    text: str
    new_text: str
    stop: str | None


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The earliest stop string that the last ``new_chars`` characters of ``text``
    complete, and where it starts; ``None`` if none. Ties go to the first in ``stops``.

    Searches only ``text[len(text) - new_chars - len(stop) + 1:]`` per stop string: a
    match wholly inside the older text would have been found before.
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of one of
    ``stops`` (0 if none): the characters a stream must not emit yet.

    Only the positions of ``text``'s last character inside each stop string are tried,
    longest first, so the cost is about the number of such positions, not
    ``len(stop)**2``.
    """
    if not text:
        return 0
    last, best = text[-1], 0
    for stop in stops:
        index = stop.rfind(last, 0, len(stop) - 1)
        while index + 1 > best:  # candidate suffix: stop[: index + 1]
            if text.endswith(stop[: index + 1]):
                best = index + 1
                break
            index = stop.rfind(last, 0, index)
    return best


@functools.lru_cache(maxsize=1024)
def _borders(stop: str) -> tuple[int, ...]:
    """KMP's failure function: entry ``i`` is the length of the longest proper prefix
    of ``stop[: i + 1]`` that is also its suffix."""
    borders = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = borders[k - 1]
        if stop[i] == stop[k]:
            k += 1
        borders[i] = k
    return tuple(borders)


class StopMatcher:
    """Stop strings in a growing text, each character looked at once. Not thread-safe.

    Per stop string it keeps the length of the longest prefix of the stop string that
    the text ends with (a KMP automaton), so a full match is seen when its last
    character arrives, and that length is what a stream must hold back.

    Args:
        stops: The stop strings (non-empty).
    """

    __slots__ = ("_borders", "_fed", "_states", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._borders = [_borders(stop) for stop in self._stops]
        self._states = [0] * len(self._stops)
        self._fed = 0  # characters of the text seen so far

    def feed(self, text: str, *, search: bool = True) -> tuple[str, int] | None:
        """Read what ``text`` (the whole text so far: it only grows) adds since the last
        call; return the earliest stop string those characters complete and where it
        starts (ties: the first in ``stops``), as :func:`find_stop` does, or ``None``.
        With ``search`` false the characters are read and a match is not reported."""
        new = text[self._fed :]
        base = self._fed
        self._fed = len(text)
        best: tuple[str, int] | None = None
        for k, stop in enumerate(self._stops):
            borders, state, size, first = self._borders[k], self._states[k], len(stop), -1
            for offset, char in enumerate(new):
                while state and stop[state] != char:
                    state = borders[state - 1]
                if stop[state] == char:
                    state += 1
                if state == size:  # a whole match ends here; go on as a partial one
                    if first < 0:
                        first = base + offset - size + 1
                    state = borders[size - 1]
            self._states[k] = state
            if search and first >= 0 and (best is None or first < best[1]):
                best = (stop, first)
        return best

    def held(self) -> int:
        """The longest suffix of the text read that is a proper prefix of a stop
        string (0 if none), as :func:`held_back`."""
        return max(self._states, default=0)


class TextTracker:
    """One request's text: detokenizes its output tokens and looks for stop strings.

    Args:
        tokenizer: Anything with ``decode(ids, skip_special_tokens=True) -> str``.
        params: The request's sampling parameters (``stop``, ``min_tokens``,
            ``include_stop_str_in_output``).
    """

    __slots__ = ("_detok", "_emitted", "_include", "_min_tokens", "_stops", "_text")

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._detok = Detokenizer(tokenizer)
        self._stops = StopMatcher(params.stop) if params.stop else None
        self._include = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._text = ""  # everything detokenized so far (cut at a stop string)
        self._emitted = 0  # how much of it the outputs have carried

    def update(self, token_ids: Sequence[int], *, finish_reason: str | None = None) -> TextUpdate:
        """The text after ``token_ids`` (all output tokens so far, a growing sequence).

        Args:
            token_ids: The request's output tokens.
            finish_reason: The scheduler's finish reason when this is the request's
                last output (``"stop"``: a stop token or EOS ended it), else ``None``.

        Once this returns a ``stop`` (or is given a ``finish_reason``) the tracker is
        done: the text is final.
        """
        finished = finish_reason is not None
        ids = token_ids
        if finish_reason == "stop" and not self._include and token_ids:
            ids = token_ids[:-1]  # the stop token's (or EOS's) text is not output
        before = len(self._text)
        self._text += self._detok.step(ids, final=finished)
        stop = None
        searched = finish_reason is None or finish_reason in _SEARCHED_AT_END
        stops = self._stops
        if stops is not None and len(self._text) > before:
            search = searched and len(token_ids) > self._min_tokens
            found = stops.feed(self._text, search=search)
            if found is not None:
                stop, index = found
                self._text = self._text[: index + len(stop) if self._include else index]
        end = len(self._text)
        if not finished and stop is None and stops is not None and not self._include:
            end -= stops.held()
        new_text = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return TextUpdate(self._text[: self._emitted], new_text, stop)


class OutputText:
    """The engine's text processor: a :class:`TextTracker` per request that has one.

    Args:
        tokenizer: The engine's tokenizer, or ``None`` (no request gets text).
        stop_requests: Finishes requests with ``"stop"`` in the scheduler and returns
            their final outputs (:meth:`Scheduler.stop_requests`).
    """

    def __init__(
        self,
        tokenizer: Any,
        stop_requests: Callable[[Iterable[str]], list[RequestOutput]],
    ) -> None:
        self._tokenizer = tokenizer
        self._stop_requests = stop_requests
        self._trackers: dict[str, TextTracker] = {}

    def __len__(self) -> int:
        """Requests with a tracker (0 when the engine is idle)."""
        return len(self._trackers)

    def check(self, params: SamplingParams) -> SamplingParams:
        """``params``, or ``InvalidRequestError`` for stop strings without a tokenizer."""
        if params.stop and self._tokenizer is None:
            raise InvalidRequestError(
                "stop", params.stop, "stop strings need a tokenizer.json in the model directory"
            )
        return params

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Track an admitted request if it gets text (a tokenizer and ``detokenize``)."""
        if self._tokenizer is not None and params.detokenize:
            self._trackers[request_id] = TextTracker(self._tokenizer, params)

    def process(self, outputs: Sequence[RequestOutput]) -> tuple[RequestOutput, ...]:
        """``outputs`` with their text; stops the requests whose stop string matched.

        Never raises for one request: a tracker that fails (a tokenizer error) is
        logged and dropped, and that request's outputs carry no more text.
        """
        if not self._trackers:
            return tuple(outputs)
        result: list[RequestOutput] = []
        stopped: list[str] = []
        for out in outputs:
            tracker = self._trackers.get(out.request_id)
            if tracker is None:
                result.append(out)
                continue
            reason = out.finish_reason if out.finished else None
            try:
                update = tracker.update(out.token_ids, finish_reason=reason)
            except Exception as exc:
                _log.error("detokenize failed", req_id=out.request_id, error=repr(exc))
                del self._trackers[out.request_id]
                result.append(out)
                continue
            fields: dict[str, Any] = {"text": update.text, "new_text": update.new_text}
            if update.stop is not None:
                fields.update(finished=True, finish_reason="stop", stop_reason=update.stop)
                if not out.finished:
                    stopped.append(out.request_id)
            if out.finished or update.stop is not None:
                del self._trackers[out.request_id]
            result.append(attrs.evolve(out, **fields))
        if stopped:
            result = self._stop(result, stopped)
        return tuple(result)

    def _stop(self, outputs: list[RequestOutput], ids: list[str]) -> list[RequestOutput]:
        """Stop ``ids`` in the scheduler; their outputs take the final metrics and the
        connector's ``kv_transfer_params``."""
        final = {out.request_id: out for out in self._stop_requests(ids)}
        return [
            attrs.evolve(
                out,
                metrics=final[out.request_id].metrics,
                kv_transfer_params=final[out.request_id].kv_transfer_params,
            )
            if out.request_id in final
            else out
            for out in outputs
        ]
