"""Helper for the nixl failure tests (not a test file): a producer engine in its own process.

    python nixl_producer.py LEASE_S

Runs a ``builtin:tiny`` engine with the nixl connector as a producer, on a free port it
picks itself (a port picked by the test could be taken while this process imports
torch), and prints ``READY <port>``. Each line on stdin is then a JSON list of prompts
(token-id lists): it prefills them (``do_remote_decode``, one token) and prints
``PARAMS <json>``, the list of the ``kv_transfer_params`` a consumer needs, one per
prompt (NIXL logs to stdout too, hence the prefixes). Exits at the end of stdin, or
when killed (the tests kill it).
"""

from __future__ import annotations

import json
import socket
import sys

from pipeline import LLM, EngineConfig, SamplingParams

PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(lease_s: float) -> tuple[LLM, int]:
    for attempt in range(5):
        port = free_port()
        options = {"role": "producer", "host": "127.0.0.1", "port": port, "lease_s": lease_s}
        config = EngineConfig(model="builtin:tiny", connector="nixl", connector_options=options)
        try:
            return LLM(config), port
        except Exception as exc:  # the port was taken meanwhile: pick another
            if "cannot bind" not in str(exc) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def main() -> None:
    llm, port = start(float(sys.argv[1]))
    with llm:
        print(f"READY {port}", flush=True)
        for line in sys.stdin:
            batch = json.loads(line)
            decode = [{"do_remote_decode": True}] * len(batch)
            outs = llm.generate(batch, PREFILL, kv_transfer_params=decode)
            print("PARAMS " + json.dumps([o.kv_transfer_params for o in outs]), flush=True)


if __name__ == "__main__":
    main()
