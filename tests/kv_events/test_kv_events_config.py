"""``EngineConfig(kv_events=...)``, ``--kv-events-endpoint`` and ``/health`` discovery."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import pytest

from pipeline import AsyncEngine, EngineConfig
from pipeline.cli.main import build_parser, main, serve_config
from pipeline.errors import InvalidConfigError
from pipeline.kv_events import KVEventsConfig


class TestConfig:
    def test_off_by_default(self) -> None:
        """EngineConfig() publishes nothing."""
        assert EngineConfig().kv_events is None

    def test_an_endpoint_or_a_dict_becomes_a_config(self) -> None:
        """A string is the PUB endpoint; a dict gives the fields (as JSON and the worker
        wire do); the config survives the engine→worker wire unchanged."""
        assert EngineConfig(kv_events="tcp://127.0.0.1:5557").kv_events == KVEventsConfig()
        wildcard = KVEventsConfig(endpoint="tcp://*:5557")
        assert EngineConfig(kv_events="tcp://*:5557").kv_events == wildcard
        config = EngineConfig(
            kv_events={"endpoint": "ipc:///tmp/e", "replay_endpoint": "ipc:///tmp/r", "topic": "t"}
        )
        assert config.kv_events == KVEventsConfig(
            endpoint="ipc:///tmp/e", replay_endpoint="ipc:///tmp/r", topic="t"
        )
        values = msgspec.msgpack.decode(msgspec.msgpack.encode({"kv_events": config.kv_events}))
        assert EngineConfig(**values).kv_events == config.kv_events

    @pytest.mark.parametrize(
        ("value", "field"),
        [
            (5, "kv_events"),
            ({"endpoint": "tcp://*:1", "port": 2}, "kv_events"),
            ("http://host:1", "kv_events.endpoint"),
            ("tcp://", "kv_events.endpoint"),
            ({"replay_endpoint": "tcp://a b:1"}, "kv_events.replay_endpoint"),
            ({"replay_endpoint": 5558}, "kv_events.replay_endpoint"),
            ({"buffer_steps": 0}, "kv_events.buffer_steps"),
            ({"buffer_steps": True}, "kv_events.buffer_steps"),
            ({"max_queue_size": 10**9}, "kv_events.max_queue_size"),
            ({"topic": 3}, "kv_events.topic"),
            ({"hash_format": "hex"}, "kv_events.hash_format"),
        ],
    )
    def test_bad_values_name_the_field(self, value: object, field: str) -> None:
        """Each bad value raises InvalidConfigError (a ValueError) naming its field."""
        with pytest.raises(InvalidConfigError) as info:
            EngineConfig(kv_events=value)
        assert info.value.field == field
        assert isinstance(info.value, ValueError)


class TestFlag:
    def test_serve_takes_an_endpoint_or_json(self) -> None:
        """--kv-events-endpoint takes an endpoint, or a JSON object of the fields."""
        parser = build_parser()
        args = parser.parse_args(["serve", "--kv-events-endpoint", "tcp://*:6000"])
        assert serve_config(args).kv_events == KVEventsConfig(endpoint="tcp://*:6000")
        text = '{"endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001"}'
        args = parser.parse_args(["serve", "--kv-events-endpoint", text])
        assert serve_config(args).kv_events == KVEventsConfig(
            endpoint="tcp://*:6000", replay_endpoint="tcp://*:6001"
        )
        assert serve_config(parser.parse_args(["serve"])).kv_events is None

    def test_a_bad_value_names_the_flag(self, capsys: pytest.CaptureFixture[str]) -> None:
        """kvstep serve exits 2 with an error that names --kv-events-endpoint."""
        assert main(["serve", "--kv-events-endpoint", "udp://x:1"]) == 2
        assert (
            "argument --kv-events-endpoint: invalid kv_events.endpoint" in capsys.readouterr().err
        )


@asynccontextmanager
async def _client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    pytest.importorskip("starlette")
    from pipeline.server import create_app

    app = create_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvstep") as client:
            yield client


class TestHealth:
    @pytest.mark.anyio
    async def test_health_names_the_event_endpoints(self, tmp_path: Path) -> None:
        """/health carries the bound endpoints and topic while events are on."""
        events = KVEventsConfig(
            endpoint="tcp://127.0.0.1:*", replay_endpoint=f"ipc://{tmp_path}/r", topic="kv"
        )
        config = EngineConfig(num_gpu_blocks=8, kv_events=events)
        async with AsyncEngine(config) as engine, _client(engine) as client:
            body = (await client.get("/health")).json()
        found = body["kv_events"]
        assert found["endpoint"].startswith("tcp://127.0.0.1:")
        assert not found["endpoint"].endswith(":*")
        assert found["replay_endpoint"] == f"ipc://{tmp_path}/r"
        assert found["topic"] == "kv"

    @pytest.mark.anyio
    async def test_health_without_events_has_no_entry(self) -> None:
        """Events off: no kv_events key."""
        async with AsyncEngine(EngineConfig(num_gpu_blocks=8)) as engine, _client(engine) as client:
            body = (await client.get("/health")).json()
        assert body["status"] == "ok" and "kv_events" not in body
