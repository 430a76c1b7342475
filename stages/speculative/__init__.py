"""Speculative decoding's parts (issue 28): proposing drafts and verifying them.

What is here: the n-gram proposer (:class:`NgramProposer`) and the acceptance rules
(:func:`accept_greedy`, :func:`accept_sampled`), pure functions tested on their own. The
scheduler already schedules a request's drafts after its last token and takes rejected
ones back (:mod:`stages.scheduler.policy`, :mod:`stages.scheduler.apply_output`). Not
yet: the graph variant that runs them (``forward`` over the drafts, ``verify`` in place
of ``sample``, ``propose`` after it) and ``EngineConfig.speculative_config``.
"""

from stages.speculative.ngram import NgramProposer
from stages.speculative.verify import accept_greedy, accept_sampled

__all__ = ["NgramProposer", "accept_greedy", "accept_sampled"]
