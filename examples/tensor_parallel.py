"""Split the model across two worker processes (tensor parallelism) and check that the
greedy tokens are those of a single rank.

``executor="multiproc"`` starts one worker process per rank; attention heads, KV heads,
the MLP and ``lm_head`` are divided between them, and they sum their partial results
every layer (gloo or shared memory on CPU, NCCL on CUDA). ``executor="ray"`` does the
same with Ray actors (``pip install 'kvstep[ray]'``).
"""

from __future__ import annotations

from pipeline import LLM, EngineConfig, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


def generate(executor: str = "inprocess", world_size: int = 1) -> list[tuple[int, ...]]:
    config = EngineConfig(
        model="builtin:tiny", max_model_len=256, executor=executor, world_size=world_size
    )
    with LLM(config) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]


def main() -> list[tuple[int, ...]]:
    single = generate()
    split = generate(executor="multiproc", world_size=2)
    print("one rank:            ", single)
    print("two worker processes:", split)
    assert split == single, "tensor-parallel ranks must give the single rank's tokens"
    return split


if __name__ == "__main__":
    main()
