"""A real attacker against a publisher's replay socket, on loopback.

The publisher runs in a subprocess (so its RSS is its own, not the attacker's buffers),
publishing one batch every 5 ms, with a replay socket. The attacker sends 64 MiB frames
and floods valid replay requests from many identities: the publisher's RSS stays within
a few MiB, a normal subscriber keeps receiving every live batch meanwhile, and a normal
replay is answered again once the flood stops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pipeline.kv_events import KVEventSubscriber

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 30.0  # a bound on a hang, never a timing assertion

_PUBLISHER = """
import json, sys, time
from pipeline.kv_events import BlockStored, KVEventsConfig, ZmqEventPublisher
config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                        buffer_steps=200)
pub = ZmqEventPublisher(config)
print(json.dumps(pub.describe()), flush=True)
n = 0
while True:
    pub.publish([BlockStored([n, n + 1], None, [], 16, None, "GPU")])
    n += 1
    time.sleep(0.005)
"""


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def publisher() -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", _PUBLISHER], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        assert process.stdout is not None
        yield process, json.loads(process.stdout.readline())
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _drain_live(sub: KVEventSubscriber, seconds: float) -> list[int]:
    """The sequence numbers of the live batches received during ``seconds``."""
    seqs: list[int] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seqs += [b.seq for b in sub.poll(0.05)]
    return seqs


class TestReplayAttack:
    @pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
    def test_huge_frames_and_a_flood_cost_the_publisher_nothing(
        self, publisher: tuple[subprocess.Popen[str], dict[str, str]]
    ) -> None:
        """64 MiB frames and a flood of 20,000 replay requests: the publisher's RSS grows
        by less than 8 MiB, a subscriber gets every live batch meanwhile (no gap, no
        stall), and a normal replay is served after the flood."""
        process, where = publisher
        ctx = zmq.Context()
        attackers: list[zmq.Socket] = []
        try:
            with KVEventSubscriber(where["endpoint"]) as sub:
                _drain_live(sub, 1.0)  # joined, and the publisher warmed up
                sub.gaps.clear()
                base = _rss_kib(process.pid)
                peak = base

                huge = b"\0" * (64 << 20)
                for _ in range(3):  # a 64 MiB frame, three times (each gets disconnected)
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(where["replay_endpoint"])
                    sock.send_multipart([b"", huge], copy=False)
                    attackers.append(sock)
                del huge
                flood = []
                for _ in range(20):  # twenty identities, a thousand requests each
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, 0)
                    sock.connect(where["replay_endpoint"])
                    flood.append(sock)
                    attackers.append(sock)
                request = [b"", (0).to_bytes(8, "big")]
                for _ in range(1000):
                    for sock in flood:
                        sock.send_multipart(request)

                live: list[int] = []
                end = time.monotonic() + 4.0
                while time.monotonic() < end:
                    live += _drain_live(sub, 0.2)
                    peak = max(peak, _rss_kib(process.pid))
                assert (peak - base) < 8 * 1024, f"publisher RSS +{(peak - base) / 1024:.1f} MiB"
                # ~800 batches were published meanwhile; every one reached the subscriber
                assert len(live) > 400, len(live)
                assert live == list(range(live[0], live[0] + len(live)))
                assert sub.gaps == []
                assert process.poll() is None

                for sock in attackers:
                    sock.close()
                attackers.clear()
                time.sleep(3.0)  # the flood is over: the rate limit refills
                with KVEventSubscriber(where["endpoint"], where["replay_endpoint"]) as late:
                    result = late.replay(0, 10.0)
                    assert result.batches and result.missed.stop == result.batches[0].seq
        finally:
            for sock in attackers:
                sock.close()
            ctx.term()
