"""The names of the shared_storage connector's files: the one place that defines them.

Layout under the store's root::

    <fingerprint key>/<hash hex[:2]>/<hash hex>.kv                      a value
    <fingerprint key>/<hash hex[:2]>/.<hash hex>.kv.<host>.<pid>.<32 hex>.tmp
                                                                        a write in progress

``<fingerprint key>`` and ``<hash hex>`` are lowercase hex. ``<host>`` is
:func:`this_host`: the hostname (characters other than letters, digits and ``-``
replaced by ``-``) and, where Linux tells it, ``_`` and the PID namespace's inode, so
two containers sharing a hostname are still told apart. The writer's ``<pid>`` is
meaningful on that host only: the stale-temp cleanup checks whether the writer is alive
only for temp files of its own host and goes by age alone for any other (and for temp
names without a host, written by older versions).

Other tools (``kvstep run``'s store summary, cleanup scripts) import these instead of
repeating the patterns.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import uuid
from pathlib import Path

import attrs

__all__ = [
    "SUFFIX",
    "TEMP_GLOB",
    "VALUE_GLOB",
    "TempName",
    "is_store_file",
    "parse_temp",
    "temp_name",
    "this_host",
    "value_name",
]

SUFFIX = ".kv"
"""The suffix of a stored value."""
VALUE_GLOB = f"*/*/*{SUFFIX}"
"""Every value, relative to the root."""
TEMP_GLOB = "*/*/.*.tmp"
"""Every temp file, relative to the root."""

_HEX = r"[0-9a-f]+"
_VALUE = re.compile(rf"{_HEX}{re.escape(SUFFIX)}")
_TEMP = re.compile(
    rf"\.(?P<target>{_HEX}{re.escape(SUFFIX)})\.(?:(?P<host>[A-Za-z0-9_-]+)\.)?"
    r"(?P<pid>\d{1,10})\.[0-9a-f]{32}\.tmp"
)


@attrs.frozen
class TempName:
    """A parsed temp file name: its target value, the writer's host (``None``: an older
    name without one) and pid."""

    target: str
    host: str | None
    pid: int


def value_name(block_hash: bytes) -> str:
    """The file name of a value: ``<hash hex>.kv``."""
    return f"{block_hash.hex()}{SUFFIX}"


@functools.cache
def this_host() -> str:
    """This host's token in temp names (see the module docstring)."""
    name = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "unknown"
    try:
        ns = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return name
    inode = re.search(r"\d+", ns)
    return f"{name}_{int(inode.group()):x}" if inode else name


def temp_name(target: str, *, host: str | None = None, pid: int | None = None) -> str:
    """A unique temp name for writing ``target`` (by default this host and process)."""
    host = this_host() if host is None else host
    pid = os.getpid() if pid is None else pid
    return f".{target}.{host}.{pid}.{uuid.uuid4().hex}.tmp"


def parse_temp(name: str) -> TempName | None:
    """The parts of a temp file name, or ``None`` if ``name`` is not one."""
    m = _TEMP.fullmatch(name)
    if m is None:
        return None
    return TempName(m["target"], m["host"], int(m["pid"]))


def is_store_file(path: Path) -> bool:
    """Whether ``path``'s name is a value or a temp file of this store."""
    return bool(_VALUE.fullmatch(path.name)) or parse_temp(path.name) is not None
