"""Log-probabilities of tokens, as a request receives them (:class:`TokenLogprob`).

Semantics are vLLM V1's default: a logprob is ``log_softmax`` of the model's **raw**
logits (before ``logit_bias``, penalties, temperature, min-p, top-k and top-p), in
float32. A :class:`TokenLogprob` crosses the engine↔worker wire as plain values (msgspec
encodes attrs classes natively).
"""

from __future__ import annotations

import attrs

__all__ = ["MAX_LOGPROBS", "TokenLogprob"]

#: Most alternatives ``SamplingParams.logprobs`` / ``prompt_logprobs`` may ask for.
MAX_LOGPROBS = 20


@attrs.frozen
class TokenLogprob:
    """The log-probability of one token of a request, and the most likely alternatives.

    Attributes:
        token_id: The token (sampled, or the prompt's actual token).
        logprob: ``log_softmax(raw logits)[token_id]`` in float32 precision.
        rank: 1-based rank of ``token_id`` in the vocabulary by logit: 1 is the most
            likely; with ties, the number of tokens at least as likely (vLLM's).
        top: The ``k`` most likely tokens as ``(token id, logprob)``, most likely first
            (``k`` is what the request asked for; empty for 0).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
