"""``DiskStore``: one framed value per block in a directory tree, written atomically.

Layout and file names: :mod:`connectors.shared_storage.naming` (``root / <fingerprint
key> / <hash hex[:2]> / <hash hex>.kv``). Both names are hex digests, checked as such,
and every directory is resolved and checked to lie under the root before any open or
unlink, so a stored key can never escape the directory.

**Privacy**: the KV of a prompt reveals the prompt, so the store is private by default:
directories it creates are ``0700``, files ``0600`` (exactly, whatever the umask), and a
root owned by another user or writable by group or others is refused
(``InvalidConfigError``) unless ``allow_shared=True`` — then directories are ``0770``
and files ``0660``, for a group that shares the store (use ``hmac_key_env`` then: any
member can write). A value that is not a regular file (a planted symlink) is a miss,
logged, never followed.

A write goes to a unique temp file in the target's directory (:func:`naming.temp_name`:
host, pid, random), is flushed and fsynced, renamed over the target with ``os.replace``
and the directory is fsynced: a reader sees the old value, the new one or none, never a
torn one. Leftover temp files of crashed writers are removed by
:meth:`DiskStore.clean_stale_temps`: this host's of a dead process, and any older than
the age limit (never another host's fresh one: its pid means nothing here).

Thread-safe: methods share no mutable state except the size estimate and the set of
paths already warned about (under a lock). Every method may block on disk I/O; call
them off the event loop.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from pathlib import Path

from connectors.shared_storage.modes import PRIVATE, SHARED, check_root, mkdir_exact
from connectors.shared_storage.naming import (
    SUFFIX,
    TEMP_GLOB,
    VALUE_GLOB,
    parse_temp,
    temp_name,
    this_host,
    value_name,
)
from pipeline.errors import InvalidConfigError
from pipeline.logger import get_logger

__all__ = ["LOW_WATER", "SUFFIX", "DiskStore", "write_atomic"]

log = get_logger()

_HEX = re.compile(r"[0-9a-f]+")
_MAX_WARNED = 1024  # planted paths remembered so that each is logged once
LOW_WATER = 0.9
"""A store found over ``max_bytes`` is evicted down to this fraction of it."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync the dir);
    the file gets exactly ``mode``.

    Raises:
        OSError: The write failed (disk full, permission); no partial ``path`` remains.
    """
    tmp = path.with_name(temp_name(path.name))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags | getattr(os, "O_CLOEXEC", 0), mode)
        with open(fd, "wb") as f:
            os.fchmod(fd, mode)  # exactly mode, whatever the umask
            f.write(data)
            f.flush()
            os.fsync(fd)
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
    except (PermissionError, OverflowError):
        return True
    return True


class DiskStore:
    """The directory of one shared store.

    Args:
        root: The store's directory; created (``0700``) if missing.
        allow_shared: Accept a root another user owns or others may write, and create
            group-accessible directories and files (module docstring).

    Raises:
        InvalidConfigError: ``root`` exists and is not a directory, cannot be created,
            or (without ``allow_shared``) is another user's or writable by others.
    """

    def __init__(self, root: Path, *, allow_shared: bool = False) -> None:
        self.allow_shared = allow_shared
        self._dir_mode, self._file_mode = SHARED if allow_shared else PRIVATE
        try:
            if not root.exists():
                root.parent.mkdir(parents=True, exist_ok=True)
                mkdir_exact(root, self._dir_mode)
            check_root(root, allow_shared)
        except OSError as exc:
            raise InvalidConfigError(
                "connector_options['path']", str(root), f"must be a usable directory ({exc})"
            ) from None
        self.root = root.resolve()
        self._lock = threading.Lock()
        self._size: int | None = None  # estimate of the bytes stored; None: not scanned
        self._warned: set[str] = set()

    def _warn_planted(self, path: Path, why: str) -> None:
        """Log a planted path (a miss) once per path."""
        with self._lock:
            if str(path) in self._warned:
                return
            if len(self._warned) >= _MAX_WARNED:
                self._warned.clear()
            self._warned.add(str(path))
        log.warning(
            "shared_storage: not a stored value, treated as a miss", path=str(path), why=why
        )

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
        path = self.root / fingerprint_key / name[:2] / value_name(block_hash)
        self.check_inside(path.parent)  # the file itself is never followed (O_NOFOLLOW)
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
        """Whether a value exists (not whether it is valid: loads verify). A symlink or
        other non-regular file, or a directory linked out of the root, is a miss
        (logged once)."""
        try:
            path = self.path_for(fingerprint_key, block_hash)
        except InvalidConfigError as exc:
            self._warn_planted(self.root / fingerprint_key, exc.allowed)
            return False
        try:
            mode = path.lstat().st_mode
        except OSError:
            return False
        if not stat.S_ISREG(mode):
            self._warn_planted(path, "a symlink" if stat.S_ISLNK(mode) else "not a regular file")
            return False
        return True

    def write(self, fingerprint_key: str, block_hash: bytes, data: bytes) -> None:
        """Store ``data`` atomically (see :func:`write_atomic`); a symlink planted at
        the value's path is replaced, never followed.

        Raises:
            OSError: The write failed; nothing partial is visible.
            InvalidConfigError: A directory on the way links out of the root.
        """
        path = self.path_for(fingerprint_key, block_hash)
        mkdir_exact(path.parent.parent, self._dir_mode)
        mkdir_exact(path.parent, self._dir_mode)
        self.check_inside(path.parent)
        write_atomic(path, data, self._file_mode)
        with self._lock:
            if self._size is not None:
                self._size += len(data)

    def touch(self, path: Path) -> None:
        """Refresh ``path``'s access time (LRU order; mounts may not do it on read)."""
        with contextlib.suppress(OSError, InvalidConfigError):
            self.check_inside(path.parent)
            os.utime(path, follow_symlinks=False)

    def discard(self, path: Path) -> bool:
        """Remove a value (a corrupt one) — the link itself if it is one; missing is
        fine. Returns whether ``path`` is gone now."""
        try:
            (self.check_inside(path.parent) / path.name).unlink(missing_ok=True)
        except InvalidConfigError:
            return False
        except OSError as exc:
            log.warning("shared_storage: could not remove a value", path=str(path), error=repr(exc))
            return False
        return True

    def added(self, fingerprint_key: str, block_hash: bytes) -> None:
        """Count a value another process wrote (a worker) in the size estimate; a
        missing one counts nothing."""
        with self._lock:
            if self._size is None:
                return  # not scanned yet: the next evict scans
        try:
            size = self.path_for(fingerprint_key, block_hash).lstat().st_size
        except (OSError, InvalidConfigError):
            return
        with self._lock:
            if self._size is not None:
                self._size += size

    def _values(self) -> list[tuple[float, int, Path]]:
        out = []
        for path in self.root.glob(VALUE_GLOB):
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append((max(st.st_atime, st.st_mtime), st.st_size, path))
        return out

    def evict(self, max_bytes: int, removed: list[Path] | None = None) -> int:
        """Remove least recently accessed values until the store holds <= ``max_bytes``.

        Scans the tree only when the running size estimate says it is over the cap, and
        then evicts down to :data:`LOW_WATER` of it, so that the next scan waits until
        that much more has landed instead of coming with nearly every save.

        Args:
            max_bytes: The cap.
            removed: Where to append the path of each value removed.

        Returns:
            The number of values removed.
        """
        with self._lock:
            if self._size is not None and self._size <= max_bytes:
                return 0
        values = sorted(self._values())
        total = sum(size for _, size, _ in values)
        target = max_bytes if total <= max_bytes else int(max_bytes * LOW_WATER)
        count = 0
        for _, size, path in values:
            if total <= target:
                break
            if self.discard(path):
                total -= size
                count += 1
                if removed is not None:
                    removed.append(path)
        with self._lock:
            self._size = total
        if count:
            log.debug("shared_storage: evicted", values=count, bytes_left=total)
        return count

    def clean_stale_temps(self, max_age_s: float) -> int:
        """Remove temp files older than ``max_age_s``, and this host's of a dead
        process. Another host's fresh temp file (and one of an older, host-less name)
        is left alone: its pid means nothing here, so only age can tell it is stale.

        Returns:
            The number removed.
        """
        now, removed, host = time.time(), 0, this_host()
        for path in self.root.glob(TEMP_GLOB):
            name = parse_temp(path.name)
            if name is None:
                continue
            try:
                old = now - path.lstat().st_mtime > max_age_s
                dead = name.host == host and not _pid_alive(name.pid)
                if old or dead:
                    (self.check_inside(path.parent) / path.name).unlink(missing_ok=True)
                    removed += 1
            except (OSError, InvalidConfigError):
                continue
        if removed:
            log.info("shared_storage: removed stale temp files", count=removed)
        return removed
