"""Helper for the nixl transport tests (not a test file): a producer rank in its own process.

    python nixl_peer.py ENGINE_ID

Builds a 2-layer CPU cache whose block ``b`` of layer ``l`` is filled with
``expected_value(l, kv, b)``, registers it with a :class:`KVAgent`, serves its info on a
random port, prints ``PORT <port>`` (NIXL logs to stdout too), then waits to be killed.
"""

from __future__ import annotations

import sys
import time

import torch

from connectors.nixl.agent import KVAgent
from connectors.nixl.handshake import HandshakeServer
from connectors.nixl.transfer_key import TransferKey

TEST_KEY = TransferKey(b"kvstep nixl transport tests key!", "test")
"""The transfer key of the transport tests (both sides of a test share it)."""

SHAPE = (2, 8, 4, 2, 8)  # [2, num_blocks, block_size, kv_heads, head_dim]


def filled_cache(num_layers: int = 2) -> list[torch.Tensor]:
    """Layer ``l``: K/V ``kv`` of block ``b`` holds ``100 * l + 10 * kv + b`` everywhere."""
    caches = []
    for layer in range(num_layers):
        t = torch.empty(SHAPE, dtype=torch.float32)
        for kv in range(2):
            for block in range(SHAPE[1]):
                t[kv, block] = 100 * layer + 10 * kv + block
        caches.append(t)
    return caches


def main() -> None:
    caches = filled_cache()
    agent = KVAgent(
        engine_id=sys.argv[1],
        fingerprint="fp",
        block_size=SHAPE[2],
        tp_rank=0,
        tp_size=1,
        kv_caches=caches,
    )
    server = HandshakeServer(agent.info, "127.0.0.1", 0, TEST_KEY)
    print(f"PORT {server.port}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
