"""A CPU engine's process keeps the memory a step frees (glibc's malloc tuned once at load),
unless ``EngineConfig.keep_freed_memory`` is off. Each case runs in a fresh interpreter:
the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's malloc only",
)

ROOT = Path(__file__).resolve().parents[3]

# Frees a 24 MiB block (below MMAP_THRESHOLD, far above glibc's initial 128 KiB) on a
# thread, as the compute thread would, and reports how much of it the process still holds.
_FREE_AND_MEASURE = """
import json, os, sys, threading
import torch

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

{setup}
held = []
def work():
    block = torch.ones(24 << 18)  # 24 MiB of float32, every page touched
    before = rss()
    del block
    held.append(before - rss())
t = threading.Thread(target=work); t.start(); t.join()
print(json.dumps({{"released": held[0], "applied": applied}}))
"""


def _run(setup: str) -> dict[str, object]:
    code = _FREE_AND_MEASURE.format(setup=setup)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_kept_memory_stays_in_the_process() -> None:
    default = _run("applied = None")
    kept = _run(
        "from stages.model.cpu_allocator import keep_freed_memory\napplied = keep_freed_memory()"
    )
    assert kept["applied"] is True
    # glibc's default maps a block this large on its own and unmaps it when freed ...
    assert isinstance(default["released"], int) and default["released"] >= 20 << 20, default
    # ... the tuned allocator keeps it for the next step.
    assert isinstance(kept["released"], int) and kept["released"] < 1 << 20, kept


def test_the_answer_is_the_first_one() -> None:
    kept = _run(
        "from stages.model.cpu_allocator import keep_freed_memory\n"
        "applied = [keep_freed_memory() for _ in range(3)] == [True] * 3"
    )
    assert kept["applied"] is True


_ENGINE = """
import json, sys
from pipeline import LLM, EngineConfig, SamplingParams
from stages.model import cpu_allocator
config = EngineConfig(model="builtin:tiny", device="cpu", keep_freed_memory={keep})
with LLM(config) as llm:
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0))
print(json.dumps({{"applied": cpu_allocator._applied, "tokens": len(out[0].token_ids)}}))
"""


@pytest.mark.parametrize("keep", [True, False])
def test_the_engine_applies_it_unless_told_not_to(keep: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE.format(keep=keep)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 2
    assert result["applied"] == ([True] if keep else [])
