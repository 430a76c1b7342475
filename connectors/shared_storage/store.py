"""``DiskStore``: one framed value per block in a directory tree, written atomically.

Layout: ``root / <fingerprint key> / <hash hex[:2]> / <hash hex>.kv``. Both names are
hex digests, checked as such, and every path is resolved and checked to lie under the
root before any open or unlink, so a stored key can never escape the directory.

A write goes to a unique temp file in the target's directory
(``.<name>.<pid>.<uuid>.tmp``), is flushed and fsynced, renamed over the target with
``os.replace`` and the directory is fsynced: a reader sees the old value, the new one or
none, never a torn one. Leftover temp files of crashed writers are removed by
:meth:`DiskStore.clean_stale_temps`.

Thread-safe: methods share no mutable state except the size estimate (under a lock).
Every method may block on disk I/O; call them off the event loop.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import uuid
from pathlib import Path

from pipeline.errors import InvalidConfigError
from pipeline.logs import get_logger

__all__ = ["DiskStore", "write_atomic"]

log = get_logger()

_HEX = re.compile(r"[0-9a-f]+")
_TEMP = re.compile(r"\..+\.(\d+)\.[0-9a-f]{32}\.tmp")
SUFFIX = ".kv"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync the dir).

    Raises:
        OSError: The write failed (disk full, permission); no partial ``path`` remains.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskStore:
    """The directory of one shared store.

    Args:
        root: The store's directory; created if missing.

    Raises:
        InvalidConfigError: ``root`` exists and is not a directory, or cannot be created.
    """

    def __init__(self, root: Path) -> None:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidConfigError(
                "connector_options['path']", str(root), f"must be a usable directory ({exc})"
            ) from None
        self.root = root.resolve()
        self._lock = threading.Lock()
        self._size: int | None = None  # estimate of the bytes stored; None: not scanned

    def path_for(self, fingerprint_key: str, block_hash: bytes) -> Path:
        """Where the value of ``block_hash`` under ``fingerprint_key`` lives.

        Raises:
            InvalidConfigError: ``fingerprint_key`` is not lowercase hex, or the path
                would resolve outside the root.
        """
        if not _HEX.fullmatch(fingerprint_key):
            raise InvalidConfigError("fingerprint key", fingerprint_key, "lowercase hex only")
        name = block_hash.hex()
        if not name:
            raise InvalidConfigError("block hash", block_hash, "a non-empty hash")
        path = self.root / fingerprint_key / name[:2] / f"{name}{SUFFIX}"
        self.check_inside(path)
        return path

    def check_inside(self, path: Path) -> Path:
        """``path`` resolved, after checking it lies under the root.

        Raises:
            InvalidConfigError: It does not (a crafted key or a symlink out).
        """
        resolved = path.resolve()
        if not resolved.is_relative_to(self.root):
            raise InvalidConfigError("store path", str(path), f"must lie under {self.root}")
        return resolved

    def contains(self, fingerprint_key: str, block_hash: bytes) -> bool:
        """Whether a value exists (not whether it is valid: loads verify)."""
        return self.path_for(fingerprint_key, block_hash).is_file()

    def write(self, fingerprint_key: str, block_hash: bytes, data: bytes) -> None:
        """Store ``data`` atomically (see :func:`write_atomic`).

        Raises:
            OSError: The write failed; nothing partial is visible.
        """
        path = self.path_for(fingerprint_key, block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
        with self._lock:
            if self._size is not None:
                self._size += len(data)

    def touch(self, path: Path) -> None:
        """Refresh ``path``'s access time (LRU order; mounts may not do it on read)."""
        with contextlib.suppress(OSError):
            os.utime(self.check_inside(path))

    def discard(self, path: Path) -> None:
        """Remove a value (a corrupt one); missing is fine."""
        try:
            self.check_inside(path).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("shared_storage: could not remove a value", path=str(path), error=repr(exc))

    def _values(self) -> list[tuple[float, int, Path]]:
        out = []
        for path in self.root.glob(f"*/*/*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            out.append((max(st.st_atime, st.st_mtime), st.st_size, path))
        return out

    def evict(self, max_bytes: int) -> int:
        """Remove least recently accessed values until the store holds <= ``max_bytes``.

        Scans the tree only when the running size estimate says it is over the cap.

        Returns:
            The number of values removed.
        """
        with self._lock:
            if self._size is not None and self._size <= max_bytes:
                return 0
        values = sorted(self._values())
        total = sum(size for _, size, _ in values)
        removed = 0
        for _, size, path in values:
            if total <= max_bytes:
                break
            self.discard(path)
            total -= size
            removed += 1
        with self._lock:
            self._size = total
        if removed:
            log.debug("shared_storage: evicted", values=removed, bytes_left=total)
        return removed

    def clean_stale_temps(self, max_age_s: float) -> int:
        """Remove temp files older than ``max_age_s`` or of a dead process (this machine).

        Returns:
            The number removed.
        """
        now, removed = time.time(), 0
        for path in self.root.glob("*/*/.*.tmp"):
            match = _TEMP.fullmatch(path.name)
            if match is None:
                continue
            try:
                old = now - path.stat().st_mtime > max_age_s
                if old or not _pid_alive(int(match.group(1))):
                    self.check_inside(path).unlink(missing_ok=True)
                    removed += 1
            except (OSError, InvalidConfigError):
                continue
        if removed:
            log.info("shared_storage: removed stale temp files", count=removed)
        return removed
