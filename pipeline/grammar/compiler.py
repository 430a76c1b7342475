"""Compiling structured-output specs: off the caller's thread, cached, bounded.

A :class:`GrammarCompiler` serves one tokenizer and one backend. :meth:`~GrammarCompiler.submit`
starts a compile on the compiler's threads (or finds it cached or already running) and
returns its future; :meth:`~GrammarCompiler.get` blocks for it. Compiled grammars are
kept in an LRU of ``max_entries`` keyed by ``(kind, spec, reasoning)``; a spec that fails to compile
is not cached (its error is cheap to find again). :func:`compiler_for` shares one
compiler per (backend, tokenizer) in a process, so the engine's compile (while the
request waits, before it is scheduled) is the in-process driver's cache hit.

Thread-safe.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.errors import InvalidRequestError
from pipeline.grammar.backend import CompiledGrammar, GrammarBackend, TokenizerInfo
from pipeline.structured_outputs import GrammarKind, Reasoning, StructuredOutputsParams

__all__ = [
    "BACKENDS",
    "DEFAULT_COMPILE_TIMEOUT_S",
    "CompileStats",
    "GrammarCompiler",
    "compiler_for",
    "timed_out",
]

#: The grammar backends by name.
BACKENDS = ("llguidance", "xgrammar")
#: How long a request may wait for its grammar before it fails (seconds).
DEFAULT_COMPILE_TIMEOUT_S = 10.0

_Key = tuple[GrammarKind, str, Reasoning | None]


class CompileStats:
    """What a compiler did: ``hits``, ``misses`` and each miss's compile seconds."""

    __slots__ = ("hits", "misses", "seconds")

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.seconds: list[float] = []


class GrammarCompiler:
    """Compiles :class:`~pipeline.structured_outputs.StructuredOutputsParams` with one
    backend, on ``threads`` threads of its own, caching ``max_entries`` grammars."""

    def __init__(
        self,
        backend: GrammarBackend,
        *,
        max_entries: int = 256,
        threads: int = 2,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.backend = backend
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self.stats = CompileStats()
        self._lock = threading.Lock()
        self._done: OrderedDict[_Key, CompiledGrammar] = OrderedDict()
        self._running: dict[_Key, Future[CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstep-grammar")

    def cached(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar of ``params`` if it is cached (counts a hit), else ``None``."""
        key = params.key
        with self._lock:
            grammar = self._done.get(key)
            if grammar is not None:
                self._done.move_to_end(key)
                self.stats.hits += 1
            return grammar

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of ``params``' compiled grammar: done already when cached; one
        compile per spec however many requests ask for it at once. Its exception is an
        :class:`~pipeline.errors.InvalidRequestError` naming the field."""
        key = params.key
        with self._lock:
            grammar = self._done.get(key)
            if grammar is not None:
                self._done.move_to_end(key)
                self.stats.hits += 1
                done: Future[CompiledGrammar] = Future()
                done.set_result(grammar)
                return done
            running = self._running.get(key)
            if running is not None:
                self.stats.hits += 1
                return running
            self.stats.misses += 1
            future = self._pool.submit(self._compile, key)
            self._running[key] = future
            return future

    def get(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """``params``' compiled grammar, compiling it (on the compiler's threads) if it
        is not cached; blocks for at most ``timeout_s``.

        Raises:
            InvalidRequestError: It does not compile, or not within ``timeout_s``.
        """
        future = self.submit(params)
        try:
            return future.result(self.timeout_s)
        except TimeoutError:
            raise timed_out(params, self.timeout_s) from None

    def _compile(self, key: _Key) -> CompiledGrammar:
        kind, spec, reasoning = key
        start = time.perf_counter()
        try:
            grammar = self.backend.compile(kind, spec, reasoning=reasoning)
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                self._running.pop(key, None)
                self.stats.seconds.append(seconds)
                del self.stats.seconds[:-1024]
        with self._lock:
            self._done[key] = grammar
            while len(self._done) > self.max_entries:
                self._done.popitem(last=False)
        return grammar


def timed_out(params: StructuredOutputsParams, timeout_s: float) -> InvalidRequestError:
    """The error of a request whose grammar did not compile within ``timeout_s``."""
    return InvalidRequestError(
        f"structured_outputs.{params.kind}",
        params.spec,
        f"did not compile within {timeout_s:g} s (make the schema or grammar smaller)",
    )


@functools.lru_cache(maxsize=8)
def compiler_for(tokenizer: TokenizerInfo, backend: str = "llguidance") -> GrammarCompiler:
    """The process's compiler for ``tokenizer`` and ``backend`` (one of :data:`BACKENDS`).

    Raises:
        InvalidRequestError: An unknown backend, or its package is not installed.
    """
    if backend == "llguidance":
        from pipeline.grammar.guidance import GuidanceBackend

        return GrammarCompiler(GuidanceBackend(tokenizer))
    if backend == "xgrammar":
        from pipeline.grammar.xgrammar_backend import XGrammarBackend

        return GrammarCompiler(XGrammarBackend(tokenizer))
    raise InvalidRequestError("structured output backend", backend, f"must be one of {BACKENDS}")
