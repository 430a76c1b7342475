"""``kvstep run`` touches only what kvstep wrote, and refuses bad flags cleanly.

Issue 10, finding 4: the store directory and the step log come from the command line;
a directory or file that is not kvstep's is refused (exit 2) and left byte-for-byte
intact. Finding 18 (CLI): a bad flag value is an argparse-style error naming the flag
(exit 2), never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli import main

REPO = Path(__file__).resolve().parents[2]


def _argv(tmp_path: Path, store: Path, step_log: Path, *extra: str) -> list[str]:
    return [
        "run", "--num-prompts", "1", "--prefix-len", "48", "--suffix-len", "16",
        "--max-tokens", "2", "--no-progress", "--json", str(tmp_path / "results.json"),
        "--connector-options", json.dumps({"path": str(store)}),
        "--step-log", str(step_log), *extra,
    ]  # fmt: skip


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root`` (and ``root`` itself): kind, mode, and bytes' hash."""
    entries: dict[str, Any] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            what: Any = ("link", os.readlink(path))
        elif stat.S_ISDIR(st.st_mode):
            what = ("dir", sorted(p.name for p in path.iterdir()))
        else:
            what = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
        entries[str(path.relative_to(root))] = (stat.S_IMODE(st.st_mode), st.st_size, what)
    return entries


def _foreign_tree(root: Path) -> None:
    """A user's directory: nested files, an executable, a hidden file, a link."""
    (root / "docs" / "deep").mkdir(parents=True)
    (root / "notes.txt").write_text("my notes\n")
    (root / ".hidden").write_bytes(b"\x00\x01secret")
    (root / "docs" / "deep" / "thesis.tex").write_text("\\section{Results}\n" * 50)
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o750)
    (root / "link").symlink_to("notes.txt")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pipeline.cli`` of the tree under test, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


class TestStoreDirectory:
    def test_a_foreign_directory_is_refused_and_left_intact(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Finding 4: a non-empty non-kvstep store directory is refused (exit 2), untouched."""
        store = tmp_path / "mine"
        _foreign_tree(store)
        before = _snapshot(store)
        assert main(_argv(tmp_path, store, tmp_path / "steps.jsonl")) == 2
        err = capsys.readouterr().err
        assert "--connector-options" in err and "not a kvstep store" in err
        assert _snapshot(store) == before

    def test_a_store_layout_with_a_foreign_file_is_refused_and_left_intact(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Finding 4: store-like hex folders do not make a directory kvstep's when it also
        holds other files: refused (exit 2), every byte kept."""
        store = tmp_path / "store"
        shard = store / "ab12" / "cd"
        shard.mkdir(parents=True)
        (shard / ("cd" + "0" * 62 + ".kv")).write_bytes(b"value")
        (shard / "keep.me").write_text("not a value\n")
        before = _snapshot(store)
        assert main(_argv(tmp_path, store, tmp_path / "steps.jsonl")) == 2
        assert "keep.me" in capsys.readouterr().err
        assert _snapshot(store) == before

    def test_kvsteps_own_store_is_cleared_and_reused_run_after_run(self, tmp_path: Path) -> None:
        """Finding 4: the store kvstep created (marked) is cleared on the next run, which
        misses again; a file put there by someone else survives both runs."""
        store, log = tmp_path / "store", tmp_path / "steps.jsonl"
        assert main(_argv(tmp_path, store, log)) == 0
        first_run = json.loads((tmp_path / "results.json").read_text())
        assert first_run[1]["loaded_tokens"] > 0
        assert list(store.rglob("*.kv"))
        (store / "README").write_text("someone else's\n")
        assert main(_argv(tmp_path, store, log)) == 0
        second_run = json.loads((tmp_path / "results.json").read_text())
        assert second_run[0]["loaded_tokens"] == 0  # cleared: the first pass missed
        assert second_run[1]["loaded_tokens"] == first_run[1]["loaded_tokens"]
        assert (store / "README").read_text() == "someone else's\n"


class TestStepLog:
    def test_a_file_that_is_not_a_step_log_is_refused_and_left_intact(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Finding 4: --step-log naming a file that is not a kvstep step log is refused
        (exit 2) and not truncated; nothing is cleared either."""
        log = tmp_path / "thesis.tex"
        log.write_text("\\documentclass{article}\n" * 100)
        log.chmod(0o640)
        store = tmp_path / "store"
        before = _snapshot(tmp_path)
        assert main(_argv(tmp_path, store, log)) == 2
        err = capsys.readouterr().err
        assert "--step-log" in err and "not a kvstep step log" in err
        assert _snapshot(tmp_path) == before
        assert not store.exists()

    def test_a_json_lines_file_that_only_says_model_is_refused(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A step log now starts with the engine's ``model`` record; a file whose first
        line merely has ``"event": "model"`` (without the record's fields) is not one."""
        log = tmp_path / "events.jsonl"
        log.write_text(json.dumps({"event": "model", "name": "my notes"}) + "\n")
        before = _snapshot(tmp_path)
        assert main(_argv(tmp_path, tmp_path / "store", log)) == 2
        assert "not a kvstep step log" in capsys.readouterr().err
        assert _snapshot(tmp_path) == before


class TestFlagErrors:
    def test_connector_options_not_an_object_is_a_clean_error(self) -> None:
        """Finding 18: --connector-options '[1,2]' exits 2 naming the flag, no traceback."""
        proc = _cli("run", "--no-progress", "--connector-options", "[1,2]")
        assert proc.returncode == 2
        assert "--connector-options" in proc.stderr and "JSON object" in proc.stderr
        assert "Traceback" not in proc.stderr

    def test_connector_options_bad_json_is_a_clean_error(self) -> None:
        """Finding 18: --connector-options '{bad' exits 2 naming the flag and saying it is
        not valid JSON, no traceback."""
        proc = _cli("run", "--no-progress", "--connector-options", "{bad")
        assert proc.returncode == 2
        message = proc.stderr.strip().splitlines()[-1]  # after argparse's usage
        assert "--connector-options" in message and "invalid JSON" in message
        assert "Traceback" not in proc.stderr

    @pytest.mark.parametrize("command", ["run", "serve"])
    def test_an_invalid_config_value_names_its_flag(self, command: str) -> None:
        """Finding 18: --block-size 0 (an EngineConfig validation error) exits 2 with an
        argparse-style message naming --block-size, no traceback, for run and serve."""
        proc = _cli(command, "--block-size", "0")
        assert proc.returncode == 2
        assert f"kvstep {command}: error: argument --block-size:" in proc.stderr
        assert "block_size" in proc.stderr and "Traceback" not in proc.stderr
