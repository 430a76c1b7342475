"""Logprobs of sampled tokens and of prompt tokens, from the model's raw logits.

vLLM V1's default semantics: ``log_softmax`` of the raw float32 logits (before
``logit_bias``, penalties, temperature, min-p, top-k, top-p); the rank of a token is the
number of tokens at least as likely (1 = most likely); the alternatives are the ``k``
most likely tokens, most likely first.

:func:`request_logprobs` isolates failures like the sampler: when the batched
computation raises, each request is computed alone, and one that still raises is
reported (it fails alone) while the others get their logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import attrs
import torch

from pipeline.artifacts import ModelOutput, SampledTokens, ScheduledRequest, SchedulerOutput
from pipeline.errors import short_repr
from pipeline.logger import get_logger
from pipeline.logprobs import TokenLogprob

__all__ = [
    "LogprobRequest",
    "RequestLogprobs",
    "add_logprobs",
    "request_logprobs",
    "token_logprobs",
]

_log = get_logger()

#: Rows computed at once: bounds the float32 temporaries of a long prompt chunk.
_ROWS_PER_BLOCK = 512


class LogprobRequest(NamedTuple):
    """One request's rows: ``logits[start : start + len(token_ids)]`` score ``token_ids``.

    Attributes:
        req_id: The request.
        start: Its first row in the logits.
        token_ids: The token each row scores (sampled, or the prompt's next token).
        num_top: How many alternatives each of its rows reports (``0`` for none).
    """

    req_id: str
    start: int
    token_ids: Sequence[int]
    num_top: int


class RequestLogprobs(NamedTuple):
    """The result of :func:`request_logprobs`.

    Attributes:
        logprobs: Request id → one :class:`TokenLogprob` per row, in row order.
        errors: Request id → why its logprobs could not be computed.
    """

    logprobs: dict[str, tuple[TokenLogprob, ...]]
    errors: dict[str, str]


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per row of ``logits [N, vocab]``.

    Row ``i`` scores ``token_ids[i]`` and lists its ``num_top[i]`` most likely tokens.
    Rows are computed in blocks (bounded temporaries); one read-back per block.

    Raises:
        ValueError: A token id outside the vocabulary, or lengths that disagree.
    """
    n, vocab = logits.shape[0], logits.shape[-1]
    if len(token_ids) != n or len(num_top) != n:
        raise ValueError(f"{n} logits rows, {len(token_ids)} tokens, {len(num_top)} top counts")
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary ({vocab})")
    result: list[TokenLogprob] = []
    for lo in range(0, n, _ROWS_PER_BLOCK):
        hi = min(n, lo + _ROWS_PER_BLOCK)
        result.extend(_block(logits[lo:hi], token_ids[lo:hi], num_top[lo:hi]))
    return result


def _block(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    lp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(list(token_ids), device=lp.device, dtype=torch.long)
    chosen = lp.gather(1, ids[:, None])
    ranks = (lp >= chosen).sum(dim=-1)
    k = min(max(num_top), lp.shape[-1])
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    if k > 0:
        values, indices = lp.topk(k, dim=-1)
        top_ids, top_lps = indices.tolist(), values.tolist()
    chosen_l: list[float] = chosen[:, 0].tolist()
    ranks_l: list[int] = ranks.tolist()
    return [
        TokenLogprob(
            token_id=int(token_ids[i]),
            logprob=chosen_l[i],
            rank=max(1, ranks_l[i]),
            top=tuple(zip(top_ids[i][: num_top[i]], top_lps[i][: num_top[i]], strict=True))
            if num_top[i]
            else (),
        )
        for i in range(len(token_ids))
    ]


def request_logprobs(logits: torch.Tensor, requests: Sequence[LogprobRequest]) -> RequestLogprobs:
    """The logprobs of every request's rows; a request that fails does so alone.

    The rows of all ``requests`` are computed in one batch; if that raises, each
    request is computed on its own and those that still raise are in ``errors``.
    Blocks the calling thread (reads the results back from the device).
    """
    if not requests:
        return RequestLogprobs({}, {})
    try:
        return RequestLogprobs(_batched(logits, requests), {})
    except Exception as exc:
        _log.warning("batched_logprobs_failed", requests=len(requests), error=repr(exc))
    done: dict[str, tuple[TokenLogprob, ...]] = {}
    errors: dict[str, str] = {}
    for req in requests:
        try:
            done.update(_batched(logits, [req]))
        except Exception as exc:
            errors[req.req_id] = f"logprobs failed: {short_repr(exc, 200)}"
    return RequestLogprobs(done, errors)


def _batched(
    logits: torch.Tensor, requests: Sequence[LogprobRequest]
) -> dict[str, tuple[TokenLogprob, ...]]:
    rows: list[int] = []
    tokens: list[int] = []
    tops: list[int] = []
    for req in requests:
        n = len(req.token_ids)
        if req.start < 0 or req.start + n > logits.shape[0]:
            raise ValueError(f"{req.req_id}: rows [{req.start}, {req.start + n}) out of range")
        rows.extend(range(req.start, req.start + n))
        tokens.extend(req.token_ids)
        tops.extend([req.num_top] * n)
    contiguous = rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
    if contiguous:
        sub = logits[rows[0] : rows[0] + len(rows)] if rows else logits[:0]
    else:
        sub = logits.index_select(0, torch.tensor(rows, device=logits.device))
    flat = token_logprobs(sub, tokens, tops)
    out: dict[str, tuple[TokenLogprob, ...]] = {}
    pos = 0
    for req in requests:
        n = len(req.token_ids)
        out[req.req_id] = tuple(flat[pos : pos + n])
        pos += n
    return out


def _with_draft_rows(
    model_output: ModelOutput,
    by_id: dict[str, ScheduledRequest],
    asks: list[LogprobRequest],
) -> tuple[torch.Tensor, list[LogprobRequest]]:
    """The rows that score each asking request's tokens, one request after another: its
    sampled row, then the rows of its kept drafts (speculative decoding: draft ``i``'s
    row scores the token after it), and the requests pointing into them."""
    draft_start: dict[str, int] = {}
    at = 0
    for req_id in model_output.draft_req_ids:
        draft_start[req_id] = at
        at += len(by_id[req_id].draft_token_ids)
    drafts = model_output.draft_logits
    pieces: list[torch.Tensor] = []
    moved: list[LogprobRequest] = []
    start = 0
    for ask in asks:
        pieces.append(model_output.logits[ask.start : ask.start + 1])
        extra = len(ask.token_ids) - 1
        if extra:
            if drafts is None or ask.req_id not in draft_start:
                raise ValueError(f"{ask.req_id}: {extra + 1} tokens without draft rows")
            first = draft_start[ask.req_id]
            pieces.append(drafts[first : first + extra])
        moved.append(ask._replace(start=start))
        start += extra + 1
    return torch.cat(pieces), moved


def add_logprobs(
    sampled: SampledTokens, scheduler_output: SchedulerOutput, model_output: ModelOutput
) -> SampledTokens:
    """``sampled`` with the logprobs of the requests of this step that asked.

    Sampled tokens: each row of ``model_output.logits`` whose request set
    ``SamplingParams.logprobs`` and got a token scores that token; a request that kept
    speculative drafts has its later tokens scored by its draft rows
    (``model_output.draft_logits``). Prompt targets:
    ``model_output.prompt_logits`` holds, request after request of
    ``model_output.prompt_req_ids``, one row per ``prompt_logprob_targets``. A request
    whose logprobs cannot be computed is moved from ``token_ids`` to ``errors`` (it
    fails alone). Blocks the calling thread.
    """
    by_id = {r.req_id: r for r in scheduler_output.requests}
    asks = [
        LogprobRequest(req_id, row, sampled.token_ids[req_id], k)
        for row, req_id in enumerate(model_output.req_ids)
        if req_id in sampled.token_ids and (k := by_id[req_id].sampling.logprobs) is not None
    ]
    logits = model_output.logits
    if any(len(a.token_ids) > 1 for a in asks):  # kept drafts: their rows follow
        logits, asks = _with_draft_rows(model_output, by_id, asks)
    token_lps = request_logprobs(logits, asks)
    prompt_asks: list[LogprobRequest] = []
    start = 0
    for req_id in model_output.prompt_req_ids:
        r = by_id[req_id]
        targets = r.prompt_logprob_targets
        prompt_asks.append(LogprobRequest(req_id, start, targets, r.sampling.prompt_logprobs or 0))
        start += len(targets)
    prompt_lps = RequestLogprobs({}, {})
    if prompt_asks:
        prompt_lps = request_logprobs(model_output.prompt_logits, prompt_asks)
    failed = {**token_lps.errors, **prompt_lps.errors}
    for req_id in failed:
        _log.warning("request_logprobs_failed", req_id=req_id, error=failed[req_id])
    return attrs.evolve(
        sampled,
        token_ids={k: v for k, v in sampled.token_ids.items() if k not in failed},
        errors={**failed, **sampled.errors},
        logprobs={k: v for k, v in token_lps.logprobs.items() if k not in failed},
        prompt_logprobs={k: v for k, v in prompt_lps.logprobs.items() if k not in failed},
    )
