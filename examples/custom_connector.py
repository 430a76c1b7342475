"""Write your own KV connector: here, one that counts the KV blocks each step fills.

A connector has a scheduler half (decides what to load and save, builds each step's
metadata) and a worker half (sees the paged KV cache layer by layer during the forward
pass). Register both under a name, then use the name in ``EngineConfig(connector=...)``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

import attrs
import torch

from connectors.base import (
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
)
from connectors.registry import register_connector, unregister_connector
from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.artifacts import SchedulerOutput
from pipeline.request import Request


@attrs.frozen
class FilledBlocks(KVConnectorMetadata):
    """This step's metadata: how many blocks become full in it, per request."""

    step_id: int
    filled: tuple[tuple[str, int], ...]


class CountingScheduler(KVConnectorScheduler):
    """Loads nothing; tells the workers which blocks each step fills."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        return MatchResult(0)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        bs = self.context.block_size
        filled = tuple(
            (
                r.req_id,
                (r.num_computed_tokens + r.num_new_tokens) // bs - r.num_computed_tokens // bs,
            )
            for r in scheduler_output.requests
        )
        return FilledBlocks(scheduler_output.step_id, filled)


class CountingWorker(KVConnectorWorker):
    """Counts filled blocks once per step (at layer 0); a real one would copy them out."""

    saved_blocks: ClassVar[dict[str, int]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()  # per-layer hooks run off the loop

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        meta = self.connector_metadata
        if layer != 0 or self.context.rank != 0 or not isinstance(meta, FilledBlocks):
            return
        with self._lock:
            for req_id, n in meta.filled:
                self.saved_blocks[req_id] = self.saved_blocks.get(req_id, 0) + n


def main() -> dict[str, int]:
    register_connector("block_counter", CountingScheduler, CountingWorker, replace=True)
    CountingWorker.saved_blocks.clear()
    try:
        config = EngineConfig(model="builtin:tiny", max_model_len=256, connector="block_counter")
        prompts = [list(range(1, 40)), list(range(50, 60))]
        with LLM(config) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    finally:
        unregister_connector("block_counter")
    counts = {out.request_id: CountingWorker.saved_blocks.get(out.request_id, 0) for out in outs}
    print("full KV blocks per request:", counts)  # 39+8 tokens -> 2 blocks, 10+8 -> 1 block
    return counts


if __name__ == "__main__":
    main()
