"""Part 2 of ``benchmarks/disagg.py``: a consumer's TTFT with a full remote hit against
the same consumer recomputing the prompt.

Two engines in this process (``LLM``, the ~100M model of ``benchmarks/kv_reuse.py``,
float32 on CPU, prefix caching off on both): a producer and a consumer of the nixl
connector, each with its own NIXL agent and side channel on loopback. Per prompt: the
producer prefills it (``max_tokens=1``, ``do_remote_decode``) and answers its
``do_remote_prefill`` params; the consumer then generates one token from those params
(it reads every full block but the last prompt token's from the producer and computes
that token: the "remote hit"), and one token from the bare prompt (it computes every
token: "recompute"), in alternating order. ``max_tokens=1``, so the wall time of
``generate`` is the TTFT; the two first tokens must be equal.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from _serve_client import free_port
from kv_reuse import BLOCK, ONE_TOKEN, engine_config

from pipeline import LLM, RequestOutput

DECODE = {"do_remote_decode": True}


def _timed(
    llm: LLM, prompt: list[int], params: Mapping[str, Any] | None = None
) -> tuple[float, RequestOutput]:
    start = time.perf_counter()
    (out,) = llm.generate([prompt], ONE_TOKEN, kv_transfer_params=[params])
    return time.perf_counter() - start, out


def measure(path: Path, prompt_lens: Sequence[int], prompts: int, vocab: int) -> dict[str, Any]:
    """Median TTFTs per prompt length (``prompts`` random prompts of ids below ``vocab``
    each) on two engines over the model saved at ``path``."""
    longest = max(prompt_lens)
    blocks = 3 * (longest // BLOCK + 1)

    def config(role: str) -> Any:
        options = {"role": role, "host": "127.0.0.1", "port": free_port(), "lease_s": 60.0}
        return engine_config(path, longest, blocks, connector="nixl", connector_options=options)

    gen = torch.Generator().manual_seed(2)
    rows: dict[str, Any] = {}
    with LLM(config("producer")) as producer, LLM(config("consumer")) as consumer:
        warm = torch.randint(1, vocab, (64,), generator=gen).tolist()
        (out,) = producer.generate([warm], ONE_TOKEN, kv_transfer_params=[DECODE])
        _timed(consumer, warm, out.kv_transfer_params)  # the handshake happens here
        _timed(consumer, warm)
        for length in prompt_lens:
            batch = torch.randint(1, vocab, (prompts, length), generator=gen).tolist()
            prefill, hit, recompute, loaded, same = [], [], [], [], True
            for i, prompt in enumerate(batch):
                t_prefill, out = _timed(producer, prompt, DECODE)
                params = out.kv_transfer_params
                assert params is not None and params.get("do_remote_prefill"), params
                if i % 2 == 0:
                    t_hit, remote = _timed(consumer, prompt, params)
                    t_re, local = _timed(consumer, prompt)
                else:
                    t_re, local = _timed(consumer, prompt)
                    t_hit, remote = _timed(consumer, prompt, params)
                prefill.append(t_prefill)
                hit.append(t_hit)
                recompute.append(t_re)
                loaded.append(remote.metrics.num_external_tokens if remote.metrics else 0)
                same &= remote.token_ids == local.token_ids and remote.finish_reason == "length"
            rows[str(length)] = {
                "prompt_len": length,
                "prompts": prompts,
                "ttft_recompute_s": statistics.median(recompute),
                "ttft_remote_hit_s": statistics.median(hit),
                "speedup": statistics.median(recompute) / statistics.median(hit),
                "producer_prefill_s": statistics.median(prefill),
                "loaded_tokens": statistics.median(loaded),
                "expected_loaded_tokens": (length - 1) // BLOCK * BLOCK,
                "identical_first_token": same,
                "raw_recompute_s": recompute,
                "raw_remote_hit_s": hit,
            }
    return rows
