"""``routing.py --trace``: what the kv-aware proxy believed at each decision, against
what the replicas then did.

Run as a script (``python benchmarks/_routing_trace.py proxy --trace PATH FLAGS...``),
this is ``kvstep proxy FLAGS...`` with two hooks that append JSON lines to ``PATH``:
every decision of :meth:`KVAwareRouter.choose` (the prompt's block hashes, the blocks
the index showed on each candidate, their open requests, the pick) and every event
batch applied to the index (the hashes each replica stored and removed). Nothing else
changes; the hooks cost a JSON line each.

:func:`summarize_trace` reads such a file back: per decision, the blocks the index said
the chosen replica held against the blocks it then had to store (what it computed: a
replica announces only blocks it did not hold), how long it took for a routed request's
first block to be announced, how many decisions were taken while a request of the same
first block was routed but not yet announced (and how many of those went elsewhere), how
many replicas each prefix was sent to, and the blocks each replica evicted.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def launch_traced(flags: Sequence[str], log: Path, env: Mapping[str, str] | None) -> Iterator[Any]:
    """``kvstep proxy FLAGS`` (with ``--trace PATH`` among them) under this module's
    hooks, as :func:`_serve_client.launch` starts it; yields its ``Launched``."""
    from _serve_client import launch

    with launch(
        "proxy", flags, log, env, program=[sys.executable, str(Path(__file__).resolve())]
    ) as launched:
        yield launched


def _hash_json(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def _install(path: Path) -> None:
    """Hook the router's decisions and the event batches applied to write ``path``."""
    from pipeline.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from pipeline.proxy import kv_follow
    from pipeline.proxy.kv_aware import KVAwareRouter

    out = path.open("a", buffering=1, encoding="utf-8")
    choose = KVAwareRouter.choose
    apply_batches = kv_follow.apply_batches

    def traced_choose(self: KVAwareRouter, candidates: Any, hashes: Any) -> Any:
        believed = self.index.match(hashes) if hashes else {}
        chosen = choose(self, candidates, hashes)
        record = {
            "t": time.monotonic(),
            "kind": "decision",
            "chosen": chosen.url,
            "hashes": [_hash_json(h) for h in hashes],
            "believed": believed,
            "in_flight": {b.url: b.in_flight for b in candidates},
        }
        out.write(json.dumps(record) + "\n")
        return chosen

    def traced_apply(index: Any, url: str, batches: Any) -> None:
        apply_batches(index, url, batches)
        stored: list[Any] = []
        removed: list[Any] = []
        cleared = False
        for item in batches:
            for event in item.batch.events:
                if isinstance(event, BlockStored) and event.medium in ("GPU", None):
                    stored += [_hash_json(h) for h in event.block_hashes]
                elif isinstance(event, BlockRemoved) and event.medium in ("GPU", None):
                    removed += [_hash_json(h) for h in event.block_hashes]
                elif isinstance(event, AllBlocksCleared):
                    cleared = True
        if stored or removed or cleared:
            record = {
                "t": time.monotonic(),
                "kind": "events",
                "replica": url,
                "stored": stored,
                "removed": removed,
                "cleared": cleared,
            }
            out.write(json.dumps(record) + "\n")

    KVAwareRouter.choose = traced_choose  # type: ignore[method-assign]
    kv_follow.apply_batches = traced_apply


def summarize_trace(path: Path, replicas: Sequence[str], since: float) -> dict[str, Any]:
    """What this module's hooks wrote to ``path`` (see the module), from ``since``
    (``time.monotonic``, the same clock in every process here) on: the warm-up's
    decisions come before it."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    decisions = [r for r in records if r["kind"] == "decision" and r["t"] >= since]
    if not decisions:
        return {"decisions": 0}
    start = decisions[0]["t"]
    events = [r for r in records if r["kind"] == "events" and r["t"] >= start]
    stores: dict[tuple[str, Any], list[float]] = defaultdict(list)  # (replica, hash) -> times
    removed = dict.fromkeys(replicas, 0)
    for event in events:
        for h in event["stored"]:
            stores[event["replica"], h].append(event["t"])
        removed[event["replica"]] += len(event["removed"])
    # the next decision on the same replica that carries a hash: its stores are its own
    later: dict[tuple[str, Any], list[float]] = defaultdict(list)
    for d in decisions:
        for h in d["hashes"]:
            later[d["chosen"], h].append(d["t"])
    believed = computed = blocks = 0
    announce_delays: list[float] = []
    unannounced_same = unannounced_elsewhere = 0
    routed_to: dict[Any, set[str]] = defaultdict(set)
    keys_per_replica: dict[str, set[Any]] = {url: set() for url in replicas}
    first_store: list[tuple[float, str, Any]] = []  # (time announced, replica, first hash)
    for d in decisions:
        hashes, url, t = d["hashes"], d["chosen"], d["t"]
        if not hashes:
            continue
        blocks += len(hashes)
        believed += d["believed"].get(url, 0)
        for h in hashes:
            until = min((u for u in later[url, h] if u > t), default=float("inf"))
            if any(t < s <= until for s in stores[url, h]):
                computed += 1
        key = hashes[0]
        pending = [(at, where) for at, where, k in first_store if k == key and at > t]
        if pending:
            unannounced_same += 1
            unannounced_elsewhere += all(where != url for _, where in pending)
        announced = min((s for s in stores[url, key] if s > t), default=None)
        if announced is not None:
            announce_delays.append(announced - t)
            first_store.append((announced, url, key))
        else:  # never announced (a hit, or not yet): counts as known at once
            first_store.append((t, url, key))
        routed_to[key].add(url)
        keys_per_replica[url].add(key)
    return {
        "decisions": len(decisions),
        "prompt_blocks": blocks,
        "believed_hit_blocks": believed,
        "computed_blocks": computed,
        "actual_hit_blocks": blocks - computed,
        "announce_delay_p50_s": statistics.median(announce_delays) if announce_delays else None,
        "announce_delay_max_s": max(announce_delays, default=None),
        "decisions_with_same_prefix_unannounced": unannounced_same,
        "of_which_sent_elsewhere": unannounced_elsewhere,
        "replicas_per_prefix": statistics.mean(len(v) for v in routed_to.values()),
        "prefixes_per_replica": [len(keys_per_replica[url]) for url in replicas],
        "removed_blocks_per_replica": [removed[url] for url in replicas],
    }


def main(argv: list[str]) -> int:
    """``proxy --trace PATH FLAGS...``: the proxy CLI with the hooks installed."""
    at = argv.index("--trace")
    path = Path(argv[at + 1])
    rest = argv[:at] + argv[at + 2 :]
    _install(path)
    from pipeline.cli.main import main as cli_main

    return int(cli_main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
