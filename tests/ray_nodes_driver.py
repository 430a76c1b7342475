"""Helper for tests/pipeline/test_ray_nodes.py (not a test file): the Ray driver of the
two-node test, run in a fresh interpreter so that no earlier ``ray.init`` of the test
process (another Ray cluster, shut down) leaves state behind.

    python tests/ray_nodes_driver.py ADDRESS MODEL tokens|kill|nodes

Connects to the cluster at ``ADDRESS``, runs an engine over two ranks with
``ray_placement_strategy="STRICT_SPREAD"`` on the prompts of the multiproc tests, and
prints one JSON object, after ``RESULT`` on its line: ``tokens`` — the greedy tokens
and the node of each rank's bundle; ``kill`` — SIGKILLs the raylet of the node with
resource ``b`` once every stream has tokens, and reports which streams raised
``EngineDeadError`` and how long after the kill the last one did; ``nodes`` — the
resources (``a``, ``b``) of the alive nodes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from proc_scan import pids_with

sys.path.insert(0, str(Path(__file__).resolve().parent / "pipeline"))

from test_multiproc_executor import PARAMS, config, workload

from pipeline import LLM, AsyncEngine, SamplingParams
from pipeline.errors import EngineDeadError


def spread(model: str, **overrides: Any) -> Any:
    return config(
        Path(model), executor="ray", world_size=2, ray_placement_strategy="STRICT_SPREAD",
        **overrides,
    )  # fmt: skip


def node_of(resource: str) -> str:
    import ray

    for node in ray.nodes():
        if node["Alive"] and resource in node["Resources"]:
            return str(node["NodeID"])
    raise LookupError(f"no alive node with resource {resource!r}")


def kill_raylet(node_id: str) -> None:
    """SIGKILL the raylet of node ``node_id`` (found by its command line)."""
    pids = pids_with(f"--node_id={node_id}", "raylet")
    if not pids:
        raise LookupError(f"no raylet of node {node_id}")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


async def kill_mid_generation(model: str) -> dict[str, Any]:
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    errors: list[str] = []
    async with AsyncEngine(spread(model, max_model_len=4096)) as engine:
        started = anyio.Event()
        seen: set[int] = set()

        async def consume(index: int, prompt: list[int]) -> None:
            try:
                async for out in engine.generate(prompt, params):
                    if len(out.token_ids) >= 4:
                        seen.add(index)
                        if len(seen) == len(workload()):
                            started.set()
            except EngineDeadError as exc:
                errors.append(str(exc))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for index, prompt in enumerate(workload()):
                    tg.start_soon(consume, index, prompt)
                await started.wait()
                kill_raylet(node_of("b"))
                killed = time.monotonic()
        return {"errors": errors, "seconds": time.monotonic() - killed}


def main() -> None:
    import ray

    address, model, what = sys.argv[1:4]
    ray.init(address=address, log_to_driver=False)
    if what == "tokens":
        with LLM(spread(model)) as llm:
            group = llm.engine.core.executor._placement_group  # type: ignore[attr-defined]
            nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
            outs = llm.generate(workload(), PARAMS)
        result: dict[str, Any] = {
            "tokens": [list(o.token_ids) for o in outs],
            "rank_nodes": [nodes[rank] for rank in sorted(nodes)],
        }
    elif what == "nodes":
        alive = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        result = {"alive": sorted(name for name in ("a", "b") if any(name in r for r in alive))}
    else:
        result = anyio.run(kill_mid_generation, model)
    print("RESULT " + json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
