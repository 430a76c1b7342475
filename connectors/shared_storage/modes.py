"""The shared_storage connector's file modes and its check of the store's root.

The KV of a prompt reveals the prompt, so a store is private to its user unless the
configuration says it is shared (``allow_shared``): see :class:`DiskStore`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pipeline.errors import InvalidConfigError

__all__ = ["PRIVATE", "SHARED", "check_root", "mkdir_exact"]

PRIVATE = (0o700, 0o600)
"""(directory, file) modes of a private store (the default)."""
SHARED = (0o770, 0o660)
"""(directory, file) modes of a store with ``allow_shared=True`` (a group shares it)."""


def mkdir_exact(path: Path, mode: int) -> None:
    """Create ``path`` (one level) with exactly ``mode``; an existing one is left as is."""
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        return
    os.chmod(path, mode)


def check_root(root: Path, allow_shared: bool) -> None:
    """Refuse a root another user owns or others may write, unless ``allow_shared``."""
    st = root.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidConfigError("connector_options['path']", str(root), "must be a directory")
    if allow_shared:
        return
    hint = "; set connector_options['allow_shared']=True to use it anyway"
    uid = getattr(os, "geteuid", lambda: st.st_uid)()
    if st.st_uid != uid:
        reason = f"is owned by another user (uid {st.st_uid}){hint}"
        raise InvalidConfigError("connector_options['path']", str(root), reason)
    if st.st_mode & 0o022:
        reason = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}){hint}"
        raise InvalidConfigError("connector_options['path']", str(root), reason)
