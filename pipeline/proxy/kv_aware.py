"""``KVAwareRouter``: send each request to the replica that already holds its prefix.

The router hashes a request's prompt exactly as the replicas' block pools do
(:func:`pipeline.kv_events.prompt_block_hashes`: the same token ids, ``block_size``,
``hash_seed`` and hash format), asks its :class:`PrefixIndex` (fed by the replicas' KV
events, :mod:`pipeline.proxy.kv_follow`) how many leading blocks each replica holds, and
picks the replica of least estimated cost::

    cost = blocks to compute + blocks it would evict + load_weight * requests open on it

* **blocks to compute**: the prompt's full blocks less the replica's cached prefix of
  it. The blocks of a request just routed count as held on its replica until its
  events announce them or ``pending_s`` passes (:meth:`PrefixIndex.expect`): a prefill
  takes a while before any block is announced, and without that a second request of
  the same prefix would look like a miss everywhere and be sent elsewhere, caching the
  prefix twice.
* **blocks it would evict**: of the prefixes recently routed to the replica, the blocks
  that would no longer fit in its cache with this prompt's misses added
  (:class:`~pipeline.proxy.footprint.Footprint`; the capacity is known once the replica
  has evicted a block, :meth:`PrefixIndex.capacity`; 0 before). Each is a block a later
  request of that prefix would recompute. This keeps a replica from being given more
  distinct prefixes than it can hold while another has room: under memory pressure the
  policy otherwise churns, a replica evicting one prefix for another it was also chosen
  for.
* **load**: ``load_weight`` blocks' worth of work for each request this proxy has open
  on the replica, so a replica is passed over for its cached prefix only when it is
  busier than the prefix is worth.

Ties go to the replica whose recent prefixes take the fewest blocks (a new prefix goes
where there is most room, so prefixes spread evenly over the replicas), then to the
pool's turn. A request the router cannot hash (no tokenizer for a text prompt, a
malformed body, which the replica will refuse anyway) is routed by load alone.

Text prompts are tokenized with the model's own tokenizer (``tokenizer.json``) and chat
messages rendered with its chat template first, as ``kvstep serve`` does; a long text is
encoded, and a long prompt hashed, on a worker thread, so the event loop never waits on
them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import anyio.to_thread

from pipeline.errors import InvalidRequestError
from pipeline.kv_events import ExternalBlockHash, prompt_block_hashes
from pipeline.proxy.event_watch import EventWatch
from pipeline.proxy.footprint import Footprint
from pipeline.proxy.metrics import ProxyMetrics
from pipeline.proxy.pool import Backend, BackendPool
from pipeline.proxy.prefix_index import PrefixIndex
from pipeline.server.chat_template import parse_messages, render_chat
from pipeline.server.prompt_encoder import INLINE_ENCODE_BYTES
from pipeline.server.tools import parse_tools

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
        pending_s: How long the blocks of a request routed to a backend count as held
            there before its events announce them.
        clock: Monotonic seconds (``time.monotonic``).

    Attributes:
        watch: Which backends send events (:mod:`pipeline.proxy.event_watch`).
        footprint: The prefixes routed to each backend lately
            (:mod:`pipeline.proxy.footprint`).
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
        pending_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
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
        self.footprint = Footprint(urls)
        self.pending_s = pending_s
        self._clock = clock
        self._clears = dict(self.index.clears)
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
        empty; see the module); counts the decision in the metrics."""
        start = time.perf_counter()
        index, footprint = self.index, self.footprint
        for url, clears in index.clears.items():  # a cleared replica holds nothing
            if clears != self._clears[url]:
                self._clears[url] = clears
                footprint.cleared(url)
        if not hashes:
            chosen = min(candidates, key=lambda b: b.in_flight)  # the first of ties
            self.metrics.route_seconds.observe(time.perf_counter() - start)
            self.metrics.routed_blocks.labels(chosen.url).inc(0)
            self.metrics.routed_hit_blocks.labels(chosen.url).inc(0)
            return chosen
        now = self._clock()
        depth = index.match(hashes, now)  # announced, or routed and not yet announced
        total, key = len(hashes), hashes[0]

        def cost(backend: Backend) -> tuple[float, int]:
            url = backend.url
            compute = total - depth[url]
            evict = min(compute, footprint.overflow(url, key, total, index.capacity(url)))
            return compute + evict + self.load_weight * backend.in_flight, footprint.blocks(url)

        chosen = min(candidates, key=cost)  # the first of ties: the pool's turn
        url = chosen.url
        announced = index.match(hashes)[url]
        self.watch.routed(url, total > announced)
        index.expect(url, hashes, now + self.pending_s, now)
        footprint.routed(url, key, total, index.capacity(url))
        metrics = self.metrics
        metrics.route_seconds.observe(time.perf_counter() - start)
        metrics.routed_blocks.labels(url).inc(total)
        metrics.routed_hit_blocks.labels(url).inc(announced)
        return chosen

    async def _token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        if path.endswith("/chat/completions"):
            if self.tokenizer is None:
                return None
            try:
                tools = parse_tools(body)  # rendered into the prompt as a replica does
                text = render_chat(
                    self.tokenizer,
                    parse_messages(body.get("messages")),
                    None if tools is None else tools.template_tools(),
                )
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
