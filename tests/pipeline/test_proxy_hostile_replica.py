"""A hostile "replica" against a real ``kvstep proxy --policy kv-aware`` process.

The replica's ``/health`` advertises a PUB socket and a replay socket on loopback that
flood the proxy: live batches of 20,000 fresh block hashes each, numbered with a gap every
time (so the proxy asks for a replay), and a replay socket that streams such batches
forever and never sends the end marker. The proxy's RSS stays bounded, and SIGTERM
ends it within a few seconds all the same.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
zmq = pytest.importorskip("zmq")

from proxy_fakes import Servers  # noqa: E402
from server_process import launch  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pipeline.kv_events import BlockStored, KVEventBatch, encode_batch  # noqa: E402

HASHES_PER_BATCH = 20_000
LIMIT_S = 120.0  # a bound on a hang, never a timing assertion


class HostileReplica:
    """A PUB and a replay ROUTER on loopback that flood once :attr:`go` is set."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.go = threading.Event()
        self.stop = threading.Event()
        self._hashes = itertools.count(1 << 40, 1)
        self._threads = [
            threading.Thread(target=self._publish, daemon=True),
            threading.Thread(target=self._replay, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.app = Starlette(routes=[Route("/health", self._health)])

    def endpoints(self) -> dict[str, str]:
        return {
            "endpoint": self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
            "replay_endpoint": self.router.getsockopt_string(zmq.LAST_ENDPOINT),
            "topic": "",
        }

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "kv_events": self.endpoints()})

    def _payload(self) -> bytes:
        hashes = [next(self._hashes) for _ in range(HASHES_PER_BATCH)]
        event = BlockStored(hashes, None, [], 16, None, "GPU")
        return encode_batch(KVEventBatch(ts=0.0, events=[event]))

    def _publish(self) -> None:
        self.go.wait()
        seq = 0
        while not self.stop.is_set():
            seq += 2  # always a gap: the proxy asks the replay socket
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self._payload()])

    def _replay(self) -> None:
        self.go.wait()
        clients: list[bytes] = []
        seq = 0
        while not self.stop.is_set():
            while self.router.poll(0):
                clients.append(self.router.recv_multipart()[0])
            for client in clients[-4:]:  # stream to the latest askers, never ending
                seq += 1
                frames = [client, b"", seq.to_bytes(8, "big"), self._payload()]
                with contextlib.suppress(zmq.Again):  # its queue is full: drop it
                    self.router.send_multipart(frames, zmq.NOBLOCK)
            if not clients:
                time.sleep(0.01)

    def close(self) -> None:
        self.go.set()
        self.stop.set()
        for thread in self._threads:
            thread.join(10)
        self.pub.close()
        self.router.close()
        self.ctx.term()


@pytest.fixture
def hostile(serve: Servers) -> Iterator[tuple[HostileReplica, str]]:
    replica = HostileReplica()
    try:
        yield replica, serve(replica.app).url
    finally:
        replica.close()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
class TestHostileReplica:
    def test_a_flooding_replica_is_capped_and_cannot_hold_the_shutdown(
        self, hostile: tuple[HostileReplica, str], tmp_path: Path
    ) -> None:
        """Ten seconds of flood: the proxy's RSS grows by less than 160 MiB (its index
        credits the replica with at most --max-backend-blocks, each frame, the waiting
        messages and a replay are capped), it keeps answering /health, and SIGTERM ends
        it within 6 s."""
        replica, url = hostile
        args = ["--backend", url, "--policy", "kv-aware", "--health-interval", "0.5"]
        with launch("proxy", args, tmp_path / "proxy.log") as proxy:
            proxy.wait_healthy(time.monotonic() + LIMIT_S)
            time.sleep(1.0)  # the proxy found the endpoints and subscribed
            base = _rss_mib(proxy.process.pid)
            replica.go.set()
            peak = base
            end = time.monotonic() + 10.0
            while time.monotonic() < end:
                time.sleep(0.1)
                peak = max(peak, _rss_mib(proxy.process.pid))
            assert proxy.health().status_code == 200
            grown = peak - base
            assert grown < 160, f"proxy RSS +{grown:.0f} MiB: {proxy.log_text()[-2000:]}"
            started = time.monotonic()
            proxy.process.send_signal(signal.SIGTERM)
            try:
                proxy.process.wait(timeout=30)
            finally:
                took = time.monotonic() - started
            assert took < 6.0, f"SIGTERM took {took:.1f}s: {proxy.log_text()[-2000:]}"
