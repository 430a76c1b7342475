"""The worker processes' files leave nothing behind (issue 10, finding 14).

The shared-memory all-reduce file is unlinked as soon as every rank has mapped it (the
ranks still reduce through their mappings), and an engine that starts removes the
``kvstep-workers-*`` directories of engines that are gone, never a live one's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline import LLM, EngineConfig, SamplingParams
from stages.model.shm_allreduce import available

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(40)], [5, 9, 11, 200, 31, 17, 3]]


def _config(model: Path, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = dict(
        model=str(model),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        fan_in_timeout_s=30.0,
    )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def _start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat: the process's start time in clock ticks."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.skipif(not available(), reason="the shared-memory all-reduce needs x86-64")
def test_allreduce_file_is_unlinked_once_every_rank_is_ready(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 14: with world_size 2 up, the all-reduce file is gone from disk, the
    tokens still equal world_size 1 in-process, and closing removes the work directory."""
    from pipeline.executors import multiproc

    with LLM(_config(llama_path)) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    planned: list[tuple[str, str | None, int]] = []
    real_plan = multiproc.plan_workdir

    def plan(config: EngineConfig, backend: str) -> tuple[str, str | None, int]:
        planned.append(real_plan(config, backend))
        return planned[-1]

    monkeypatch.setattr(multiproc, "plan_workdir", plan)
    with LLM(_config(llama_path, executor="multiproc", world_size=2)) as llm:
        (workdir, shared, slot) = planned[0]
        assert shared is not None and slot > 0, "the shared-memory all-reduce was not planned"
        assert not os.path.exists(shared)
        assert os.path.isdir(workdir)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert tokens == reference
    assert not os.path.exists(workdir)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_stale_worker_dirs_are_swept_when_an_engine_starts(
    llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 14: an engine's start removes kvstep-workers-* dirs whose owner is dead
    (or whose pid now belongs to a later process), and keeps a live owner's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    me = os.getpid()
    dead = tmp_path / f"kvstep-workers-{_dead_pid()}-12345-dead0001"
    reused = tmp_path / f"kvstep-workers-{me}-{_start_time(me) + 1}-reused01"
    live = tmp_path / f"kvstep-workers-{me}-{_start_time(me)}-live0001"
    unrelated = tmp_path / "kvstep-other-1-1-x"
    for d in (dead, reused, live, unrelated):
        d.mkdir()
        (d / "rendezvous").write_bytes(b"x")
    (dead / "allreduce").write_bytes(b"\0" * 4096)
    with LLM(_config(llama_path, executor="multiproc", world_size=2)) as llm:
        assert llm.generate([PROMPTS[1]], PARAMS)[0].token_ids
    assert not dead.exists() and not reused.exists()
    assert (live / "rendezvous").exists() and (unrelated / "rendezvous").exists()
