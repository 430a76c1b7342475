"""``StepSampler``: a worker's logits and sampling of one step, with the token histories
that penalties and logits stages read."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pipeline.artifacts import ModelOutput, SampledTokens, SchedulerOutput
from pipeline.logits import Logits, LogitsBatch
from pipeline.sampling_params import SamplingParams
from stages.model.histories import TokenHistories
from stages.model.logprobs import add_logprobs
from stages.model.sampling import Sampler, adjust_logits
from stages.speculative.verify import verify_drafts

#: The built-in logits stage's name, in the failure of a row it could not adjust.
BUILTIN_LOGITS = "logits"

__all__ = ["StepSampler"]


class StepSampler:
    """Samples a step's logits rows with each request's parameters.

    Args:
        seed: Seed of the generator shared by requests without their own seed.
        device: Device of the logits.
        eos_token_id: The model's end-of-sequence token (``None``: it has none).

    It follows the scheduled tokens of the requests whose sampling reads them
    (:class:`~stages.model.histories.TokenHistories`). Not thread-safe: owned by one
    :class:`~stages.model.runner.ModelRunner`.
    """

    def __init__(self, *, seed: int, device: torch.device, eos_token_id: int | None) -> None:
        self._sampler = Sampler(seed=seed, device=device, eos_token_id=eos_token_id)
        self._histories = TokenHistories()

    def track(self, scheduler_output: SchedulerOutput) -> None:
        """Follow the step's scheduled tokens (before its forward pass)."""
        self._histories.track(scheduler_output)

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget ``req_ids``; unknown ids are ignored."""
        self._histories.drop(req_ids)

    def clear(self) -> None:
        """Forget every request."""
        self._histories.clear()

    def logits(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> Logits:
        """The step's :class:`~pipeline.logits.Logits`: the raw logits of the rows to
        sample, with ``min_tokens``, ``logit_bias`` and the penalties applied
        (:func:`~stages.model.sampling.adjust_logits`); a row that cannot be adjusted
        fails alone. Blocks (on the compute thread)."""
        if not model_output.req_ids:
            return Logits()
        by_id = {r.req_id: r for r in scheduler_output.requests}
        scheduled = [by_id[req_id] for req_id in model_output.req_ids]
        batch = self._histories.batch(scheduled)
        raw = Logits(model_output.logits, batch)
        if not any(r.sampling.adjusts_logits for r in scheduled):
            return raw  # nothing to adjust: no copy, no call
        counts = [r.num_output_tokens for r in scheduled]
        histories = self._histories.rows(scheduled)
        index = {req_id: i for i, req_id in enumerate(model_output.req_ids)}
        eos = self._sampler.eos_token_id

        def adjust(logits: torch.Tensor, rows: LogitsBatch) -> torch.Tensor:
            at = [index[req_id] for req_id in rows.req_ids]
            tokens = None if histories is None else [histories[i] for i in at]
            with torch.inference_mode():
                return adjust_logits(logits, rows.params, [counts[i] for i in at], tokens, eos)

        return raw.amend(BUILTIN_LOGITS, adjust)

    def sample_logits(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput, logits: Logits
    ) -> SampledTokens:
        """One token per row of ``logits`` (adjusted already), then the logprobs asked
        for (of the raw logits of ``model_output``). Rows a logits stage failed, and
        rows that cannot be sampled, get no token: their requests are named in
        ``SampledTokens.errors`` and fail alone. Blocks (it reads the tokens back)."""
        sampled = self._sample_tokens(scheduler_output, logits)
        if model_output.draft_req_ids:  # speculative decoding: keep the drafts that hold
            sampled = verify_drafts(sampled, scheduler_output, model_output, self._sample_drafts)
        if model_output.prompt_logits is not None or any(
            r.sampling.logprobs is not None for r in scheduler_output.requests
        ):
            return add_logprobs(sampled, scheduler_output, model_output)
        return sampled

    def _sample_drafts(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
    ) -> list[int | None]:
        """Draft rows sampled as their requests' tokens are (no adjustment: a request
        whose logits are adjusted gets no drafts)."""
        return self._sampler.sample_rows(logits, params, output_indices, adjust=False).tokens

    def sample(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> SampledTokens:
        """:meth:`logits` then :meth:`sample_logits`: the built-in graph's ``logits`` and
        ``sample`` stages in one call.

        See :meth:`~stages.model.runner.ModelRunner.sample`.
        """
        return self.sample_logits(
            scheduler_output, model_output, self.logits(scheduler_output, model_output)
        )

    def _sample_tokens(self, scheduler_output: SchedulerOutput, logits: Logits) -> SampledTokens:
        batch, failed = logits.batch, logits.failed
        if not len(batch) or logits.tensor is None:
            return SampledTokens(token_ids={})
        by_id = {r.req_id: r for r in scheduler_output.requests}
        rows = [i for i, req_id in enumerate(batch.req_ids) if req_id not in failed]
        if not rows:
            return SampledTokens(token_ids={}, errors=dict(failed))
        tensor = logits.tensor
        if len(rows) < len(batch):
            tensor = tensor.index_select(0, torch.tensor(rows, device=tensor.device))
        tokens, errors = self._sampler.sample_rows(
            tensor,
            [batch.params[i] for i in rows],
            [by_id[batch.req_ids[i]].num_output_tokens for i in rows],
            adjust=False,
        )
        req_ids = [batch.req_ids[i] for i in rows]
        return SampledTokens(
            token_ids={
                req_id: (tok,)
                for req_id, tok in zip(req_ids, tokens, strict=True)
                if tok is not None
            },
            errors={**failed, **{req_ids[row]: reason for row, reason in errors.items()}},
        )
