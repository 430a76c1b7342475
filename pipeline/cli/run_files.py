"""What ``kvstep run`` may clear before it starts: its own store and step log, nothing else.

The run job clears the ``shared_storage`` directory (so that its first pass really
misses) and truncates its step log (so that the log holds this run only). Both paths
come from the command line, so both are checked before anything is touched:

* The store directory must be missing (it is then created with a marker file,
  ``.kvstep-run-store``), empty, marked, or hold nothing but the store's own layout
  (``<hex key>/<hh>/<hex>.kv`` and the store's temp files, as
  :mod:`connectors.shared_storage.naming` names them). Clearing removes only the
  files of that layout (and the layout's directories left empty), never anything else,
  even in a marked directory.
* The step log must be missing, empty, or a kvstep step log (its first line is a
  step-log record). Anything else is refused rather than truncated.

A refusal is an :class:`~pipeline.errors.InvalidConfigError` naming the path and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from connectors.shared_storage.naming import is_store_file
from pipeline.errors import InvalidConfigError

__all__ = ["MARKER", "is_step_log", "prepare_run_files", "store_files"]

MARKER = ".kvstep-run-store"
"""The file ``kvstep run`` writes in a store directory it created or adopted (empty)."""

STORE_FIELD = "connector_options['path']"
_HEX = re.compile(r"[0-9a-f]+")
_FIRST_LINE_MAX = 1 << 16


def store_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The files of the store's layout under ``root``, and every other entry found.

    Walks ``root / <hex key> / <hh> / <file>`` without following links; a link, a file
    where a directory belongs, or a name outside the layout is "other" (the marker is
    neither).
    """
    ours: list[Path] = []
    other: list[Path] = []
    for key in os.scandir(root):
        if key.name == MARKER and key.is_file(follow_symlinks=False):
            continue
        if not (_HEX.fullmatch(key.name) and key.is_dir(follow_symlinks=False)):
            other.append(Path(key.path))
            continue
        for shard in os.scandir(key.path):
            name = shard.name
            if not (len(name) == 2 and _HEX.fullmatch(name)):
                other.append(Path(shard.path))
                continue
            if not shard.is_dir(follow_symlinks=False):
                other.append(Path(shard.path))
                continue
            for value in os.scandir(shard.path):
                path = Path(value.path)
                ok = is_store_file(path) and value.is_file(follow_symlinks=False)
                (ours if ok else other).append(path)
    return ours, other


def is_step_log(path: Path) -> bool:
    """Whether ``path``'s first line is a kvstep step-log record: a JSON object with
    ``event`` and ``step_id``, or the ``model`` record an engine writes first (with its
    ``linear_kernel`` and ``num_blocks``)."""
    try:
        with path.open("rb") as f:
            first = f.readline(_FIRST_LINE_MAX)
        record = json.loads(first)
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or "event" not in record:
        return False
    if record["event"] == "model":
        return "linear_kernel" in record and "num_blocks" in record
    return "step_id" in record


def _check_store(root: Path) -> list[Path] | None:
    """The files to remove to clear ``root`` (``None``: create it).

    Raises:
        InvalidConfigError: ``root`` is not a directory, or holds what is not a store's.
    """
    if not os.path.lexists(root):
        return None
    if not root.is_dir():
        raise InvalidConfigError(STORE_FIELD, str(root), "exists and is not a directory")
    try:
        ours, other = store_files(root)
    except OSError as exc:
        raise InvalidConfigError(STORE_FIELD, str(root), f"cannot be read ({exc})") from None
    if other and not (root / MARKER).is_file():
        raise InvalidConfigError(
            STORE_FIELD,
            str(root),
            f"is a non-empty directory that is not a kvstep store (it holds "
            f"{other[0].name!r}); give a new or empty directory, or a kvstep store",
        )
    return ours


def _check_step_log(path: Path) -> None:
    """Raises InvalidConfigError unless ``path`` is missing, empty or a step log."""
    if not os.path.lexists(path):
        return
    if not path.is_file():
        raise InvalidConfigError("step_log", str(path), "exists and is not a regular file")
    if path.stat().st_size and not is_step_log(path):
        raise InvalidConfigError(
            "step_log",
            str(path),
            "exists and is not a kvstep step log; give a new file, an empty one or a "
            "kvstep step log (it is truncated)",
        )


def _clear_store(root: Path, files: list[Path]) -> None:
    dirs = {f.parent for f in files}
    for f in files:
        f.unlink(missing_ok=True)
    for shard in sorted(dirs):  # then the layout's directories left empty
        for d in (shard, shard.parent):
            with contextlib.suppress(OSError):
                d.rmdir()


def prepare_run_files(
    store: Path | None, step_log: Path | None, *, clear_store: bool, store_mode: int = 0o700
) -> None:
    """Check the run's store directory and step log, then clear them.

    Nothing is touched unless both pass. A missing store directory is created with
    ``store_mode`` (private by default, like the store's own root); a missing or empty
    one is marked; ``clear_store`` removes the store's values; the step log is truncated
    (created when missing). Blocks on the file system.

    Raises:
        InvalidConfigError: A path that is not kvstep's (see the module docstring), or
            one that cannot be created or cleared.
    """
    files = _check_store(store) if store is not None else None
    if step_log is not None:
        _check_step_log(step_log)
    try:
        if store is not None:
            if files is None:  # missing: created like the store's own root
                store.parent.mkdir(parents=True, exist_ok=True)
                store.mkdir(mode=store_mode)
                os.chmod(store, store_mode)
            if not any(store.iterdir()):
                (store / MARKER).write_text("kvstep run store: only *.kv values are removed\n")
            if clear_store and files:
                _clear_store(store, files)
    except OSError as exc:
        raise InvalidConfigError(STORE_FIELD, str(store), f"cannot be prepared ({exc})") from None
    if step_log is not None:
        try:
            step_log.parent.mkdir(parents=True, exist_ok=True)
            step_log.write_bytes(b"")
        except OSError as exc:
            raise InvalidConfigError(
                "step_log", str(step_log), f"cannot be written ({exc})"
            ) from None
