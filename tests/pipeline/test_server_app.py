"""The server app in process (ASGI transport): routes, errors, metrics, lifecycles."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

pytest.importorskip("starlette")


from asgi_client import client_for

from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.kernel.report import StageRecord, StepReport
from pipeline.server import LoopLagMonitor, ServerMetrics, create_app


@pytest.fixture
def config(llama_path: Path) -> EngineConfig:
    return EngineConfig(model=str(llama_path), dtype="float32", max_model_len=128)


def _body(**fields: object) -> dict[str, object]:
    return {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, **fields}


class TestCompletions:
    @pytest.mark.anyio
    async def test_non_streaming_matches_engine(self, config: EngineConfig) -> None:
        """A non-stream completion carries the engine's greedy tokens, text and usage."""
        async with AsyncEngine(config) as engine:
            expected: list[int] = []
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            async for out in engine.generate([1, 2, 3], params):
                expected.extend(out.new_token_ids)
            async with client_for(create_app(engine)) as client:
                resp = await client.post("/v1/completions", json=_body(ignore_eos=True))
        assert resp.status_code == 200
        body = resp.json()
        choice = body["choices"][0]
        assert body["object"] == "text_completion"
        assert choice["token_ids"] == expected
        assert choice["text"] == "".join(f" {t}" for t in expected)
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}

    @pytest.mark.anyio
    async def test_streaming_ends_with_usage_and_done(self, config: EngineConfig) -> None:
        """SSE chunks carry one token each; a usage chunk (asked for) ends, then ``[DONE]``."""
        body = _body(stream=True, ignore_eos=True, stream_options={"include_usage": True})
        async with client_for(create_app(config)) as client:
            resp = await client.post("/v1/completions", json=body)
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [httpx.Response(200, content=e).json() for e in events[:-1]]
        assert chunks[-1]["choices"] == []  # OpenAI's usage chunk
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        chunks = chunks[:-1]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 4
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all("usage" not in c for c in chunks)


class TestErrors:
    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("body", "needle"),
        [
            (_body(prompt="hello"), "tokenizer"),
            (_body(prompt=[]), "prompt"),
            (_body(prompt=[1, "x"]), "token ids"),
            (_body(prompt=[1, 10**6]), "token id"),
            (_body(max_tokens=0), "max_tokens"),
            (_body(temperature=-1), "temperature"),
            (_body(n=17), "invalid n=17"),
            (_body(stream="yes"), "stream"),
        ],
    )
    async def test_bad_input_is_400(
        self, config: EngineConfig, body: dict[str, object], needle: str
    ) -> None:
        """Bad input answers 400 with a message naming what is wrong."""
        async with client_for(create_app(config)) as client:
            resp = await client.post("/v1/completions", json=body)
            health = (await client.get("/health")).json()
        assert resp.status_code == 400
        assert needle in resp.json()["error"]["message"]
        assert health["requests"] == 0

    @pytest.mark.anyio
    async def test_not_json_is_400(self, config: EngineConfig) -> None:
        """A body that is not JSON answers 400."""
        async with client_for(create_app(config)) as client:
            resp = await client.post(
                "/v1/completions",
                content=b"{not json",
                headers={"Content-Type": "application/json"},
            )
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] is None

    @pytest.mark.anyio
    async def test_unknown_model_is_404(self, config: EngineConfig) -> None:
        """Asking for another model answers 404 naming the served one."""
        async with client_for(create_app(config, model_name="tiny")) as client:
            resp = await client.post("/v1/completions", json=_body(model="gpt-4"))
        assert resp.status_code == 404
        assert "'tiny'" in resp.json()["error"]["message"]

    @pytest.mark.anyio
    async def test_overload_is_429(self, llama_path: Path) -> None:
        """Past max_queue_depth the server answers 429 at once."""
        config = EngineConfig(model=str(llama_path), max_model_len=128, max_queue_depth=2)
        async with AsyncEngine(config) as engine:
            held = [engine.generate([1, 2], SamplingParams(max_tokens=100)) for _ in range(2)]
            async with client_for(create_app(engine)) as client:
                resp = await client.post("/v1/completions", json=_body(stream=True))
            for stream in held:
                await stream.aclose()
        assert resp.status_code == 429
        assert "overloaded" in resp.json()["error"]["message"]

    @pytest.mark.anyio
    async def test_engine_not_running_is_503(self, config: EngineConfig) -> None:
        """An embedder's engine that is not open yet answers 503."""
        app = create_app(AsyncEngine(config))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvstep") as client:
            health = await client.get("/health")
            resp = await client.post("/v1/completions", json=_body())
        assert health.status_code == 503
        assert resp.status_code == 503


class TestInfoRoutes:
    @pytest.mark.anyio
    async def test_models_lists_served_name(self, config: EngineConfig) -> None:
        """/v1/models lists the served model id."""
        async with client_for(create_app(config, model_name="tiny-llama")) as client:
            body = (await client.get("/v1/models")).json()
        assert [m["id"] for m in body["data"]] == ["tiny-llama"]

    @pytest.mark.anyio
    async def test_metrics_after_a_request(
        self, config: EngineConfig, leak_check: Callable[[dict[str, int]], None]
    ) -> None:
        """/metrics exposes steps, stage histograms, KV counters and queue depth."""
        async with client_for(create_app(config)) as client:
            await client.post("/v1/completions", json=_body())
            text = (await client.get("/metrics")).text
            health = (await client.get("/health")).json()
        for name in (
            'kvstep_steps_total{outcome="ok"}',
            'kvstep_stage_latency_seconds_count{kind="engine",stage="schedule"}',
            'kvstep_stage_latency_seconds_count{kind="worker",stage="forward"}',
            "kvstep_kv_loaded_tokens_total",
            "kvstep_kv_saved_tokens_total",
            "kvstep_queue_depth 0.0",
            "kvstep_event_loop_lag_max_seconds",
        ):
            assert name in text
        steps = next(line for line in text.splitlines() if line.startswith("kvstep_steps_total"))
        assert float(steps.split()[-1]) >= 4
        assert health["status"] == "ok"
        leak_check(health["leaks"])

    @pytest.mark.anyio
    async def test_embedder_owns_the_engine(self, config: EngineConfig) -> None:
        """With a running engine, the app's lifespan leaves it open for the embedder."""
        async with AsyncEngine(config) as engine:
            async with client_for(create_app(engine)) as client:
                assert (await client.get("/health")).status_code == 200
            out = [o async for o in engine.generate([4, 5], SamplingParams(max_tokens=2))]
            assert out[-1].finished


class TestServerMetrics:
    def test_on_step_counts_engine_steps_and_kv(self) -> None:
        """An engine step report adds a step, its stage latencies and its KV tokens."""
        metrics = ServerMetrics()
        stage = StageRecord("forward", "ok", 0.0, 0.002, False, None)
        skipped = StageRecord("save", "skipped", 0.0, 0.0, False, None)
        report = StepReport(3, None, "ok", 0.01, (stage, skipped), None, ())
        metrics.on_step(report, "engine", {"loaded_tokens": 32, "saved_tokens": 16})
        text = metrics.render(queue_depth=5, lag=LoopLagMonitor()).decode()
        assert 'kvstep_steps_total{outcome="ok"} 1.0' in text
        assert "kvstep_kv_loaded_tokens_total 32.0" in text
        assert "kvstep_kv_saved_tokens_total 16.0" in text
        assert "kvstep_queue_depth 5.0" in text
        assert 'stage="save"' not in text

    def test_worker_reports_do_not_count_steps(self) -> None:
        """A worker report adds latencies but not steps (the engine counts those)."""
        metrics = ServerMetrics()
        report = StepReport(1, 0, "ok", 0.01, (), None, ())
        metrics.on_step(report, "worker", {})
        text = metrics.render(queue_depth=0, lag=LoopLagMonitor()).decode()
        assert "kvstep_steps_total{" not in text
        assert 'kvstep_step_latency_seconds_count{kind="worker"} 1.0' in text


class TestLoopLagMonitor:
    @pytest.mark.anyio
    async def test_blocking_the_loop_shows_as_lag(self) -> None:
        """A synchronous 50 ms block on the loop is measured as >= 40 ms of lag."""
        import time

        import anyio

        monitor = LoopLagMonitor(interval_s=0.005)
        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor.run)
            await anyio.sleep(0.02)
            time.sleep(0.05)
            await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        assert monitor.max_s >= 0.04
        assert monitor.snapshot()["samples"] >= 2
        monitor.reset()
        assert monitor.p99_s() == 0.0


class TestStepLogListeners:
    def test_failing_listener_does_not_fail_the_step(self) -> None:
        """A listener that raises is logged; later listeners still see the report."""
        from pipeline.steplog import StepLog

        seen: list[tuple[int, str]] = []

        def broken(report: StepReport, kind: str, fields: dict[str, object]) -> None:
            raise RuntimeError("listener bug")

        log = StepLog(None)
        log.listeners += [broken, lambda r, k, f: seen.append((r.step_id, k))]
        log.record_step(StepReport(7, None, "ok", 0.01, (), None, ()), kind="engine")
        assert seen == [(7, "engine")]


class TestDetokenizer:
    def test_text_deltas_with_a_tokenizer(self) -> None:
        """With a tokenizer, each delta is the new suffix of the decoded text."""
        from pipeline.detokenize import Detokenizer
        from pipeline.request import RequestOutput

        class Letters:
            def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
                return "".join(chr(ord("a") + i) for i in ids)

        detok = Detokenizer(Letters())
        texts = []
        for upto in (1, 3):
            out = RequestOutput(
                request_id="r",
                prompt_token_ids=(0,),
                token_ids=tuple(range(upto)),
                new_token_ids=tuple(range(upto))[-2:] if upto > 1 else (0,),
                finished=False,
            )
            texts.append(detok.delta(out))
        assert texts == ["a", "bc"]
