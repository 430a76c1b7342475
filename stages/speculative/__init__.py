"""Speculative decoding's parts (issue 28): proposing drafts and verifying them.

What is here: what a proposer is (:class:`Proposer`), the n-gram one
(:class:`NgramProposer`), and the acceptance rules (:func:`accept_greedy`,
:func:`accept_sampled`), pure functions tested on their own. The scheduler schedules a
request's drafts after its last token and takes rejected ones back
(:mod:`stages.scheduler.policy`, :mod:`stages.scheduler.apply_output`); the runner's
forward pass computes them (their KV is written, their logits come back as
``ModelOutput.draft_logits``); ``sample`` keeps the ones that hold
(:func:`verify_drafts`) and ``propose`` (:mod:`stages.propose`) sets the next step's.
"""

from stages.speculative.ngram import NgramProposer
from stages.speculative.proposer import Proposer
from stages.speculative.verify import (
    DraftSampler,
    accept_greedy,
    accept_sampled,
    no_drafts_reason,
    speculates,
    verify_drafts,
)

__all__ = [
    "DraftSampler",
    "NgramProposer",
    "Proposer",
    "accept_greedy",
    "accept_sampled",
    "no_drafts_reason",
    "speculates",
    "verify_drafts",
]
