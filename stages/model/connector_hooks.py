"""``ConnectorHooks``: a KV connector's per-layer calls, made from inside a forward pass."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from connectors.base import ForwardContext, KVConnectorWorker
from pipeline.errors import ConnectorLifecycleError

__all__ = ["ConnectorHooks"]


@attrs.define(eq=False)
class ConnectorHooks:
    """The :class:`~stages.model.layers.LayerHooks` of one forward pass with a connector:
    ``wait_for_layer_load(i)`` before layer ``i``'s attention, ``save_kv_layer(i,
    kv_caches[i], ctx)`` after it.

    A ``save_kv_layer`` that raises fails the step's saves on this rank, never the
    forward pass: the error is kept in :attr:`save_error` (the runner hands it on in
    ``ModelOutput.save_error``) and no later layer of the pass is offered for saving,
    so the connector never holds a block with a layer missing in its middle. A
    ``ConnectorLifecycleError`` (a call out of order: an engine bug) and a raising
    ``wait_for_layer_load`` (load side) still fail the step.

    One instance per forward pass, used by the compute thread only.

    Attributes:
        save_error: The first exception ``save_kv_layer`` raised in this pass, or ``None``.
    """

    connector: KVConnectorWorker
    kv_caches: Sequence[torch.Tensor]
    ctx: ForwardContext
    save_error: Exception | None = None

    def before_attention(self, layer: int) -> None:
        self.connector.wait_for_layer_load(layer)

    def after_attention(self, layer: int) -> None:
        if self.save_error is not None:
            return
        try:
            self.connector.save_kv_layer(layer, self.kv_caches[layer], self.ctx)
        except ConnectorLifecycleError:
            raise
        except Exception as exc:  # a failing cache tier costs caching, not the step
            self.save_error = exc
