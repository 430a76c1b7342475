"""Per-request sampling parameters: :class:`SamplingParams`, validated at construction.

A bad value raises :class:`~pipeline.errors.InvalidRequestError` naming the field, a
short repr of the value and what is allowed. Every field is type-checked (a ``bool`` is
never taken for a number), numbers must be finite and in range, and what passes is
exactly what the engine↔worker wire (:mod:`pipeline.executors.wire`, msgspec) encodes and
its typed decoder accepts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import attrs
import msgspec

from pipeline.checks import INT64_MAX, INT64_MIN, check_float, check_int
from pipeline.errors import InvalidRequestError, short_repr
from pipeline.logprobs import MAX_LOGPROBS
from pipeline.structured_outputs import StructuredOutputsParams

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "MAX_EXTRA_ARGS_BYTES",
    "MAX_EXTRA_ARGS_DEPTH",
    "MAX_EXTRA_ARGS_KEYS",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKENS_LIMIT",
    "PENALTY_LIMIT",
    "SAMPLING_EPS",
    "ExtraArgs",
    "SamplingParams",
    "check_extra_args",
]

#: A temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``): dividing
#: logits by a smaller one overflows to inf and the softmax to NaN.
SAMPLING_EPS = 1e-5
#: Largest ``max_tokens`` (and ``top_k``) a request may ask for (int32).
MAX_TOKENS_LIMIT = (1 << 31) - 1
#: Most ``stop_token_ids`` one request may name.
MAX_STOP_TOKEN_IDS = 1024
_MAX_TOKEN_ID = (1 << 31) - 1
#: Most ``stop`` strings one request may give.
MAX_STOP_STRINGS = 16
#: Longest ``stop`` string, in characters.
MAX_STOP_STRING_CHARS = 512
#: Most ``logit_bias`` entries one request may give (OpenAI allows 300).
MAX_LOGIT_BIAS = 300
#: Bound of each ``logit_bias`` value (OpenAI: [-100, 100]).
LOGIT_BIAS_LIMIT = 100.0
#: Bound of ``presence_penalty`` and ``frequency_penalty`` (OpenAI: [-2, 2]).
PENALTY_LIMIT = 2.0
#: Most top-level keys of ``extra_args``.
MAX_EXTRA_ARGS_KEYS = 64
#: Largest ``extra_args``, in bytes of its compact JSON encoding.
MAX_EXTRA_ARGS_BYTES = 16 * 1024
#: Deepest nesting of lists and mappings inside ``extra_args`` (``{"a": [1]}`` is 2).
MAX_EXTRA_ARGS_DEPTH = 16


def _stop_token_ids(values: Iterable[int]) -> frozenset[int]:
    """The stop tokens as a set; at most :data:`MAX_STOP_TOKEN_IDS` token ids, read
    lazily so that a huge iterable is refused without being materialised."""
    what = "stop_token_ids"
    allowed = f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids"
    if isinstance(values, str | bytes | bytearray | Mapping) or not isinstance(values, Iterable):
        raise InvalidRequestError(what, values, allowed)
    items = list(itertools.islice(values, MAX_STOP_TOKEN_IDS + 1))
    if len(items) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(what, values, allowed)
    return frozenset(
        check_int(f"{what}[{i}]", tok, InvalidRequestError, lo=0, hi=_MAX_TOKEN_ID)
        for i, tok in enumerate(items)
    )


def _stop(values: object) -> tuple[str, ...]:
    """The stop strings as a tuple: one string or an iterable of at most
    :data:`MAX_STOP_STRINGS` non-empty strings of at most :data:`MAX_STOP_STRING_CHARS`
    characters each, read lazily so that a huge iterable is refused without being
    materialised."""
    what = "stop"
    allowed = (
        f"must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
        f"of at most {MAX_STOP_STRING_CHARS} characters"
    )
    if isinstance(values, str):
        values = (values,)
    if isinstance(values, bytes | bytearray | Mapping) or not isinstance(values, Iterable):
        raise InvalidRequestError(what, values, allowed)
    items = list(itertools.islice(values, MAX_STOP_STRINGS + 1))
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError(what, f"<more than {MAX_STOP_STRINGS} strings>", allowed)
    for i, item in enumerate(items):
        if not isinstance(item, str) or not 0 < len(item) <= MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"{what}[{i}]", item, allowed)
        if not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    f"{what}[{i}]", item, "must be valid Unicode (no lone surrogates)"
                ) from None
    return tuple(str(item) for item in items)


def _logit_bias(values: object) -> tuple[tuple[int, float], ...]:
    """The bias as ``(token id, bias)`` pairs sorted by token id (what the wire carries):
    from a mapping token id → bias or an iterable of pairs; at most
    :data:`MAX_LOGIT_BIAS` entries, ids in ``[0, 2**31)``, biases finite in [-100, 100],
    no id twice."""
    what = "logit_bias"
    allowed = (
        f"must map at most {MAX_LOGIT_BIAS} token ids to biases in "
        f"[{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
    )
    if isinstance(values, Mapping):
        if len(values) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(what, f"<{len(values)} entries>", allowed)
        items: list[Any] = list(values.items())
    elif isinstance(values, str | bytes | bytearray) or not isinstance(values, Iterable):
        raise InvalidRequestError(what, values, allowed)
    else:
        items = list(itertools.islice(values, MAX_LOGIT_BIAS + 1))
        if len(items) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(what, f"<more than {MAX_LOGIT_BIAS} entries>", allowed)
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidRequestError(what, item, "entries must be (token id, bias) pairs")
        tok = check_int(f"{what} token id", item[0], InvalidRequestError, lo=0, hi=_MAX_TOKEN_ID)
        if tok in pairs:
            raise InvalidRequestError(f"{what}[{tok}]", item[1], "token id given twice")
        pairs[tok] = check_float(
            f"{what}[{tok}]",
            item[1],
            InvalidRequestError,
            lo=-LOGIT_BIAS_LIMIT,
            hi=LOGIT_BIAS_LIMIT,
        )
    return tuple(sorted(pairs.items()))


class ExtraArgs(dict[str, Any]):
    """A read-only ``str`` → JSON value mapping: what :attr:`SamplingParams.extra_args`
    holds, built by :func:`check_extra_args`.

    A ``dict`` (so that msgspec encodes it natively on the engine↔worker wire) whose
    mutating methods raise ``TypeError``; its lists are tuples and its nested mappings
    are ``ExtraArgs`` too, so the whole value is immutable and hashable (a
    ``SamplingParams`` is). It compares equal to a ``dict`` of the same items.
    """

    __slots__ = ()

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("extra_args is read-only: build new SamplingParams (attrs.evolve)")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __copy__(self) -> ExtraArgs:
        return self

    def __deepcopy__(self, memo: object) -> ExtraArgs:
        return self

    def __reduce__(self) -> tuple[type[ExtraArgs], tuple[dict[str, Any]]]:
        return (type(self), (dict(self),))


_EMPTY_EXTRA_ARGS = ExtraArgs()
_JSON_KINDS = "None, bool, int, float, str, lists and mappings with str keys of those"


class _ExtraArgsWalk:
    """One pass over a candidate ``extra_args`` value: checks every node and builds
    the frozen copy, counting a lower bound of its JSON size as it goes, so that a huge
    value is refused after :data:`MAX_EXTRA_ARGS_BYTES` nodes or characters, never
    walked whole."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.size = 0

    def grow(self, path: str, size: int) -> None:
        self.size += size
        if self.size > MAX_EXTRA_ARGS_BYTES:
            raise InvalidRequestError(
                self.what,
                f"<more than {MAX_EXTRA_ARGS_BYTES} bytes at {path}>",
                f"must encode to at most {MAX_EXTRA_ARGS_BYTES} bytes of JSON",
            )

    def text(self, path: str, value: str) -> str:
        self.grow(path, len(value) + 2)
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    path, value, "must be valid Unicode (no lone surrogates)"
                ) from None
        return str(value)

    def mapping(self, path: str, values: Mapping[Any, Any], depth: int) -> ExtraArgs:
        self.grow(path, 1)  # the braces, less the comma after the last item
        frozen: dict[str, Any] = {}
        for key, item in values.items():
            if not isinstance(key, str):
                raise InvalidRequestError(f"{path} key", key, "keys must be strings")
            self.text(path, key)
            self.grow(path, 2)  # the colon and the comma
            frozen[str(key)] = self.value(f"{path}[{short_repr(key, 40)}]", item, depth)
        return ExtraArgs(frozen)

    def value(self, path: str, value: object, depth: int) -> Any:
        if value is None or isinstance(value, bool):
            self.grow(path, 4)
            return value
        if isinstance(value, int):
            self.grow(path, 1)
            return check_int(path, value, InvalidRequestError)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidRequestError(path, value, "must be a finite number")
            self.grow(path, 1)
            return float(value)
        if isinstance(value, str):
            return self.text(path, value)
        if isinstance(value, Mapping | list | tuple):
            if depth >= MAX_EXTRA_ARGS_DEPTH:
                raise InvalidRequestError(
                    path, "...", f"nests deeper than {MAX_EXTRA_ARGS_DEPTH} levels"
                )
            if isinstance(value, Mapping):
                return self.mapping(path, value, depth + 1)
            self.grow(path, 1)  # the brackets, less the comma after the last item
            items = []
            for i, item in enumerate(value):
                self.grow(path, 1)  # the comma
                items.append(self.value(f"{path}[{i}]", item, depth + 1))
            return tuple(items)
        raise InvalidRequestError(path, type(value).__name__, f"must be JSON: {_JSON_KINDS}")


def check_extra_args(values: object, what: str = "extra_args") -> ExtraArgs:
    """``values`` as the read-only :class:`ExtraArgs` that ``SamplingParams`` holds.

    Accepts a mapping of at most :data:`MAX_EXTRA_ARGS_KEYS` ``str`` keys to JSON
    values: ``None``, ``bool``, 64-bit ``int``, finite ``float``, ``str`` (valid
    Unicode), and lists/tuples and mappings with ``str`` keys of those, nested at most
    :data:`MAX_EXTRA_ARGS_DEPTH` levels, encoding to at most
    :data:`MAX_EXTRA_ARGS_BYTES` bytes of compact JSON. Lists become tuples and nested
    mappings ``ExtraArgs``. Pure; microseconds for a few keys.

    Args:
        values: The candidate value.
        what: The name errors give it (the server passes ``"vllm_xargs"``).

    Raises:
        InvalidRequestError: Anything else; the message names the key path
            (``extra_args['force']``) and what is allowed.
    """
    if not isinstance(values, Mapping):
        raise InvalidRequestError(
            what, type(values).__name__, "must be a mapping of str keys to JSON values"
        )
    if not values:
        return _EMPTY_EXTRA_ARGS
    if len(values) > MAX_EXTRA_ARGS_KEYS:
        raise InvalidRequestError(
            what, f"<{len(values)} keys>", f"must have at most {MAX_EXTRA_ARGS_KEYS} keys"
        )
    frozen = _ExtraArgsWalk(what).mapping(what, values, 1)
    size = len(msgspec.json.encode(frozen))
    if size > MAX_EXTRA_ARGS_BYTES:
        raise InvalidRequestError(
            what, f"<{size} bytes>", f"must encode to at most {MAX_EXTRA_ARGS_BYTES} bytes of JSON"
        )
    return frozen


def _extra_args(values: object) -> ExtraArgs:
    return check_extra_args(values)


def _extra_args_repr(value: Mapping[str, Any]) -> str:
    return short_repr(dict(value))


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request samples and when it stops; checked strictly at construction.

    Everything that passes crosses the engine↔worker wire unchanged: integers are real
    ``int`` (a ``bool`` is refused) in the ranges below, floats are stored as finite
    builtin ``float`` (an ``int`` is accepted and converted; one too large for a float is
    refused), so that no later ``float()`` or encode can fail for one request.

    Attributes:
        max_tokens: Most tokens to generate, in ``[1, MAX_TOKENS_LIMIT]``.
        temperature: Finite, >= 0; below :data:`SAMPLING_EPS` means greedy (argmax);
            otherwise logits are divided by it.
        top_p: Nucleus sampling mass in (0, 1].
        top_k: Keep the k most likely tokens; 0 or -1 keeps all; at most
            ``MAX_TOKENS_LIMIT``.
        seed: Per-request seed, a signed 64-bit integer, or ``None``: the same seed gives
            the same tokens whatever the batch.
        stop_token_ids: Tokens that end the request (the stop token is kept in output):
            at most :data:`MAX_STOP_TOKEN_IDS` ids in ``[0, 2**31)``, kept as a set.
        ignore_eos: Do not stop at the model's end-of-sequence token (a ``bool``).
        presence_penalty: In [-2, 2] (OpenAI): subtracted once from the logit of every
            token already generated (output tokens only).
        frequency_penalty: In [-2, 2] (OpenAI): subtracted from a token's logit once per
            time it was generated (output tokens only).
        repetition_penalty: Finite, > 0; 1 is off (vLLM, CTRL): the positive logits of
            tokens in the prompt or the output are divided by it, the negative ones
            multiplied by it.
        min_p: In [0, 1] (vLLM): after temperature, tokens whose probability is below
            ``min_p`` times the most likely token's are dropped (0 is off).
        logit_bias: Token id → bias in [-100, 100] added to its logit before the
            penalties (OpenAI); at most :data:`MAX_LOGIT_BIAS` entries. A mapping or
            pairs are accepted; stored as ``(id, bias)`` pairs sorted by id. An id
            outside the model's vocabulary fails the request when it is sampled.
        min_tokens: In [0, max_tokens] (vLLM): until this many tokens are generated the
            end-of-sequence token (unless ``ignore_eos``) and ``stop_token_ids`` cannot
            be sampled.
        stop: Strings that end the request when the output text contains one (vLLM):
            a string or at most :data:`MAX_STOP_STRINGS` non-empty strings of at most
            :data:`MAX_STOP_STRING_CHARS` characters, stored as a tuple. Matched on the
            detokenized text once more than ``min_tokens`` tokens were generated; the
            earliest match wins. Needs a tokenizer and ``detokenize``.
        include_stop_str_in_output: Keep the matched stop string at the end of the
            text (default: the text ends just before it). A ``bool``.
        detokenize: Whether the engine makes ``RequestOutput.text`` (a ``bool``;
            ``False`` with ``stop`` strings is refused).
        logprobs: ``None`` (default) or an int in ``[0, MAX_LOGPROBS]``: each
            generated token comes with its logprob and rank (0), plus the ``k`` most
            likely alternatives (``k``), in ``RequestOutput.logprobs``.
        prompt_logprobs: ``None`` (default) or an int in ``[0, MAX_LOGPROBS]``: the
            logprob of every prompt token given the tokens before it, plus the ``k``
            most likely alternatives, in ``RequestOutput.prompt_logprobs``. Such a
            request computes its whole prompt: no prefix-cache hits, no connector loads.
        extra_args: Per-request arguments for custom logits stages (vLLM's field; the
            server's ``vllm_xargs``), read as ``params.extra_args.get("force")``: a
            mapping of ``str`` keys to JSON values (see :func:`check_extra_args` for the
            bounds: at most :data:`MAX_EXTRA_ARGS_KEYS` keys and
            :data:`MAX_EXTRA_ARGS_BYTES` bytes of JSON). Stored read-only
            (:class:`ExtraArgs`: lists become tuples); ``repr`` shows its first items.
            kvstep's own stages never read it.
        structured_outputs: ``None`` or a
            :class:`~pipeline.structured_outputs.StructuredOutputsParams`: the output must
            match its JSON schema, regex, choice or grammar (the ``structured`` logits
            stage masks every other token). Compiled before the request is scheduled;
            a spec that does not compile fails the request alone.

    Logprobs follow vLLM V1's default: ``log_softmax`` of the model's **raw** logits,
    in float32, before ``logit_bias``, the penalties, temperature, ``min_p``, top-k
    and top-p (what is reported is the model's distribution, not the sampler's).

    Logits are adjusted as vLLM's sampler does, in this order: ``min_tokens`` masking,
    ``logit_bias``, repetition, frequency and presence penalties; then temperature,
    ``min_p``, top-k and top-p.

    Raises:
        InvalidRequestError: A field of another type or out of range; the message names
            the field and what is allowed.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_stop_token_ids)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    min_tokens: int = 0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    extra_args: Mapping[str, Any] = attrs.field(
        default=_EMPTY_EXTRA_ARGS, converter=_extra_args, repr=_extra_args_repr
    )
    structured_outputs: StructuredOutputsParams | None = None

    def __attrs_post_init__(self) -> None:
        error = InvalidRequestError
        max_tokens = check_int("max_tokens", self.max_tokens, error, lo=1, hi=MAX_TOKENS_LIMIT)
        normalised: dict[str, object] = {
            "max_tokens": max_tokens,
            "temperature": check_float(
                "temperature", self.temperature, error, lo=0.0, hi=float("inf")
            ),
            "top_p": check_float("top_p", self.top_p, error, lo=0.0, hi=1.0, lo_open=True),
        }
        top_k = check_int("top_k", self.top_k, error, lo=-1, hi=MAX_TOKENS_LIMIT)
        normalised["top_k"] = top_k
        for name in ("presence_penalty", "frequency_penalty"):
            normalised[name] = check_float(
                name, getattr(self, name), error, lo=-PENALTY_LIMIT, hi=PENALTY_LIMIT
            )
        normalised["repetition_penalty"] = check_float(
            "repetition_penalty",
            self.repetition_penalty,
            error,
            lo=0.0,
            hi=float("inf"),
            lo_open=True,
        )
        normalised["min_p"] = check_float("min_p", self.min_p, error, lo=0.0, hi=1.0)
        normalised["min_tokens"] = check_int(
            "min_tokens", self.min_tokens, error, lo=0, hi=max_tokens
        )
        for name in ("logprobs", "prompt_logprobs"):
            normalised[name] = check_int(
                name, getattr(self, name), error, lo=0, hi=MAX_LOGPROBS, optional=True
            )
        if not isinstance(self.logit_bias, tuple):  # decoded, not converted
            raise error("logit_bias", self.logit_bias, "must be (token id, bias) pairs")
        if self.logit_bias:  # a decoded value was not converted: check it again
            normalised["logit_bias"] = _logit_bias(self.logit_bias)
        if self.seed is not None:
            normalised["seed"] = check_int("seed", self.seed, error, lo=INT64_MIN, hi=INT64_MAX)
        for flag in ("ignore_eos", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, flag), bool):
                raise error(flag, getattr(self, flag), "must be true or false (a bool)")
        if not isinstance(self.stop, tuple):  # decoded, not converted
            raise error("stop", self.stop, "must be a list of strings")
        if self.stop:  # a decoded value was not converted: check it again
            normalised["stop"] = _stop(self.stop)
            if not self.detokenize:
                raise error("stop", self.stop, "stop strings need detokenize=true")
        if not isinstance(self.stop_token_ids, frozenset):  # decoded, not converted
            raise error("stop_token_ids", self.stop_token_ids, "must be a set of token ids")
        if type(self.extra_args) is not ExtraArgs:  # decoded, not converted
            normalised["extra_args"] = check_extra_args(self.extra_args)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise error(
                "structured_outputs",
                self.structured_outputs,
                "must be a StructuredOutputsParams (or None)",
            )
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax (temperature below ``SAMPLING_EPS`` or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (a penalty is on)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before temperature (penalties, bias, min_tokens)."""
        return self.needs_history or bool(self.logit_bias) or self.min_tokens > 0
