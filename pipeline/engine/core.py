"""The engine core: scheduler, executor and both step graphs, stepped one step at a time.

:class:`EngineCore` is driven by :class:`~pipeline.engine.async_engine.AsyncEngine` (which owns
the step loop) and, through it, by :class:`~pipeline.engine.llm.LLM`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import attrs

from connectors.base import KVConnectorRole, KVConnectorScheduler
from connectors.registry import create_connector, get_connector
from pipeline.artifacts import EngineStepOutput
from pipeline.config import EngineConfig, SamplingParams
from pipeline.engine.admission import (
    check_params,
    check_priority,
    check_prompt,
    check_tenant,
    new_request,
)
from pipeline.engine.kv_events import start_kv_events
from pipeline.engine.lora_registry import LoRARegistry
from pipeline.engine.output_text import OutputText
from pipeline.engine.step_record import record_engine_step
from pipeline.errors import EngineDeadError, InvalidRequestError
from pipeline.executors.backends import start_executor
from pipeline.executors.protocol import Executor
from pipeline.executors.worker import GraphArg, Worker, apply_graph, connector_context
from pipeline.grammar.backend import CompiledGrammar
from pipeline.grammar.compiler import compiler_for
from pipeline.kernel.context import StepContext
from pipeline.logger import get_logger
from pipeline.lora import LoRAAdapter
from pipeline.request import RequestOutput
from pipeline.steplog import StepLog, bind_step
from pipeline.structured_outputs import StructuredOutputsParams
from pipeline.tokenizer import load_tokenizer
from pipeline.transfer_params import check_transfer_params
from stages.fail_step import step_error
from stages.fan_in import FanInAggregator
from stages.graphs import default_engine_graph
from stages.model.builtin import tokenizer_dir
from stages.model.compute_thread import Compute
from stages.model.config import ModelConfig
from stages.model.runner_parts import resolve_device, resolve_dtype
from stages.schedule import StepLink
from stages.scheduler.scheduler import Scheduler
from stages.speculative import NgramProposer
from stages.speculative.draft_model import DraftModelProposer
from stages.structured import tokenizer_info

__all__ = ["EngineCore", "GraphArg"]

_log = get_logger()


class EngineCore:
    """Everything one engine owns. Not thread-safe: used from one event loop.

    Args:
        config: The engine configuration.
        worker_graph: A :class:`StepGraph` for every rank, or a function from the default
            worker graph of a rank to a new one.
        engine_graph: Likewise for the engine graph.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        worker_graph: GraphArg = None,
        engine_graph: GraphArg = None,
    ) -> None:
        if config.connector is not None:
            get_connector(config.connector)  # unknown names fail before the model loads
        if config.engine_id is None:  # one id per started engine, for every rank
            config = attrs.evolve(config, engine_id=uuid.uuid4().hex)
        self.config = config
        self.step_log = StepLog(config.step_log)
        self.workers: list[Worker] = []  # in-process ranks only
        self.executor: Executor
        try:
            started = start_executor(config, step_log=self.step_log, worker_graph=worker_graph)
            self.executor = started.executor
            self.workers = list(started.workers)
            self.model_config = started.model_config
            self.fingerprint = started.fingerprint
            num_blocks = started.num_blocks
            self.tokenizer = load_tokenizer(tokenizer_dir(config.model))
            self.connector: KVConnectorScheduler | None = None
            if config.connector is not None:
                self.connector = create_connector(
                    config.connector,
                    KVConnectorRole.SCHEDULER,
                    connector_context(
                        config,
                        role=KVConnectorRole.SCHEDULER,
                        rank=0,
                        fingerprint=self.fingerprint,
                    ),
                )
            self.scheduler = Scheduler.from_config(
                config, num_blocks=num_blocks, connector=self.connector
            )
            self.proposer = _proposer(
                config,
                self.model_config,
                num_blocks,
                compute=getattr(self.workers[0].runner, "compute", None) if self.workers else None,
            )
        except BaseException:
            self._abandon()
            raise
        self.linear_kernel = started.linear_kernel
        self.compiled = started.compiled
        self.step_log.record_model(
            model=config.model,
            dtype=config.dtype,
            device=config.device,
            world_size=config.world_size,
            executor=config.executor,
            num_blocks=num_blocks,
            block_size=config.block_size,
            linear_kernel=started.linear_kernel,
            compiled=started.compiled,
        )
        self.output_text = OutputText(self.tokenizer, self.scheduler.stop_requests)
        #: The LoRA adapters this engine has read (:class:`LoRARegistry`).
        self.loras = LoRARegistry(
            self.model_config, enabled=config.enable_lora, max_rank=config.max_lora_rank
        )
        self.aggregator = FanInAggregator(config.world_size, lease_s=config.transfer_lease_s)
        self.engine_graph = apply_graph(
            engine_graph,
            default_engine_graph(
                self.scheduler,
                self.executor,
                aggregator=self.aggregator,
                fan_in_timeout_s=config.fan_in_timeout_s,
                ahead=config.async_scheduling,
                proposer=self.proposer,
            ),
        )
        self.async_scheduling = config.async_scheduling
        self.grammar_tokenizer = tokenizer_info(
            config.model, self.model_config.vocab_size, self.model_config.eos_token_id
        )
        #: Called (from a compile thread) when a waiting request's grammar is compiled:
        #: the async engine wakes its loop with it.
        self.on_grammar_ready: Callable[[], None] | None = None
        self._closed = False
        try:  # last: nothing after it can fail and leave its thread running
            self.kv_events = start_kv_events(
                config, self.scheduler.kv_cache_manager.block_pool, self.connector
            )
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Release what a failed ``__init__`` had started (worker processes, runners)."""
        kill = getattr(getattr(self, "executor", None), "kill", None)
        if kill is not None:
            kill()
        for worker in self.workers:
            close = getattr(worker.runner, "close", None)
            if close is not None:
                close()
        proposer = getattr(self, "proposer", None)
        if isinstance(proposer, DraftModelProposer):
            proposer.close()
        self.step_log.close()

    # ----------------------------------------------------------------- requests

    def new_request_id(self) -> str:
        """A fresh request id, ``req-`` and a uuid4's hex: unguessable, since an id names
        a request's held KV to a connector and is shown to clients (``cmpl-<id>``)."""
        return f"req-{uuid.uuid4().hex}"

    def validate_prompt(self, prompt: object) -> list[int]:
        """Return the prompt as token ids, or raise ``InvalidRequestError`` naming it
        (:func:`~pipeline.engine.admission.check_prompt`)."""
        cache_tokens = self.scheduler.num_blocks * self.config.block_size
        return check_prompt(
            prompt,
            self.tokenizer,
            self.model_config.vocab_size,
            self.config.max_model_len,
            cache_tokens,
        )

    def validate_params(self, params: object) -> SamplingParams:
        """Return ``params`` if the workers will accept it, or raise
        ``InvalidRequestError`` (:func:`~pipeline.engine.admission.check_params`)."""
        return check_params(params, self.output_text, self.model_config.vocab_size)

    def validate_priority(self, priority: object, tenant: object = None) -> tuple[int, str | None]:
        """Return ``(priority, tenant)`` if this engine takes them, or raise
        ``InvalidRequestError`` naming the bad one: a non-zero ``priority`` needs
        ``scheduling_policy="priority"`` (as vLLM), a tenant is a short printable
        string (:func:`~pipeline.engine.admission.check_tenant`)."""
        return check_priority(priority, self.config.scheduling_policy), check_tenant(tenant)

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
        lora: LoRAAdapter | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> None:
        """Admit one request (its prompt already validated).

        Args:
            arrival_time: When the request arrived (``time.monotonic()``; default now):
                its queue time and TTFT count from there.
            kv_transfer_params: The request's data for the KV connector: checked, and a
                copy set on ``Request.kv_transfer_params`` before the scheduler sees the
                request (:mod:`pipeline.transfer_params`). It stays in this process;
                workers get only what the connector's metadata carries.
            lora: The request's LoRA adapter, one this engine's :attr:`loras` resolved
                (``None``: the base model).
            priority: Under ``scheduling_policy="priority"``, lower runs first (ties by
                arrival); must be 0 otherwise.
            tenant: Whose request it is, for ``tenant_fair_share`` (``None``: the
                unnamed tenant).

        Raises:
            InvalidRequestError: ``params`` is not a ``SamplingParams`` the workers'
                decoder accepts (e.g. altered after it was checked); ``arrival_time``
                is not a finite time in the past; ``kv_transfer_params`` is not a small
                JSON object; a bad ``priority`` or ``tenant`` (:meth:`validate_priority`).
        """
        self.validate_params(params)
        priority, tenant = self.validate_priority(priority, tenant)
        request = new_request(
            request_id,
            prompt,
            params,
            eos_token_id=self.model_config.eos_token_id,
            arrival_time=arrival_time,
            kv_transfer_params=kv_transfer_params,
            lora=self._known_lora(lora),
            priority=priority,
            tenant=tenant,
            kv_variant=self.model_config.prefix_cache_key(len(prompt)),
        )
        if self.connector is not None:
            self.connector.check_request(request)
        if params.structured_outputs is not None:
            request.grammar_wait = self._compile_grammar(params.structured_outputs)
        self.scheduler.add_request(request)
        self.output_text.add(request_id, params)

    def _known_lora(self, lora: LoRAAdapter | None) -> LoRAAdapter | None:
        """``lora`` if this engine resolved it (a request never brings its own identity
        of an adapter's weights)."""
        if lora is None or self.loras.holds(lora):
            return lora
        raise InvalidRequestError(
            "lora", getattr(lora, "name", lora), "is not an adapter this engine resolved"
        )

    def _compile_grammar(
        self, params: StructuredOutputsParams
    ) -> tuple[Future[Any], float, float] | None:
        """Start compiling ``params`` (off this thread); ``None`` when it is compiled
        already, else what the request waits on (``Request.grammar_wait``).

        Raises:
            InvalidRequestError: No tokenizer, no backend, or the spec is cached as
                failing (a compile that failed fast: the future is done).
        """
        future, timeout_s = self.grammar_future(params)
        if future.done():
            future.result()  # raises a compile error now, before anything is queued
            return None
        wake = self.on_grammar_ready
        if wake is not None:
            future.add_done_callback(lambda _: wake())
        return future, time.monotonic() + timeout_s, timeout_s

    def grammar_future(
        self, params: StructuredOutputsParams
    ) -> tuple[Future[CompiledGrammar], float]:
        """The future of ``params``' compiled grammar (done when cached) and how long a
        request may wait for it, in seconds.

        Raises:
            InvalidRequestError: The model has no tokenizer, or the backend's package is
                not installed.
        """
        if self.grammar_tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs", params, "needs a model with a tokenizer.json"
            )
        compiler = compiler_for(self.grammar_tokenizer, self.config.structured_outputs_backend)
        return compiler.submit(params), compiler.timeout_s

    def release_transfer(self, kv_transfer_params: object) -> bool:
        """Free what the connector holds for a transfer its receiver refused
        (:meth:`~connectors.base.KVConnectorScheduler.release_transfer`); whether
        anything is freed.

        Raises:
            InvalidRequestError: ``kv_transfer_params`` is not a small JSON object.
        """
        params = check_transfer_params(kv_transfer_params)
        if self.connector is None or params is None:
            return False
        return self.connector.release_transfer(params)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        aborted = self.scheduler.abort_requests(request_ids)
        self.aggregator.forget(out.request_id for out in aborted)
        return list(self.output_text.process(aborted))

    def has_work(self, *, ahead: bool = False) -> bool:
        """Whether a step would make progress: requests left, delayed frees, transfers
        the connector or fan-in still wait for (their lease expires on a step).
        ``ahead``: a step is in flight (async scheduling): whether one planned now could
        compute anything (transfers wait for the step in flight)."""
        if self.executor.check_alive() is not None:
            return True  # the next step raises EngineDeadError at once
        if ahead:
            return self.scheduler.has_unfinished_requests(ahead=True)
        waiting = self.aggregator.num_pending > 0
        requests = self.scheduler.has_unfinished_requests()
        return requests or waiting or self._connector_pending()

    def _connector_pending(self) -> bool:
        if self.connector is None:
            return False
        try:
            return bool(self.connector.has_pending_work())
        except Exception as exc:  # a failing probe must not kill the loop; assume drained
            _log.error("connector has_pending_work failed", error=repr(exc))
            return False

    # --------------------------------------------------------------------- step

    async def step(self, link: StepLink | None = None) -> EngineStepOutput:
        """Run one engine step: ``schedule → execute → fan_in → update ⟂ fail_step``.

        With ``link`` (async scheduling: an input of the engine graph, which its
        ``schedule`` stage takes), the step is planned at once and runs once
        ``link.previous`` is applied (:mod:`pipeline.engine.ahead`); ``link`` is
        finished once its outputs are applied or its requests failed.

        A failing step fails its own requests, not the engine: the graph's ``fail_step``
        finalizer (:class:`~stages.fail_step.FailStepStage`) fails them and leaves their
        outputs as the step's result, which this returns. What is re-raised instead is
        decided by :func:`stages.fail_step.step_error` (the failure table there).

        Raises:
            EngineDeadError: A worker rank is gone for good.
            Exception: The step's own error when the scheduler itself failed (no
                SchedulerOutput was produced, which leaves the engine in an unknown
                state), or when no finalizer failed the step's requests.
        """
        self._raise_if_dead()
        ctx = StepContext(self.scheduler.next_step_id, None, inputs=self._step_inputs(link))
        with bind_step(ctx.step_id):
            try:
                await self.engine_graph.run(ctx)
            except BaseException as exc:
                error = step_error(ctx, exc, dead=self._dead_error())
                if error is exc:
                    raise
                if error is not None:
                    raise error from error.__cause__
            finally:
                self._end_step(ctx)
        return ctx.get(EngineStepOutput)

    def _step_inputs(self, link: StepLink | None) -> tuple[object, ...]:
        """The engine graph's inputs for one step: its ``link`` under async scheduling
        (a fresh one, with no step before it, when the caller gave none)."""
        if StepLink not in self.engine_graph.inputs:
            return () if link is None else (link,)
        return (StepLink() if link is None else link,)

    def _end_step(self, ctx: StepContext) -> None:
        """After every step, whatever happened: text and stop strings, the link's
        hand-over to the next step, the KV events, the step log."""
        self._add_text(ctx)
        link = ctx.maybe(StepLink)
        if link is not None:
            link.finish(failed=ctx.error is not None or EngineStepOutput not in ctx)
        if self.kv_events is not None:
            self.kv_events.flush()
        if ctx.report is not None:
            record_engine_step(self.step_log, ctx)

    def publish_kv_events(self) -> None:
        """Publish the KV events recorded since the last batch (no-op when off)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def _add_text(self, ctx: StepContext) -> None:
        """Give the step's outputs their text, and stop the requests whose stop string
        matched (:class:`~pipeline.engine.output_text.OutputText`)."""
        out = ctx.maybe(EngineStepOutput)
        if out is not None:
            ctx.put(attrs.evolve(out, outputs=self.output_text.process(out.outputs)))

    def _raise_if_dead(self) -> None:
        dead = self._dead_error()
        if dead is not None:
            raise dead from dead.__cause__

    def _dead_error(self) -> EngineDeadError | None:
        """The engine's death, if the executor recorded one (its cause chained)."""
        # The executor's recorded failure only: has_work() polls the workers (the loop
        # calls it before every step), and a step notices a death through its replies.
        failure = self.executor.failure
        if failure is None:
            return None
        dead = EngineDeadError(
            f"worker rank {failure.rank} died: {failure.reason}; "
            f"the {self.config.executor} executor cannot run another step"
        )
        dead.__cause__ = failure
        return dead

    # ------------------------------------------------------------ introspection

    def leak_report(self) -> dict[str, int]:
        """Counts that must all be 0 when the engine is idle (blocks, requests, transfers)."""
        report = dict(self.scheduler.leak_report())
        report["fan_in_pending"] = self.aggregator.num_pending
        report["bound_metadata"] = self.executor.bound_metadata()
        report["text_trackers"] = len(self.output_text)
        return report

    async def aclose(self) -> None:
        """Close workers, connectors and the step log; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.executor.shutdown()
        finally:
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.close()
            if self.kv_events is not None:
                self.kv_events.close()
            self.step_log.close()


def _target_dtype(config: EngineConfig, target: ModelConfig) -> str:
    """The dtype the target runs in on this process's device: ``config.dtype`` with
    ``"auto"`` resolved against the target's checkpoint (a draft's own checkpoint may be
    saved in another dtype)."""
    device = resolve_device(config.device)
    return str(resolve_dtype(config.dtype, device, target.torch_dtype)).removeprefix("torch.")


def _proposer(
    config: EngineConfig, target: ModelConfig, num_blocks: int, *, compute: Compute | None = None
) -> NgramProposer | DraftModelProposer | None:
    """The drafts' proposer of ``config.speculative_config`` (``None``: off); a draft
    model is loaded with the target's settings and dtype and as many KV blocks
    (``num_blocks``), must have the target's vocabulary, and runs on ``compute`` (rank
    0's compute thread when the target runs in this process)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "draft_model":
        assert spec.model is not None
        return DraftModelProposer.load(
            spec.model,
            spec.num_speculative_tokens,
            vocab_size=target.vocab_size,
            num_blocks=num_blocks,
            compute=compute,
            dtype=_target_dtype(config, target),
            device=config.device,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            seed=config.seed,
            keep_freed_memory=config.keep_freed_memory,
        )
    return NgramProposer(
        k=spec.num_speculative_tokens, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max
    )
