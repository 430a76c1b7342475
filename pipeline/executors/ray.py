"""``ray``: one Ray actor per rank, tensor-parallel over torch.distributed inside them.

For more than one machine. The ranks are placed by a Ray placement group (one bundle
per rank: a CPU, or a GPU on CUDA) on whatever nodes the cluster offers, packed by
default (``EngineConfig.ray_placement_strategy``: ``"STRICT_SPREAD"`` puts every rank on
a node of its own); rank 0's actor
names the rendezvous address (its node's IP and a free port) and every rank joins the
``torch.distributed`` group there (gloo on CPU, NCCL on CUDA), exactly as the
``multiproc`` workers do. Each actor runs the same worker code as a worker process
(:mod:`pipeline.executors.remote_worker`).

Nothing is pickled: every actor call takes and returns ``bytes`` holding one
:mod:`pipeline.executors.wire` message, which Ray carries as raw binary (its serializer does not
pickle ``bytes``), and the actor methods never raise (an exception would travel
pickled): failures come back as ``InitFailed`` / ``StepFailed`` messages. Fan-in awaits
each rank's object ref. Ray ships the actor *class* itself as code, the way it ships
any remote function.

The extra ``kvstep[ray]`` installs Ray. Without a running Ray, :meth:`RayExecutor.launch`
calls ``ray.init()`` (a local cluster, or the one ``RAY_ADDRESS`` names).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import attrs

from connectors.base import ModelFingerprint
from pipeline.artifacts import SchedulerOutput, WorkerOutput
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError, WorkerDiedError, WorkerFailedError
from pipeline.executors import wire
from pipeline.executors.ray_actor import RayWorkerActor
from pipeline.executors.remote import check_ready, init_message, settle_reply
from pipeline.executors.wire_checks import encode_step_isolated
from pipeline.logger import get_logger
from pipeline.steplog import StepLog
from stages.execute import SubmittedStep

__all__ = ["RayExecutor"]

_log = get_logger()
START_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise InvalidConfigError(
            "executor", "ray", "needs Ray: install the extra with pip install 'kvstep[ray]'"
        ) from exc
    return ray


@attrs.define(eq=False)
class _Actor:
    rank: int
    handle: Any
    metadata_bound: bool = False


class RayExecutor:
    """Ray actors, one per rank; see the module docstring. Build it with :meth:`launch`."""

    name = "ray"

    def __init__(
        self,
        actors: Sequence[_Actor],
        *,
        placement_group: Any,
        step_log: StepLog,
        num_blocks: int,
        fingerprint: ModelFingerprint,
        linear_kernel: str = "mkl",
        compiled: bool = False,
    ) -> None:
        self._actors = tuple(actors)
        self._placement_group = placement_group
        self.step_log = step_log
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint
        self.linear_kernel = linear_kernel
        self.compiled = compiled
        self.failure: WorkerDiedError | None = None
        self._closed = False

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @classmethod
    def launch(
        cls,
        config: EngineConfig,
        *,
        step_log: StepLog,
        worker_graph: str | None = None,
        connector_classes: tuple[str, str] | None = None,
    ) -> RayExecutor:
        """Place ``config.world_size`` actors, start them, wait until each is ready.

        Raises:
            InvalidConfigError: Ray is not installed, or the cluster cannot place the ranks
                within ``START_TIMEOUT_S``.
            WorkerFailedError: A rank failed to start; every actor is removed.
        """
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(log_to_driver=True)
        cuda = config.device.startswith("cuda")
        bundle = {"CPU": 1.0, "GPU": 1.0} if cuda else {"CPU": 1.0}
        group = placement_group(
            [dict(bundle) for _ in range(config.world_size)],
            strategy=config.ray_placement_strategy,
        )
        ready_ref = group.ready()
        done, _ = ray.wait([ready_ref], timeout=START_TIMEOUT_S)
        if not done:
            remove_placement_group(group)
            raise InvalidConfigError(
                "world_size",
                config.world_size,
                f"the Ray cluster could not place {config.world_size} ranks of {bundle} "
                f"within {START_TIMEOUT_S}s ({ray.cluster_resources()} in the cluster)",
            )
        remote_cls = ray.remote(RayWorkerActor)
        actors: list[_Actor] = []
        try:
            for rank in range(config.world_size):
                handle = remote_cls.options(
                    num_cpus=1,
                    num_gpus=1 if cuda else 0,
                    max_concurrency=1,  # steps run one at a time, in submission order
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=rank
                    ),
                ).remote()
                actors.append(_Actor(rank, handle))
            address = ray.get(actors[0].handle.rendezvous.remote(), timeout=START_TIMEOUT_S)
            refs = [
                a.handle.start.remote(
                    wire.encode(
                        init_message(
                            config,
                            a.rank,
                            device="cuda:0" if cuda else "cpu",  # Ray gives each one GPU
                            backend="nccl" if cuda else "gloo",
                            init_method=address,
                            worker_graph=worker_graph,
                            connector_classes=connector_classes,
                        )
                    )
                )
                for a in actors
            ]
            replies = zip(actors, ray.get(refs, timeout=START_TIMEOUT_S), strict=True)
            ready = [check_ready(a.rank, wire.decode(data)) for a, data in replies]
        except BaseException:
            for actor in actors:
                ray.kill(actor.handle)
            remove_placement_group(group)
            raise
        _log.info("workers_ready", executor="ray", world_size=config.world_size)
        return cls(
            actors,
            placement_group=group,
            step_log=step_log,
            num_blocks=min(r.num_blocks for r in ready),
            fingerprint=ready[0].fingerprint,
            linear_kernel=ready[0].linear_kernel,
            compiled=ready[0].compiled,
        )

    # -------------------------------------------------------------------- step

    def submit(self, scheduler_output: SchedulerOutput) -> SubmittedStep:
        """Encode the step once; each waiter calls its actor and awaits the object ref."""
        encoded = encode_step_isolated(scheduler_output)  # a bad request fails alone
        data = encoded.frame
        step_id = scheduler_output.step_id
        waiters: list[Callable[[], Awaitable[WorkerOutput]]] = [
            partial(self._rank_step, actor, data, step_id) for actor in self._actors
        ]
        return SubmittedStep(tuple(waiters), encoded.request_errors)

    async def _rank_step(self, actor: _Actor, data: bytes, step_id: int) -> WorkerOutput:
        ray = _import_ray()
        if self.failure is not None:
            raise WorkerDiedError(actor.rank, step_id, f"the executor is dead: {self.failure}")
        ref = actor.handle.step.remote(data)
        try:
            raw = await _await_ref(ray, ref)
        except ray.exceptions.RayActorError as exc:
            error = WorkerDiedError(actor.rank, step_id, f"Ray actor is gone ({exc})")
            if self.failure is None:
                self.failure = error
                _log.error("worker_died", executor="ray", rank=actor.rank)
            raise error from exc
        reply = settle_reply(actor.rank, step_id, wire.decode(raw), self.step_log)
        actor.metadata_bound = reply.metadata_bound
        if isinstance(reply, wire.StepDone):
            return reply.output
        if reply.fatal:
            reason = f"tensor-parallel step broken: {reply.reason}"
            error = WorkerDiedError(actor.rank, step_id, reason)
            if self.failure is None:
                self.failure = error
            raise error
        raise WorkerFailedError(actor.rank, step_id, reply.reason, report=reply.report)

    def check_alive(self) -> WorkerDiedError | None:
        """The first death a step noticed (Ray reports a dead actor on its next call)."""
        return self.failure

    def bound_metadata(self) -> int:
        """Ranks whose connector metadata was still bound after their last step."""
        return sum(1 for a in self._actors if a.metadata_bound)

    # ---------------------------------------------------------------- shutdown

    def kill(self) -> None:
        """Remove every actor and the placement group now; idempotent."""
        if self._placement_group is None:
            return
        ray = _import_ray()
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        for actor in self._actors:
            try:
                ray.kill(actor.handle)
            except Exception as exc:  # already gone
                _log.debug("ray_kill_failed", rank=actor.rank, error=repr(exc))
        group, self._placement_group = self._placement_group, None
        remove_placement_group(group)

    async def shutdown(self) -> None:
        """Close each actor's worker (``STOP_GRACE_S``), then remove them; idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = _import_ray()
        refs = [a.handle.shutdown.remote() for a in self._actors]
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(
                lambda: ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
            )
        self.kill()


async def _await_ref(ray: Any, ref: Any) -> bytes:
    """Await an object ref under asyncio (natively) or trio (on a worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio: no asyncio loop in this thread
        pass
    else:
        result: bytes = await asyncio.wrap_future(ref.future())
        return result
    return await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)
