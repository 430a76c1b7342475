"""A CUDA graph's replay semantics on CPU, for testing code written to be captured.

:class:`RecordedReplay` "captures" a function by running it once under a
``TorchDispatchMode`` that records every aten op with its arguments, and "replays" it
by running the recorded ops again, without running any of the function's Python: as a
CUDA graph does, a replay reuses every Python value the capture saw (shapes, slice
bounds, scalars, which branch was taken) and reads only the current contents of the
tensors that existed before the capture (the fixed input buffers, the KV cache, the
weights). Tensors made during the capture are remade by the replay. A host sync
(``.item()``, ``.tolist()``), which a CUDA graph cannot capture, fails the capture.

If code meant for a graph lets a step's Python values reach the computation (a
context length as a slice bound, a per-step branch), its replay on the next step
computes with the capture step's values and differs from the eager result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_SYNCS = {torch.ops.aten._local_scalar_dense.default}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _SYNCS:
            raise RuntimeError(f"{func} syncs with the host: a CUDA graph cannot capture it")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedReplay:
    """A ``GraphCapture`` whose replays run the recorded aten ops (see the module)."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        recorder = _Recorder()
        with recorder:
            out = fn()
        ops = recorder.ops

        def replay() -> torch.Tensor:
            made: dict[int, torch.Tensor] = {}  # id of a captured tensor -> its remake

            def remake(x: Any) -> Any:
                return made.get(id(x), x) if isinstance(x, torch.Tensor) else x

            for func, args, kwargs, old in ops:
                new = func(*tree_map(remake, args), **tree_map(remake, kwargs))
                for o, n in zip(tree_flatten(old)[0], tree_flatten(new)[0], strict=True):
                    if isinstance(o, torch.Tensor):
                        made[id(o)] = n
            self.replays += 1
            result: torch.Tensor = remake(out)
            return result

        return replay
