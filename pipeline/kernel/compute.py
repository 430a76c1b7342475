"""Compute stages: synchronous work on a thread, fused with their neighbours into one hop.

A model step's compute-bound stages (the forward pass, the logits stages, sampling) run
on the model runner's compute thread. Handing work to a thread and back costs two thread
wake-ups (about 250 µs on a 2-vCPU machine, more than a small model's decode step), so
the plan fuses adjacent compute stages of one ``runs_on`` into one hand-over
(:class:`~pipeline.kernel.plan.Fused`): the graph stays what it prints, each stage keeps
its own timing and outcome in the step report, and a step costs one hop, not one per
stage. No stage reaches into another's work.

A compute stage subclasses :class:`ComputeStage` (or declares the same attributes)::

    @attrs.frozen
    class Scale(ComputeStage):
        name: ClassVar[str] = "scale"
        requires: ClassVar[tuple[type, ...]] = (ModelOutput,)
        provides: ClassVar[type] = Scaled

        def compute(self, ctx: StepContext) -> Scaled:   # on the compute thread
            return Scaled(ctx.get(ModelOutput).logits * 2)

A stage that owns the thread (``forward``) also defines ``hop(ctx, work)``; a fused block
hands ``work`` over with its first member's ``hop``.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from pipeline.kernel.context import StepContext

__all__ = ["ComputeStage", "Hop", "hop_of"]

T = TypeVar("T")

Hop = Callable[[StepContext, Callable[[], Any]], Awaitable[Any]]
"""``hop(ctx, work)``: run ``work()`` on the stage's thread; return (or raise) what it did."""


def hop_of(stage: object) -> Hop | None:
    """The stage's ``hop`` (a bound ``async`` method), or ``None`` when it has none."""
    hop = getattr(stage, "hop", None)
    return hop if callable(hop) else None


class ComputeStage(abc.ABC):
    """A stage whose work is the synchronous :meth:`compute`, run on the ``runs_on`` thread.

    Subclasses set ``name``, ``requires`` and ``provides`` (class attributes) and
    implement :meth:`compute`. Alone (no compute stage next to it), :meth:`run` hands
    ``compute`` over with the stage's ``hop`` when it defines one, else runs it on the
    event loop, blocking it meanwhile.

    Attributes:
        runs_on: The thread's name; stages of one ``runs_on`` fuse.
    """

    runs_on: ClassVar[str] = "compute"

    @abc.abstractmethod
    def compute(self, ctx: StepContext) -> Any:
        """This stage's work for one step (blocking); return its artifact.

        Runs on the compute thread with every required artifact in ``ctx``; must not
        touch the event loop (no awaits, no anyio calls).
        """

    async def run(self, ctx: StepContext) -> Any:
        """Run :meth:`compute` through the stage's ``hop`` (or here, without one)."""
        hop = hop_of(self)
        if hop is None:
            return self.compute(ctx)
        return await hop(ctx, lambda: self.compute(ctx))
