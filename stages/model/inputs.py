"""Per-request worker state (block tables) and the model inputs of one step.

:class:`RequestStates` follows the scheduler's instructions: a ``ScheduledRequest`` with
``new=True`` (re)creates a request's block table from its ``block_ids``; otherwise the
``block_ids`` are appended; ``SchedulerOutput.finished_req_ids`` are dropped. Every
scheduled request is validated before any state changes, so a refused step leaves the
tables as they were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np
import torch

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.errors import InvalidRequestError
from stages.model.attention import AttentionMetadata, build_attention_metadata
from stages.model.decode_inputs import DecodeInputs
from stages.model.rope import LongRope

__all__ = ["BatchInputs", "RequestStates"]


@attrs.frozen(kw_only=True, eq=False)
class BatchInputs:
    """The tensors of one step's flat batch.

    Attributes:
        input_ids: ``[T]`` token ids.
        attn_meta: Attention metadata (also holds ``positions``).
        sample_rows: ``[N]`` rows whose logits are sampled (last row of each chunk that
            samples), in batch order.
        sample_req_ids: The requests of those rows.
        prompt_rows: ``[R]`` rows whose prompt logprobs are asked for (for each request
            of ``prompt_req_ids``, the first ``len(prompt_logprob_targets)`` rows of its
            chunk), or ``None`` when no request asked.
        prompt_req_ids: The requests of those rows, in order.
        draft_rows: ``[D]`` the rows of the draft tokens (speculative decoding): for each
            request of ``draft_req_ids`` in order, one row per draft, each the position
            whose logits verify the next draft (the last one's give the token after all
            of them); ``None`` when no request has drafts. A request's sampled row is
            that of its last known token, before its drafts.
        draft_req_ids: The requests with drafts, in order.
        rope_rows: ``[T]`` each token's row of the rotary table, for a ``longrope``
            model (:class:`~stages.model.rope.LongRope`); ``None``: its position
            (``attn_meta.positions``).
    """

    input_ids: torch.Tensor
    attn_meta: AttentionMetadata
    sample_rows: torch.Tensor
    sample_req_ids: tuple[str, ...]
    prompt_rows: torch.Tensor | None = None
    prompt_req_ids: tuple[str, ...] = ()
    draft_rows: torch.Tensor | None = None
    draft_req_ids: tuple[str, ...] = ()
    rope_rows: torch.Tensor | None = None


class RequestStates:
    """Block tables of the requests this worker knows, keyed by request id.

    ``long_rope``: a ``longrope`` model's rule; each step's inputs then carry the
    tokens' rotary-table rows (``BatchInputs.rope_rows``). ``None``: nothing is added.

    Not thread-safe: owned by one :class:`~stages.model.runner.ModelRunner`.
    """

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
        long_rope: LongRope | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.long_rope = long_rope
        self._tables: dict[str, list[int]] = {}
        self._decode: DecodeInputs | None = None  # buffers of decode-only steps

    def __len__(self) -> int:
        return len(self._tables)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._tables

    def block_table(self, req_id: str) -> tuple[int, ...]:
        """The current block table of ``req_id`` (KeyError when unknown)."""
        return tuple(self._tables[req_id])

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget ``req_ids``; unknown ids are ignored."""
        for req_id in req_ids:
            self._tables.pop(req_id, None)

    def clear(self) -> None:
        """Forget every request."""
        self._tables.clear()

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Validate every scheduled request, then apply their block ids.

        Raises:
            InvalidRequestError: Naming the request and the bad value: an unknown request
                that is not ``new``, a duplicate, an empty chunk, a token id (or draft)
                outside the vocabulary, a chunk (with its drafts) past
                ``max_model_len``, a block id out of range, a block table too short, or
                drafts on a chunk that does not sample.
        """
        seen: set[str] = set()
        tables: dict[str, list[int]] = {}
        for r in scheduler_output.requests:
            if r.req_id in seen:
                raise InvalidRequestError("req_id", r.req_id, "scheduled twice in one step")
            seen.add(r.req_id)
            if not r.new and r.req_id not in self._tables:
                raise InvalidRequestError(
                    "req_id", r.req_id, "unknown to this worker; its first schedule needs new=True"
                )
            base = [] if r.new else self._tables[r.req_id]
            tables[r.req_id] = self._checked_table(r, base)
        self._tables.update(tables)

    def _checked_table(self, r: ScheduledRequest, base: list[int]) -> list[int]:
        if not r.token_ids:
            raise InvalidRequestError("token_ids", r.token_ids, f"{r.req_id}: need >= 1 token")
        if r.num_prompt_tokens < 0:
            raise InvalidRequestError(
                "num_prompt_tokens", r.num_prompt_tokens, f"{r.req_id}: must be >= 0"
            )
        for name, ids in (("token_id", r.token_ids), ("draft_token_id", r.draft_token_ids)):
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise InvalidRequestError(
                    name, bad, f"{r.req_id}: must be in [0, vocab_size={self.vocab_size})"
                )
        if r.draft_token_ids and not r.sample:
            raise InvalidRequestError(
                "draft_token_ids", r.draft_token_ids, f"{r.req_id}: only after a sampled token"
            )
        targets = r.prompt_logprob_targets
        if targets and (
            len(targets) > len(r.token_ids)
            or not 0 <= min(targets) <= max(targets) < self.vocab_size
        ):
            raise InvalidRequestError(
                "prompt_logprob_targets",
                targets,
                f"{r.req_id}: at most {len(r.token_ids)} token ids in [0, {self.vocab_size})",
            )
        end = r.num_computed_tokens + r.num_scheduled_tokens  # drafts included: their KV is written
        if r.num_computed_tokens < 0 or end > self.max_model_len:
            raise InvalidRequestError(
                "num_computed_tokens",
                r.num_computed_tokens,
                f"{r.req_id}: context + {r.num_scheduled_tokens} new tokens must fit in "
                f"[0, max_model_len={self.max_model_len}]",
            )
        bad_blocks = tuple(b for b in r.block_ids if not 0 <= b < self.num_blocks)
        if bad_blocks:
            raise InvalidRequestError(
                "block_ids", bad_blocks, f"{r.req_id}: must be in [0, {self.num_blocks})"
            )
        table = [*base, *r.block_ids]
        needed = -(-end // self.block_size)
        if len(table) < needed:
            raise InvalidRequestError(
                "block_ids",
                tuple(table),
                f"{r.req_id}: {end} tokens need {needed} blocks of {self.block_size}",
            )
        return table

    @property
    def tables(self) -> Mapping[str, Sequence[int]]:
        """Every known request's block table (read it, never change it)."""
        return self._tables

    @staticmethod
    def decode_only(scheduler_output: SchedulerOutput) -> bool:
        """Whether every request of a non-empty step has one new token, sampled, and
        asks for no prompt logprobs (the steady state of decoding)."""
        requests = scheduler_output.requests
        return scheduler_output.total_num_scheduled_tokens == len(requests) and all(
            r.sample and not r.prompt_logprob_targets for r in requests
        )

    def prepare(self, scheduler_output: SchedulerOutput, device: torch.device) -> BatchInputs:
        """The inputs of a non-empty step whose requests :meth:`update` accepted.

        A decode-only step (one new token per request, each sampled, no prompt
        logprobs) is written into buffers kept per batch shape (:class:`DecodeInputs`).
        """
        requests = scheduler_output.requests
        if self.decode_only(scheduler_output):
            if self._decode is None or self._decode.device != device:
                self._decode = DecodeInputs(self.block_size, device, self.long_rope)
            input_ids, decode_meta, decode_rows = self._decode.build(requests, self._tables)
            return BatchInputs(
                input_ids=input_ids,
                attn_meta=decode_meta,
                sample_rows=decode_rows,
                sample_req_ids=tuple(r.req_id for r in requests),
                prompt_rows=None,
                prompt_req_ids=(),
                rope_rows=self._decode.rope_rows,
            )
        ids = np.fromiter(
            (t for r in requests for t in (*r.token_ids, *r.draft_token_ids)),
            dtype=np.int64,
            count=scheduler_output.total_num_scheduled_tokens,
        )
        query_lens = [r.num_scheduled_tokens for r in requests]
        meta = build_attention_metadata(
            query_lens=query_lens,
            context_lens=[r.num_computed_tokens for r in requests],
            block_tables=[self._tables[r.req_id] for r in requests],
            block_size=self.block_size,
            device=device,
        )
        ends = np.cumsum(query_lens) - 1
        num_drafts = np.fromiter(
            (len(r.draft_token_ids) for r in requests), np.int64, len(requests)
        )
        sampled = [i for i, r in enumerate(requests) if r.sample]
        drafted = [i for i in sampled if num_drafts[i]]
        draft_rows = None
        if drafted:  # the rows of a request's drafts follow its sampled row
            draft_rows = torch.from_numpy(
                np.concatenate(
                    [np.arange(ends[i] - num_drafts[i] + 1, ends[i] + 1) for i in drafted]
                )
            ).to(device)
        prompt = [i for i, r in enumerate(requests) if r.prompt_logprob_targets]
        prompt_rows = None
        if prompt:
            starts = ends - np.asarray(query_lens) + 1
            rows = np.concatenate(
                [
                    np.arange(starts[i], starts[i] + len(requests[i].prompt_logprob_targets))
                    for i in prompt
                ]
            )
            prompt_rows = torch.from_numpy(rows).to(device)
        return BatchInputs(
            input_ids=torch.from_numpy(ids).to(device),
            attn_meta=meta,
            sample_rows=torch.from_numpy((ends - num_drafts)[sampled]).to(device),
            sample_req_ids=tuple(requests[i].req_id for i in sampled),
            prompt_rows=prompt_rows,
            prompt_req_ids=tuple(requests[i].req_id for i in prompt),
            draft_rows=draft_rows,
            draft_req_ids=tuple(requests[i].req_id for i in drafted),
            rope_rows=None if self.long_rope is None else self._rope_rows(requests, device),
        )

    def _rope_rows(
        self, requests: Sequence[ScheduledRequest], device: torch.device
    ) -> torch.Tensor:
        """The rotary-table rows of a mixed step's tokens (:class:`LongRope`)."""
        assert self.long_rope is not None
        threshold, offset = self.long_rope
        n = len(requests)
        lens = np.fromiter((r.num_scheduled_tokens for r in requests), np.int64, n)
        ctx = np.fromiter((r.num_computed_tokens for r in requests), np.int64, n)
        prompt = np.fromiter((r.num_prompt_tokens for r in requests), np.int64, n)
        first_row = np.cumsum(lens) - lens
        positions = np.arange(int(lens.sum())) + np.repeat(ctx - first_row, lens)
        long = np.repeat(prompt > threshold, lens) | (positions >= threshold)
        return torch.from_numpy(positions + offset * long).to(device)
