"""Token sampling: greedy, temperature, top-k and top-p, with per-request seeds.

A request with a ``seed`` draws its noise from a ``torch.Generator`` seeded from
``(seed, num_output_tokens)``, so the token it samples at a given output index is the
same whatever else is in the batch and however often it was preempted. Requests
without a seed share one engine generator seeded from ``EngineConfig.seed``.

Sampling uses the exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which draws
exactly from ``p`` and vectorises over the batch; greedy rows are one ``argmax``.

:meth:`Sampler.sample_rows` isolates failures: when the batched path raises, every row
is sampled alone, and a row that still raises is reported (its request fails alone)
while the others get their tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pipeline.config import SamplingParams
from pipeline.errors import short_repr
from pipeline.logs import get_logger

__all__ = ["RowSamples", "Sampler", "request_seed"]

_log = get_logger()


class RowSamples(NamedTuple):
    """The result of :meth:`Sampler.sample_rows`.

    Attributes:
        tokens: The token of each row, ``None`` for a row that failed.
        errors: Row index → why that row could not be sampled.
    """

    tokens: list[int | None]
    errors: dict[int, str]


def request_seed(seed: int, output_index: int) -> int:
    """The generator seed of a seeded request's ``output_index``-th token (63 bits)."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Sampler:
    """Samples one token per logits row.

    Args:
        seed: Seed of the generator shared by requests without their own seed.
        device: Device of the logits it will receive.

    Not thread-safe (the shared generator advances); one call at a time.
    """

    def __init__(self, *, seed: int, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> list[int]:
        """One token id per row of ``logits [N, vocab]`` (float32).

        Args:
            logits: Row ``i`` belongs to the request sampled with ``params[i]``.
            params: Sampling parameters per row.
            num_output_tokens: Index of the token each row produces (seeds).

        Returns:
            The sampled token ids, in row order.
        """
        n = logits.shape[0]
        if n == 0:
            return []
        greedy = [p.greedy for p in params]
        result = torch.empty(n, dtype=torch.long, device=logits.device)
        greedy_rows = [i for i in range(n) if greedy[i]]
        if greedy_rows:
            if len(greedy_rows) == n:
                return logits.argmax(dim=-1).tolist()
            rows_t = torch.tensor(greedy_rows, device=logits.device)
            result[rows_t] = logits[rows_t].argmax(dim=-1)
        random_rows = [i for i in range(n) if not greedy[i]]
        rows_t = torch.tensor(random_rows, device=logits.device)
        chosen = self._sample_random(
            logits[rows_t],
            [params[i] for i in random_rows],
            [num_output_tokens[i] for i in random_rows],
        )
        result[rows_t] = chosen
        return result.tolist()

    def sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> RowSamples:
        """Like :meth:`sample`, but a row that cannot be sampled fails alone.

        The batch is sampled at once; if that raises, each row is sampled on its own
        (greedy and seeded rows get the very tokens they get in any batch; unseeded rows
        draw from the shared generator in row order). Rows that raise on their own are
        reported in :attr:`RowSamples.errors`; nothing is raised for them.
        """
        try:
            tokens: list[int | None] = list(self.sample(logits, params, num_output_tokens))
            return RowSamples(tokens, {})
        except Exception as exc:
            _log.warning("batched_sampling_failed", rows=len(params), error=repr(exc))
        tokens = []
        errors: dict[int, str] = {}
        for i in range(len(params)):
            try:
                tokens.append(
                    self.sample(logits[i : i + 1], [params[i]], [num_output_tokens[i]])[0]
                )
            except Exception as exc:
                tokens.append(None)
                errors[i] = f"sampling failed: {short_repr(exc, 200)}"
        return RowSamples(tokens, errors)

    def _sample_random(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
    ) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[-1]
        temps = torch.tensor([float(p.temperature) for p in params], device=dev)
        x = logits / temps[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [float(p.top_p) for p in params]
        order: torch.Tensor | None = None
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            x, order = x.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev)
            k_t = torch.tensor(top_k, device=dev)
            x = x.masked_fill(ranks[None, :] >= k_t[:, None], float("-inf"))
            if any(p < 1.0 for p in top_p):
                probs = x.softmax(dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs
                p_t = torch.tensor(top_p, device=dev)
                drop = (mass_before >= p_t[:, None]) & (p_t[:, None] < 1.0)
                drop[:, 0] = False
                x = x.masked_fill(drop, float("-inf"))
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            rows = torch.tensor(unseeded, device=dev)
            shared = torch.empty(len(unseeded), vocab, device=dev)
            noise[rows] = shared.exponential_(generator=self._generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(device=dev)
                gen.manual_seed(request_seed(p.seed, indices[i]))
                noise[i].exponential_(generator=gen)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        choice = (probs / noise).argmax(dim=-1)
        if order is not None:
            choice = order.gather(1, choice[:, None])[:, 0]
        return choice
