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

The distributions are the processed ones (penalties, temperature, top-k/p applied), as
the target's sampler would draw from. Run on the compute thread, after the logits stages.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from pipeline.artifacts import ModelOutput, SampledTokens, SchedulerOutput
from pipeline.sampling_params import SAMPLING_EPS, SamplingParams

__all__ = ["accept_greedy", "accept_sampled", "speculates", "verify_greedy"]


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


def speculates(params: SamplingParams) -> bool:
    """Whether a request with these parameters gets drafts: greedy, with nothing that
    processes its logits (penalties, ``logit_bias``, ``min_tokens``, a grammar) and no
    logprobs. Its drafts are then verified by argmax alone (:func:`verify_greedy`), and
    its tokens are those of decoding without speculation."""
    return (
        params.temperature < SAMPLING_EPS
        and not params.adjusts_logits
        and params.logprobs is None
        and params.structured_outputs is None
    )


def verify_greedy(
    sampled: SampledTokens, scheduler_output: SchedulerOutput, model_output: ModelOutput
) -> SampledTokens:
    """``sampled`` with each drafted request's kept drafts and the target's next token
    (:func:`accept_greedy` over its sampled token and the argmax of its draft rows,
    ``ModelOutput.draft_logits``). A request that failed, or that does not
    :func:`speculates`, keeps its one sampled token: its drafts are all rejected."""
    rows = model_output.draft_logits
    if rows is None or not model_output.draft_req_ids:
        return sampled
    by_id = {r.req_id: r for r in scheduler_output.requests}
    choices = rows.argmax(dim=-1).tolist()
    token_ids = dict(sampled.token_ids)
    start = 0
    for req_id in model_output.draft_req_ids:
        request = by_id[req_id]
        drafts = request.draft_token_ids
        mine = choices[start : start + len(drafts)]
        start += len(drafts)
        first = token_ids.get(req_id)
        if first is not None and len(first) == 1 and speculates(request.sampling):
            token_ids[req_id] = tuple(accept_greedy([first[0], *mine], drafts))
    return attrs.evolve(sampled, token_ids=token_ids)
