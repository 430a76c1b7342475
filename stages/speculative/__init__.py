"""Speculative decoding's parts (issue 28): proposing drafts and verifying them.

What is here: the n-gram proposer (:class:`NgramProposer`) and the acceptance rules
(:func:`accept_greedy`, :func:`accept_sampled`), pure functions tested on their own. The
scheduler already schedules a request's drafts after its last token and takes rejected
ones back (:mod:`stages.scheduler.policy`, :mod:`stages.scheduler.apply_output`), and the
runner's forward pass computes them: their KV is written and their logits come back as
``ModelOutput.draft_logits`` (:class:`~stages.model.inputs.RequestStates`). Not yet: the
graph variant that uses them (``verify`` in place of ``sample``, ``propose`` after
``update``) and ``EngineConfig.speculative_config``; until then nothing proposes drafts.
"""

from stages.speculative.ngram import NgramProposer
from stages.speculative.verify import accept_greedy, accept_sampled, speculates, verify_greedy

__all__ = ["NgramProposer", "accept_greedy", "accept_sampled", "speculates", "verify_greedy"]
