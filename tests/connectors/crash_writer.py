"""Helper for the shared_storage crash test (not a test file).

    python crash_writer.py STORE_DIR

Imports torch and the connector once, then serves one command per stdin line:

* ``fork SEED``: fork a child that writes blocks through the store's real write path
  (:func:`connectors.framing.encode_block` + :meth:`DiskStore.write`) to random keys,
  in a loop, until killed; print the child's pid. The test kills it with SIGKILL.
* ``reap PID``: wait for that child; print ``signaled SIG`` or ``exited CODE``.
* ``run SEED``: write in this process itself (the test kills this whole process).

Every key's content is a pure function of the key (:func:`expected_layers`), so a
reader can tell a valid value from wrong data.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from pathlib import Path

import torch

from connectors.framing import encode_block
from connectors.shared_storage.store import DiskStore

FP_KEY = "ab" * 16
NUM_KEYS = 32
NUM_LAYERS = 3
LAYER_SHAPE = (2, 4, 2, 64)  # ~2 KiB a layer
DTYPE = torch.float32


def block_hash(index: int) -> bytes:
    """The chained-hash stand-in of key ``index``."""
    return hashlib.sha256(index.to_bytes(4, "little")).digest()


def expected_layers(index: int) -> list[torch.Tensor]:
    """What key ``index`` must hold: layer ``l`` is filled with ``index * 100 + l`` plus
    a ramp, so values of different keys or layers never compare equal."""
    ramp = torch.arange(torch.Size(LAYER_SHAPE).numel(), dtype=DTYPE).reshape(LAYER_SHAPE)
    return [ramp + (index * 100 + layer) for layer in range(NUM_LAYERS)]


def write_forever(store: DiskStore, seed: int, limit: int = 5000) -> None:
    rng = random.Random(seed)
    frames = {}
    for _ in range(limit):
        index = rng.randrange(NUM_KEYS)
        if index not in frames:
            key = FP_KEY.encode() + block_hash(index)
            frames[index] = encode_block(key, expected_layers(index))
        store.write(FP_KEY, block_hash(index), frames[index])


def main() -> None:
    torch.set_num_threads(1)
    store = DiskStore(Path(sys.argv[1]))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "fork":
            pid = os.fork()
            if pid == 0:  # the child: write until killed
                try:
                    write_forever(store, int(arg))
                finally:
                    os._exit(0)
            print(pid, flush=True)
        elif cmd == "reap":
            _, status = os.waitpid(int(arg), 0)
            if os.WIFSIGNALED(status):
                print("signaled", os.WTERMSIG(status), flush=True)
            else:
                print("exited", os.WEXITSTATUS(status), flush=True)
        elif cmd == "run":
            print("writing", flush=True)
            write_forever(store, int(arg))
            print("done", flush=True)


if __name__ == "__main__":
    main()
