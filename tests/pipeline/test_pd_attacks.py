"""Attackers of a P/D deployment, on loopback: real ``kvstep serve`` producer and
consumer processes (nixl) behind a real ``kvstep proxy`` (examples/disaggregated.py),
and an HTTP client that does what the audit of issue 24 did (findings H1-H5, H9).

A client never chooses which peer, blocks or KV an engine serves it: a consumer admits
``do_remote_prefill`` params only under the producer's ticket for that very prompt
(anything else is a 400 before any byte is read or any connection made), and a request
the consumer refuses frees the producer's held blocks at once.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")

import httpx
from example_modules import load_example

BS = 16
ex = load_example("disaggregated.py", "example_disaggregated_attacks")


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with ex.cluster(tmp_path_factory.mktemp("pd_attacks")) as cluster:
        yield cluster


def complete(url: str, prompt: list[int], **fields: Any) -> httpx.Response:
    body = {"model": "builtin:tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json={**body, **fields}, timeout=60)


def tokens(response: httpx.Response) -> str:
    """The answer's text (byte-level BPE: equal text, equal tokens)."""
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


def own_params(procs: Any, prompt: list[int]) -> dict[str, Any]:
    """Genuine params, as any client reaching the producer gets for its own prompt."""
    answer = complete(procs.urls["producer"], prompt, max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    assert answer.status_code == 200, answer.text
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    assert params["ticket"] and params["do_remote_prefill"] is True
    return params


def refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "kv_transfer_params" in error["message"] and field in error["message"]
    assert "choices" not in response.json()


def secret(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(48)] + [99]


class TestRefusedRequests:
    def test_a_request_the_consumer_refuses_frees_the_producers_blocks_at_once(
        self, procs: Any
    ) -> None:
        """H9: requests whose max_tokens the consumer refuses (past the context) are
        prefilled by the producer first; the proxy then asks the producer to free the
        blocks it held for them, which it does at once (not after its 60 s lease), and
        the next user is served promptly. (First in this file: the other tests leave
        prefills held until their lease.)"""
        for _ in range(4):
            answer = complete(procs.urls["proxy"], [10] * 255, max_tokens=4000)
            assert answer.status_code == 400, answer.text
        deadline = time.monotonic() + 10.0
        while True:
            leaks = httpx.get(f"{procs.urls['producer']}/health", timeout=10).json()["leaks"]
            if not leaks["pending_transfers"] and not leaks["blocks_in_use"]:
                break
            assert time.monotonic() < deadline, f"the producer still holds: {leaks}"
            time.sleep(0.1)
        start = time.monotonic()
        assert tokens(complete(procs.urls["proxy"], secret(5))) is not None
        assert time.monotonic() - start < 30.0
        metrics = httpx.get(f"{procs.urls['proxy']}/metrics", timeout=10).text
        assert 'kvstep_proxy_kv_transfers_released_total{result="released"} 4.0' in metrics

    def test_a_release_names_its_transfer_exactly(self, procs: Any) -> None:
        """The release route frees only what the producer's own answer names: an edited
        ticket or another engine id frees nothing."""
        params = own_params(procs, secret(6))
        url = f"{procs.urls['producer']}/v1/kv_transfer/release"
        for edit in ({"ticket": "00" * 32}, {"remote_engine_id": "someone-else"}):
            wrong = httpx.post(url, json={"kv_transfer_params": {**params, **edit}}, timeout=10)
            assert wrong.status_code == 200 and wrong.json() == {"released": False}
        right = httpx.post(url, json={"kv_transfer_params": params}, timeout=10)
        assert right.status_code == 200 and right.json() == {"released": True}


class TestForgedParams:
    def test_another_requests_blocks_cannot_be_read(self, procs: Any) -> None:
        """H1: the victim's prompt goes through the proxy; the attacker takes genuine
        params for its own prompt from the producer, points them at other blocks (or
        forges them whole), and asks the consumer: a 400 each time, no tokens."""
        victim = secret(1)
        assert complete(procs.urls["proxy"], victim).status_code == 200
        attacker = [200] * 48 + [99]
        mine = own_params(procs, attacker)
        for edit in ({"remote_block_ids": [1, 2, 3]}, {"remote_request_id": "req-7"}):
            forged = complete(procs.urls["consumer"], attacker, kv_transfer_params={**mine, **edit})
            refused(forged, "ticket")
        whole = {k: v for k, v in mine.items() if k != "ticket"}
        refused(complete(procs.urls["consumer"], attacker, kv_transfer_params=whole), "ticket")
        made_up = {**mine, "ticket": "00" * 32}
        refused(complete(procs.urls["consumer"], attacker, kv_transfer_params=made_up), "ticket")

    def test_the_prefix_cache_cannot_be_poisoned(self, procs: Any) -> None:
        """H2: genuine params of prompt A presented with prompt B (a shared system
        prompt) are refused; a later user of B gets one engine's tokens."""
        system = secret(2)[:48]
        params_a = own_params(procs, [*system, 1])
        poisoned = complete(procs.urls["consumer"], [*system, 42], kv_transfer_params=params_a)
        refused(poisoned, "ticket")
        user = complete(procs.urls["proxy"], [*system, 42])
        assert tokens(user) == tokens(complete(procs.urls["reference"], [*system, 42]))

    def test_a_forged_done_notification_frees_nothing(self, procs: Any) -> None:
        """H3: params naming another request with no block to read (which would only
        notify the producer to free its blocks) are refused at the consumer's door."""
        attacker = secret(3)
        mine = own_params(procs, attacker)
        forged = {**mine, "remote_block_ids": [], "remote_request_id": "req-7"}
        refused(complete(procs.urls["consumer"], attacker, kv_transfer_params=forged), "ticket")

    def test_the_consumer_connects_to_no_port_a_client_names(self, procs: Any) -> None:
        """H4/H5: params naming a port the attacker listens on (an impostor of the
        producer, or a port to scan) are refused before any connection: the listener
        never sees one, and the answer comes at once (no timing to scan ports by)."""
        attacker = secret(4)
        mine = own_params(procs, attacker)
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            listener.settimeout(1.0)
            port = listener.getsockname()[1]
            start = time.monotonic()
            answer = complete(procs.urls["consumer"], attacker,
                              kv_transfer_params={**mine, "remote_port": port})  # fmt: skip
            took = time.monotonic() - start
            refused(answer, "ticket")
            with pytest.raises(TimeoutError):
                listener.accept()
        assert took < 5.0

    def test_silent_handshakes_cannot_disable_pd_for_everyone(self, procs: Any) -> None:
        """Medium: 64 requests naming silent ports (which would each start a handshake
        that never ends, and fill the bound on handshakes in flight) are refused at the
        door; a user's request through the proxy still moves its KV."""
        attacker = secret(7)
        mine = own_params(procs, attacker)
        silent = []
        try:
            for _ in range(8):
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                sock.listen(64)  # connections complete in the kernel, nothing is read
                silent.append(sock)
            for i in range(64):
                port = silent[i % 8].getsockname()[1]
                forged = {**mine, "remote_port": port, "remote_engine_id": f"silent-{i}"}
                answer = complete(procs.urls["consumer"], attacker, kv_transfer_params=forged)
                refused(answer, "ticket")
        finally:
            for sock in silent:
                sock.close()
        before = ex.loaded(procs)
        user = [5 + (j * 7) % 240 for j in range(200)]
        assert tokens(complete(procs.urls["proxy"], user)) == tokens(
            complete(procs.urls["reference"], user)
        )
        assert ex.loaded(procs) - before >= 12 * BS  # its prompt's KV came from the producer
