"""``KVAwareRouter``: send each request to the replica that already holds its prefix.

The router hashes a request's prompt exactly as the replicas' block pools do
(:func:`pipeline.kv_events.prompt_block_hashes`: the same token ids, ``block_size``,
``hash_seed`` and hash format), asks its :class:`PrefixIndex` (fed by the replicas' KV
events, :mod:`pipeline.proxy.kv_follow`) how many leading blocks each replica holds, and
picks the replica of least estimated cost::

    cost = (prompt blocks - cached blocks) + load_weight * requests open on it

that is, the blocks it would have to compute, plus ``load_weight`` blocks' worth of
work for each request this proxy has open on it; ties go to the pool's turn. A request
the router cannot hash (no tokenizer for a text prompt, a malformed body, which the
replica will refuse anyway) is routed by load alone.

Text prompts are tokenized with the model's own tokenizer (``tokenizer.json``) and chat
messages rendered with its chat template first, as ``kvstep serve`` does; a long text is
encoded, and a long prompt hashed, on a worker thread, so the event loop never waits on
them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any, Literal

import anyio.to_thread

from pipeline.errors import InvalidRequestError
from pipeline.kv_events import ExternalBlockHash, prompt_block_hashes
from pipeline.proxy.event_watch import EventWatch
from pipeline.proxy.metrics import ProxyMetrics
from pipeline.proxy.pool import Backend, BackendPool
from pipeline.proxy.prefix_index import PrefixIndex
from pipeline.server.chat_template import parse_messages, render_chat
from pipeline.server.prompt import INLINE_ENCODE_BYTES

__all__ = ["KVAwareRouter"]

_MAX_PROMPT_IDS = 1 << 20  # a token-id prompt longer than this is not hashed
_INLINE_HASH_TOKENS = 256  # longer prompts are hashed on a worker thread (~30 us a block)


class KVAwareRouter:
    """Scores the healthy backends of ``pool`` by cached prefix and load (see the module).

    Args:
        pool: The replicas.
        tokenizer: The model's :class:`pipeline.tokenizer.Tokenizer`, or ``None`` (then
            only token-id prompts are hashed).
        block_size: The replicas' ``block_size``.
        hash_seed: The replicas' ``hash_seed``.
        hash_format: The replicas' ``kv_events`` hash format (``"int"`` or ``"bytes"``).
        load_weight: Blocks of work one open request on a replica counts as.
        max_blocks: The index's bound on distinct block hashes.
        metrics: Where decisions are counted and timed.
        max_backend_blocks: The index's bound on the hashes of one backend
            (``max_blocks`` by default).
        silent_after_s: When a backend counts as silent (:class:`EventWatch`).

    Attributes:
        watch: Which backends send events (:mod:`pipeline.proxy.event_watch`).
    """

    def __init__(
        self,
        pool: BackendPool,
        *,
        tokenizer: Any,
        block_size: int,
        hash_seed: int,
        hash_format: Literal["int", "bytes"],
        load_weight: float,
        max_blocks: int,
        metrics: ProxyMetrics,
        max_backend_blocks: int | None = None,
        silent_after_s: float = 30.0,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._hash_seed = hash_seed
        self.hash_format = hash_format
        self.load_weight = load_weight
        self.metrics = metrics
        urls = [b.url for b in pool.backends]
        self.index = PrefixIndex(urls, max_blocks, max_backend_blocks)
        self.watch = EventWatch(urls, silent_after_s)
        self.limiter = anyio.CapacityLimiter(2)

    def __repr__(self) -> str:  # the seed stays out (a secret of the replicas)
        return (
            f"KVAwareRouter({self.pool!r}, block_size={self.block_size}, blocks={len(self.index)})"
        )

    async def prompt_hashes(self, path: str, body: dict[str, Any]) -> list[ExternalBlockHash]:
        """The block hashes of the request's (first) prompt; ``[]`` when it cannot be
        hashed here."""
        token_ids = await self._token_ids(path, body)
        if token_ids is None:
            return []
        hashes = functools.partial(
            prompt_block_hashes,
            token_ids,
            self.block_size,
            hash_seed=self._hash_seed,
            hash_format=self.hash_format,
        )
        if len(token_ids) <= _INLINE_HASH_TOKENS:
            return hashes()
        return await anyio.to_thread.run_sync(hashes, limiter=self.limiter)

    def choose(self, candidates: Sequence[Backend], hashes: Sequence[ExternalBlockHash]) -> Backend:
        """The candidate of least cost (``candidates`` in the pool's turn order, not
        empty); counts the decision in the metrics."""
        start = time.perf_counter()
        depth = self.index.match(hashes) if hashes else {}
        total = len(hashes)

        def cost(backend: Backend) -> float:
            return total - depth.get(backend.url, 0) + self.load_weight * backend.in_flight

        chosen = min(candidates, key=cost)  # the first of ties: the pool's turn
        self.watch.routed(chosen.url, total > depth.get(chosen.url, 0))
        metrics = self.metrics
        metrics.route_seconds.observe(time.perf_counter() - start)
        metrics.routed_blocks.labels(chosen.url).inc(total)
        metrics.routed_hit_blocks.labels(chosen.url).inc(depth.get(chosen.url, 0))
        return chosen

    async def _token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        if path.endswith("/chat/completions"):
            if self.tokenizer is None:
                return None
            try:
                text = render_chat(self.tokenizer, parse_messages(body.get("messages")))
            except InvalidRequestError:
                return None
            return await self._encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_ids(prompt):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(prompt, str):
            return await self._encode(prompt) if self.tokenizer is not None else None
        if isinstance(prompt, list) and _is_ids(prompt) and len(prompt) <= _MAX_PROMPT_IDS:
            return prompt
        return None

    async def _encode(self, text: str) -> list[int]:
        if len(text) <= INLINE_ENCODE_BYTES:
            ids: list[int] = self.tokenizer.encode(text)
            return ids
        encoded: list[int] = await anyio.to_thread.run_sync(
            self.tokenizer.encode, text, limiter=self.limiter
        )
        return encoded


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
