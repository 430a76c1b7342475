"""``ConnectorHooks``: a KV connector's per-layer calls, made from inside a forward pass."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from connectors.base import ForwardContext, KVConnectorWorker

__all__ = ["ConnectorHooks"]


@attrs.frozen
class ConnectorHooks:
    """The :class:`~stages.model.layers.LayerHooks` of one forward pass with a connector:
    ``wait_for_layer_load(i)`` before layer ``i``'s attention, ``save_kv_layer(i,
    kv_caches[i], ctx)`` after it."""

    connector: KVConnectorWorker
    kv_caches: Sequence[torch.Tensor]
    ctx: ForwardContext

    def before_attention(self, layer: int) -> None:
        self.connector.wait_for_layer_load(layer)

    def after_attention(self, layer: int) -> None:
        self.connector.save_kv_layer(layer, self.kv_caches[layer], self.ctx)
