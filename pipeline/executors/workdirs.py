"""The worker processes' private directories: named after their owner, swept when stale.

An engine with worker processes (``multiproc``) keeps their rendezvous file, and the
shared-memory all-reduce file, in a directory ``kvstep-workers-<pid>-<start>-<random>``
(on ``/dev/shm`` when it has room, else the temporary directory): ``pid`` is the
engine's process id and ``start`` its start time in clock ticks since boot
(``/proc/<pid>/stat``; 0 where there is no ``/proc``), so that a reused pid is not taken
for the owner.

The engine removes its directory when it closes or fails to start. A directory whose
owner was killed (SIGKILL, a crash) is removed by the next engine that starts: only
directories owned by the current user, named in this format, whose owner process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pipeline.logger import get_logger

__all__ = [
    "PREFIX",
    "make_workdir",
    "owner_alive",
    "process_start_time",
    "release_shared_file",
    "sweep_stale_workdirs",
    "workdir_bases",
]

_log = get_logger()

PREFIX = "kvstep-workers-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-")
SHM = "/dev/shm"


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot, from ``/proc/<pid>/stat``.

    ``None`` where the process does not exist or there is no ``/proc``.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (the command) may hold spaces and parentheses: fields 3.. follow the last ")".
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def owner_alive(pid: int, start: int) -> bool:
    """Whether process ``pid``, started at ``start`` (0: unknown), is still running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    if start == 0:
        return True
    now = process_start_time(pid)
    return now is None or now == start  # another start time: the pid was reused


def make_workdir(where: str | None) -> str:
    """Create this process's directory under ``where`` (``None``: the temporary directory)."""
    pid = os.getpid()
    start = process_start_time(pid) or 0
    return tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-{start}-", dir=where)


def workdir_bases() -> list[str]:
    """Where worker directories are made: ``/dev/shm`` (when writable) and the temp dir."""
    bases = [SHM] if os.access(SHM, os.W_OK) else []
    tmp = tempfile.gettempdir()
    return bases if tmp in bases else [*bases, tmp]


def sweep_stale_workdirs(bases: Iterable[str] | None = None) -> list[str]:
    """Remove worker directories under ``bases`` whose owner process is gone.

    Only directories (not links) owned by the current user and named
    ``kvstep-workers-<pid>-<start>-*`` are considered; a directory of a live owner, of
    another user, or of another naming is left alone. Never raises for a directory it
    cannot inspect or remove (another engine may be sweeping it too).

    Args:
        bases: Parent directories to scan; by default :func:`workdir_bases`.

    Returns:
        The directories removed.
    """
    uid = os.getuid()
    removed: list[str] = []
    for base in workdir_bases() if bases is None else bases:
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            match = _NAME.match(entry.name)
            if match is None:
                continue
            try:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
            except OSError:
                continue
            if owner_alive(int(match.group(1)), int(match.group(2))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed.append(entry.path)
    if removed:
        _log.info("swept_stale_worker_dirs", count=len(removed), paths=removed)
    return removed


def release_shared_file(path: str | None) -> None:
    """Unlink the shared-memory all-reduce file once every rank has mapped it.

    The ranks' mappings outlive the name, and the memory is freed when the last rank
    unmaps it: nothing is left behind should the engine be killed. Never raises: a
    file that cannot be unlinked goes with its directory when the engine closes.
    """
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
