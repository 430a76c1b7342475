"""``StepSampler``: a worker's sampling of one step, with the histories penalties read."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pipeline.artifacts import ModelOutput, SampledTokens, SchedulerOutput
from stages.forward.histories import TokenHistories
from stages.forward.logprobs import add_logprobs
from stages.forward.sampling import Sampler

__all__ = ["StepSampler"]


class StepSampler:
    """Samples a step's logits rows with each request's parameters.

    Args:
        seed: Seed of the generator shared by requests without their own seed.
        device: Device of the logits.
        eos_token_id: The model's end-of-sequence token (``None``: it has none).

    It follows the scheduled tokens of the requests whose sampling reads them
    (:class:`~stages.forward.histories.TokenHistories`). Not thread-safe: owned by one
    :class:`~stages.forward.runner.ModelRunner`.
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

    def sample(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> SampledTokens:
        """One token per row of ``model_output``, then the logprobs asked for.

        See :meth:`~stages.forward.runner.ModelRunner.sample`.
        """
        sampled = self._sample_tokens(scheduler_output, model_output)
        if model_output.prompt_logits is not None or any(
            r.sampling.logprobs is not None for r in scheduler_output.requests
        ):
            return add_logprobs(sampled, scheduler_output, model_output)
        return sampled

    def _sample_tokens(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput
    ) -> SampledTokens:
        if not model_output.req_ids:
            return SampledTokens(token_ids={})
        by_id = {r.req_id: r for r in scheduler_output.requests}
        scheduled = [by_id[req_id] for req_id in model_output.req_ids]
        histories = self._histories.rows(scheduled)
        with torch.inference_mode():
            tokens, errors = self._sampler.sample_rows(
                model_output.logits,
                [r.sampling for r in scheduled],
                [r.num_output_tokens for r in scheduled],
                histories,
            )
        req_ids = model_output.req_ids
        return SampledTokens(
            token_ids={
                req_id: tok for req_id, tok in zip(req_ids, tokens, strict=True) if tok is not None
            },
            errors={req_ids[row]: reason for row, reason in errors.items()},
        )
