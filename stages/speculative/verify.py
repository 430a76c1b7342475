"""Verifying drafts against the target model: which proposed tokens a request keeps.

One forward pass of the target over a request's last token and its ``k`` drafts gives
``k + 1`` distributions: ``p_0`` after the last token, ``p_i`` after draft ``i``. The
request keeps a prefix of its drafts and one more token the target chose, so a step
yields between 1 and ``k + 1`` tokens and never a token the target would not give:

- **Greedy** (:func:`accept_greedy`): a draft is kept while it equals the target's
  argmax at its position; the first argmax that differs (or the one after the last
  draft) follows. The tokens are exactly those of decoding without speculation.
- **Sampling** (:func:`accept_sampled`): speculative sampling (Leviathan et al. 2023,
  Chen et al. 2023; vLLM's rejection sampler): draft ``x_i``, proposed with probability
  ``q_i(x_i)``, is kept with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
  rejection a token is drawn from ``max(0, p_i - q_i)`` renormalised, and when every draft
  is kept a bonus token is drawn from ``p_k``. Every output token is then distributed as
  the target's own sampling would give. A draft without a distribution (n-gram: a single
  guess) has ``q_i`` one-hot at ``x_i``: kept with probability ``p_i(x_i)``, else drawn
  from ``p_i`` without ``x_i``.

The distributions are the processed ones (temperature, top-k/p, min-p applied), as the
target's sampler would draw from. For drafts without a distribution the rule is the
same as sampling the target at every position and keeping the drafts that equal its
draws (:func:`verify_drafts`, which the engine runs on the compute thread, after the
logits stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from pipeline.artifacts import ModelOutput, SampledTokens, SchedulerOutput
from pipeline.sampling_params import SamplingParams

__all__ = [
    "DraftSampler",
    "accept_greedy",
    "accept_sampled",
    "no_drafts_reason",
    "speculates",
    "verify_drafts",
]


def accept_greedy(target_argmax: Sequence[int] | torch.Tensor, drafts: Sequence[int]) -> list[int]:
    """The tokens a greedy request keeps: its drafts while they equal ``target_argmax``
    (``len(drafts) + 1`` entries: the target's choice at each position), then the
    target's choice at the first difference (or after the last draft)."""
    choices = [int(t) for t in target_argmax]
    if len(choices) != len(drafts) + 1:
        raise ValueError(f"{len(choices)} target positions for {len(drafts)} drafts")
    kept: list[int] = []
    for draft, choice in zip(drafts, choices, strict=False):
        kept.append(choice)
        if draft != choice:
            return kept
    kept.append(choices[-1])
    return kept


def accept_sampled(
    target_probs: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a sampling request keeps (speculative sampling; see the module).

    Args:
        target_probs: ``[len(drafts) + 1, vocab]``: the target's distribution at each
            position (rows sum to 1).
        drafts: The proposed tokens.
        draft_probs: ``[len(drafts), vocab]``: the proposer's distribution at each
            position; ``None`` for a proposer without one (one-hot at each draft).
        generator: The request's generator (seeded requests stay reproducible).

    Returns:
        The kept drafts and the token after them: 1 to ``len(drafts) + 1`` tokens.
    """
    k = len(drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} for {k} drafts")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} for {k} drafts")
    p = target_probs.double()
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device)
    kept: list[int] = []
    for i, x in enumerate(drafts):
        p_x = float(p[i, x])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q_x > 0.0 and float(uniforms[i]) < min(1.0, p_x / q_x):
            kept.append(int(x))
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - draft_probs[i].double()).clamp_min_(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p equals q where p has mass: any draw from p is right
            residual, total = p[i], float(p[i].sum())
        token = torch.multinomial(residual / total, 1, generator=generator)
        kept.append(int(token))
        return kept
    kept.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return kept


def no_drafts_reason(params: SamplingParams) -> str | None:
    """Why a request with these parameters gets no drafts, or ``None`` when it does
    (:func:`speculates`): ``"logits_adjusted"`` (penalties, ``logit_bias`` or
    ``min_tokens``: each draft position would need them applied over the drafts before
    it) or ``"structured_outputs"`` (drafts are not checked against a grammar yet)."""
    if params.adjusts_logits:
        return "logits_adjusted"
    if params.structured_outputs is not None:
        return "structured_outputs"
    return None


def speculates(params: SamplingParams) -> bool:
    """Whether a request with these parameters gets drafts: nothing processes its logits
    beyond temperature, top-k, top-p and min-p (no penalties, ``logit_bias``,
    ``min_tokens`` or grammar; :func:`no_drafts_reason`). Its logprobs, if it asks, are
    those of each kept token's row.
    Greedy or sampled, its drafts are verified by :func:`verify_drafts`, and its tokens
    are distributed as without speculation (greedy and seeded: the very same tokens)."""
    return no_drafts_reason(params) is None


class DraftSampler(Protocol):
    """Samples rows of logits as the request's sampler would: one token per row (``None``
    for a row that failed), ``params[i]`` its request's parameters and
    ``output_indices[i]`` the output index of the token it draws (a seeded request's
    noise depends on it)."""

    def __call__(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
    ) -> Sequence[int | None]: ...


def verify_drafts(
    sampled: SampledTokens,
    scheduler_output: SchedulerOutput,
    model_output: ModelOutput,
    sample_rows: DraftSampler,
) -> SampledTokens:
    """``sampled`` with each drafted request's kept drafts and the target's token after
    them.

    A draft proposed without a distribution (n-gram: one guess) is kept with the target's
    probability of it, and at its first rejection the target draws from its distribution
    without it (:func:`accept_sampled` with one-hot drafts). That is the same as drawing
    the target's token at every position, as decoding without speculation would (argmax
    for greedy rows), and keeping the drafts while they equal those draws: so each draft
    row of a request that :func:`speculates` is sampled by ``sample_rows`` with the output
    index its token would have (a seeded request draws the noise it would draw without
    speculation), and :func:`accept_greedy` keeps the matching prefix. A request that
    failed, or that does not speculate, keeps its one sampled token: its drafts are all
    rejected.
    """
    rows = model_output.draft_logits
    if rows is None or not model_output.draft_req_ids:
        return sampled
    by_id = {r.req_id: r for r in scheduler_output.requests}
    token_ids = dict(sampled.token_ids)
    picked: list[int] = []
    params: list[SamplingParams] = []
    indices: list[int] = []
    owners: list[tuple[str, int, int]] = []  # (req_id, first row in picked, drafts)
    start = 0
    for req_id in model_output.draft_req_ids:
        request = by_id[req_id]
        count = len(request.draft_token_ids)
        first = token_ids.get(req_id)
        if first is not None and len(first) == 1 and speculates(request.sampling):
            owners.append((req_id, len(picked), count))
            picked.extend(range(start, start + count))
            params.extend([request.sampling] * count)
            indices.extend(range(request.num_output_tokens + 1,
                                 request.num_output_tokens + 1 + count))  # fmt: skip
        start += count
    if not owners:
        return sampled
    if len(picked) < rows.shape[0]:
        rows = rows.index_select(0, torch.tensor(picked, device=rows.device))
    draws = list(sample_rows(rows, params, indices))
    for req_id, at, count in owners:
        mine = draws[at : at + count]
        cut = next((j for j, t in enumerate(mine) if t is None), count)  # a row failed
        drafts = by_id[req_id].draft_token_ids[:cut]
        choices = [token_ids[req_id][0], *(t for t in mine[:cut] if t is not None)]
        token_ids[req_id] = tuple(accept_greedy(choices, drafts))
    return attrs.evolve(sampled, token_ids=token_ids)
