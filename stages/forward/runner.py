"""``ModelRunner``: the worker-side object the forward and sample stages call.

It owns the model (possibly shared with other in-process ranks, or this rank's
tensor-parallel shard of it), this rank's paged KV cache, the per-request block tables
and the sampler. Its calls are synchronous and
block the calling thread for the whole forward pass: stages run them in a worker thread
so the event loop stays responsive. One call at a time (not thread-safe).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

from connectors.base import ForwardContext, KVConnectorWorker, ModelFingerprint
from connectors.device import DeviceSync, make_device_sync
from pipeline.artifacts import ModelOutput, SampledTokens, SchedulerOutput
from pipeline.errors import StageError
from stages.forward.compute_thread import ComputeThread
from stages.forward.config import ModelConfig
from stages.forward.inputs import RequestStates
from stages.forward.kv_cache import allocate_kv_caches, local_kv_heads
from stages.forward.loader import LoadedModel
from stages.forward.model import CausalLM
from stages.forward.parallel import UNSHARDED, TensorParallel
from stages.forward.runner_load import SharedWeights, load_parts, resolve_device, resolve_dtype
from stages.forward.sampling import Sampler

__all__ = ["ModelRunner", "resolve_device", "resolve_dtype"]


@attrs.frozen
class _ConnectorHooks:
    """Layer hooks that drive a connector's per-layer calls during one forward."""

    connector: KVConnectorWorker
    kv_caches: Sequence[torch.Tensor]
    ctx: ForwardContext

    def before_attention(self, layer: int) -> None:
        self.connector.wait_for_layer_load(layer)

    def after_attention(self, layer: int) -> None:
        self.connector.save_kv_layer(layer, self.kv_caches[layer], self.ctx)


class ModelRunner:
    """Runs the model over one step's batch and samples from its logits.

    Build it with :meth:`load`. Attributes ``model_config``, ``device``, ``dtype``,
    ``block_size``, ``num_blocks``, ``kv_caches``, ``fingerprint`` and ``tp`` (how the
    model is sharded: ``TensorParallel()`` for a whole model) are read-only.
    """

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        seed: int,
        rank: int,
        world_size: int,
        tp: TensorParallel = UNSHARDED,
        compute: ComputeThread | None = None,
    ) -> None:
        self.compute = compute or ComputeThread(f"kvstep-compute-r{rank}")
        self._loaded = loaded
        self.model: CausalLM = loaded.model
        self.model_config: ModelConfig = loaded.config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.rank = rank
        self.world_size = world_size
        self.tp = tp
        self.kv_caches: list[torch.Tensor] = allocate_kv_caches(
            loaded.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
            tp_size=tp.size,
        )
        self.fingerprint = ModelFingerprint(
            architecture=loaded.config.architecture,
            weights_id=loaded.weights_id,
            dtype=str(dtype).removeprefix("torch."),
            block_size=block_size,
            tp_rank=rank,
            tp_size=world_size,
            kv_heads=local_kv_heads(loaded.config, tp.size),
        )
        self.device_sync: DeviceSync = make_device_sync(device)
        self._states = RequestStates(
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            vocab_size=loaded.config.vocab_size,
        )
        self._sampler = Sampler(seed=seed, device=device)
        self._closed = False

    @classmethod
    def load(
        cls,
        model: str,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_model_len: int = 4096,
        kv_cache_memory_bytes: int = 2 << 30,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shared_model: ModelRunner | None = None,
        tp: TensorParallel | None = None,
    ) -> ModelRunner:
        """Load ``model`` (a local HF directory or ``"builtin:tiny"``) and allocate the cache.

        Arguments, errors and blocking are those of
        :func:`~stages.forward.runner_load.load_parts`; the loading and the cache
        allocation run on the new runner's compute thread, which then runs every forward
        pass and sample.
        """
        shared = None if shared_model is None else shared_model._shared_weights()
        compute = ComputeThread(f"kvstep-compute-r{rank}")

        def build() -> ModelRunner:
            parts = load_parts(
                model,
                dtype=dtype,
                device=device,
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                seed=seed,
                rank=rank,
                world_size=world_size,
                shared_model=shared,
                tp=tp,
            )
            return cls(**attrs.asdict(parts, recurse=False), compute=compute)

        try:
            return compute.call(build)
        except BaseException:
            compute.close()
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
        attention and ``save_kv_layer(i, kv_caches[i], ctx)`` after it.

        Returns:
            Float32 logits of the requests whose ``sample`` is set, in batch order. An
            empty step returns ``req_ids=()`` and a ``[0, vocab]`` tensor without
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
        if scheduler_output.is_empty:
            empty = torch.empty(0, self.model_config.vocab_size, device=self.device)
            return ModelOutput(req_ids=(), logits=empty, num_tokens=0)
        self._states.update(scheduler_output)
        batch = self._states.prepare(scheduler_output, self.device)
        hooks = None
        if connector is not None:
            hooks = _ConnectorHooks(
                connector, self.kv_caches, self.forward_context(scheduler_output)
            )
        with torch.inference_mode(), self.device_sync.compute_stream():
            meta = batch.attn_meta
            hidden = self.model(batch.input_ids, meta.positions, meta, self.kv_caches, hooks)
            logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        return ModelOutput(req_ids=batch.sample_req_ids, logits=logits, num_tokens=meta.num_tokens)

    def sample(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> SampledTokens:
        """Sample one token per row of ``model_output`` with each request's parameters.

        A row that cannot be sampled does not fail the others: its request is named in
        ``SampledTokens.errors`` (and gets no token), and fails alone. Blocks the calling
        thread (it reads the tokens back from the device).
        """
        if not model_output.req_ids:
            return SampledTokens(token_ids={})
        by_id = {r.req_id: r for r in scheduler_output.requests}
        scheduled = [by_id[req_id] for req_id in model_output.req_ids]
        with torch.inference_mode():
            tokens, errors = self._sampler.sample_rows(
                model_output.logits,
                [r.sampling for r in scheduled],
                [r.num_output_tokens for r in scheduled],
            )
        req_ids = model_output.req_ids
        return SampledTokens(
            token_ids={
                req_id: tok for req_id, tok in zip(req_ids, tokens, strict=True) if tok is not None
            },
            errors={req_ids[row]: reason for row, reason in errors.items()},
        )

    def drop_requests(self, req_ids: Iterable[str]) -> None:
        """Forget the state of ``req_ids`` (unknown ids are ignored), as a step does.

        For a step that ended before its forward pass. Not thread-safe: never while a
        forward pass runs.
        """
        self._states.drop(req_ids)

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
        self.kv_caches = []
        self.compute.close()
