"""vs_vllm.py's vLLM side: the static batch in vLLM's in-process ``LLM``, in vLLM's venv.

Run by ``vs_vllm.py`` with the interpreter given as ``--vllm-python``; it imports only
the standard library, torch and vllm (kvstep is not installed there). Reads the job as
JSON on stdin (``model``, ``dtype``, ``prompts`` as token ids, ``new_tokens``,
``repeats``, ``max_model_len``), writes ``{"seconds", "tokens", "vllm"}`` as JSON to the
path given as its one argument: the best of ``repeats`` timed ``generate`` calls after
one untimed call, and each prompt's greedy tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # its default zeroes ~20 GB first

    import vllm

    llm = vllm.LLM(
        model=job["model"],
        dtype=job["dtype"],
        skip_tokenizer_init=True,
        max_model_len=job["max_model_len"],
        max_num_seqs=len(job["prompts"]),
        max_num_batched_tokens=sum(len(p) for p in job["prompts"]),
        enable_prefix_caching=False,
        seed=0,
    )
    params = vllm.SamplingParams(
        max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
    )
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    times = []
    outs = []
    for i in range(job["repeats"] + 1):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if i:
            times.append(time.perf_counter() - start)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    with open(sys.argv[1], "w") as f:
        json.dump({"seconds": min(times), "tokens": tokens, "vllm": vllm.__version__}, f)


if __name__ == "__main__":
    main()
