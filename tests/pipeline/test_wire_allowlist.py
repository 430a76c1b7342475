"""A step's connector metadata class comes from an allow-list, never an import (finding 16)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from connectors.registry import get_connector
from connectors.testing import RecordingMetadata
from pipeline.artifacts import SchedulerOutput
from pipeline.errors import TransportError
from pipeline.executors import wire
from pipeline.executors.remote_worker import connector_metadata_types
from pipeline.executors.wire_checks import metadata_types


def _step(metadata_type: str, data: bytes = b"") -> wire.Step:
    return wire.Step(SchedulerOutput(step_id=4), metadata_type=metadata_type, metadata=data)


class TestAllowList:
    def test_registered_connectors_metadata_is_rebuilt(self) -> None:
        """Finding 16: the metadata class of the worker's connector is accepted."""
        metadata = RecordingMetadata(step_id=4)
        frame = wire.encode_step(SchedulerOutput(step_id=4, kv_connector_metadata=metadata))
        step = wire.decode(frame)
        assert isinstance(step, wire.Step)
        allowed = connector_metadata_types("recording")
        rebuilt = wire.decode_metadata(step, allowed).kv_connector_metadata
        assert isinstance(rebuilt, RecordingMetadata)

    @pytest.mark.parametrize("path", ["os:system", "subprocess:Popen", "builtins:eval"])
    def test_a_class_outside_the_list_is_refused(self, path: str) -> None:
        """Finding 16: a frame naming os:system (or any class not allowed) is refused."""
        with pytest.raises(TransportError, match="not the metadata"):
            wire.decode_metadata(_step(path), connector_metadata_types("recording"))
        with pytest.raises(TransportError):
            wire.decode_metadata(_step(path))  # no connector: nothing is allowed

    def test_an_unknown_module_is_never_imported(self) -> None:
        """Finding 16: the module a frame names is not imported (absent from sys.modules)."""
        name = "kvstep_hostile_module_for_finding_16"
        assert name not in sys.modules
        with pytest.raises(TransportError):
            wire.decode_metadata(_step(f"{name}:Meta"), connector_metadata_types("recording"))
        assert name not in sys.modules
        # A real module not imported yet is not imported either.
        assert "this" not in sys.modules
        with pytest.raises(TransportError):
            wire.decode_metadata(_step("this:Meta"), connector_metadata_types("recording"))
        assert "this" not in sys.modules

    def test_another_connectors_metadata_is_not_this_ones(self) -> None:
        """Finding 16: the allow-list holds only the connector's own package's classes."""
        from tests.pipeline import test_liveness  # noqa: F401  (defines a metadata class)

        allowed = metadata_types(*_halves("recording"))
        assert "connectors.testing:RecordingMetadata" in allowed
        assert not any(path.startswith("tests.") for path in allowed)
        assert not any(path.startswith(("os", "builtins")) for path in allowed)

    def test_each_path_maps_to_the_class_its_module_names(self) -> None:
        """The allow-list never maps a path to a class a decorator replaced: attrs builds
        a new slotted class, and the old one lingers among ``__subclasses__()`` until it
        is collected (a worker that took it could not decode any step's metadata)."""
        import types

        module = types.ModuleType("kvstep_fake_connector")
        source = (
            "import attrs\n"
            "from connectors.base import KVConnectorMetadata, KVConnectorWorker\n"
            "class Meta(KVConnectorMetadata):\n"
            "    step: int = 0\n"
            "STALE = Meta\n"
            "Meta = attrs.frozen(Meta)\n"
            "class Worker(KVConnectorWorker):\n"
            "    pass\n"
        )
        sys.modules[module.__name__] = module
        try:
            exec(compile(source, "<kvstep_fake_connector>", "exec"), module.__dict__)
            assert module.STALE is not module.Meta
            allowed = metadata_types(None, module.Worker)
            assert allowed == {"kvstep_fake_connector:Meta": module.Meta}
        finally:
            del sys.modules[module.__name__]


def _halves(name: str) -> tuple[type, type]:
    spec = get_connector(name)
    return spec.scheduler_cls, spec.worker_cls


class TestWorkerRefusal:
    @pytest.mark.anyio
    async def test_a_refused_class_fails_the_step_not_the_worker(self) -> None:
        """Finding 16: a step naming a class outside the list fails, non-fatally."""
        from types import SimpleNamespace

        from pipeline.executors.remote_worker import Records, run_step

        worker: Any = SimpleNamespace(rank=0, connector=None, runner=None)
        reply = await run_step(worker, _step("os:system"), Records(), 5.0, {})
        assert isinstance(reply, wire.StepFailed)
        assert (reply.step_id, reply.fatal) == (4, False)
        assert "not the metadata" in reply.reason
