"""The README's command blocks, run as a user types them (subprocesses on loopback).

:func:`readme_block` finds a fenced ``bash`` block of ``README.md`` by a line it
contains, and :func:`run_block` runs that block's text verbatim in ``bash`` (in a
session of its own, so every process it starts, backgrounded or not, is stopped at the
end). ``kvstep`` on the block's ``PATH`` is a shim that runs this tree's
``python -m pipeline.cli``, so the tree under test serves even when another checkout
is installed. A README edit that breaks a command breaks the test that runs it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_block(containing: str, language: str = "bash") -> str:
    """The text of the one ``language`` block of the README that contains ``containing``.

    Raises:
        LookupError: No block, or more than one, contains it.
    """
    found = [
        m.group(2)
        for m in _FENCE.finditer(README.read_text())
        if m.group(1) == language and containing in m.group(2)
    ]
    if len(found) != 1:
        raise LookupError(f"{len(found)} README {language} blocks contain {containing!r}")
    return found[0]


def run_python_block(text: str, cwd: Path, timeout_s: float = 240.0) -> str:
    """Run a README ``python`` block verbatim in a fresh interpreter; its output.

    Raises:
        AssertionError: It exited non-zero (the message holds its output).
    """
    done = subprocess.run(
        [sys.executable, "-c", text],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _shim(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "kvstep"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m pipeline.cli "$@"\n')
    shim.chmod(0o755)


class BlockProcess:
    """A README block running in ``bash``: its process and its combined output."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, url: str, timeout_s: float = 180.0) -> None:
        """Return once ``url``/health answers 200; ``RuntimeError`` with the log's tail
        when the block's shell exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"block exited {self.process.returncode}: {self.tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up: {self.tail()}")
            time.sleep(0.25)

    def tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]


@contextlib.contextmanager
def run_block(
    text: str, tmp: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[BlockProcess]:
    """Run ``text`` verbatim with ``bash`` in ``cwd`` (default ``tmp``; kvstep's cache in
    ``tmp``), stop everything it started on exit (SIGTERM to its session, then SIGKILL)."""
    _shim(tmp / "bin")
    environ = {**os.environ, **(env or {})}
    environ["PATH"] = f"{tmp / 'bin'}{os.pathsep}{environ.get('PATH', '')}"
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p
    )
    log = tmp / "block.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", text + "\nwait\n"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd or tmp,
            env=environ,
            start_new_session=True,
        )
        try:
            yield BlockProcess(process, log)
        finally:
            _stop_session(process)


def _stop_session(process: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            process.poll()  # reap the shell: a zombie still counts in its session
            try:
                os.killpg(process.pid, 0)  # anyone left in the session?
            except ProcessLookupError:
                process.wait()
                return
            time.sleep(0.1)
    process.wait()
