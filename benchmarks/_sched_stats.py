"""What the kernel says a process did over a window (Linux ``/proc``): CPU time it ran
and time its runnable threads waited for a core, summed over its threads; and which
cores a process may run on (:func:`pin`).

The wait is the direct measure of CPU contention: a decode step that is ready but
queued behind another process's prefill shows up there, not in the step's own time.
``/proc/PID/task/TID/schedstat`` holds ``run_ns wait_ns timeslices``; where it is
missing (not Linux, or schedstats off) every figure is 0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Mapping
from pathlib import Path

import attrs

__all__ = ["CpuTimes", "Snapshot", "cpu_times", "pin", "since", "snapshot", "snapshots"]


@attrs.frozen
class CpuTimes:
    """Nanoseconds a process's threads ran, and waited runnable for a core."""

    run_ns: int = 0
    wait_ns: int = 0

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.run_ns - other.run_ns, self.wait_ns - other.wait_ns)

    def __add__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.run_ns + other.run_ns, self.wait_ns + other.wait_ns)


#: A process's threads' ``CpuTimes`` so far, by thread id.
Snapshot = dict[int, CpuTimes]


def snapshot(pid: int) -> Snapshot:
    """Each live thread of ``pid``'s run and wait time so far; ``{}`` when ``/proc``
    does not say."""
    out: Snapshot = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (task / "schedstat").read_text().split()
                out[int(task.name)] = CpuTimes(int(fields[0]), int(fields[1]))
    return out


def cpu_times(pid: int) -> CpuTimes:
    """``pid``'s live threads' run and wait time so far."""
    return sum(snapshot(pid).values(), CpuTimes())


def since(before: Snapshot, after: Snapshot) -> CpuTimes:
    """What the threads alive at ``after`` did since ``before`` (a thread started in
    between counts from 0; one that ended in between is not counted: its time is gone
    from ``/proc``, and subtracting it would make the figure negative)."""
    return sum((t - before.get(tid, CpuTimes()) for tid, t in after.items()), CpuTimes())


def snapshots(pids: Mapping[str, int]) -> dict[str, Snapshot]:
    """:func:`snapshot` of each named process."""
    return {name: snapshot(pid) for name, pid in pids.items()}


def pin(pid: int, cpus: Collection[int]) -> None:
    """Run every thread of ``pid`` on ``cpus`` only (``os.sched_setaffinity`` per
    thread: it sets one thread's; a thread started later inherits its starter's). Two
    passes, so a thread started during the first by one not yet pinned is caught."""
    for _ in range(2):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):  # a thread that just exited
                os.sched_setaffinity(int(task.name), cpus)
