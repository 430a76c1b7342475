"""``executor="ray"`` across two Ray nodes: a head and a second node started with
``ray start`` on this machine (each a raylet of its own), rank 0 and rank 1 placed on
different nodes (``ray_placement_strategy="STRICT_SPREAD"``). TP=2 gives the single
rank's greedy tokens; killing the second node's raylet ends every request with
``EngineDeadError`` (no hang); with the node back, a new engine serves again."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from proc_scan import pids_with

pytest.importorskip("ray")

import test_multiproc_executor as multiproc
from test_multiproc_executor import workload

reference_llama = multiproc.reference_llama  # the fixture: the single rank's tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RAY = Path(sys.executable).parent / "ray"
NODE_MEMORY = str(80 * 1024 * 1024)  # object store of each node: small, this is one machine
# Workers on ports the kernel picks, not Ray's fixed 10002-19999 (other tests' servers).
WORKER_PORTS = ("--min-worker-port", "0", "--max-worker-port", "0")


class Cluster:
    """A head node (resource ``a``) and a second node (resource ``b``) of one Ray
    cluster, started with ``ray start`` under ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        while self.port < 20_000:  # below it: Ray's default worker ports
            self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Token authentication off: a driver reads its token once per process, and this
        # one's Ray may already have been used; a loopback cluster of one test only.
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}

    def _ray(self, *args: str) -> None:
        done = subprocess.run(
            [str(RAY), *args], env=self.env, capture_output=True, text=True, timeout=180
        )
        if done.returncode != 0:
            pytest.skip(f"`ray {' '.join(args[:2])}` could not start a node here: "
                        f"{done.stderr[-600:]}")  # fmt: skip

    def start_head(self) -> None:
        self._ray("start", "--head", "--port", str(self.port), "--num-cpus", "1",
                  "--resources", '{"a": 1}', "--temp-dir", str(self.tmp),
                  "--object-store-memory", NODE_MEMORY, "--include-dashboard", "false",
                  "--disable-usage-stats", *WORKER_PORTS)  # fmt: skip

    def start_second(self) -> None:
        self._ray("start", "--address", self.address, "--num-cpus", "1",
                  "--resources", '{"b": 1}', "--object-store-memory", NODE_MEMORY,
                  *WORKER_PORTS)  # fmt: skip

    def stop(self) -> None:
        """Every process of this cluster (they all run under ``tmp``); never ``ray stop``,
        which would stop the other Ray clusters of this machine too."""
        for pid in pids_with(str(self.tmp)):
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


DRIVER = Path(__file__).resolve().parent.parent / "ray_nodes_driver.py"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if shutil.which(str(RAY)) is None:
        pytest.skip("no `ray` command beside this interpreter")
    tmp = Path(f"/tmp/kvstep-ray-{secrets.token_hex(4)}")  # Ray's socket paths must be short
    tmp.mkdir()
    nodes = Cluster(tmp)
    try:
        nodes.start_head()
        nodes.start_second()
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def drive(cluster: Cluster, model: Path, what: str) -> dict[str, Any]:
    """Run the driver (:mod:`ray_nodes_driver`) against ``cluster`` in a fresh
    interpreter: a Ray driver's state does not survive another cluster's
    ``ray.shutdown()`` in one process (an actor class exported to the first is taken as
    exported to the second, whose actors are then cancelled before they run)."""
    done = subprocess.run(
        [sys.executable, str(DRIVER), cluster.address, str(model), what],
        env={**cluster.env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


class TestTwoNodes:
    def test_ranks_on_two_nodes_give_the_single_ranks_tokens(
        self, cluster: Cluster, llama_path: Path, reference_llama: Any
    ) -> None:
        """STRICT_SPREAD puts rank 0 and rank 1 on different nodes; TP=2 over them gives
        the single rank's greedy tokens."""
        result = drive(cluster, llama_path, "tokens")
        assert len(set(result["rank_nodes"])) == 2, result["rank_nodes"]
        assert [tuple(t) for t in result["tokens"]] == reference_llama

    def test_a_dead_node_ends_requests_then_the_engine_restarts(
        self, cluster: Cluster, llama_path: Path, reference_llama: Any
    ) -> None:
        """SIGKILL of the second node's raylet mid-generation: every request raises
        ``EngineDeadError`` within the fan-in deadline; with the node started again, a
        new engine over both nodes gives the single rank's tokens."""
        killed = drive(cluster, llama_path, "kill")
        assert len(killed["errors"]) == len(workload()), killed
        assert killed["seconds"] < 90, killed
        deadline = time.monotonic() + 60
        while "b" in drive(cluster, llama_path, "nodes")["alive"]:  # the head notices
            assert time.monotonic() < deadline, "the killed node still looks alive"
            time.sleep(0.5)
        cluster.start_second()
        result = drive(cluster, llama_path, "tokens")
        assert len(set(result["rank_nodes"])) == 2
        assert [tuple(t) for t in result["tokens"]] == reference_llama
