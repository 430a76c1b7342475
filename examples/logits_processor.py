"""A logits stage: force one token for the requests that ask, leave the others alone.

``ForceToken`` is a :class:`~pipeline.LogitsStage`: it runs after the built-in ``logits``
stage (penalties, bias, min-p) and before ``sample``, on the model runner's compute
thread, in the same hand-over as the forward pass. A request asks for it with
``SamplingParams(extra_args={"force": t})`` (on the OpenAI server: ``"vllm_xargs":
{"force": t}``); every other row of the batch is untouched, so its tokens are those of a
run without the stage.

Two ways to put it in the graph:

* ``LLM(config, worker_graph=lambda g: g.insert_after("logits", ForceToken()))``, in
  the engine's process;
* ``EngineConfig(logits_processors=["logits_processor:ForceToken"])``: by import path,
  which is also how worker processes (``executor="multiproc"``) build it.

The example checks both, with prefix caching, chunked prefill, async scheduling, a KV
connector and two tensor-parallel worker processes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch

from pipeline import LLM, EngineConfig, LogitsBatch, LogitsStage, SamplingParams

FORCED = 42
PROMPTS = [list(range(1, 41)), list(range(5, 50)), list(range(9, 40)), [7, 8, 9]]
MAX_TOKENS = 8


@attrs.frozen
class ForceToken(LogitsStage):
    """Rows whose ``extra_args["force"]`` is a token id can only sample that token."""

    name: ClassVar[str] = "force_token"

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        for row, params in enumerate(batch.params):
            token = params.extra_args.get("force")
            if token is not None:
                logits[row] = float("-inf")
                logits[row, int(token)] = 0.0
        return logits


def params(force: bool, seed: int) -> SamplingParams:
    extra = {"force": FORCED} if force else {}
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, ignore_eos=True, extra_args=extra
    )


def generate(stage: str, **options: Any) -> list[tuple[int, ...]]:
    """The batch's tokens: rows 0 and 2 ask for the forced token; ``stage`` is "none",
    "graph" (worker_graph=) or "config" (logits_processors=). Generated twice in one
    engine: the second pass hits the prefix cache and must give the same tokens."""
    config = EngineConfig(
        model="builtin:tiny",
        max_model_len=256,
        logits_processors=["logits_processor:ForceToken"] if stage == "config" else [],
        **options,
    )
    graph = (lambda g: g.insert_after("logits", ForceToken())) if stage == "graph" else None
    batch = [params(force=i % 2 == 0, seed=i) for i in range(len(PROMPTS))]
    with LLM(config, worker_graph=graph) as llm:
        first = [out.token_ids for out in llm.generate(PROMPTS, batch)]
        again = llm.generate(PROMPTS, batch)  # the prompts' full blocks hit the prefix cache
    assert again[0].num_cached_tokens > 0, "the second pass reads the prefix cache"
    assert [out.token_ids for out in again] == first
    return first


def main() -> dict[str, list[tuple[int, ...]]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # "logits_processor:..." imports
    with tempfile.TemporaryDirectory() as store:
        setups: dict[str, dict[str, Any]] = {
            "default": {},
            "chunked prefill": {"max_num_batched_tokens": 32},
            "async scheduling": {"async_scheduling": True},
            "connector": {"connector": "shared_storage", "connector_options": {"path": store}},
            "multiproc x2": {"executor": "multiproc", "world_size": 2},
        }
        results: dict[str, list[tuple[int, ...]]] = {}
        for label, options in setups.items():
            plain = generate("none", **options)
            for stage in ("graph", "config") if label != "multiproc x2" else ("config",):
                forced = generate(stage, **options)
                for row, (got, ref) in enumerate(zip(forced, plain, strict=True)):
                    if row % 2 == 0:
                        assert got == (FORCED,) * MAX_TOKENS, (label, stage, row, got)
                    else:
                        assert got == ref, (label, stage, row, got, ref)
                results[f"{label} ({stage})"] = forced
            print(f"{label:17} forced rows: {forced[0]}; other rows as without the stage")
    return results


if __name__ == "__main__":
    main()
