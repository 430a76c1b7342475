"""Layer-wise overlap of offload loads and the forward pass, by the order of events (no
timing): layer 0's attention runs while later layers are still loading."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from checkpoints import build_checkpoint

from connectors.offload import LoadJob, OffloadScheduler, OffloadWorker
from connectors.registry import register_connector, unregister_connector
from pipeline import LLM, EngineConfig, SamplingParams

LAYERS = 4
NAME = "offload_overlap_probe"
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
GATE_TIMEOUT_S = 10.0


class ProbeWorker(OffloadWorker):
    """Offload worker that records ``("load", i)`` when layer i's copy finished (loader
    thread) and ``("attention", i)`` when the forward may start layer i's attention.

    When ``gated``, the last layer's copy waits for layer 0's attention first (with a
    timeout), so a forward that waits for every load before computing would stall and
    show the wrong order instead of passing by luck.
    """

    events: ClassVar[list[tuple[str, int]]] = []
    gated: ClassVar[bool] = False
    attention_started: ClassVar[threading.Event] = threading.Event()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def record(cls, kind: str, layer: int) -> None:
        with cls._lock:
            cls.events.append((kind, layer))

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        loader = self._loader
        assert loader is not None
        real = loader.load_layer
        last = len(kv_caches) - 1

        def probed(layer: int, kv: torch.Tensor, job: LoadJob) -> None:
            if ProbeWorker.gated and layer == last:
                ProbeWorker.attention_started.wait(GATE_TIMEOUT_S)
            real(layer, kv, job)
            ProbeWorker.record("load", layer)

        loader.load_layer = probed  # type: ignore[method-assign]

    def wait_for_layer_load(self, layer: int) -> None:
        super().wait_for_layer_load(layer)
        ProbeWorker.record("attention", layer)
        if layer == 0:
            ProbeWorker.attention_started.set()


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with four layers."""
    path = tmp_path_factory.mktemp("deep") / "llama"
    return build_checkpoint("llama", path, num_hidden_layers=LAYERS)


@pytest.fixture
def probe() -> Iterator[type[ProbeWorker]]:
    register_connector(NAME, OffloadScheduler, ProbeWorker, replace=True)
    ProbeWorker.events, ProbeWorker.gated = [], False
    ProbeWorker.attention_started.clear()
    yield ProbeWorker
    ProbeWorker.gated = False
    unregister_connector(NAME)


def config(path: Path, connector: str | None) -> EngineConfig:
    options = {"num_blocks": 64, "load_timeout_s": 2 * GATE_TIMEOUT_S} if connector else {}
    return EngineConfig(
        model=str(path),
        device="cpu",  # the probe hooks the CPU loader thread
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=False,
        connector=connector,
        connector_options=options,
    )


def prompt() -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(1, 256) for _ in range(70)]  # 4 full blocks load on a hit


class TestLayerOverlap:
    def test_layer_zero_attention_starts_before_the_last_layer_loaded(self, deep_llama, probe):
        """On a hit, the forward starts layer 0's attention before the last layer's load
        completed (the last copy is held until then), each layer's attention comes after
        its own load, and the output equals a run without a connector."""
        with LLM(config(deep_llama, None)) as llm:
            (expected,) = llm.generate([prompt()], PARAMS)
        with LLM(config(deep_llama, NAME)) as llm:
            llm.generate([prompt()], PARAMS)  # stores the prompt's full blocks
            probe.events.clear()
            probe.attention_started.clear()
            probe.gated = True
            (out,) = llm.generate([prompt()], PARAMS)
            worker = llm.engine.core.workers[0].connector.inner
            assert isinstance(worker, ProbeWorker)
            assert worker.stats.load_errors == 0
        assert out.token_ids == expected.token_ids
        assert out.num_cached_tokens == 64
        events = probe.events
        loads = [e for e in events if e[0] == "load"]
        assert loads == [("load", i) for i in range(LAYERS)]  # one job, layer 0 first
        first_attention = events.index(("attention", 0))
        assert first_attention < events.index(("load", LAYERS - 1))
        for layer in range(LAYERS):  # no attention reads a layer before it landed
            assert events.index(("load", layer)) < events.index(("attention", layer))
