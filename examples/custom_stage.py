"""Put your own stage into every worker step: here, one that counts the tokens it sees.

A stage is a small object with a ``name``, the artifact types it ``requires`` and the one
it ``provides``; the graph wires it by type and runs it with the built-in stages.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from pipeline import LLM, EngineConfig, ModelOutput, SamplingParams, StepContext


@attrs.frozen
class TokensSeen:
    rows: int


@attrs.frozen
class CountRows:
    name: ClassVar[str] = "count_rows"
    requires: ClassVar[tuple[type, ...]] = (ModelOutput,)
    provides: ClassVar[type] = TokensSeen

    seen: list[int] = attrs.field(factory=list)

    async def run(self, ctx: StepContext) -> TokensSeen:
        rows = len(ctx.get(ModelOutput).req_ids)
        self.seen.append(rows)
        return TokensSeen(rows)


def main() -> int:
    counter = CountRows()
    config = EngineConfig(model="builtin:tiny", max_model_len=256)
    with LLM(config, worker_graph=lambda g: g.insert_after("forward", counter)) as llm:
        print("worker graph:", llm.engine.core.workers[0].graph)
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0))
    print(f"rows sampled per step: {counter.seen}")
    return sum(counter.seen)


if __name__ == "__main__":
    main()
