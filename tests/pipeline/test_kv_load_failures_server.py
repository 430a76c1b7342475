"""A served engine whose connector fails its loads says so: the failures by cause on
``/metrics``, one warning per cause in its log, ``"degraded"`` in ``/health`` until a
load succeeds; and ``/health`` shows the KV events endpoints only to key holders.

Real ``kvstep serve`` processes; the faults are real: the shared_storage connector's
files are overwritten (corrupt) or removed (missing) under a running server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, free_port, run_server

_PROMPT = [5 + (j * 7) % 200 for j in range(96)]  # 6 blocks of 16


def _complete(server: ServerProcess, prompt: list[int]) -> list[int]:
    body = {"model": "builtin:tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def _failures(server: ServerProcess) -> dict[str, float]:
    """cause → kvstep_kv_load_failures_total{connector="shared_storage"}."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = r'^kvstep_kv_load_failures_total\{cause="(\w+)",connector="shared_storage"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def _overwrite(store: Path) -> int:
    files = [p for p in store.rglob("*") if p.is_file()]
    for path in files:
        path.write_bytes(b"\x00" * path.stat().st_size)
    return len(files)


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A server on shared_storage without its own prefix cache: every repeated prompt
    is loaded from the store."""
    tmp = tmp_path_factory.mktemp("store")
    store = tmp / "kv"
    extra = [
        "--connector", "shared_storage",
        "--connector-options", json.dumps({"path": str(store)}),
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    with run_server("builtin:tiny", tmp / "server.log", extra) as server:
        yield server, store


class TestLoadFailuresServed:
    def test_failures_are_counted_by_cause_and_health_degrades_then_recovers(
        self, store_server: tuple[ServerProcess, Path]
    ) -> None:
        """Corrupt values count under "corrupt", the connector turns degraded (200),
        the answers stay a recompute's; a load that works makes it healthy again."""
        server, store = store_server
        expected = _complete(server, _PROMPT)  # computed, saved
        assert server.health().json()["kv_connector"]["state"] == "ok"
        assert _overwrite(store) >= 5
        assert _complete(server, _PROMPT) == expected  # loads fail: recomputed
        assert _complete(server, _PROMPT) == expected
        failures = _failures(server)
        assert failures.get("corrupt", 0) >= 10, failures  # 5 full blocks, twice
        health = server.health()
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "degraded"
        kv = body["kv_connector"]
        assert kv["state"] == "degraded" and kv["name"] == "shared_storage"
        assert kv["causes"]["corrupt"] >= 10 and "corrupt" in kv["reason"]
        assert kv["failures_last_60s"] == sum(kv["causes"].values())
        # Repair: remove the bad values; the next request saves good ones, the one
        # after loads them.
        for path in [p for p in store.rglob("*") if p.is_file()]:
            path.unlink()
        assert _complete(server, _PROMPT) == expected
        assert _complete(server, _PROMPT) == expected
        body = server.health().json()
        assert body["status"] == "ok" and body["kv_connector"]["state"] == "ok"

    def test_the_first_failure_of_a_cause_is_a_warning_the_rest_are_not(
        self, store_server: tuple[ServerProcess, Path]
    ) -> None:
        """Several requests failed to load, under one cause: one warning in the log."""
        server, _ = store_server
        log = server.log_text()
        warnings = [line for line in log.splitlines() if "KV load failed" in line]
        assert len(warnings) == 1, warnings
        assert "cause='corrupt'" in warnings[0] and "WARNING" in warnings[0]
        assert _failures(server).get("corrupt", 0) >= 10


@pytest.mark.parametrize("api_key", [None, "s3cret-key"])
def test_health_shows_kv_events_only_to_key_holders(tmp_path: Path, api_key: str | None) -> None:
    """With --api-key, /health names the KV events endpoints only under that key;
    without one, to everybody."""
    port = free_port()
    extra = ["--kv-events-endpoint", f"tcp://127.0.0.1:{port}"]
    if api_key is not None:
        extra += ["--api-key", api_key]
    with run_server("builtin:tiny", tmp_path / "server.log", extra) as server:
        anonymous = server.health()
        wrong = server.health(Authorization="Bearer not-the-key")
        holder = server.health(Authorization=f"Bearer {api_key or 'anything'}")
    assert anonymous.status_code == wrong.status_code == holder.status_code == 200
    assert "kv_events" in holder.json()
    if api_key is None:
        assert "kv_events" in anonymous.json()
    else:
        assert "kv_events" not in anonymous.json() and "kv_events" not in wrong.json()
        assert str(port) not in anonymous.text and str(port) not in wrong.text
