"""The transfer benchmark's producer: one NIXL agent over a KV cache, in its own process.

    python benchmarks/_disagg_peer.py LAYERS NUM_BLOCKS BLOCK_SIZE KV_HEADS HEAD_DIM SEED

Builds ``LAYERS`` float32 cache tensors ``[2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS,
HEAD_DIM]`` filled by :func:`layer_fill` (so the reader can check what it got),
registers them with a :class:`~connectors.nixl.agent.KVAgent` as the nixl worker does,
serves the agent's info on a random loopback port, prints ``PORT <port>`` and serves
until its stdin closes (the benchmark closes it, or dies), then closes the agent.
Nothing but the side channel's msgpack crosses the process boundary.
"""

from __future__ import annotations

import sys

import torch

from connectors.nixl.agent import KVAgent
from connectors.nixl.handshake import HandshakeServer
from connectors.nixl.transfer_key import TransferKey

FINGERPRINT = "disagg-bench"


def layer_fill(shape: tuple[int, ...], seed: int, layer: int) -> torch.Tensor:
    """Layer ``layer``'s cache: seeded normal values, the same in both processes."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def main(argv: list[str]) -> None:
    layers, blocks, block_size, kv_heads, head_dim, seed = (int(a) for a in argv)
    shape = (2, blocks, block_size, kv_heads, head_dim)
    caches = [layer_fill(shape, seed, layer) for layer in range(layers)]
    agent = KVAgent(
        engine_id="disagg-bench-producer",
        fingerprint=FINGERPRINT,
        block_size=block_size,
        tp_rank=0,
        tp_size=1,
        kv_caches=caches,
    )
    # this user's key file: the benchmark's consumer reads the same one
    server = HandshakeServer(agent.info, "127.0.0.1", 0, TransferKey.default())
    try:
        print(f"PORT {server.port}", flush=True)
        sys.stdin.read()  # until the benchmark closes our stdin (or exits)
    finally:
        server.close()
        agent.close()


if __name__ == "__main__":
    main(sys.argv[1:])
