"""Logits stages on a real engine: they change only the rows they mean to, a failing one
fails its rows alone, they see each row's tokens, and they cost no extra thread hop."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch

from pipeline import LLM, EngineConfig, LogitsBatch, LogitsStage, SamplingParams
from pipeline.kernel import StepGraph

PROMPTS = [list(range(1, 41)), list(range(5, 30)), [7, 8, 9]]


def _config(**options: Any) -> EngineConfig:
    return EngineConfig(model="builtin:tiny", max_model_len=256, **options)


def _params(extra: dict[str, Any] | None = None, seed: int = 0) -> SamplingParams:
    return SamplingParams(
        max_tokens=6, temperature=0.8, seed=seed, ignore_eos=True, extra_args=extra or {}
    )


@attrs.frozen
class Ban(LogitsStage):
    """Rows with ``extra_args["ban"]`` never sample that token."""

    name: ClassVar[str] = "ban"

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        for row, params in enumerate(batch.params):
            if (token := params.extra_args.get("ban")) is not None:
                logits[row, token] = float("-inf")
        return logits


@attrs.frozen
class Boom(LogitsStage):
    """Raises whenever a row with ``extra_args["boom"]`` is in the batch."""

    name: ClassVar[str] = "boom"

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        if any(p.extra_args.get("boom") for p in batch.params):
            raise RuntimeError("injected: this row's grammar is broken")
        return logits


@attrs.frozen
class Seen(LogitsStage):
    """Records, per step, each row's request id, prompt and output tokens."""

    name: ClassVar[str] = "seen"
    log: list[list[tuple[str, tuple[int, ...], tuple[int, ...]]]] = attrs.field(factory=list)

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        self.log.append(
            [
                (req_id, tuple(prompt), tuple(out))
                for req_id, prompt, out in zip(
                    batch.req_ids, batch.prompt_token_ids, batch.output_token_ids, strict=True
                )
            ]
        )
        return logits


@attrs.frozen
class Noop(LogitsStage):
    name: ClassVar[str] = "noop"

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        return logits


def _generate(params: list[SamplingParams], graph: Any = None, **options: Any) -> list[Any]:
    with LLM(_config(**options), worker_graph=graph) as llm:
        return list(llm.generate(PROMPTS, params))


class TestRows:
    def test_a_stage_changes_only_the_rows_that_ask(self) -> None:
        """The banned token never appears in the asking row; the other rows' tokens are
        those of a run without the stage."""
        plain = _generate([_params(seed=i) for i in range(3)])
        banned = plain[0].token_ids[0]
        params = [_params({"ban": banned}, seed=0), _params(seed=1), _params(seed=2)]
        out = _generate(params, lambda g: g.insert_after("logits", Ban()))
        assert banned not in out[0].token_ids
        assert [o.token_ids for o in out[1:]] == [o.token_ids for o in plain[1:]]

    def test_a_failing_stage_fails_its_rows_alone(self) -> None:
        """A stage that raises for one row: that request ends with "error" naming the
        stage; the others finish as without it, and the engine keeps serving."""
        plain = _generate([_params(seed=i) for i in range(3)])
        params = [_params(seed=0), _params({"boom": True}, seed=1), _params(seed=2)]
        with LLM(_config(), worker_graph=lambda g: g.insert_after("logits", Boom())) as llm:
            out = llm.generate(PROMPTS, params)
            again = llm.generate(PROMPTS, [_params(seed=i) for i in range(3)])
        assert [o.finish_reason for o in out] == ["length", "error", "length"]
        assert out[1].error is not None and "logits stage 'boom' failed" in out[1].error
        assert "injected" in out[1].error
        assert [out[0].token_ids, out[2].token_ids] == [plain[0].token_ids, plain[2].token_ids]
        assert [o.token_ids for o in again] == [o.token_ids for o in plain]

    def test_a_stage_returning_the_wrong_shape_fails_the_rows(self) -> None:
        """A stage must return a tensor of the logits' shape; otherwise its rows fail."""

        @attrs.frozen
        class Shrink(LogitsStage):
            name: ClassVar[str] = "shrink"

            def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
                return logits[:, :10]

        out = _generate(
            [_params(seed=i) for i in range(3)], lambda g: g.insert_after("logits", Shrink())
        )
        assert {o.finish_reason for o in out} == {"error"}
        assert all("must return a tensor of shape" in (o.error or "") for o in out)


class TestBatch:
    @pytest.mark.parametrize(
        "options",
        [{}, {"max_num_batched_tokens": 16}, {"async_scheduling": True}],
        ids=["default", "chunked", "async"],
    )
    def test_rows_see_their_prompt_and_outputs(self, options: dict[str, Any]) -> None:
        """At every sample, a row's prompt_token_ids is its prompt and output_token_ids
        its tokens so far, including on a second pass that hits the prefix cache."""
        seen = Seen()
        params = [_params(seed=i) for i in range(3)]
        with LLM(_config(**options), worker_graph=lambda g: g.insert_after("logits", seen)) as llm:
            llm.generate(PROMPTS, params)
            seen.log.clear()
            out = llm.generate(PROMPTS, params)
        assert out[0].num_cached_tokens > 0
        by_id = {o.request_id: o for o in out}
        steps: dict[str, int] = {}
        for step in seen.log:
            for req_id, prompt, outputs in step:
                o = by_id[req_id]
                assert prompt == o.prompt_token_ids
                assert outputs == o.token_ids[: len(outputs)]
                assert len(outputs) == steps.get(req_id, 0)
                steps[req_id] = len(outputs) + 1
        assert steps == {o.request_id: len(o.token_ids) for o in out}


class TestOneHop:
    def test_an_inserted_stage_costs_no_extra_hand_over(self) -> None:
        """The runner's compute thread is handed the same number of calls per step with
        a user's logits stage inserted as without it (forward, logits, the user's stage
        and sample run in one)."""

        def calls(graph: Any) -> tuple[int, str]:
            with LLM(_config(), worker_graph=graph) as llm:
                llm.generate(PROMPTS, [_params(seed=i) for i in range(3)])
                worker = llm.engine.core.workers[0]
                compute = worker.runner.compute
                return compute.thread_calls + compute.inline_calls, str(worker.graph)

        plain, plain_graph = calls(None)
        noop, noop_graph = calls(lambda g: g.insert_after("logits", Noop()))
        assert noop == plain
        assert "forward → logits → structured → sample" in plain_graph
        assert "forward → logits → noop → structured → sample" in noop_graph

    def test_graph_functions_get_the_build(self) -> None:
        """A graph function of two arguments gets the rank's build (rank, runner, config)."""
        got: list[Any] = []

        def graph(g: StepGraph, build: Any) -> StepGraph:
            got.append(build)
            return g

        with LLM(_config(), worker_graph=graph) as llm:
            runner = llm.engine.core.workers[0].runner
        (build,) = got
        assert (build.rank, build.world_size, build.runner) == (0, 1, runner)
        assert build.config.model == "builtin:tiny" and build.connector is None


@attrs.frozen
class InPlace(LogitsStage):
    """Writes every row in place (as Ban, ForceToken and the structured mask do) and
    records the batch size of each call."""

    name: ClassVar[str] = "in_place"
    sizes: list[int] = attrs.field(factory=list)

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        self.sizes.append(len(batch))
        logits[:, 0] = float("-inf")
        return logits


def test_an_in_place_stage_gets_the_whole_batch_once() -> None:
    """The logits of a forward pass are inference tensors: a stage that writes them in
    place runs on the whole batch in one call per step (under inference mode), never
    falls back to one call per row, and no row fails."""
    stage = InPlace()
    with LLM(_config(), worker_graph=lambda g: g.insert_after("logits", stage)) as llm:
        outs = llm.generate(PROMPTS, [_params(seed=i) for i in range(len(PROMPTS))])
    assert all(out.finish_reason == "length" and 0 not in out.token_ids for out in outs)
    assert len(stage.sizes) == 6  # one call per step: every row samples in every step
    assert set(stage.sizes) == {len(PROMPTS)}
