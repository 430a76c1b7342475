"""``ModelRunner``: the worker-side object the forward and sample stages call.

It owns the model (possibly shared with other in-process ranks, or this rank's
tensor-parallel shard of it), this rank's paged KV cache, the per-request block tables
and the sampler. Its calls are synchronous and
block the calling thread for the whole forward pass: stages run them in a worker thread
so the event loop stays responsive. One call at a time (not thread-safe).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import attrs
import torch

from connectors.base import ForwardContext, KVConnectorWorker, ModelFingerprint
from pipeline.artifacts import ModelOutput, SampledTokens, SchedulerOutput
from pipeline.device_sync import DeviceSync, make_device_sync
from pipeline.errors import StageError
from pipeline.logits import Logits
from stages.model.attention import AttentionMetadata
from stages.model.compiled_forward import CompiledForward, compiled_or_eager
from stages.model.compute_thread import Compute, make_compute
from stages.model.config import ModelConfig
from stages.model.connector_hooks import ConnectorHooks
from stages.model.cuda_graphs import DecodeGraphs
from stages.model.decode_mirror import DecodeMirror
from stages.model.inputs import RequestStates
from stages.model.kv_cache import allocate_kv_caches, local_kv_heads
from stages.model.lora import LoRASlots, lora_step
from stages.model.model import CausalLM
from stages.model.parallel import TensorParallel
from stages.model.runner_parts import (
    RunnerParts,
    SharedWeights,
    load_parts,
    resolve_device,
    resolve_dtype,
)
from stages.model.settings import RunnerSettings
from stages.model.step_sampler import StepSampler

__all__ = ["ModelRunner", "resolve_device", "resolve_dtype"]


def _compute(settings: RunnerSettings, rank: int) -> Compute:
    """Rank ``rank``'s compute thread (or :class:`InlineCompute`), as ``settings`` ask."""
    inline, below_s = settings.inline_forward, settings.inline_forward_below_s
    return make_compute(f"kvstep-compute-r{rank}", inline=inline, inline_below_s=below_s)


class ModelRunner:
    """Runs the model over one step's batch and samples from its logits.

    Build it with :meth:`load`. Attributes ``settings``, ``model_config``, ``device``,
    ``dtype``, ``block_size``, ``num_blocks``, ``kv_caches``, ``fingerprint``, ``tp``
    (how the model is sharded: ``TensorParallel()`` for a whole model) and
    ``linear_kernel`` (what the projections run on, :mod:`stages.model.linear_kernels`)
    are read-only.
    """

    def __init__(
        self, parts: RunnerParts, *, compute: Compute | None = None, owns_compute: bool = True
    ) -> None:
        settings, loaded, tp = parts.settings, parts.loaded, parts.tp
        self.compute = compute or _compute(settings, parts.rank)
        self._owns_compute = owns_compute or compute is None
        self.settings = settings
        self._loaded = loaded
        self.model: CausalLM = loaded.model
        self.model_config: ModelConfig = loaded.config
        self.linear_kernel: str = loaded.linear_kernel
        self.device = parts.device
        self.dtype = parts.dtype
        self.block_size = settings.block_size
        self.num_blocks = parts.num_blocks
        self.max_model_len = settings.max_model_len
        self.rank = parts.rank
        self.world_size = settings.world_size
        self.tp = tp
        self.kv_caches: list[torch.Tensor] = allocate_kv_caches(
            loaded.config,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            dtype=self.dtype,
            device=self.device,
            tp_size=tp.size,
        )
        self.fingerprint = ModelFingerprint(
            architecture=loaded.config.architecture,
            weights_id=loaded.weights_id,
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.block_size,
            tp_rank=self.rank,
            tp_size=self.world_size,
            kv_heads=local_kv_heads(loaded.config, tp.size),
            layer_pattern=loaded.config.layer_pattern,
        )
        self.device_sync: DeviceSync = make_device_sync(self.device)
        self._states = RequestStates(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            vocab_size=loaded.config.vocab_size,
            long_rope=self.model.rotary.long_rope,
        )
        self._sampling = StepSampler(
            seed=settings.seed, device=self.device, eos_token_id=loaded.config.eos_token_id
        )
        self._graphs = (
            DecodeGraphs(
                self.model,
                self.kv_caches,
                block_size=self.block_size,
                max_batch=settings.max_num_seqs,
                max_blocks=-(-self.max_model_len // self.block_size),
                capture=parts.graph_capture,
            )
            if parts.graph_capture is not None
            else None
        )
        self._mirror: DecodeMirror | None = None
        if settings.decode_mirror and self.device.type == "cpu" and self._graphs is None:
            kv = self.kv_caches[0]
            budget = settings.decode_mirror_memory_bytes
            if budget is None:  # as much as the paged cache itself
                budget = sum(c.numel() * c.element_size() for c in self.kv_caches)
            self._mirror = DecodeMirror(
                num_layers=len(self.kv_caches),
                kv_heads=kv.shape[-2],
                head_dim=kv.shape[-1],
                block_size=self.block_size,
                dtype=kv.dtype,
                device=self.device,
                budget_bytes=budget,
            )
        self._lora: LoRASlots | None = None
        if settings.enable_lora:
            self._lora = LoRASlots(
                loaded.config,
                tp,
                max_loras=settings.max_loras,
                max_rank=settings.max_lora_rank,
                dtype=self.dtype,
                device=self.device,
            )
            self._lora.attach(self.model)
        self._forward: CausalLM | CompiledForward = self.model
        if settings.torch_compile:
            self._forward = compiled_or_eager(self.model, self.kv_caches, tp, settings.enable_lora)
        self._closed = False

    @classmethod
    def load(
        cls,
        settings: RunnerSettings | str,
        *,
        rank: int = 0,
        shared_model: ModelRunner | None = None,
        tp: TensorParallel | None = None,
        compute: Compute | None = None,
        **options: Any,
    ) -> ModelRunner:
        """Load ``settings.model`` as rank ``rank`` and allocate its KV cache.

        ``settings`` is what the engine passes (one :class:`RunnerSettings` for every rank,
        built once from ``EngineConfig``), or a model path (a local HF directory or
        ``"builtin:tiny"``) with the settings' other fields as ``options`` and its
        defaults for the rest: ``ModelRunner.load(path, device="cpu", num_blocks=8)``.

        Arguments, errors and blocking are those of
        :func:`~stages.model.runner_parts.load_parts` (``shared_model`` is a runner
        here); the loading and the cache allocation run on the new runner's compute
        thread, which then runs every forward pass and sample (with
        ``settings.inline_forward``: on the calling thread, and the passes on the thread
        that awaits the forward stage, the event loop's). ``compute``: run on that
        existing compute thread instead of a new one (another runner's: CPU torch work
        on a second thread of a process slows the first thread's ops, see
        :mod:`~stages.model.compute_thread`); the runner then does not close it.

        Raises:
            InvalidConfigError: A bad option (see :class:`RunnerSettings`) or argument.
            TypeError: An option :class:`RunnerSettings` does not have, or options next
                to built settings.
        """
        if isinstance(settings, str):
            settings = RunnerSettings(model=settings, **options)
        elif options:
            raise TypeError(f"options {sorted(options)} belong in the RunnerSettings")
        shared = None if shared_model is None else shared_model._shared_weights()
        owned = compute is None
        run_on = _compute(settings, rank) if compute is None else compute

        def build() -> ModelRunner:
            parts = load_parts(settings, rank=rank, shared_model=shared, tp=tp)
            return cls(parts, compute=run_on, owns_compute=owned)

        try:
            return run_on.call(build)
        except BaseException:
            if owned:
                run_on.close()
            raise

    def _shared_weights(self) -> SharedWeights:
        """What this runner offers to a runner built with ``shared_model=self``."""
        return SharedWeights(
            loaded=self._loaded,
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            sharded=self.tp.sharded,
            closed=self._closed,
        )

    def forward_context(self, scheduler_output: SchedulerOutput) -> ForwardContext:
        """The context the connector hooks see for this step (cheap; no copies)."""
        return ForwardContext(
            step_id=scheduler_output.step_id,
            rank=self.rank,
            kv_caches=self.kv_caches,
            scheduler_output=scheduler_output,
        )

    def execute(
        self, scheduler_output: SchedulerOutput, connector: KVConnectorWorker | None = None
    ) -> ModelOutput:
        """Run the forward pass of one step.

        Drops ``finished_req_ids``, applies the scheduled block ids, then runs the model;
        with a ``connector``, calls ``wait_for_layer_load(i)`` before layer ``i``'s
        attention and ``save_kv_layer(i, kv_caches[i], ctx)`` after it (a raising
        ``save_kv_layer`` ends the pass's saves, not the pass: ``ModelOutput.save_error``,
        see :class:`~stages.model.connector_hooks.ConnectorHooks`). Without one, and
        with ``settings.cuda_graphs``, a decode-only step replays a captured graph
        (:attr:`decode_graphs`).

        Returns:
            Float32 logits of the requests whose ``sample`` is set, in batch order,
            and of the prompt positions whose logprobs a request asked for
            (``prompt_logits``; computed in the same ``lm_head`` call). An empty step
            returns ``req_ids=()`` and a ``[0, vocab]`` tensor without
            running the model.

        Raises:
            InvalidRequestError: A scheduled request is inconsistent (see
                :meth:`RequestStates.update`); the per-request state is left unchanged.
            StageError: The runner is closed.

        Blocks the calling thread; not thread-safe; not cancellable once started.
        """
        if self._closed:
            raise StageError("forward", scheduler_output.step_id, "the model runner is closed")
        self._states.drop(scheduler_output.finished_req_ids)
        self._sampling.drop(scheduler_output.finished_req_ids)
        if self._mirror is not None:
            self._mirror.drop(scheduler_output.finished_req_ids)
        if scheduler_output.is_empty:
            empty = torch.empty(0, self.model_config.vocab_size, device=self.device)
            return ModelOutput(req_ids=(), logits=empty, num_tokens=0)
        self._states.update(scheduler_output)
        self._sampling.track(scheduler_output)
        lora = None if self._lora is None else self._lora.step(scheduler_output.requests)
        if self._graphs is not None and connector is None and lora is None:
            output = self._replay(scheduler_output)
            if output is not None:
                return output
        batch = self._states.prepare(scheduler_output, self.device)
        meta = batch.attn_meta
        if self._mirror is not None:
            meta = self._mirrored(scheduler_output, meta)
        hooks = None
        if connector is not None:
            hooks = ConnectorHooks(
                connector, self.kv_caches, self.forward_context(scheduler_output)
            )
        adapters = nullcontext() if lora is None else lora_step(lora)  # none: nothing to set
        with torch.inference_mode(), self.device_sync.compute_stream(), adapters:
            rope_rows = meta.positions if batch.rope_rows is None else batch.rope_rows
            try:
                hidden = self._forward(batch.input_ids, rope_rows, meta, self.kv_caches, hooks)
            except BaseException:
                if self._mirror is not None:  # some layers' slots may lack the step's token
                    self._mirror.clear()
                raise
            parts = [r for r in (batch.sample_rows, batch.prompt_rows, batch.draft_rows)
                     if r is not None]  # fmt: skip
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)  # one lm_head (a collective)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        n = len(batch.sample_req_ids)
        p = n + (0 if batch.prompt_rows is None else len(batch.prompt_rows))
        return ModelOutput(
            req_ids=batch.sample_req_ids,
            logits=logits if len(parts) == 1 else logits[:n],
            num_tokens=meta.num_tokens,
            prompt_req_ids=batch.prompt_req_ids,
            prompt_logits=None if batch.prompt_rows is None else logits[n:p],
            draft_req_ids=batch.draft_req_ids,
            draft_logits=None if batch.draft_rows is None else logits[p:],
            save_error=None if hooks is None else hooks.save_error,
        )

    def _mirrored(
        self, scheduler_output: SchedulerOutput, meta: AttentionMetadata
    ) -> AttentionMetadata:
        """``meta`` whose decode batch attends over the mirror (when it fits its budget)."""
        assert self._mirror is not None
        requests = scheduler_output.requests
        self._mirror.observe(requests)
        if meta.decode is None:
            return meta
        decode = [r for r in requests if r.num_scheduled_tokens == 1]
        step = self._mirror.step(decode, self._states.tables, meta.decode.token_rows)
        if step is None:
            return meta
        return attrs.evolve(meta, decode=attrs.evolve(meta.decode, mirror=step))

    @property
    def compiled(self) -> bool:
        """Whether passes run through ``torch.compile``'s graph (``settings.torch_compile``
        where :mod:`~stages.model.compiled_forward` applies; ``False``: eagerly)."""
        forward = self._forward
        return isinstance(forward, CompiledForward) and forward.active

    @property
    def decode_mirror(self) -> DecodeMirror | None:
        """The decode requests' contiguous KV (``settings.decode_mirror``), or ``None``."""
        return self._mirror

    def _replay(self, scheduler_output: SchedulerOutput) -> ModelOutput | None:
        """A decode-only step through a captured graph, or ``None`` (run it eagerly)."""
        assert self._graphs is not None
        requests = scheduler_output.requests
        if not self._states.decode_only(scheduler_output):
            return None
        with torch.inference_mode(), self.device_sync.compute_stream():
            hidden = self._graphs.hidden(requests, self._states.tables)
            if hidden is None:
                return None
            logits = self.model.compute_logits(hidden)
        req_ids = tuple(r.req_id for r in requests)
        return ModelOutput(req_ids=req_ids, logits=logits, num_tokens=len(req_ids))

    def sample(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> SampledTokens:
        """Sample one token per row of ``model_output`` with each request's parameters.

        A row that cannot be sampled does not fail the others: its request is named in
        ``SampledTokens.errors`` (and gets no token), and fails alone. The logprobs of
        the requests that asked (sampled tokens, prompt targets) are added from the raw
        logits (:func:`~stages.model.logprobs.add_logprobs`); a request whose
        logprobs fail fails alone too. Blocks the calling thread (it reads the tokens
        back from the device).
        """
        return self._sampling.sample(scheduler_output, model_output)

    def logits(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> Logits:
        """The graph's ``logits`` stage: the rows to sample with the built-in adjustments
        (``min_tokens``, ``logit_bias``, penalties), each row that cannot be adjusted
        failing alone (:meth:`StepSampler.logits`). Blocks the calling thread."""
        return self._sampling.logits(scheduler_output, model_output)

    def sample_logits(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput, logits: Logits
    ) -> SampledTokens:
        """The graph's ``sample`` stage: one token per row of ``logits`` (already
        adjusted), then the logprobs asked for, of the raw logits
        (:meth:`StepSampler.sample_logits`). Blocks the calling thread."""
        return self._sampling.sample_logits(scheduler_output, model_output, logits)

    def drop_requests(self, req_ids: Iterable[str]) -> None:
        """Forget the state of ``req_ids`` (unknown ids are ignored), as a step does.

        For a step that ended before its forward pass. Not thread-safe: never while a
        forward pass runs.
        """
        req_ids = list(req_ids)
        self._states.drop(req_ids)
        self._sampling.drop(req_ids)
        if self._mirror is not None:
            self._mirror.drop(req_ids)

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The captured decode graphs (``settings.cuda_graphs``), or ``None``."""
        return self._graphs

    def block_table(self, req_id: str) -> tuple[int, ...]:
        """The block table this worker holds for ``req_id`` (KeyError when unknown)."""
        return self._states.block_table(req_id)

    @property
    def num_requests(self) -> int:
        """Requests whose state this worker holds."""
        return len(self._states)

    def close(self) -> None:
        """Drop the KV cache and request state. Idempotent; never raises.

        Shared weights stay alive for the runners that share them.
        """
        if self._closed:
            return
        self._closed = True
        self._states.clear()
        self._sampling.clear()
        if self._mirror is not None:
            self._mirror.clear()
        self._graphs = None  # they hold the cache
        self.kv_caches = []
        if self._owns_compute:
            self.compute.close()
