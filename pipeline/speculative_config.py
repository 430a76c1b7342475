"""``EngineConfig.speculative_config``: vLLM's speculative decoding settings, checked once.

Accepted as vLLM's dict (or JSON on the command line, ``--speculative-config``)::

    {"method": "ngram", "num_speculative_tokens": 3,
     "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 3}

``method`` is ``"ngram"`` (prompt lookup; :class:`stages.speculative.NgramProposer`) or
``"draft_model"`` (a small model with the target's vocabulary proposes greedily;
:class:`stages.speculative.draft_model.DraftModelProposer`). Another method, a key the
method does not take, or a key no method takes is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from pipeline.errors import InvalidConfigError

__all__ = ["MAX_SPECULATIVE_TOKENS", "METHODS", "SpeculativeConfig"]

#: The methods built; a config naming another is refused.
METHODS: Final = ("ngram", "draft_model")
#: Most drafts per request and step.
MAX_SPECULATIVE_TOKENS: Final = 16
_KEYS: Final = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("method", "num_speculative_tokens", "model"),
}
_FIELD: Final = "speculative_config"


def _int(key: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidConfigError(f"{_FIELD}.{key}", value, f"must be an integer in [{lo}, {hi}]")
    return value


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """Checked speculative decoding settings.

    Attributes:
        method: ``"ngram"`` or ``"draft_model"``.
        num_speculative_tokens: Drafts per request and step, in ``[1, 16]``.
        prompt_lookup_min: ngram: shortest n-gram looked up (default 2).
        prompt_lookup_max: ngram: longest n-gram looked up, tried first (default 4).
        model: draft_model: the draft's local model directory (or ``"builtin:tiny"``);
            its vocabulary must be the target's (checked when it loads).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None

    @classmethod
    def parse(cls, value: Mapping[str, Any]) -> SpeculativeConfig:
        """``value`` (vLLM's dict) checked.

        Raises:
            InvalidConfigError: Not a dict, an unknown key or method, or a size out of
                range, naming the key and what is allowed.
        """
        if not isinstance(value, Mapping):
            raise InvalidConfigError(_FIELD, value, 'must be a dict such as {"method": "ngram", '
                                     '"num_speculative_tokens": 3}')  # fmt: skip
        method = value.get("method")
        if method not in METHODS:
            raise InvalidConfigError(
                f"{_FIELD}.method", method, f"must be one of {', '.join(METHODS)}"
            )
        keys = _KEYS[method]
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise InvalidConfigError(
                _FIELD, unknown, f"unknown keys for method {method}; allowed: {', '.join(keys)}"
            )
        if "num_speculative_tokens" not in value:
            raise InvalidConfigError(_FIELD, dict(value), "needs num_speculative_tokens")
        k = _int("num_speculative_tokens", value["num_speculative_tokens"], 1,
                 MAX_SPECULATIVE_TOKENS)  # fmt: skip
        if method == "draft_model":
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise InvalidConfigError(f"{_FIELD}.model", model,
                                         "must be the draft's local model directory")  # fmt: skip
            return cls(method=method, num_speculative_tokens=k, model=model)
        high = _int("prompt_lookup_max", value.get("prompt_lookup_max", 4), 1, 64)
        low = _int("prompt_lookup_min", value.get("prompt_lookup_min", min(2, high)), 1, high)
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=low,
                   prompt_lookup_max=high)  # fmt: skip
