"""What one HTTP request may ask of the engine: its share of the slots, its prompt logprobs.

Both checks run after the body is parsed (and its prompts encoded) and before anything
is admitted, and raise :class:`~pipeline.errors.InvalidRequestError` (a 400) naming the
field and the cap:

- ``n`` times the request's prompts is at most
  :meth:`ServerOptions.max_choices <pipeline.server.options.ServerOptions.max_choices>`
  (by default half the engine's ``max_num_seqs``): one request with ``n=16`` and four
  long prompts would otherwise hold all 64 scheduler slots until it finished, and every
  other client would wait for it;
- the prompt logprob values a request asks for (each choice's prompt tokens times
  ``prompt_logprobs + 1``: the token's own logprob and its alternatives) are at most
  :attr:`ServerOptions.max_prompt_logprobs <pipeline.server.options.ServerOptions>`:
  each value is a JSON object the server builds and writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.errors import InvalidRequestError
from pipeline.server.options import ServerOptions

__all__ = ["check_choices", "check_prompt_logprobs"]


def check_choices(options: ServerOptions, max_num_seqs: int, n: int, num_prompts: int) -> None:
    """Refuse a request whose ``n * num_prompts`` choices exceed its share of the slots."""
    cap = options.max_choices(max_num_seqs)
    choices = n * num_prompts
    if choices > cap:
        prompts = f"{num_prompts} prompts" if num_prompts != 1 else "1 prompt"
        raise InvalidRequestError(
            "n",
            n,
            f"times the request's {prompts} gives {choices} choices; at most {cap} are "
            f"served per request ({options.max_request_share:g} of the engine's "
            f"max_num_seqs={max_num_seqs}, --max-request-share)",
        )


def check_prompt_logprobs(
    options: ServerOptions, prompt_logprobs: int | None, prompt_lens: Sequence[int], n: int
) -> None:
    """Refuse a request whose prompt logprobs (``prompt_lens`` each with ``n`` choices,
    ``prompt_logprobs`` alternatives per token) exceed the server's cap."""
    if prompt_logprobs is None:
        return
    values = n * sum(prompt_lens) * (prompt_logprobs + 1)
    cap = options.max_prompt_logprobs
    if values > cap:
        raise InvalidRequestError(
            "prompt_logprobs",
            prompt_logprobs,
            f"asks for {values} logprob values ({sum(prompt_lens)} prompt tokens x "
            f"{n} choices x {prompt_logprobs + 1}); at most {cap} per request "
            f"(--max-prompt-logprobs): ask for fewer alternatives or a shorter prompt",
        )
