"""``executor="ray"`` across two Ray nodes: a head and a second node started with
``ray start`` on this machine (each a raylet of its own), rank 0 and rank 1 placed on
different nodes (``ray_placement_strategy="STRICT_SPREAD"``). TP=2 gives the single
rank's greedy tokens; killing the second node's raylet ends every request with
``EngineDeadError`` (no hang); with the node back, a new engine serves again."""

from __future__ import annotations

import contextlib
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

import anyio
import pytest
from ports import free_port

from pipeline import AsyncEngine, SamplingParams
from pipeline.errors import EngineDeadError

ray = pytest.importorskip("ray")

import test_multiproc_executor as multiproc  # noqa: E402
from test_multiproc_executor import config, generate, workload  # noqa: E402

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

    def processes(self, marker: str) -> list[int]:
        """PIDs of this machine's processes whose command line holds ``marker``."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline:
                found.append(int(entry.name))
        return found

    def kill_raylet(self, node_id: str) -> None:
        """SIGKILL the raylet of node ``node_id`` (its processes die with it)."""
        pids = [p for p in self.processes(f"--node_id={node_id}") if p != os.getpid()]
        assert pids, f"no raylet of node {node_id} found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Every process of this cluster (they all run under ``tmp``); never ``ray stop``,
        which would stop the other Ray clusters of this machine too."""
        for pid in self.processes(str(self.tmp)):
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


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
        ray.init(address=nodes.address, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def alive_nodes() -> dict[str, str]:
    """Resource name (``a`` or ``b``) → node id, of the alive nodes."""
    out = {}
    for node in ray.nodes():
        if node["Alive"]:
            for name in ("a", "b"):
                if name in node["Resources"]:
                    out[name] = node["NodeID"]
    return out


def spread(model: Path, **overrides: Any) -> Any:
    return config(
        model, executor="ray", world_size=2, ray_placement_strategy="STRICT_SPREAD", **overrides
    )


class TestTwoNodes:
    def test_ranks_on_two_nodes_give_the_single_ranks_tokens(
        self, cluster: Cluster, llama_path: Path, reference_llama: Any
    ) -> None:
        """STRICT_SPREAD puts rank 0 and rank 1 on different nodes; TP=2 over them gives
        the single rank's greedy tokens."""
        assert set(alive_nodes()) == {"a", "b"}
        tokens, _ = generate(spread(llama_path))
        assert tokens == reference_llama

    @pytest.mark.anyio
    async def test_a_dead_node_ends_requests_then_the_engine_restarts(
        self, cluster: Cluster, llama_path: Path, reference_llama: Any
    ) -> None:
        """SIGKILL of the second node's raylet mid-generation: every request raises
        ``EngineDeadError`` within the fan-in deadline; with the node started again, a
        new engine over both nodes gives the single rank's tokens."""
        params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        errors: list[BaseException] = []
        async with AsyncEngine(spread(llama_path, max_model_len=4096)) as engine:
            executor: Any = engine.core.executor
            group = ray.util.placement_group_table(executor._placement_group)
            nodes = set(group["bundles_to_node_id"].values())
            assert len(nodes) == 2, group  # rank 0 and rank 1 on different nodes
            started = anyio.Event()

            async def consume(prompt: list[int]) -> None:
                try:
                    async for out in engine.generate(prompt, params):
                        if len(out.token_ids) >= 4:
                            started.set()
                except EngineDeadError as exc:
                    errors.append(exc)

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for prompt in workload():
                        tg.start_soon(consume, prompt)
                    await started.wait()
                    cluster.kill_raylet(alive_nodes()["b"])
                    killed = time.monotonic()
            assert len(errors) == len(workload())
            assert time.monotonic() - killed < 90
        deadline = time.monotonic() + 60
        while "b" in alive_nodes():  # the head notices the node is gone
            assert time.monotonic() < deadline, "the killed node still looks alive"
            await anyio.sleep(0.5)
        cluster.start_second()
        tokens, _ = await anyio.to_thread.run_sync(generate, spread(llama_path))
        assert tokens == reference_llama
