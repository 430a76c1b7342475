"""Helper for the nixl failure tests (not a test file): a consumer rank in its own process.

    python nixl_consumer.py

Prints ``READY`` once imported. Then reads JSON lines on stdin: first a producer's
``{"host": ..., "port": ...}``: asks its rank 0 for its info, registers a cache of the
same layout with a :class:`KVAgent`, admits the producer, prints ``ADMITTED``; then the
``kv_transfer_params`` of a prefill it holds: reads its blocks without a notification
(as a consumer that dies before its read completes would never send one), prints
``READ`` once the read is done (NIXL logs to stdout too), and waits to be killed.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from connectors.nixl.agent import KVAgent
from connectors.nixl.handshake import fetch_peer_info
from connectors.nixl.transfer_key import TransferKey


def main() -> None:
    print("READY", flush=True)
    address = json.loads(sys.stdin.readline())
    key = TransferKey.default()  # this user's: the producer's too
    info = fetch_peer_info(address["host"], address["port"], 10.0, key=key)
    layer = (2, info.num_blocks, info.block_bytes // 4)  # float32: the same bytes per block
    agent = KVAgent(
        engine_id="killed-consumer",
        fingerprint=info.fingerprint,
        block_size=info.block_size,
        tp_rank=0,
        tp_size=info.tp_size,
        kv_caches=[torch.zeros(layer) for _ in info.layer_addrs],
    )
    agent.add_peer(info)
    print("ADMITTED", flush=True)
    blocks = json.loads(sys.stdin.readline())["remote_block_ids"]
    handle = agent.start_read(info.engine_id, blocks, list(range(len(blocks))), b"", 10.0)
    while not agent.poll(handle):
        time.sleep(0.001)
    print("READ", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
