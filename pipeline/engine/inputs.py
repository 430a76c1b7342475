"""What ``LLM.generate`` and ``AsyncEngine.generate`` accept as prompts and parameters.

A prompt is a string (it needs a tokenizer) or a sequence of token ids; ``LLM.generate``
also takes a sequence of prompts. Shape errors are ``InvalidRequestError`` naming the value.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError

__all__ = ["as_prompt_list", "check_one_prompt", "check_sampling_params"]

_ONE_PROMPT = "a string or a list of token ids"


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_prompt(value: object) -> bool:
    return isinstance(value, str) or (
        isinstance(value, Sequence) and not isinstance(value, bytes | bytearray)
    )


def as_prompt_list(prompts: object) -> list[object]:
    """``prompts`` as a list of prompts: one prompt (a string or token ids) or a list of them.

    ``[1, 2, 3]`` is one prompt, ``[[1, 2], [3]]`` two, ``"hi"`` one, ``["a", "b"]`` two.

    Raises:
        InvalidRequestError: An empty list (neither one prompt nor any), a list that mixes
            token ids with prompts, or something that is neither.
    """
    if isinstance(prompts, str):
        return [prompts]
    if not _is_prompt(prompts):
        raise InvalidRequestError(
            "prompts", prompts, f"must be one prompt ({_ONE_PROMPT}) or a list of prompts"
        )
    assert isinstance(prompts, Sequence)
    items = list(prompts)
    if not items:
        raise InvalidRequestError(
            "prompts",
            prompts,
            "is empty: neither a prompt (token ids) nor a list of prompts; pass at least one",
        )
    tokens = [_is_token(item) for item in items]
    if all(tokens):
        return [items]
    if any(tokens):
        raise InvalidRequestError(
            "prompts",
            prompts,
            "mixes token ids with prompts: pass one list of token ids or a list of prompts",
        )
    return items


def check_one_prompt(prompt: object) -> None:
    """Refuse a list of prompts where exactly one is expected (``AsyncEngine.generate``).

    Raises:
        InvalidRequestError: ``prompt`` is a list whose first item is itself a prompt.
    """
    if isinstance(prompt, str) or not _is_prompt(prompt):
        return
    assert isinstance(prompt, Sequence)
    if len(prompt) and _is_prompt(prompt[0]):
        raise InvalidRequestError(
            "prompt",
            prompt,
            f"must be one prompt ({_ONE_PROMPT}); AsyncEngine.generate serves one request, "
            "call it once per prompt (LLM.generate takes a list)",
        )


def check_sampling_params(params: object, *, many: bool = False) -> None:
    """Refuse what is not a ``SamplingParams`` (a ``dict`` above all) with one clear error.

    Raises:
        InvalidRequestError: Names ``sampling_params`` and the type that was passed.
    """
    if params is None or isinstance(params, SamplingParams):
        return
    if many and isinstance(params, Sequence) and not isinstance(params, str | bytes):
        for each in params:
            check_sampling_params(each)
        return
    kind = type(params).__name__
    hint = " (build one: SamplingParams(**fields))" if isinstance(params, dict) else ""
    allowed = "a SamplingParams" + (" or a list of them" if many else "")
    raise InvalidRequestError("sampling_params", kind, f"must be {allowed}{hint}")
