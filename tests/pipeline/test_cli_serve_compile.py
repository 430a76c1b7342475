"""``kvstep serve`` compiles the forward pass by default (``--no-torch-compile`` turns it
off); ``EngineConfig`` and ``kvstep run`` keep the eager default (issue 27)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_process import run_server

from pipeline.cli.main import build_parser, serve_config
from pipeline.config import EngineConfig


def _config(*flags: str) -> EngineConfig:
    return serve_config(build_parser().parse_args(["serve", *flags]))


def test_serve_compiles_by_default_and_the_flag_turns_it_off() -> None:
    assert _config().torch_compile is True
    assert _config("--no-torch-compile").torch_compile is False
    assert _config("--torch-compile").torch_compile is True
    assert EngineConfig().torch_compile is False


def test_the_help_shows_each_commands_default(capsys: pytest.CaptureFixture[str]) -> None:
    for command, shown in (("serve", "(default: on)"), ("run", "(default: off)")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        start = help_text.index("--torch-compile, --no-torch-compile")
        assert shown in help_text[start : help_text.index(" --", start + 40)], command


@pytest.mark.slow
def test_a_served_model_runs_compiled(tmp_path: Path) -> None:
    """A real ``kvstep serve`` with its defaults: the model is compiled before /health
    answers (``torch_compiled`` in its log, no fallback warning), and it serves."""
    with run_server("builtin:tiny", tmp_path / "server.log", start_timeout_s=240) as server:
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "the cat", "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        assert server.health().json()["compiled"] is True
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "kvstep_forward_compiled 1.0" in metrics
        log = server.log_text()
    assert "torch_compiled" in log and "torch_compile_fallback" not in log
