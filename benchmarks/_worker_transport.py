"""The floors under ``workers.py``'s numbers: one Step → StepDone exchange with an echo
process, and one all-reduce between two processes (gloo and shared memory)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from pipeline.artifacts import SchedulerOutput
from pipeline.executors import wire
from pipeline.executors.channel import Channel

_ECHO = """
import socket, sys, anyio
from pipeline.executors import wire
from pipeline.artifacts import WorkerOutput
from pipeline.executors.channel import Channel

async def serve(channel):
    while True:
        message = await channel.recv()
        if isinstance(message, wire.Shutdown):
            return
        step_id = message.scheduler_output.step_id
        await channel.send(wire.StepDone(WorkerOutput(rank=0, step_id=step_id), []))

anyio.run(serve, Channel(socket.socket(fileno=int(sys.argv[1])), peer="engine"))
"""


async def measure_round_trip(n: int) -> float:
    """Median µs of one Step → StepDone exchange with an echo process: the floor of what
    the process boundary costs per step (a socket pair, msgspec, two wake-ups)."""
    mine, theirs = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env
    )
    theirs.close()
    channel = Channel(mine, peer="echo")
    samples: list[int] = []
    try:
        for step_id in range(n + 50):
            start = time.perf_counter_ns()
            await channel.send(wire.encode_step(SchedulerOutput(step_id=step_id)))
            await channel.recv(alive=lambda: proc.poll() is None)
            if step_id >= 50:
                samples.append(time.perf_counter_ns() - start)
        await channel.send(wire.Shutdown())
    finally:
        proc.wait(timeout=30)
        channel.close()
    return round(statistics.median(samples) / 1000, 1)


_ALL_REDUCE = """
import json, statistics, sys, time
import torch
import torch.distributed as dist
from stages.model.shm_allreduce import SharedMemoryAllReduce
rank, workdir, rows, hidden, n = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:6])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{workdir}/rdv", rank=rank, world_size=2)
shm = SharedMemoryAllReduce(f"{workdir}/shm", rank=rank, size=2, slot_bytes=rows * hidden * 4,
                            fallback=dist.all_reduce, timeout_s=60)
x = torch.randn(rows, hidden)
result = {}
for name, reduce in (("gloo", dist.all_reduce), ("shared_memory", shm)):
    for _ in range(20):
        reduce(x)
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        reduce(x)
        samples.append(time.perf_counter_ns() - start)
    result[name] = round(statistics.median(samples) / 1000, 1)
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(result))
"""


def measure_all_reduce(rows: int, hidden: int, n: int = 100) -> dict[str, float]:
    """Median µs of one all-reduce of a float32 ``[rows, hidden]`` between two processes,
    with gloo and with the shared-memory reduce that ``multiproc`` CPU ranks use: what
    each of a tensor-parallel layer's two reductions costs here."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        argv = [tmp, str(rows), str(hidden), str(n)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _ALL_REDUCE, str(rank), *argv],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
            )
            for rank in (0, 1)
        ]
        out = [proc.communicate(timeout=120)[0] for proc in procs]
    result: dict[str, float] = json.loads(out[0])
    return result
