"""Crash consistency of the shared_storage store: writers killed with SIGKILL at random
points leave every key either a valid value or a miss, never wrong data; the stale-temp
cleanup then removes what they left behind."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import crash_writer as cw
import pytest
import torch

from connectors.framing import decode_block
from connectors.shared_storage.naming import temp_name
from connectors.shared_storage.store import DiskStore
from pipeline.errors import FrameError

WRITER = Path(__file__).with_name("crash_writer.py")
TRIALS = 50


def check_every_key(store: DiskStore) -> tuple[int, int]:
    """(valid, missing) over every key; fails on a value with wrong data."""
    valid = missing = 0
    for index in range(cw.NUM_KEYS):
        path = store.path_for(cw.FP_KEY, cw.block_hash(index))
        try:
            layers = decode_block(
                path.read_bytes(),
                cw.FP_KEY.encode() + cw.block_hash(index),
                num_layers=cw.NUM_LAYERS,
                layer_shape=cw.LAYER_SHAPE,
                dtype=cw.DTYPE,
            )
        except (FileNotFoundError, FrameError):
            missing += 1
            continue
        for got, want in zip(layers, cw.expected_layers(index), strict=True):
            assert torch.equal(got, want), f"key {index} holds wrong data"
        valid += 1
    return valid, missing


def temps(root: Path) -> list[Path]:
    return list(root.glob("*/*/.*.tmp"))


@contextlib.contextmanager
def writer(root: Path) -> Iterator[subprocess.Popen]:
    """A writer process on ``root``, killed (and its pipes closed) on exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(WRITER.parent)])}
    with subprocess.Popen(
        [sys.executable, str(WRITER), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            yield proc
        finally:
            proc.kill()
            proc.wait()


@pytest.fixture
def server(tmp_path) -> Iterator[subprocess.Popen]:
    """The writer process (imports once; forks one writer child per trial)."""
    with writer(tmp_path / "store") as proc:
        yield proc


def ask(proc: subprocess.Popen, line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


class TestCrashConsistency:
    def test_sigkilled_writers_never_leave_wrong_data(self, server, tmp_path):
        """50 writers SIGKILLed after a random 5-50 ms: every key valid or a miss."""
        rng = random.Random(3)
        store = DiskStore(tmp_path / "store")
        for trial in range(TRIALS):
            pid = int(ask(server, f"fork {trial}"))
            time.sleep(rng.uniform(0.005, 0.05))
            os.kill(pid, signal.SIGKILL)
            assert ask(server, f"reap {pid}") == f"signaled {int(signal.SIGKILL)}"
            check_every_key(store)
        valid, _ = check_every_key(store)
        assert valid > 0  # the writers did get somewhere
        left = temps(tmp_path / "store")
        assert store.clean_stale_temps(max_age_s=3600) == len(left)  # every pid is dead
        assert temps(tmp_path / "store") == []
        assert check_every_key(store)[0] == valid

    def test_killing_the_writer_process_itself(self, tmp_path):
        """The writer process itself SIGKILLed mid-write: valid or miss, then its temp
        files are removed by the cleanup (dead pid)."""
        root = tmp_path / "store"
        for trial in range(2):
            with writer(root) as proc:
                assert ask(proc, f"run {trial}") == "writing"
                time.sleep(0.005 + 0.02 * trial)
                proc.kill()
            assert proc.returncode == -signal.SIGKILL
        store = DiskStore(root)
        check_every_key(store)
        store.clean_stale_temps(max_age_s=3600)
        assert temps(root) == []
        check_every_key(store)


class TestStaleTemps:
    def test_cleanup_removes_dead_and_old_temps_only(self, tmp_path):
        """Temps of a dead pid or older than the limit go; a live writer's fresh temp
        and the values stay."""
        store = DiskStore(tmp_path)
        folder = tmp_path / ("ab" * 16) / "00"
        folder.mkdir(parents=True)
        value = folder / "00ff.kv"
        value.write_bytes(b"x")
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        # This host's temp names (naming.temp_name): the pid is checked only for those.
        dead_tmp = folder / temp_name("00ff.kv", pid=int(dead.stdout))
        live_tmp = folder / temp_name("00ee.kv")
        old_tmp = folder / temp_name("00dd.kv")
        for path in (dead_tmp, live_tmp, old_tmp):
            path.write_bytes(b"partial")
        os.utime(old_tmp, (time.time() - 1000, time.time() - 1000))
        assert store.clean_stale_temps(max_age_s=300) == 2
        assert sorted(folder.iterdir()) == sorted([value, live_tmp])
