"""``kvstep run`` (pipeline.cli.run_job + pipeline.cli): two passes across a restart."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli import main
from pipeline.cli.run_job import RunOptions, cache_dir, default_run_config
from pipeline.config import EngineConfig


def _run(tmp_path: Path, *extra: str, prompts: int = 1) -> list[dict[str, Any]]:
    out = tmp_path / "results.json"
    argv = [
        "run", "--num-prompts", str(prompts), "--prefix-len", "48", "--suffix-len", "16",
        "--max-tokens", "3", "--no-progress", "--json", str(out),
        "--connector-options", json.dumps({"path": str(tmp_path / "store")}),
        "--step-log", str(tmp_path / "steps.jsonl"), *extra,
    ]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


class TestRunJob:
    def test_second_pass_loads_the_first_pass_kv_from_the_store(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """One prompt: the first pass misses, the restarted engine loads its full blocks."""
        first, second = _run(tmp_path)
        assert first["loaded_tokens"] == 0
        assert second["loaded_tokens"] == 48 + 16 - 16  # full blocks, last token recomputed
        assert first["tokens"] == second["tokens"] == 3
        assert first["leaks"] == second["leaks"] == 0
        out = capsys.readouterr().out
        assert "TTFT ms" in out and "steps.jsonl" in out

    def test_each_step_runs_the_finalizer(self, tmp_path: Path) -> None:
        """Finalizer runs (clear records) equal the steps of each pass."""
        results = _run(tmp_path, prompts=3)
        for r in results:
            assert r["steps"] > 0 and r["finalizer_runs"] == r["steps"]
            assert r["requests"] == 3

    def test_store_is_cleared_unless_kept(self, tmp_path: Path) -> None:
        """A second run's first pass misses again, unless --keep-store."""
        _run(tmp_path)
        first, _ = _run(tmp_path)
        assert first["loaded_tokens"] == 0
        kept, _ = _run(tmp_path, "--keep-store")
        assert kept["loaded_tokens"] > 0

    def test_default_config_uses_shared_storage_under_the_cache_dir(self) -> None:
        """The embedded default: builtin:tiny, shared_storage in <cache>/run-store."""
        config = default_run_config()
        assert config.model == "builtin:tiny"
        assert config.connector == "shared_storage"
        assert config.connector_options == {"path": str(cache_dir() / "run-store")}
        assert config.enable_prefix_caching is False
        assert RunOptions().num_prompts > 1

    def test_forward_inline_by_default_in_process_only(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The job's loop serves nothing else: its forward passes run there, unless the
        flag says otherwise or the ranks run in worker processes."""
        assert default_run_config().inline_forward is True
        assert default_run_config(inline_forward=False).inline_forward is False
        multiproc = default_run_config(executor="multiproc", world_size=2)
        assert multiproc.inline_forward is False
        with pytest.raises(SystemExit):
            main(["run", "--help"])
        assert "on with executor inprocess" in " ".join(capsys.readouterr().out.split())

    def test_bad_flag_value_exits_2_naming_it(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An invalid EngineConfig value is a clean error, not a traceback."""
        argv = ["run", "--no-progress", "--block-size", "0"]
        assert main(argv) == 2
        assert "block_size" in capsys.readouterr().err


class TestServeCommand:
    def test_missing_server_extra_exits_2_with_install_hint(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Without pipeline.server importable, serve names the extra to install."""
        monkeypatch.setitem(sys.modules, "pipeline.server", None)
        assert main(["serve", "--port", "1"]) == 2
        assert "pip install 'kvstep[server]'" in capsys.readouterr().err

    def test_lazy_uvicorn_import_failure_gets_the_same_hint(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A server extra missing only at serve() time also exits 2 with the hint."""

        def serve(config: EngineConfig, host: str, port: int, options: object) -> None:
            raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")

        fake = types.ModuleType("pipeline.server")
        fake.serve = serve  # type: ignore[attr-defined]
        fake.server_options = lambda args: None  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "pipeline.server", fake)
        assert main(["serve"]) == 2
        assert "kvstep[server]" in capsys.readouterr().err

    def test_serve_gets_the_config_host_and_port(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Every EngineConfig flag reaches serve() along with --host and --port."""
        seen: list[tuple[EngineConfig, str, int]] = []
        fake = types.ModuleType("pipeline.server")
        fake.serve = lambda config, host, port, options: seen.append((config, host, port))  # type: ignore[attr-defined]
        fake.server_options = lambda args: None  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "pipeline.server", fake)
        argv = ["serve", "--host", "0.0.0.0", "--port", "8123", "--max-num-seqs", "4",
                "--no-enable-prefix-caching", "--connector", "offload"]  # fmt: skip
        assert main(argv) == 0
        config, host, port = seen[0]
        assert (host, port) == ("0.0.0.0", 8123)
        assert config.max_num_seqs == 4 and config.enable_prefix_caching is False
        assert config.connector == "offload"
