"""builtin:tiny: deterministic, cached atomically, loaded like any checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.errors import ModelLoadError
from stages.model import ModelRunner, resolve_model_path
from stages.model import builtin as builtin_mod


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSTEP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class TestBuiltinTiny:
    def test_builds_into_cache_dir(self, cache_dir: Path) -> None:
        """The first resolve writes the checkpoint and its tokenizer under the cache dir."""
        path = resolve_model_path("builtin:tiny")
        assert path.parent == cache_dir and path.name.startswith("builtin-tiny-")
        assert {p.name for p in path.iterdir()} == {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        }
        assert [p.name for p in cache_dir.iterdir()] == [path.name]  # no temp dir left

    def test_second_resolve_reuses_the_cache(
        self, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Once built, resolving again does not rebuild or rewrite anything."""
        path = resolve_model_path("builtin:tiny")
        mtime = (path / "model.safetensors").stat().st_mtime_ns

        def fail() -> None:
            raise AssertionError("rebuilt")

        monkeypatch.setattr(builtin_mod, "build_tiny_state_dict", fail)
        assert resolve_model_path("builtin:tiny") == path
        assert (path / "model.safetensors").stat().st_mtime_ns == mtime

    def test_deterministic_weights(self) -> None:
        """Two builds give bit-identical weights."""
        a, b = builtin_mod.build_tiny_state_dict(), builtin_mod.build_tiny_state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)

    def test_same_fingerprint_across_cache_dirs(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Builds in two cache directories have the same weights id."""
        ids = []
        for name in ("one", "two"):
            monkeypatch.setenv("KVSTEP_CACHE_DIR", str(tmp_path / name))
            runner = ModelRunner.load("builtin:tiny", device="cpu", num_blocks=8)
            ids.append(runner.fingerprint.weights_id)
            runner.close()
        assert ids[0] == ids[1]

    def test_unknown_builtin(self) -> None:
        """An unknown builtin name is refused, listing the builtins."""
        with pytest.raises(ModelLoadError, match="builtin:tiny"):
            resolve_model_path("builtin:huge")

    def test_missing_local_directory(self, tmp_path: Path) -> None:
        """A local path that is not a directory is a ModelLoadError naming it."""
        with pytest.raises(ModelLoadError, match="no such model directory") as info:
            resolve_model_path(str(tmp_path / "absent"))
        assert str(tmp_path / "absent") in str(info.value)

    def test_greedy_outputs_are_not_degenerate(self, cache_dir: Path) -> None:
        """Greedy continuations vary within a sequence and between prompts."""
        runner = ModelRunner.load("builtin:tiny", device="cpu", num_blocks=16, max_model_len=64)
        assert runner.model_config.vocab_size == 512
        prompts = {"a": [5, 6, 7, 8], "b": [300, 301]}
        outputs: dict[str, list[int]] = {k: [] for k in prompts}
        tokens = {k: list(v) for k, v in prompts.items()}
        for step in range(12):
            requests = []
            for i, (req_id, toks) in enumerate(tokens.items()):
                done = 0 if step == 0 else len(toks) - 1
                requests.append(
                    ScheduledRequest(
                        req_id=req_id,
                        token_ids=tuple(toks[done:]),
                        num_computed_tokens=done,
                        block_ids=(i,) if step == 0 else (),
                        new=step == 0,
                        sampling=SamplingParams(temperature=0.0),
                        sample=True,
                        num_output_tokens=len(outputs[req_id]),
                    )
                )
            sched = SchedulerOutput(step_id=step, requests=tuple(requests))
            sampled = runner.sample(sched, runner.execute(sched)).token_ids
            for req_id, toks in sampled.items():
                tokens[req_id].extend(toks)
                outputs[req_id].extend(toks)
        assert len(set(outputs["a"])) >= 6 and len(set(outputs["b"])) >= 6
        assert outputs["a"] != outputs["b"]
