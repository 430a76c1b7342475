"""The schedule-ahead link is a typed input of the engine graph (issue 25): under async
scheduling ``schedule`` requires the step's :class:`StepLink`, which the graph declares;
no ``ctx.scratch`` key carries it."""

from __future__ import annotations

import anyio
import pytest
from fake_executor import FakeRanks
from schedule_driver import add, make_scheduler

from pipeline.artifacts import SchedulerOutput
from pipeline.errors import GraphError
from pipeline.kernel.context import StepContext
from stages.aggregator import FanInAggregator
from stages.graphs import default_engine_graph
from stages.schedule import ScheduleStage, StepLink


class TestTheLinkIsInTheGraph:
    def test_the_ahead_engine_graph_declares_the_link(self) -> None:
        """ahead=True: StepLink is the graph's input and schedule requires it; the
        printed step is the same."""
        ahead = default_engine_graph(
            make_scheduler(), FakeRanks([]), aggregator=FanInAggregator(1), ahead=True
        )
        serial = default_engine_graph(
            make_scheduler(), FakeRanks([]), aggregator=FanInAggregator(1)
        )
        assert ahead.inputs == (StepLink,) and ahead["schedule"].requires == (StepLink,)
        assert serial.inputs == () and serial["schedule"].requires == ()
        assert str(ahead) == str(serial) == "schedule → execute → fan_in → update ⟂ fail_step"

    @pytest.mark.anyio
    async def test_a_step_without_its_link_is_refused(self) -> None:
        """The ahead graph run without a StepLink fails at once, naming the type."""
        graph = default_engine_graph(
            make_scheduler(), FakeRanks([]), aggregator=FanInAggregator(1), ahead=True
        )
        with pytest.raises(GraphError, match="StepLink"):
            await graph.run(StepContext(0))


@pytest.mark.anyio
class TestScheduleAhead:
    async def test_plans_then_waits_for_the_previous_step(self) -> None:
        """With a previous step in flight, schedule marks its step planned at once, then
        returns only once the previous step is done; nothing goes through scratch."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2, 3])
        previous = StepLink()
        link = StepLink(previous=previous)
        ctx = StepContext(0, None, inputs=(link,))
        outputs: list[SchedulerOutput] = []

        async def run() -> None:
            outputs.append(await ScheduleStage(scheduler, ahead=True).run(ctx))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(5):
                await link.scheduled.wait()
            await anyio.sleep(0.02)
            assert outputs == [] and link.previous is None
            previous.finish(failed=False)
        assert [r.req_id for r in outputs[0].requests] == ["a"]
        assert link.waited_s > 0 and ctx.scratch == {}

    async def test_without_ahead_it_ignores_a_link(self) -> None:
        """ScheduleStage(scheduler) requires nothing and leaves a link alone."""
        link = StepLink(previous=StepLink())
        output = await ScheduleStage(make_scheduler()).run(StepContext(0, None, inputs=(link,)))
        assert isinstance(output, SchedulerOutput) and not link.scheduled.is_set()
