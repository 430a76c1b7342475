"""``multiproc``: one long-lived worker process per rank, tensor-parallel over torch.distributed.

Each rank is ``python -m pipeline.executors.remote_worker`` holding one end of a socket pair; the
engine and the worker exchange :mod:`pipeline.executors.wire` messages (msgspec, never pickle).
The ranks meet in a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA, through a
file store in a private temporary directory) and split the model's heads and MLP.

A worker that dies is noticed by its socket closing (and, should the socket stay open,
by polling the process while a step waits): the step fails with
:class:`~pipeline.errors.WorkerDiedError` naming the rank, :attr:`failure` is set, and
the engine raises :class:`~pipeline.errors.EngineDeadError` to every caller. Nothing
waits on a dead rank: the surviving ranks' steps are cancelled with the step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import anyio
import attrs

from connectors.base import ModelFingerprint
from pipeline.artifacts import SchedulerOutput, WorkerOutput
from pipeline.config import EngineConfig
from pipeline.errors import WorkerDiedError, WorkerFailedError
from pipeline.executors import wire
from pipeline.executors.channel import Channel, PeerGone
from pipeline.executors.remote import (
    check_ready,
    init_message,
    plan_workdir,
    rank_device,
    settle_reply,
)
from pipeline.executors.wire_checks import encode_step_isolated
from pipeline.executors.workdirs import release_shared_file
from pipeline.logger import get_logger
from pipeline.steplog import StepLog
from stages.execute import SubmittedStep

__all__ = ["MultiprocExecutor"]

_log = get_logger()
START_TIMEOUT_S = 600.0
STOP_GRACE_S = 5.0


def _step_of(reply: wire.StepDone | wire.StepFailed) -> int:
    return reply.output.step_id if isinstance(reply, wire.StepDone) else reply.step_id


@attrs.define(eq=False)
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    channel: Channel
    lock: anyio.Lock = attrs.field(factory=anyio.Lock)
    metadata_bound: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None


def _kill(procs: Sequence[subprocess.Popen[bytes]], workdir: str) -> None:
    """Last resort (garbage collection, interpreter exit): no worker outlives its engine."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
    shutil.rmtree(workdir, ignore_errors=True)


class MultiprocExecutor:
    """Worker processes, one per rank; see the module docstring.

    Build it with :meth:`launch` (blocking: it waits for every rank's model to load).
    Attributes ``num_blocks`` (the smallest cache of the ranks), ``fingerprint`` and
    ``linear_kernel`` and ``compiled`` (rank 0's) come from the ranks' ``Ready``.
    """

    name = "multiproc"

    def __init__(
        self,
        ranks: Sequence[_Rank],
        *,
        step_log: StepLog,
        num_blocks: int,
        fingerprint: ModelFingerprint,
        workdir: str,
        linear_kernel: str = "mkl",
        compiled: bool = False,
    ) -> None:
        self._ranks = tuple(ranks)
        self.step_log = step_log
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint
        self.linear_kernel = linear_kernel
        self.compiled = compiled
        self.failure: WorkerDiedError | None = None
        self._workdir = workdir
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill, [r.proc for r in ranks], workdir)

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def pids(self) -> tuple[int, ...]:
        """The worker processes' ids, by rank."""
        return tuple(r.proc.pid for r in self._ranks)

    # ------------------------------------------------------------------- start

    @classmethod
    def launch(
        cls,
        config: EngineConfig,
        *,
        step_log: StepLog,
        worker_graph: str | None = None,
        connector_classes: tuple[str, str] | None = None,
    ) -> MultiprocExecutor:
        """Start ``config.world_size`` worker processes and wait until each is ready.

        Raises:
            InvalidConfigError: A bad device for the ranks.
            WorkerFailedError: A rank failed to start (its error is in the message) or
                did not become ready within ``START_TIMEOUT_S``; every rank is stopped.
        """
        devices = [rank_device(config.device, r) for r in range(config.world_size)]
        backend = "gloo" if devices[0] == "cpu" else "nccl"
        workdir, allreduce, slot = plan_workdir(config, backend)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        ranks: list[_Rank] = []
        try:
            for rank, device in enumerate(devices):
                mine, theirs = socket.socketpair()
                try:
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "pipeline.executors.remote_worker",
                            "--fd",
                            str(theirs.fileno()),
                        ],
                        pass_fds=(theirs.fileno(),),
                        stdin=subprocess.DEVNULL,
                        env=env,
                    )
                except BaseException:
                    mine.close()
                    raise
                finally:
                    theirs.close()
                ranks.append(_Rank(rank, proc, Channel(mine, peer=f"worker rank {rank}")))
                init = init_message(
                    config,
                    rank,
                    device=device,
                    backend=backend,
                    init_method=f"file://{workdir}/rendezvous",
                    worker_graph=worker_graph,
                    connector_classes=connector_classes,
                    shm_allreduce=allreduce,
                    shm_slot_bytes=slot,
                )
                ranks[-1].channel.send_sync(init)
            ready = [cls._await_ready(r) for r in ranks]
            release_shared_file(allreduce)  # every rank mapped it before its Ready
        except BaseException:
            _kill([r.proc for r in ranks], workdir)
            for r in ranks:
                r.channel.close()
            raise
        _log.info("workers_ready", world_size=config.world_size, pids=[r.pid for r in ready])
        return cls(
            ranks,
            step_log=step_log,
            num_blocks=min(r.num_blocks for r in ready),
            fingerprint=ready[0].fingerprint,
            workdir=workdir,
            linear_kernel=ready[0].linear_kernel,
            compiled=ready[0].compiled,
        )

    @staticmethod
    def _await_ready(rank: _Rank) -> wire.Ready:
        try:
            message = rank.channel.recv_sync(timeout_s=START_TIMEOUT_S, alive=rank.alive)
        except PeerGone as exc:
            code = rank.proc.poll()
            raise WorkerDiedError(
                rank.rank,
                -1,
                f"worker process exited while starting (exit code {code}): {exc}",
                exit_code=code,
            ) from exc
        return check_ready(rank.rank, message)

    # -------------------------------------------------------------------- step

    def submit(self, scheduler_output: SchedulerOutput) -> SubmittedStep:
        """Encode the step once; each rank's waiter sends it and awaits the reply."""
        encoded = encode_step_isolated(scheduler_output)  # a bad request fails alone
        frame = encoded.frame
        step_id = scheduler_output.step_id
        waiters: list[Callable[[], Awaitable[WorkerOutput]]] = [
            partial(self._rank_step, rank, frame, step_id) for rank in self._ranks
        ]
        return SubmittedStep(tuple(waiters), encoded.request_errors)

    async def _rank_step(self, rank: _Rank, frame: bytes, step_id: int) -> WorkerOutput:
        """One rank's step: send, then read replies until this step's.

        A reply of an earlier step (its waiter was cancelled at the fan-in deadline) is
        read and dropped here. Cancellation-safe: a cancelled read keeps its bytes.
        """
        if self.failure is not None:
            raise self._died(rank, step_id, f"the executor is dead: {self.failure.reason}")
        async with rank.lock:
            try:
                await rank.channel.send(frame)
                while True:
                    message = await rank.channel.recv(alive=rank.alive)
                    reply = settle_reply(rank.rank, step_id, message, self.step_log)
                    rank.metadata_bound = reply.metadata_bound
                    if isinstance(reply, wire.StepFailed) and reply.fatal:
                        raise self._died(rank, step_id, f"step failed: {reply.reason}")
                    if _step_of(reply) != step_id:
                        continue  # the late reply of a step cut at the fan-in deadline
                    if isinstance(reply, wire.StepFailed):
                        raise WorkerFailedError(
                            rank.rank, step_id, reply.reason, report=reply.report
                        )
                    return reply.output
            except PeerGone as exc:
                raise self._died(rank, step_id, str(exc)) from exc

    def _died(self, rank: _Rank, step_id: int, detail: str) -> WorkerDiedError:
        code = rank.proc.poll()
        if code is None:  # the socket broke first; give the exit status a moment
            try:
                code = rank.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                code = None
        how = "is gone" if code is None else f"exited with status {code}"
        error = WorkerDiedError(
            rank.rank, step_id, f"worker process {rank.proc.pid} {how} ({detail})", exit_code=code
        )
        if self.failure is None:
            self.failure = error
            _log.error("worker_died", rank=rank.rank, pid=rank.proc.pid, exit_code=code)
        return error

    def check_alive(self) -> WorkerDiedError | None:
        """Poll every process (cheap); the first death found becomes :attr:`failure`."""
        if self.failure is None:
            for rank in self._ranks:
                if not rank.alive():
                    self._died(rank, -1, "found dead between steps")
                    break
        return self.failure

    def bound_metadata(self) -> int:
        """Ranks whose connector metadata was still bound after their last step."""
        return sum(1 for r in self._ranks if r.metadata_bound)

    # ---------------------------------------------------------------- shutdown

    def kill(self) -> None:
        """Kill every worker now (no graceful stop); idempotent. For failure paths."""
        self._closed = True
        self._finalizer()
        for rank in self._ranks:
            rank.channel.close()

    async def shutdown(self) -> None:
        """Ask every rank to stop, wait ``STOP_GRACE_S``, then kill; idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for rank in self._ranks:
                if rank.alive() and not rank.lock.locked():
                    with contextlib.suppress(PeerGone):
                        await rank.channel.send(wire.Shutdown())
            deadline = time.monotonic() + STOP_GRACE_S
            while any(r.alive() for r in self._ranks) and time.monotonic() < deadline:
                await anyio.sleep(0.02)
            self._finalizer()  # kills what is left, removes the work directory
            for rank in self._ranks:
                rank.channel.close()
