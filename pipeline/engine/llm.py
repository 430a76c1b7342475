"""``LLM``: the synchronous, offline front of the engine."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal

from pipeline.config import EngineConfig, SamplingParams
from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.core import GraphArg
from pipeline.engine.inputs import as_prompt_list, check_sampling_params
from pipeline.errors import EngineDeadError, InvalidRequestError
from pipeline.lora import LoRARequest
from pipeline.request import RequestOutput
from pipeline.transfer_params import transfer_params_per_prompt

__all__ = ["LLM"]


class LLM:
    """Generate for a prompt or a list of prompts, blocking until all are done.

    The engine runs on an event loop in a background thread (an anyio blocking portal),
    so ``LLM`` works from plain synchronous code. Use it as a context manager or call
    :meth:`close`.

    Args:
        config: The engine configuration (default: ``EngineConfig()``); keyword
            arguments build one when ``config`` is omitted.
        worker_graph / engine_graph: As for :class:`~pipeline.engine.async_engine.AsyncEngine`.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        worker_graph: GraphArg = None,
        engine_graph: GraphArg = None,
        **config_fields: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(**config_fields)
        elif config_fields:
            raise InvalidRequestError(
                "config_fields", sorted(config_fields), "pass either an EngineConfig or fields"
            )
        self.config = config
        self._threads_before = set(threading.enumerate())
        self._stack = contextlib.ExitStack()
        self._portal: BlockingPortal = self._stack.enter_context(start_blocking_portal())
        self.engine = AsyncEngine(config, worker_graph=worker_graph, engine_graph=engine_graph)
        self._stop: anyio.Event | None = None
        try:
            self._serving, _ = self._portal.start_task(self._serve)
        except BaseException:
            self._stack.close()
            raise
        self._closed = False

    async def _serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Holds the engine open in one task of the portal's loop until close()."""
        async with self.engine:
            self._stop = anyio.Event()
            task_status.started()
            await self._stop.wait()

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str] | Sequence[int] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        kv_transfer_params: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] = 0,
        tenant: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs are in prompt order.

        ``prompts`` is one prompt (a string, which needs a tokenizer, or a list of token
        ids) or a list of prompts: ``[1, 2, 3]`` is one prompt, ``[[1, 2], [3]]`` two,
        ``"hi"`` one, ``["a", "b"]`` two. The result is always a list, one output per
        prompt (a single prompt gives a list of one).

        Each result is the request's final output: its ``token_ids`` and, when the
        engine has a tokenizer and ``detokenize`` is on, its ``text`` (a ``stop``
        string ends it with ``finish_reason="stop"`` and ``stop_reason``).

        ``kv_transfer_params`` (vLLM's disaggregated prefill/decode) is each request's
        data for the KV connector: one dict for a single prompt, or a list of one dict
        (or ``None``) per prompt; each is checked and copied
        (:mod:`pipeline.transfer_params`). A result's ``kv_transfer_params`` is what the
        connector's ``request_finished`` returned for it.

        ``lora_request`` (``enable_lora``): one LoRA adapter for every prompt, or a list
        of one (or ``None``: the base model) per prompt. Each adapter is read and
        checked before any prompt is queued.

        ``priority`` (vLLM's; ``scheduling_policy="priority"``, else 0): one for every
        prompt or a list of one per prompt; lower runs first, ties by arrival (here: by
        prompt order). ``tenant`` (``tenant_fair_share``): one for every prompt, or a
        list of one (or ``None``) per prompt.

        A request that fails ends with ``finish_reason="error"``; the others complete.
        Bad input raises before any prompt is queued.

        Raises:
            InvalidRequestError: A bad prompt, parameters, ``kv_transfer_params``,
                ``priority`` or ``tenant`` (nothing was queued): an empty list, a
                ``dict`` (or anything else) where ``SamplingParams`` is expected, one
                transfer dict for several prompts.
            EngineDeadError: The engine died (a worker process or actor is gone).
        """
        prompt_list = as_prompt_list(prompts)
        check_sampling_params(params, many=True)
        if isinstance(params, SamplingParams) or params is None:
            per_prompt = [params or SamplingParams()] * len(prompt_list)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompt_list):
                raise InvalidRequestError(
                    "params", len(per_prompt), f"must be one SamplingParams or {len(prompt_list)}"
                )
        for each in per_prompt:
            self.engine.core.validate_params(each)
        checked = [self.engine.core.validate_prompt(p) for p in prompt_list]
        transfers = transfer_params_per_prompt(kv_transfer_params, len(prompt_list))
        ranks = self._ranks_per_prompt(priority, tenant, len(prompt_list))
        loras = self._loras_per_prompt(lora_request, len(prompt_list))
        return self._portal.call(self._generate, checked, per_prompt, transfers, loras, ranks)

    def _ranks_per_prompt(
        self, priority: int | Sequence[int], tenant: str | Sequence[str | None] | None, n: int
    ) -> list[tuple[int, str | None]]:
        """One checked ``(priority, tenant)`` per prompt."""
        priorities: list[object]
        if isinstance(priority, Sequence) and not isinstance(priority, str | bytes):
            if len(priority) != n:
                raise InvalidRequestError("priority", priority, f"must be an int or {n} of them")
            priorities = list(priority)
        else:
            priorities = [priority] * n
        tenants: list[object]
        if tenant is None or isinstance(tenant, str):
            tenants = [tenant] * n
        elif isinstance(tenant, Sequence) and len(tenant) == n:
            tenants = list(tenant)
        else:
            raise InvalidRequestError("tenant", tenant, f"must be a string, None, or {n} of them")
        core = self.engine.core
        return [core.validate_priority(p, t) for p, t in zip(priorities, tenants, strict=True)]

    def _loras_per_prompt(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[LoRARequest | None]:
        """One adapter (or ``None``) per prompt, each read and checked now."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * n
        elif isinstance(lora_request, Sequence) and len(lora_request) == n:
            loras = list(lora_request)
        else:
            raise InvalidRequestError(
                "lora_request", lora_request, f"must be a LoRARequest, None, or {n} of them"
            )
        for each in dict.fromkeys(loras):
            if each is not None:
                self._portal.call(self.engine.add_lora, each)
        return loras

    async def _generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        transfers: list[dict[str, Any] | None],
        loras: list[LoRARequest | None],
        ranks: list[tuple[int, str | None]],
    ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(prompts)
        limit = anyio.Semaphore(self.config.max_queue_depth)

        async def one(index: int) -> None:
            async with limit:
                stream = self.engine.generate(
                    prompts[index],
                    params[index],
                    kv_transfer_params=transfers[index],
                    lora_request=loras[index],
                    priority=ranks[index][0],
                    tenant=ranks[index][1],
                )
                async for out in stream:
                    results[index] = out

        try:
            async with anyio.create_task_group() as tg:
                for index in range(len(prompts)):
                    tg.start_soon(one, index)
        except BaseExceptionGroup as group:
            # Every stream of a dead engine raises the same EngineDeadError: raise it once.
            dead, rest = group.split(EngineDeadError)
            if dead is not None and rest is None:
                first: BaseException = dead.exceptions[0]
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                raise first from None
            raise
        return [r for r in results if r is not None]

    def leak_report(self) -> dict[str, int]:
        """Counts that must be 0 when idle; see ``EngineCore.leak_report``."""
        return self._portal.call(self.engine.leak_report)

    def close(self) -> None:
        """Stop the engine and its loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stop is not None:
                self._portal.call(self._stop.set)
            self._serving.result()
        finally:
            self._stack.close()
            self._join_worker_threads()

    def _join_worker_threads(self, timeout_s: float = 5.0) -> None:
        """Wait for the worker threads the engine's loop started to exit.

        They ran torch; once the portal's loop is gone they exit on their own, but
        asynchronously. A process that ends right after ``close()`` would otherwise race
        them through interpreter shutdown, where a thread exiting out of torch's C++
        code aborts the process ("terminate called without an active exception"; seen
        in about 1 run in 12 of a short script).
        """
        deadline = time.monotonic() + timeout_s
        for thread in set(threading.enumerate()) - self._threads_before:
            if thread.name == "AnyIO worker thread" and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
