"""``AsyncEngine``: owns the step loop; one async iterator of outputs per request."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import TaskGroup

from pipeline.config import EngineConfig, SamplingParams
from pipeline.engine.ahead import StepLoopError, StepsAhead, unwrap_loop_error
from pipeline.engine.core import EngineCore, GraphArg
from pipeline.engine.inputs import check_one_prompt, check_sampling_params
from pipeline.engine.request_stream import RequestStream
from pipeline.errors import (
    EngineDeadError,
    EngineNotStartedError,
    EngineOverloaded,
    InvalidRequestError,
)
from pipeline.grammar.compiler import timed_out
from pipeline.logger import get_logger
from pipeline.lora import LoRAAdapter, LoRARequest
from pipeline.request import RequestOutput
from pipeline.structured_outputs import StructuredOutputsParams
from pipeline.transfer_params import check_transfer_params
from stages.model.compute_thread import threadsafe_call_soon, wake_loop

__all__ = ["AsyncEngine", "RequestStream"]

_log = get_logger()


class AsyncEngine:
    """An engine embedded in an async program (asyncio, or trio through anyio).

    Use as ``async with AsyncEngine(config) as engine``; the step loop runs while the
    context is open and stops (aborting what is left) when it closes.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        worker_graph: GraphArg = None,
        engine_graph: GraphArg = None,
    ) -> None:
        self.config = config or EngineConfig()
        self._graphs: dict[str, Any] = {"worker_graph": worker_graph, "engine_graph": engine_graph}
        self._core: EngineCore | None = None
        self._streams: dict[str, RequestStream] = {}
        self._aborts: deque[str] = deque()
        self._abort_lock = threading.Lock()
        self._wakeup = anyio.Event()
        self._dead: BaseException | None = None
        self._tg: TaskGroup | None = None
        self._closed = False
        self._stepping = False
        self.num_steps = 0

    @property
    def is_running(self) -> bool:
        """Whether the step loop is open (inside ``async with``) and has not died."""
        return self._core is not None and self._dead is None

    @property
    def is_idle(self) -> bool:
        """Whether the step loop is at rest: no step running, no abort waiting, and no
        step needed (no requests, no transfers). With async scheduling a step may still
        run after the last stream ended (its step was planned ahead)."""
        core = self._core
        if core is None or self._stepping or self._aborts:
            return False
        return not core.has_work()

    @property
    def is_dead(self) -> bool:
        """Whether the step loop died; every ``generate`` then raises ``EngineDeadError``."""
        return self._dead is not None

    @property
    def core(self) -> EngineCore:
        """The engine core; only while the engine runs.

        Raises:
            EngineNotStartedError: Before ``async with`` (not started) or after it (closed).
        """
        if self._core is None:
            if self._closed:
                raise EngineNotStartedError(
                    "the engine is closed (its `async with` block ended); start a new one"
                )
            raise EngineNotStartedError(
                "the engine is not started: use `async with AsyncEngine(...) as engine` first"
            )
        return self._core

    async def __aenter__(self) -> AsyncEngine:
        if self.config.inline_forward:  # the model loads on the thread that runs it
            self._core = EngineCore(self.config, **self._graphs)
        else:
            self._core = await anyio.to_thread.run_sync(
                lambda: EngineCore(self.config, **self._graphs)
            )
        self._wakeup = anyio.Event()
        call_soon = threadsafe_call_soon()
        self._core.on_grammar_ready = lambda: wake_loop(call_soon, self._wake)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._loop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None
            self._closed = True
            core, self._core = self._core, None
            if core is not None:
                with anyio.CancelScope(shield=True):
                    core.abort(list(self._streams))
                    await core.aclose()
            for stream in list(self._streams.values()):
                stream._deliver(EngineDeadError("the engine was closed"))
            self._streams.clear()
        return None

    # ----------------------------------------------------------------- requests

    def generate(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> RequestStream:
        """Admit one request; iterate the result for its outputs.

        ``prompt`` is one prompt: a string (needs a tokenizer) or a sequence of token ids;
        a list of prompts is refused (call ``generate`` once per prompt). Each output's
        ``new_text`` extends its ``text`` (never retracted: text that may begin a stop
        string is held back until it cannot), when the engine has a tokenizer.

        ``arrival_time`` (``time.monotonic()``, default now) is when the request arrived,
        e.g. when a server received it: the request's queue time and TTFT
        (``RequestOutput.metrics``) count from there.

        ``kv_transfer_params`` (vLLM's disaggregated prefill/decode) is the request's
        data for the KV connector, which reads it as ``Request.kv_transfer_params``: a
        small JSON object, checked and copied here (the caller may reuse its dict). The
        final output's ``kv_transfer_params`` is what the connector's
        ``request_finished`` returned.

        ``lora_request`` (``enable_lora``) runs the request with that LoRA adapter. An
        adapter the engine has not read yet is read and checked first, off the event
        loop (:meth:`add_lora`), and the request is admitted then; a bad adapter
        directory ends the stream with its ``InvalidRequestError`` when iterated.

        ``priority`` (vLLM's, with ``scheduling_policy="priority"``; must be 0 under
        ``"fcfs"``): lower runs first, ties by arrival; a running request of a lower
        priority is preempted when this one cannot start. ``tenant``: whose request it
        is, for ``tenant_fair_share`` (``None``: the unnamed tenant).

        Raises at once (before anything is queued): ``InvalidRequestError`` for a bad
        prompt, parameters (a ``dict`` where ``SamplingParams`` is expected),
        ``kv_transfer_params`` (:mod:`pipeline.transfer_params`), ``priority`` or
        ``tenant``,
        ``EngineOverloaded`` past ``max_queue_depth``, ``EngineDeadError`` when the step
        loop has died, ``EngineNotStartedError`` before ``async with`` or after it.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine's step loop died: {self._dead!r}") from self._dead
        core = self.core
        check_sampling_params(params)
        check_one_prompt(prompt)
        token_ids = core.validate_prompt(prompt)
        transfer = check_transfer_params(kv_transfer_params)
        priority, tenant = core.validate_priority(priority, tenant)
        params = SamplingParams() if params is None else params
        if len(self._streams) >= self.config.max_queue_depth:
            raise EngineOverloaded(len(self._streams), self.config.max_queue_depth)
        request_id = request_id or core.new_request_id()
        if request_id in self._streams:
            raise InvalidRequestError(
                "request_id", request_id, "must be unique among live requests"
            )
        lora = None if lora_request is None else core.loras.get(lora_request)
        stream = RequestStream(self, request_id)
        if lora_request is not None and lora is None:
            assert self._tg is not None
            self._streams[request_id] = stream
            arrival_time = time.monotonic() if arrival_time is None else arrival_time
            admit = functools.partial(
                core.add_request, request_id, token_ids, params, arrival_time,
                kv_transfer_params=transfer, priority=priority, tenant=tenant,
            )  # fmt: skip
            self._tg.start_soon(self._admit_with_adapter, stream, lora_request, admit)
            return stream
        core.add_request(
            request_id,
            token_ids,
            params,
            arrival_time,
            kv_transfer_params=transfer,
            lora=lora,
            priority=priority,
            tenant=tenant,
        )
        self._streams[request_id] = stream
        self._wakeup.set()
        return stream

    async def _admit_with_adapter(
        self, stream: RequestStream, lora_request: LoRARequest, admit: Callable[..., None]
    ) -> None:
        """Read ``lora_request``'s adapter off the loop, then admit the request (unless
        its stream was aborted meanwhile); a bad adapter ends the stream with its error."""
        request_id = stream.request_id
        try:
            lora = await self.add_lora(lora_request)
            if self._streams.get(request_id) is stream:
                admit(lora=lora)
        except InvalidRequestError as exc:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                stream._deliver(exc)
            return
        self._wakeup.set()

    async def add_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check ``lora_request``'s adapter (once per id; off the event loop);
        requests may then name it. vLLM's ``add_lora``.

        Raises:
            InvalidRequestError: LoRA is off (``enable_lora``), the id or name belongs to
                another adapter, or the directory is not an adapter of this model
                (:mod:`stages.model.lora_files`).
        """
        loras = self.core.loras
        known = loras.get(lora_request)
        if known is not None:
            return known
        return await anyio.to_thread.run_sync(loras.resolve, lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Forget the adapter ``lora_name`` (requests running with it finish with it);
        whether there was one."""
        return self.core.loras.remove(lora_name) is not None

    def list_loras(self) -> list[LoRAAdapter]:
        """The adapters the engine has read, in the order they were added."""
        return self.core.loras.adapters()

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile ``params``' grammar (or find it cached) without blocking the loop.

        ``generate`` does not need it (a request whose grammar compiles waits for it in
        the scheduler, others running meanwhile); a server calls it first so that a
        schema, regex or grammar that does not compile is refused before any request is
        admitted (an HTTP 400), not a request that fails later.

        Raises:
            InvalidRequestError: It does not compile, or not within the compile time
                bound; names ``structured_outputs.<kind>``.
        """
        future, timeout_s = self.core.grammar_future(params)
        if not future.done():
            done = anyio.Event()
            call_soon = threadsafe_call_soon()
            future.add_done_callback(lambda _: wake_loop(call_soon, done.set))
            with anyio.move_on_after(timeout_s):
                await done.wait()
            if not future.done():
                raise timed_out(params, timeout_s)
        future.result()

    def release_transfer(self, kv_transfer_params: object) -> bool:
        """Free at once what this engine holds for a KV transfer whose receiver refused
        the request (the ``kv_transfer_params`` this engine answered); whether anything
        was freed. Not thread-safe: call it from the engine's event loop.

        Raises:
            InvalidRequestError: ``kv_transfer_params`` is not a small JSON object.
        """
        freed = self.core.release_transfer(kv_transfer_params)
        if freed:
            self._wakeup.set()
        return freed

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with ``finish_reason="abort"``. Thread-safe."""
        self._request_abort(request_id)

    def abort_all(self) -> int:
        """Abort every live request (a server's drain at its deadline); each stream ends
        with ``finish_reason="abort"`` on the next pass of the step loop. Returns how
        many were asked. Call it from the engine's event loop."""
        ids = list(self._streams)
        for request_id in ids:
            self._request_abort(request_id)
        return len(ids)

    def _request_abort(self, request_id: str) -> None:
        with self._abort_lock:
            self._aborts.append(request_id)
        # Event.set is not thread-safe; the loop also polls the deque before each step.
        with contextlib.suppress(RuntimeError):
            self._wakeup.set()

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished."""
        return len(self._streams)

    def leak_report(self) -> dict[str, int]:
        report = self.core.leak_report()
        report["streams"] = len(self._streams)
        return report

    # --------------------------------------------------------------------- loop

    def _apply_aborts(self, core: EngineCore, *, in_flight: bool = False) -> None:
        """Abort the requests asked for. ``in_flight``: a step runs (async scheduling);
        a request the scheduler no longer knows then ended in a step whose outputs are
        not published yet, and its stream gets its final output from there."""
        with self._abort_lock:
            ids = list(self._aborts)
            self._aborts.clear()
        if ids:
            self._publish(core.abort(ids))
            if in_flight:
                return
            for request_id in ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._end()

    def _publish(self, outputs: tuple[RequestOutput, ...] | list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._deliver(out)
            if out.finished:
                del self._streams[out.request_id]

    def _wake(self) -> None:
        self._wakeup.set()

    async def _idle(self) -> None:
        with anyio.move_on_after(0.05):  # also polls aborts from other threads
            await self._wakeup.wait()
        self._wakeup = anyio.Event()

    async def _steps_in_series(self, core: EngineCore) -> None:
        while True:
            self._apply_aborts(core)
            if not core.has_work():
                await self._idle()
                continue
            self._stepping = True
            try:
                result = await core.step()
            finally:
                self._stepping = False
            self.num_steps += 1
            self._publish(result.outputs)
            await anyio.lowlevel.checkpoint()

    async def _steps_ahead(self, core: EngineCore) -> None:
        """Async scheduling: step N+1 is planned as soon as step N is, runs once N is
        applied, and N's outputs reach their streams while N+1 runs
        (:class:`~pipeline.engine.ahead.StepsAhead`)."""
        async with anyio.create_task_group() as tg:
            ahead = StepsAhead(core, tg)
            try:
                while True:
                    self._apply_aborts(core, in_flight=ahead.running)
                    if ahead.can_start() and core.has_work(ahead=ahead.running):
                        self._stepping = True
                        await ahead.start()
                        continue
                    self._stepping = ahead.running
                    if not ahead.running:
                        await self._idle()
                        continue
                    result = await ahead.next_result()
                    self.num_steps += 1
                    self._publish(result.outputs)
                    await anyio.lowlevel.checkpoint()
            except Exception as exc:  # a step failed the engine: stop the one after it
                tg.cancel_scope.cancel()
                raise StepLoopError(exc) from exc

    async def _loop(self) -> None:
        core = self.core
        try:
            try:
                if core.async_scheduling:
                    await self._steps_ahead(core)
                else:
                    await self._steps_in_series(core)
            except BaseExceptionGroup as group:  # the task group of _steps_ahead
                raise unwrap_loop_error(group) from None
            except StepLoopError as wrapped:
                raise wrapped.error from None
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._dead = exc
            _log.error("engine_dead", error=repr(exc))
            dead = EngineDeadError(f"the engine's step loop died: {exc!r}")
            dead.__cause__ = exc
            for stream in list(self._streams.values()):
                stream._deliver(dead)
            try:  # release what the dead loop held; the scheduler may be inconsistent
                core.abort(list(self._streams))
            except Exception as abort_exc:
                _log.error("engine_dead_abort_failed", error=repr(abort_exc))
            self._streams.clear()
