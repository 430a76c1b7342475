"""``forward`` and ``sample``: the model's pass over the step's batch, off the event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs

from connectors.base import KVConnectorWorker
from pipeline.artifacts import LoadStarted, ModelOutput, SampledTokens, SchedulerOutput
from pipeline.kernel.context import StepContext

if TYPE_CHECKING:
    from stages.forward.runner import ModelRunner

__all__ = ["ForwardStage", "SampleStage", "cost_key"]

_PRESAMPLED = "forward.presampled"
"""``ctx.scratch`` key: ``(model_output, SampledTokens | Exception)`` sampled by forward."""


def cost_key(
    runner: ModelRunner, scheduler_output: SchedulerOutput, connector: KVConnectorWorker | None
) -> tuple[int, int] | None:
    """The shape a pass's duration is estimated by (``ComputeThread.run``'s cost key):
    the number of requests and the power of two of the token count. ``None`` (always
    on the compute thread) off the CPU, where the pass is a launch; with more than one
    rank, whose pass waits for the others'; and when a connector's layer hooks run,
    which may wait for work of the event loop's.
    """
    if runner.device.type != "cpu" or runner.world_size != 1 or connector is not None:
        return None
    tokens = scheduler_output.total_num_scheduled_tokens
    return len(scheduler_output.requests), tokens.bit_length()


def _needs_sampling(model_output: ModelOutput) -> bool:
    return bool(model_output.req_ids) or model_output.prompt_logits is not None


def _forward_and_sample(
    runner: ModelRunner, scheduler_output: SchedulerOutput, connector: KVConnectorWorker | None
) -> tuple[ModelOutput, SampledTokens | Exception | None]:
    """On the compute thread: the forward pass, then its sample (an error is kept)."""
    model_output = runner.execute(scheduler_output, connector)
    if not _needs_sampling(model_output):
        return model_output, None
    try:
        return model_output, runner.sample(scheduler_output, model_output)
    except Exception as exc:  # the sample stage raises it, as if it had sampled
        return model_output, exc


@attrs.frozen
class ForwardStage:
    """Runs the model on the runner's compute thread; per-layer connector hooks run there.

    The event loop stays free while the pass runs, unless recent passes of the step's
    shape (:func:`cost_key`) were shorter than the runner's ``inline_forward_below_s``:
    then it runs on the loop's thread, without the two thread wake-ups. When ``load``
    bound nothing, the connector is not handed to the pass, so its layer hooks are not
    called. On a tensor-parallel rank the pass all-reduces with the other ranks
    (``collective``): a step that fails before it completes is fatal to the worker.

    With ``presample`` (the driver rank of the default graph), the same call on the
    compute thread also samples the logits, and :class:`SampleStage` takes the result
    from the step's context: one thread hop a step instead of two (a hop cost more than
    the sampling of a small batch). The sampling time then shows in ``forward``'s
    duration in the step log, and ``sample``'s is the hand-over.
    """

    name: ClassVar[str] = "forward"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, LoadStarted)
    provides: ClassVar[type] = ModelOutput
    collective: ClassVar[bool] = True

    runner: ModelRunner
    connector: KVConnectorWorker | None = None
    presample: bool = False

    async def run(self, ctx: StepContext) -> ModelOutput:
        scheduler_output = ctx.get(SchedulerOutput)
        connector = self.connector if ctx.get(LoadStarted).started else None
        if scheduler_output.is_empty and connector is None:
            return self.runner.execute(scheduler_output, None)  # drops finished state only
        key = cost_key(self.runner, scheduler_output, connector)
        if not self.presample:
            return await self.runner.compute.run(
                self.runner.execute, scheduler_output, connector, cost_key=key
            )
        model_output, sampled = await self.runner.compute.run(
            _forward_and_sample, self.runner, scheduler_output, connector, cost_key=key
        )
        if sampled is not None:
            ctx.scratch[_PRESAMPLED] = (model_output, sampled)
        return model_output


@attrs.frozen
class SampleStage:
    """Samples one token per request that reached the end of its known tokens, and
    computes the logprobs the requests asked for (sampled tokens, prompt tokens).

    Only the driver rank samples (``driver=True``); the other ranks return nothing, and
    fan-in takes the driver's tokens. When ``forward`` sampled already (its
    ``presample``), this stage returns (or raises) what it got, without a thread hop.
    """

    name: ClassVar[str] = "sample"
    requires: ClassVar[tuple[type, ...]] = (SchedulerOutput, ModelOutput)
    provides: ClassVar[type] = SampledTokens

    runner: ModelRunner
    driver: bool = True

    async def run(self, ctx: StepContext) -> SampledTokens:
        model_output = ctx.get(ModelOutput)
        presampled = ctx.scratch.pop(_PRESAMPLED, None)
        if not self.driver or not _needs_sampling(model_output):
            return SampledTokens()
        if presampled is not None and presampled[0] is model_output:
            if isinstance(presampled[1], Exception):
                raise presampled[1]
            return presampled[1]
        return await self.runner.compute.run(
            self.runner.sample, ctx.get(SchedulerOutput), model_output
        )
