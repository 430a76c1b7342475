"""``finished`` keeps no state of its own: the transfers ``get_finished`` handed over that
no output carried yet live in the rank's :class:`UnsentTransfers`, a worker graph input
(issue 25), so one stage, or one graph, can serve two ranks or engines at once."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from connectors.types import WorkerFinished
from pipeline.artifacts import LoadStarted, SampledTokens, SaveResult, SchedulerOutput
from pipeline.kernel.context import StepContext
from pipeline.kernel.graph import StepGraph
from stages.finished import FinishedStage, UnsentTransfers
from stages.graphs import default_worker_graph

INPUTS = (SchedulerOutput, SampledTokens, SaveResult, UnsentTransfers)


class _Connector:
    """A worker connector half for ``finished``: its ``i``-th ``get_finished`` sets
    ``entered[i]``, then answers ``answers[i]`` once ``gates[i]`` is set; the
    ``get_kv_stats`` right after answer ``i`` raises when ``i`` is in ``fail_stats``."""

    def __init__(self, answers: list[frozenset[str]], fail_stats: set[int]) -> None:
        self.answers = answers
        self.gates = [anyio.Event() for _ in answers]
        self.entered = [anyio.Event() for _ in answers]
        self.fail_stats = fail_stats
        self.calls = 0
        self.answered = -1

    async def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerFinished:
        i = self.calls
        self.calls += 1
        self.entered[i].set()
        await self.gates[i].wait()
        self.answered = i
        return WorkerFinished(sending=self.answers[i])

    def get_kv_stats(self) -> tuple[int, int, int, int]:
        if self.answered in self.fail_stats:
            raise RuntimeError("stats query failed")
        return (0, 0, 0, 0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_load_failures(self) -> Any:
        raise AssertionError("asked only when a block failed")


def _context(step: int, unsent: UnsentTransfers) -> StepContext:
    inputs = (SchedulerOutput(step_id=step), SampledTokens(), SaveResult(), unsent)
    return StepContext(step, 0, inputs=(*inputs, LoadStarted(started=True)))


@pytest.mark.anyio
class TestFinishedStageState:
    async def test_two_graphs_sharing_the_stage_keep_their_own_reports(self) -> None:
        """One FinishedStage in two graphs run at once: the report of A's failed step
        goes out with A's next step, never with B's."""
        connector = _Connector([frozenset({"a"}), frozenset({"b"}), frozenset()], {0})
        gates = connector.gates
        stage = FinishedStage(0, connector)  # type: ignore[arg-type]
        graph_a = StepGraph([stage], inputs=INPUTS, name="a")
        graph_b = StepGraph([stage], inputs=INPUTS, name="b")
        mine, theirs = UnsentTransfers(), UnsentTransfers()
        ctx_a, ctx_b = _context(1, mine), _context(1, theirs)

        async def step_a() -> None:
            with pytest.raises(RuntimeError, match="stats query failed"):
                await graph_a.run(ctx_a)
            gates[1].set()  # B's get_finished answers once A's step has failed

        async with anyio.create_task_group() as tg:
            tg.start_soon(step_a)
            await connector.entered[0].wait()  # A asked first: its answer is {"a"}
            tg.start_soon(graph_b.run, ctx_b)
            await connector.entered[1].wait()
            gates[0].set()
        out_b = ctx_b.maybe(stage.provides)
        assert out_b is not None and out_b.finished_sending == {"b"}
        assert mine.sending == {"a"} and not theirs.sending

        gates[2].set()
        ctx_next = _context(2, mine)
        await graph_a.run(ctx_next)
        out_next = ctx_next.maybe(stage.provides)
        assert out_next is not None and out_next.finished_sending == {"a"}
        assert not mine.sending

    def test_the_stage_holds_no_mutable_state(self) -> None:
        """Every field of the frozen stage is one it was built with: no private carry."""
        stage = FinishedStage(3, None)
        assert [f.name for f in stage.__attrs_attrs__] == ["rank", "connector"]
        assert UnsentTransfers in FinishedStage.requires

    def test_the_default_worker_graph_takes_the_rank_state_as_an_input(self) -> None:
        """The default worker graph declares UnsentTransfers next to SchedulerOutput."""
        runner: Any = object()
        assert default_worker_graph(runner).inputs == (SchedulerOutput, UnsentTransfers)
