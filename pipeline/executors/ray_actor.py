"""The body of one rank's Ray actor (``ray.remote`` wraps it when the executor launches).

It runs the same worker code as a ``multiproc`` worker process
(:mod:`pipeline.executors.remote_worker`). Every method takes and returns the bytes of one
:mod:`pipeline.executors.wire` message and never raises: an exception would travel back pickled,
so failures come back as ``InitFailed`` / ``StepFailed`` messages.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from pipeline.config import EngineConfig
from pipeline.executors import wire
from pipeline.logger import get_logger

__all__ = ["RayWorkerActor"]

_log = get_logger()


class RayWorkerActor:
    """The body of one rank's actor (wrapped by ``ray.remote`` at launch).

    Every method takes and returns wire-message bytes and never raises.
    """

    def __init__(self) -> None:
        from pipeline.executors.remote_worker import Records

        self._records = Records()
        self._worker: Any = None
        self._timeout_s = 300.0
        self._metadata_types: dict[str, type] = {}

    def rendezvous(self) -> str:
        """``tcp://<this node's IP>:<a free port>`` for the group's rendezvous."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, data: bytes) -> bytes:
        """Decode the ``Init``, join the group, load the shard; ``Ready`` or ``InitFailed``."""
        from pipeline.executors.remote_worker import (
            bind_worker_context,
            connector_metadata_types,
            start,
        )

        rank = -1
        try:
            init = wire.decode(data)
            if not isinstance(init, wire.Init):
                raise TypeError(f"expected Init, got {type(init).__name__}")
            rank = init.rank
            bind_worker_context(init.rank)
            config = EngineConfig(**init.config)
            self._timeout_s = config.fan_in_timeout_s
            self._worker = start(init, self._records)
            self._metadata_types = connector_metadata_types(config.connector)
            runner = self._worker.runner
            return wire.encode(
                wire.Ready(
                    init.rank,
                    os.getpid(),
                    runner.num_blocks,
                    runner.fingerprint,
                    runner.linear_kernel,
                    runner.compiled,
                )
            )
        except Exception as exc:
            _log.error("worker_start_failed", error=repr(exc))
            return wire.encode(wire.InitFailed(rank, type(exc).__name__, str(exc)))

    async def step(self, data: bytes) -> bytes:
        """Run one ``Step``; ``StepDone`` or ``StepFailed`` (also for a frame that does not
        decode, or a reply that does not encode: see :mod:`pipeline.executors.remote_worker`)."""
        from pipeline.executors.remote_worker import answer

        if self._worker is None:
            return wire.encode(wire.StepFailed(-1, -1, "the worker is not started", None, []))
        result = await answer(
            self._worker, data, self._records, self._timeout_s, self._metadata_types
        )
        if result.reply is None:  # Shutdown through step(): not a step
            return wire.encode(
                wire.StepFailed(self._worker.rank, -1, "Shutdown sent as a step", None, [])
            )
        return result.reply

    async def shutdown(self) -> bytes:
        """Close the worker and leave the group; idempotent."""
        from stages.model.parallel import destroy_process_group

        try:
            if self._worker is not None:
                worker, self._worker = self._worker, None
                await worker.aclose()
            destroy_process_group()
        except Exception as exc:
            _log.error("worker_shutdown_failed", error=repr(exc))
        return wire.encode(wire.Shutdown())
