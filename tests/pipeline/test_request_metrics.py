"""Per-request metrics: RequestOutput.metrics, the /metrics histograms, trace spans."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.request import RequestMetrics, RequestOutput
from pipeline.steplog_tools.summary import load_step_log
from pipeline.steplog_tools.trace import trace_events


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _times(m: RequestMetrics) -> list[float]:
    times = [m.arrival_time, m.first_scheduled_time, m.first_token_time]
    times += [m.last_token_time, m.finished_time]
    assert all(t is not None for t in times), m
    return [float(t) for t in times if t is not None]


class TestRequestMetrics:
    def test_finished_request_is_complete_and_monotone(self) -> None:
        """arrival <= first scheduled <= first token <= last token <= finished."""
        with LLM(EngineConfig(max_model_len=128)) as llm:
            (out,) = llm.generate([1, 2, 3, 4], _params(5))
        m = out.metrics
        assert m is not None and out.finished
        times = _times(m)
        assert times == sorted(times)
        assert m.num_output_tokens == 5
        assert m.queue_time_s is not None and m.queue_time_s >= 0
        assert m.e2e_s is not None and m.e2e_s >= (m.ttft_s or 0.0)

    @pytest.mark.anyio
    async def test_every_output_carries_metrics_so_far(self) -> None:
        """Streamed outputs carry metrics; the first token time is fixed once set."""
        outs: list[RequestOutput] = []
        async with AsyncEngine(EngineConfig(max_model_len=128)) as engine:
            async for out in engine.generate([1, 2, 3], _params(4)):
                outs.append(out)
        assert all(o.metrics is not None for o in outs)
        first = {o.metrics.first_token_time for o in outs if o.metrics is not None}
        assert len(first) == 1 and None not in first
        assert all(o.metrics is not None and o.metrics.finished_time is None for o in outs[:-1])
        last = outs[-1].metrics
        assert last is not None and last.finished_time is not None

    def test_second_request_queues_with_one_seq(self) -> None:
        """With max_num_seqs=1 the second request waits for the first to finish."""
        with LLM(EngineConfig(max_model_len=128, max_num_seqs=1)) as llm:
            a, b = llm.generate([[1, 2, 3], [4, 5, 6]], [_params(6), _params(2)])
        ma, mb = a.metrics, b.metrics
        assert ma is not None and mb is not None
        assert mb.first_scheduled_time is not None and ma.finished_time is not None
        assert mb.first_scheduled_time >= ma.finished_time
        assert mb.queue_time_s is not None and ma.queue_time_s is not None
        assert mb.queue_time_s > ma.queue_time_s
        assert mb.queue_time_s >= ma.finished_time - mb.arrival_time

    def test_prefix_hit_is_counted(self) -> None:
        """A repeated 40-token prompt is served 32 tokens (two blocks) from the cache."""
        prompt = list(range(1, 41))
        with LLM(EngineConfig(max_model_len=128, block_size=16)) as llm:
            (first,) = llm.generate(prompt, _params(2))
            (second,) = llm.generate(prompt, _params(2))
        assert first.metrics is not None and second.metrics is not None
        assert first.metrics.num_cached_tokens == 0
        assert second.metrics.num_cached_tokens == 32
        assert second.metrics.num_external_tokens == 0
        assert second.num_cached_tokens == 32

    def test_connector_tokens_are_counted_apart(self) -> None:
        """Without a prefix cache, a repeated prompt comes from the connector."""
        prompt = list(range(1, 41))
        config = EngineConfig(
            max_model_len=128, block_size=16, enable_prefix_caching=False,
            connector="offload", connector_options={"num_blocks": 64},
        )  # fmt: skip
        with LLM(config) as llm:
            llm.generate(prompt, _params(2))
            (second,) = llm.generate(prompt, _params(2))
        assert second.metrics is not None
        assert second.metrics.num_external_tokens == 32
        assert second.metrics.num_cached_tokens == 0

    def test_derived_values(self) -> None:
        """queue time, TTFT, mean ITL and e2e from the recorded times."""
        m = RequestMetrics(
            arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
            last_token_time=13.0, finished_time=13.25, num_output_tokens=5,
        )  # fmt: skip
        assert m.queue_time_s == pytest.approx(0.5)
        assert m.ttft_s == pytest.approx(1.0)
        assert m.mean_itl_s == pytest.approx(0.5)  # 2 s over 4 gaps
        assert m.e2e_s == pytest.approx(3.25)
        one = RequestMetrics(arrival_time=1.0, first_token_time=2.0, last_token_time=2.0,
                             num_output_tokens=1)  # fmt: skip
        assert one.mean_itl_s is None and one.queue_time_s is None and one.e2e_s is None
        assert RequestMetrics(arrival_time=0.0).ttft_s is None


def _count(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


class TestPrometheus:
    @pytest.mark.anyio
    async def test_histograms_count_finished_requests(self) -> None:
        """After N requests each latency histogram has N (ITL: N with >= 2 tokens)."""
        pytest.importorskip("starlette")
        from pipeline.server import create_app

        n = 3
        prompt = list(range(1, 21))
        async with AsyncEngine(EngineConfig(max_model_len=128, block_size=16)) as engine:
            app = create_app(engine)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://k") as c:
                    for _ in range(n):
                        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0.0,
                                "ignore_eos": True}  # fmt: skip
                        assert (await c.post("/v1/completions", json=body)).status_code == 200
                    text = (await c.get("/metrics")).text
        names = ("time_to_first_token", "request_time_per_output_token",
                 "e2e_request_latency", "request_queue_time")  # fmt: skip
        for short in names:
            name = f"kvstep_{short}_seconds"
            assert _count(text, f"{name}_count") == n, name
            assert _count(text, f"{name}_sum") >= 0
        # Inter-token latency: one sample per token after each request's first.
        assert _count(text, "kvstep_inter_token_latency_seconds_count") == n * (3 - 1)
        assert _count(text, "kvstep_prefix_cache_queries_total") == n * 20
        # The first request misses; the next two hit the one full block (16 tokens).
        assert _count(text, "kvstep_prefix_cache_hits_total") == (n - 1) * 16


class TestInterTokenLatency:
    @pytest.mark.anyio
    async def test_streamed_tokens_each_give_one_gap(self) -> None:
        """Per-token ITL: a streamed request of k tokens adds k - 1 samples whose sum is
        its first-to-last token time, i.e. (k - 1) times its time per output token."""
        import httpx

        from pipeline.server import create_app

        k = 6
        async with AsyncEngine(EngineConfig(max_model_len=128)) as engine:
            app = create_app(engine)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://k") as c:
                    body = {"prompt": [1, 2, 3], "max_tokens": k, "temperature": 0.0,
                            "ignore_eos": True, "stream": True}  # fmt: skip
                    async with c.stream("POST", "/v1/completions", json=body) as response:
                        assert response.status_code == 200
                        events = [line async for line in response.aiter_lines() if line]
                    text = (await c.get("/metrics")).text
        assert events[-1] == "data: [DONE]"
        itl = "kvstep_inter_token_latency_seconds"
        tpot = "kvstep_request_time_per_output_token_seconds"
        assert _count(text, f"{itl}_count") == k - 1
        assert _count(text, f"{tpot}_count") == 1
        assert _count(text, f"{itl}_sum") == pytest.approx(
            (k - 1) * _count(text, f"{tpot}_sum"), rel=1e-6, abs=1e-9
        )


class TestTrace:
    def test_queued_request_span_starts_at_arrival(self, tmp_path: Path) -> None:
        """The waiting request's span begins before its first step, by its queue time."""
        path = tmp_path / "steps.jsonl"
        config = EngineConfig(max_model_len=128, max_num_seqs=1, step_log=str(path))
        with LLM(config) as llm:
            _, b = llm.generate([[1, 2, 3], [4, 5, 6]], [_params(6), _params(2)])
        records = load_step_log(path)
        events = trace_events(records)
        begin = next(e for e in events if e["ph"] == "b" and e["id"] == b.request_id)
        end = next(e for e in events if e["ph"] == "e" and e["id"] == b.request_id)
        first_step_id = next(
            r["step_id"] for r in records
            if r.get("event") == "step" and r.get("kind") == "engine"
            and b.request_id in (r.get("requests") or ())
        )  # fmt: skip
        first_step = next(
            e for e in events
            if e["ph"] == "X" and e["name"] == f"step {first_step_id}"
            and e["cat"] == "engine"
        )  # fmt: skip
        assert b.metrics is not None and b.metrics.queue_time_s is not None
        assert begin["ts"] < first_step["ts"] < end["ts"]
        assert begin["args"]["queue_s"] == pytest.approx(b.metrics.queue_time_s, abs=1e-5)
        assert begin["args"]["queue_s"] > 0
        assert begin["args"]["ttft_s"] >= begin["args"]["queue_s"]
        assert min(e["ts"] for e in events if "ts" in e) == 0


class TestArrivalTime:
    @pytest.mark.anyio
    async def test_given_arrival_counts_in_queue_time_and_ttft(self) -> None:
        """``AsyncEngine.generate(arrival_time=...)``: a request that arrived 0.5 s before
        it was admitted has that half second in its queue time, TTFT and E2E."""
        import time

        async with AsyncEngine(EngineConfig(max_model_len=128)) as engine:
            arrived = time.monotonic() - 0.5
            outs = [
                out async for out in engine.generate([1, 2, 3], _params(2), arrival_time=arrived)
            ]
        m = outs[-1].metrics
        assert m is not None and m.arrival_time == arrived
        assert m.queue_time_s is not None and m.queue_time_s >= 0.5
        assert (m.ttft_s or 0.0) >= 0.5 and (m.e2e_s or 0.0) >= 0.5

    @pytest.mark.anyio
    @pytest.mark.parametrize("bad", [True, float("nan"), -1.0, "0", 1e30])
    async def test_bad_arrival_time_is_refused(self, bad: object) -> None:
        """A bool, NaN, a negative, a string or a time in the future is an
        ``InvalidRequestError`` naming ``arrival_time``; nothing is queued."""
        from pipeline.errors import InvalidRequestError

        async with AsyncEngine(EngineConfig(max_model_len=128)) as engine:
            with pytest.raises(InvalidRequestError, match="arrival_time"):
                engine.generate([1, 2, 3], _params(2), arrival_time=bad)  # type: ignore[arg-type]
            assert engine.num_requests == 0
            assert engine.leak_report()["requests"] == 0

    @pytest.mark.anyio
    async def test_server_counts_from_the_http_arrival(self) -> None:
        """The server's requests arrive when the HTTP request did: a body that takes
        0.3 s to upload is in the request's queue time on /metrics."""
        import anyio

        from pipeline.server import create_app

        async def slow_body():  # type: ignore[no-untyped-def]
            yield b'{"prompt": [1, 2, 3], "max_tokens": 2, '
            await anyio.sleep(0.3)
            yield b'"temperature": 0.0, "ignore_eos": true}'

        async with AsyncEngine(EngineConfig(max_model_len=128)) as engine:
            app = create_app(engine)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://k") as c:
                    response = await c.post(
                        "/v1/completions",
                        content=slow_body(),
                        headers={"content-type": "application/json"},
                    )
                    assert response.status_code == 200, response.text
                    text = (await c.get("/metrics")).text
        assert _count(text, "kvstep_request_queue_time_seconds_count") == 1
        assert _count(text, "kvstep_request_queue_time_seconds_sum") >= 0.3
        assert _count(text, "kvstep_time_to_first_token_seconds_sum") >= 0.3
