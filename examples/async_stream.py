"""Stream tokens from several concurrent requests with ``AsyncEngine``."""

from __future__ import annotations

import anyio

from pipeline import AsyncEngine, EngineConfig, SamplingParams


async def stream_one(engine: AsyncEngine, prompt: list[int], results: dict[int, list[int]]) -> None:
    async for out in engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0)):
        results.setdefault(prompt[0], []).extend(out.new_token_ids)


async def amain() -> dict[int, list[int]]:
    results: dict[int, list[int]] = {}
    config = EngineConfig(model="builtin:tiny", max_model_len=256)
    async with AsyncEngine(config) as engine, anyio.create_task_group() as tg:
        for first in (1, 20, 300):
            tg.start_soon(stream_one, engine, [first, 2, 3, 4], results)
    for first, tokens in sorted(results.items()):
        print(first, tokens)
    return results


def main() -> dict[int, list[int]]:
    return anyio.run(amain)


if __name__ == "__main__":
    main()
