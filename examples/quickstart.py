"""Generate from the embedded default model with the synchronous ``LLM`` front."""

from __future__ import annotations

from pipeline import LLM, EngineConfig, SamplingParams


def main() -> list[list[int]]:
    with LLM(EngineConfig(model="builtin:tiny", max_model_len=256)) as llm:
        outs = llm.generate(
            [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0)
        )
    for out in outs:
        print(out.request_id, out.token_ids, out.finish_reason)
    return [list(out.token_ids) for out in outs]


if __name__ == "__main__":
    main()
