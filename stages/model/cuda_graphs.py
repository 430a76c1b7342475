"""Decode steps replayed from CUDA graphs, one graph per padded batch shape.

On a GPU a small model's decode step is bound by kernel launches, not by the kernels:
each layer launches a dozen of them, and the Python that launches them costs more than
their work. :class:`DecodeGraphs` captures the whole decoder (embedding, every layer's
attention and MLP, the final norm) once per shape and replays it, one launch per step.
``lm_head`` stays outside the graph: a ``[batch, vocab]`` output per captured shape
would hold gigabytes for a large vocabulary, and it is one kernel.

A shape is a padded batch size (:func:`capture_sizes`: 1, 2, 4, 8, then multiples of 8)
and a padded block-table width (the next power of two, up to the longest context's),
so a server sees a few dozen shapes at most; each is captured the first time a step
needs it. A step of more requests than the largest size runs eagerly.

Inside the graph every input is a fixed tensor: the step's token ids, positions,
context lengths, slots, block tables (and a ``longrope`` model's rotary-table rows,
:class:`~stages.model.rope.LongRope`) are written into one pinned host buffer and
copied to the graph's device buffer in one transfer
(:class:`~stages.model.decode_inputs.DecodeBuffers`, as the eager decode steps do).
Decode attention takes the padded, masked path of
:func:`~stages.model.attention.paged_attention` (the keys of the padded width,
masked by each request's context length, computed on the device inside the graph); the
eager path instead slices the keys to the exact context when every request shares it,
so the two agree to rounding, not bit for bit. Padding rows repeat row 0's inputs: they
compute row 0's key and value again and write them to row 0's slot, the same values, so
no other request's cache is touched and no slot needs reserving.

The graphs bake in the model's parameter tensors: assigning a parameter anywhere in the
process (which :mod:`stages.model.layers` counts) drops them, and the next steps
capture again. Filling a parameter in place needs nothing.

On CPU the tests capture with a recorder of the function's tensor ops whose replay runs
those ops again and no Python, as a graph's does, and check it against the eager path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from pipeline.artifacts import ScheduledRequest
from pipeline.errors import InvalidConfigError
from stages.model.decode_inputs import DecodeBuffers
from stages.model.layers import assignments
from stages.model.model import CausalLM

__all__ = [
    "CudaGraphCapture",
    "DecodeGraphs",
    "GraphCapture",
    "capture_sizes",
    "graph_capture",
    "padded_width",
]


_Replay = Callable[[], torch.Tensor]


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """The padded batch sizes captured for steps of at most ``max_batch`` requests."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    return (*sizes, *range(8, max_batch + 8, 8)) if max_batch > 4 else (*sizes, max_batch)


def padded_width(blocks: int, max_blocks: int) -> int:
    """The block-table width of a step whose longest context needs ``blocks`` blocks."""
    return min(1 << (blocks - 1).bit_length(), max_blocks)


class GraphCapture(Protocol):
    """Turns a function of fixed tensors into a replay of it."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Return a function that recomputes ``fn``'s output tensor in place."""
        ...


class CudaGraphCapture:
    """Captures into ``torch.cuda.CUDAGraph``\\ s that share one memory pool.

    The graphs replay one at a time on the forward pass's stream, so what one leaves in
    the pool the next may reuse; each graph's output tensor stays its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm up outside the capture (cuBLAS workspaces, lazily loaded kernels) on a
        # side stream, as capturing requires; it computes what the replay will.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's other threads may use CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def graph_capture(device: torch.device) -> GraphCapture:
    """How the runner on ``device`` captures its decode graphs.

    Raises:
        InvalidConfigError: ``device`` is not a CUDA device.
    """
    if device.type != "cuda":
        raise InvalidConfigError(
            "cuda_graphs", True, f"needs a CUDA device; the model is on {device}"
        )
    return CudaGraphCapture(device)


class DecodeGraphs:
    """Runs decode-only steps of one runner's model through captured graphs.

    Args:
        model: The runner's model (one rank holding the whole model).
        kv_caches: The runner's cache tensors (the graphs write into them).
        block_size: Tokens per KV block.
        max_batch: Most requests of one step (``max_num_seqs``).
        max_blocks: Blocks of the longest context (``max_model_len / block_size``).
        capture: How graphs are made; ``None``: :func:`graph_capture` of the model's
            device (CUDA only).

    Not thread-safe: one step at a time, on the runner's compute thread.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: Sequence[torch.Tensor],
        *,
        block_size: int,
        max_batch: int,
        max_blocks: int,
        capture: GraphCapture | None = None,
    ) -> None:
        self.device = kv_caches[0].device
        self._capture = capture or graph_capture(self.device)
        self.model = model
        self.kv_caches = tuple(kv_caches)
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks
        self._shapes: dict[tuple[int, int], tuple[DecodeBuffers, _Replay]] = {}
        self._assignments = assignments()
        self.captures = 0  # graphs captured (a shape dropped and captured again: twice)

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The ``(batch, width)`` shapes captured now."""
        return tuple(self._shapes)

    def hidden(
        self, requests: Sequence[ScheduledRequest], tables: Mapping[str, Sequence[int]]
    ) -> torch.Tensor | None:
        """The final-norm hidden states ``[n, hidden]`` of a decode-only step, or ``None``.

        Every request must have one new token and a block table that covers it (as
        :meth:`~stages.model.inputs.RequestStates.update` checked). ``None`` when the
        step has more requests than the largest captured size (run it eagerly). Writes
        the new keys and values into the cache, as the eager forward pass does. The
        tensor is the graph's output: valid until the next step of its shape.
        """
        n = len(requests)
        batch = next((s for s in self.sizes if s >= n), None)
        if batch is None or n == 0:
            return None
        if self._assignments != assignments():  # a parameter was replaced: recapture
            self._shapes.clear()
            self._assignments = assignments()
        blocks = max(r.num_computed_tokens for r in requests) // self.block_size + 1
        key = (batch, padded_width(blocks, self.max_blocks))
        shape = self._shapes.get(key)
        buf = (DecodeBuffers(*key, self.block_size, self.device, self.model.rotary.long_rope)
               if shape is None else shape[0])  # fmt: skip
        buf.fill(requests, tables)  # before a capture too: its warm-up computes this step
        if shape is None:

            def forward() -> torch.Tensor:  # tensor ops on fixed tensors only
                rows = buf.rope_rows  # the positions, or longrope's table rows
                return self.model(buf.ids, rows, buf.metadata(None), self.kv_caches, None)

            shape = self._shapes[key] = (buf, self._capture.capture(forward))
            self.captures += 1
        return shape[1]()[:n]
