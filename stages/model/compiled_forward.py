"""The forward pass compiled by ``torch.compile`` (inductor) on a CPU.

Eager CPU torch pays a dispatch for every small op of a decoder layer (norms, rotary,
residual adds, SiLU and product, splits and views: ~45 per layer), which at a decode
step's few rows costs as much as the GEMMs. Compiled, inductor fuses those ops into a
few generated C++ loops; what stays opaque is called as it is:

- the paged attention, the KV writes and the connector hooks of each layer, as one
  custom op (``kvstep::paged_attention``) that reads the step's metadata, caches and
  hooks from :class:`CompiledForward`'s thread-local step (what a graph cannot take as
  input: Python ints that change every step, connector callbacks);
- a projection prepacked by oneDNN (``kvstep::onednn_linear``), which inductor's own
  oneDNN lowering only accepts for weights it packed itself.

Two graphs (``dynamic=True``: one for a single row, which dynamo specialises, one for
any other number of tokens), both compiled at load by :meth:`CompiledForward.warm_up`
so that no request waits for them; each model has a code object of its own (dynamo
counts its recompilations per code object) and no guards on its frozen modules. Only
where every op is one of these: one rank on a CPU, dense layers (no mixture of
experts), no sliding-window layers and no LoRA; anything else runs eagerly, and
:func:`ineligible` says why. bfloat16 intermediates are rounded where the eager pass
rounds them (``emulate_precision_casts``): compiled greedy tokens are transformers' on
the oracle tests, in float32 and bfloat16, though logits may differ in the last bits.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import torch

from pipeline.logger import get_logger
from stages.model.attention import AttentionMetadata
from stages.model.layers import LayerHooks, hooked_attention
from stages.model.model import CausalLM
from stages.model.parallel import TensorParallel

__all__ = ["CompiledForward", "compiled_or_eager", "ineligible"]

log = get_logger()

_LIB: Final = torch.library.Library("kvstep", "DEF")
_LIB.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
    "bool compiled) -> Tensor"
)
_LIB.define("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


@attrs.frozen
class _Step:
    """What the attention op of a compiled pass reads: the step's metadata, this rank's
    caches and the connector hooks; ``meta=None``: a warm-up pass (no cache touched)."""

    meta: AttentionMetadata | None
    kv_caches: Sequence[torch.Tensor]
    hooks: LayerHooks | None


class _Current(threading.local):
    step: _Step | None = None
    calls = 0  # attention ops run in the current pass (none: torch ran it eagerly)


_CURRENT: Final = _Current()


def _paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    compiled: bool,
) -> torch.Tensor:
    step = _CURRENT.step
    if step is None:
        raise RuntimeError("kvstep::paged_attention runs only inside CompiledForward")
    _CURRENT.calls += compiled  # traced: True is in the graph; False where torch ran eagerly
    if step.meta is None:  # warm-up: the shapes only
        return torch.zeros_like(query)
    cache = step.kv_caches[layer]
    return hooked_attention(query, key, value, cache, step.meta, scale, layer, step.hooks)


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


# CompositeExplicitAutograd: a packed weight is an MkldnnCPU tensor, the activations CPU.
_LIB.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
_LIB.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("kvstep::paged_attention", lib=_LIB)
def _paged_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    compiled: bool,
) -> torch.Tensor:
    return torch.empty_like(query)


@torch.library.register_fake("kvstep::onednn_linear", lib=_LIB)
def _onednn_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def ineligible(model: CausalLM, device: torch.device, tp: TensorParallel, lora: bool) -> str | None:
    """Why ``model``'s pass cannot be compiled here, or ``None`` when it can."""
    config = model.config
    if device.type != "cpu":
        return f"compiles on a CPU only, the model is on {device} (CUDA has cuda_graphs)"
    if tp.sharded:
        return f"one rank only, not tensor parallel size {tp.size}"
    if config.sparse_layers:
        return f"{config.architecture}: mixture-of-experts layers run eagerly"
    if config.sliding_layers:
        return f"{config.architecture}: sliding-window layers run eagerly"
    if lora:
        return "LoRA adapters run eagerly"
    return None


_INDUCTOR: Final[dict[str, str | int | bool | Callable[..., Any]]] = {
    "emulate_precision_casts": True,
    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    "size_asserts": False,
}
"""Round where the eager pass rounds: a bfloat16 intermediate is rounded to bfloat16
even inside a fused loop (inductor otherwise keeps it in float32), so compiled greedy
tokens stay transformers' bfloat16 ones. No size asserts: the generated code would
check the size and strides of every input and of every custom op's result in every
pass (111 checks a decode pass of an 8-layer Llama, ~0.5 us each); dynamo's guards
already check the inputs, and the ops' results are the fake implementations' shapes."""


def _own_forward(model: CausalLM) -> Callable[..., torch.Tensor]:
    """``model.forward`` with a code object of its own: dynamo keeps its graphs (and
    counts recompilations against a limit of 8) per code object, so the models of one
    process (a draft beside its target, several runners) would share one cache, and
    the ninth graph of the process would run eagerly."""
    function = type(model).forward
    code = function.__code__.replace()  # a copy
    own = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    return types.MethodType(own, model)


class CompiledForward:
    """``model.forward`` compiled by inductor; called as the model is.

    Args:
        model: A loaded model that :func:`ineligible` accepts.

    Attributes:
        active: Whether passes run compiled; ``False`` once torch ran one eagerly
            instead (dynamo's recompile limit reached by other models of the process,
            or a graph it would not build): the model's own forward then runs, after
            one ``torch_compile_fallback`` warning.
        passes: Passes run through the compiled graph.

    Not thread-safe (one pass at a time, as the model); the step it reads is
    thread-local, so it is set and read on the thread that runs the pass.
    """

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._no_caches = (None,) * len(model.model.layers)  # the op reads the step's
        self.active = True
        self.passes = 0
        self._compiled: Callable[..., torch.Tensor] = torch.compile(
            _own_forward(model), dynamic=True, options=_INDUCTOR
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """:meth:`CausalLM.forward`, compiled (same arguments, same result)."""
        if not self.active:
            return self.model(input_ids, positions, attn_meta, kv_caches, hooks)
        return self._run(input_ids, positions, _Step(attn_meta, kv_caches, hooks))

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, step: _Step) -> torch.Tensor:
        _CURRENT.step, _CURRENT.calls = step, 0
        try:
            # No metadata, caches or hooks in the graph (their guards would cost every
            # call): the attention op reads them, compiled or run eagerly by torch.
            out = self._compiled(input_ids, positions, None, self._no_caches, None)
            compiled = _CURRENT.calls > 0
        finally:
            _CURRENT.step = None
        if compiled:
            self.passes += 1
        else:
            self.active = False
            log.warning("torch_compile_fallback", forward="eager",
                        reason="torch ran the compiled pass eagerly (dynamo's recompile "
                        "limit, or a graph it would not build)")  # fmt: skip
        return out

    def warm_up(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Compile the graphs of one row and of several (inductor specialises one),
        without touching ``kv_caches``. Raises what compilation raises (no C++
        compiler, an op inductor cannot lower)."""
        device = self.model.model.embed_tokens.weight.device
        # The model's float attributes (norm epsilons, attention scales) as constants of
        # the graphs: by default dynamo makes each a graph input, wrapped in a tensor by
        # the code before every call (25 for an 8-layer Llama: 60-80 us a pass).
        with torch._dynamo.config.patch(specialize_float=True):
            for rows in (1, 2):
                # Made outside inference mode, as the runner's inputs are (a guard checks).
                ids = torch.zeros(rows, dtype=torch.long, device=device)
                positions = torch.arange(rows, device=device)
                with torch.inference_mode():
                    self._run(ids, positions, _Step(None, kv_caches, None))


def compiled_or_eager(
    model: CausalLM, kv_caches: Sequence[torch.Tensor], tp: TensorParallel, lora: bool
) -> CausalLM | CompiledForward:
    """``model``'s pass compiled and warmed up, or ``model`` itself (eager) where it
    cannot be compiled, with one warning saying why (``torch_compile_fallback``)."""
    reason = ineligible(model, kv_caches[0].device, tp, lora)
    if reason is None:
        compiled = CompiledForward(model)
        start = time.perf_counter()
        try:
            compiled.warm_up(kv_caches)
        except Exception as exc:  # no C++ compiler, an op inductor cannot lower, ...
            reason = f"compilation failed: {type(exc).__name__}: {exc}"
        else:
            log.info("torch_compiled", seconds=round(time.perf_counter() - start, 3))
            return compiled
    log.warning("torch_compile_fallback", reason=reason, forward="eager")
    return model
