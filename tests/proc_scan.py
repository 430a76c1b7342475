"""Find this machine's processes by their command line (Linux ``/proc``), for tests that
must kill or wait on a process another program started (a Ray node's raylet, its
workers)."""

from __future__ import annotations

from pathlib import Path


def pids_with(*markers: str) -> list[int]:
    """PIDs of the processes whose command line holds every one of ``markers``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if all(marker in cmdline for marker in markers):
            found.append(int(entry.name))
    return found
