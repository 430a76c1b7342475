"""The KV connector API, split by role, with vLLM's ``KVConnectorBase_V1`` method names.

Which method runs where (stage of the engine or worker graph, process, thread)::

    scheduler half: engine process, event loop     worker half: each rank, per step
    ──────────────────────────────────────────     ──────────────────────────────────────
    schedule stage:                                bind stage (event loop):
      get_num_new_matched_tokens  per waiting        begin_step                once
                                  request, per try   bind_connector_metadata   once
                                                   load stage (event loop):
      update_state_after_alloc    per allocation     start_load_kv             once, async
      build_connector_meta        once per step    forward stage (compute thread):
    update stage:                                    wait_for_layer_load  ┐ per layer,
      update_connector_output     once per step      save_kv_layer        ┘ in order
      request_finished            per finished     save stage (event loop):
                                  request            wait_for_save             once, async
    engine loop, between steps:                    finished stage (event loop):
      has_pending_work            per decision       get_finished              once, async
                                                     get_block_ids_with_load_errors,
                                                     get_load_failures, get_kv_stats
                                                   clear finalizer (always, event loop):
                                                     clear_connector_metadata  once
                                                   worker start / shutdown:
                                                     register_kv_caches, aclose

A connector is registered under a name with one class per role
(:func:`connectors.registry.register_connector`); both are constructed with a
:class:`ConnectorContext`. There is one scheduler half per engine and one worker half
per rank (in the engine process for in-process ranks, else in the rank's worker
process). Each method's docstring is its contract: who calls it and when, how often, on
which rank and thread, whether it may block or is ``async``, whether it is
cancellation-safe, what it returns and what it must not mutate.

Worker-side calls are checked by the lifecycle guard (:mod:`connectors.lifecycle`).
The step-level calls that may wait are ``async``; the two per-layer hooks are
synchronous and must be thread-safe: they run inside the forward pass, on the rank's
compute thread, off the event loop. Scheduler-side calls are synchronous and run on the
engine's event loop, so none may block for long.
"""

from __future__ import annotations

from connectors.scheduler_half import KVConnectorScheduler
from connectors.types import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    MatchResult,
    ModelFingerprint,
    RequestFinishedResult,
    WorkerFinished,
)
from connectors.worker_half import KVConnectorWorker

__all__ = [
    "ConnectorContext",
    "ForwardContext",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "MatchResult",
    "ModelFingerprint",
    "RequestFinishedResult",
    "WorkerFinished",
]
