"""Tests of the connector registry (connectors.registry)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from connectors import registry
from connectors.base import (
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
)
from connectors.registry import (
    ConnectorSpec,
    create_connector,
    get_connector,
    list_connectors,
    register_connector,
    unregister_connector,
)
from connectors.testing import RecordingConnector
from pipeline.errors import DuplicateConnectorError, InvalidConfigError, UnknownConnectorError


class _Scheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> MatchResult:
        return MatchResult(0)

    def update_state_after_alloc(
        self, request: Any, block_ids: Any, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        raise NotImplementedError


class _Worker(KVConnectorWorker):
    pass


class _OtherWorker(KVConnectorWorker):
    pass


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees a copy of the registry; its registrations do not leak."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.setattr(registry, "_builtins_tried", set(registry._builtins_tried))
    yield


@pytest.fixture
def fake_builtins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Built-in table with a module that registers, one that is absent, one that breaks."""
    (tmp_path / "kvstep_fake_builtin.py").write_text(
        textwrap.dedent(
            """
            from connectors.registry import register_connector
            from connectors.testing import RecordingConnector
            register_connector(
                "fake", RecordingConnector.Scheduler, RecordingConnector.Worker
            )
            """
        )
    )
    (tmp_path / "kvstep_broken_builtin.py").write_text("import kvstep_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = {
        **registry._BUILTIN_MODULES,
        "fake": "kvstep_fake_builtin",
        "ghost": "connectors.kvstep_ghost_connector",
        "broken": "kvstep_broken_builtin",
    }
    monkeypatch.setattr(registry, "_BUILTIN_MODULES", table)
    yield table
    for module in ("kvstep_fake_builtin", "kvstep_broken_builtin"):
        sys.modules.pop(module, None)


class TestRegisterConnector:
    def test_registered_name_is_found(self) -> None:
        """A registered connector is returned by get_connector and listed."""
        spec = register_connector("mine", _Scheduler, _Worker)
        assert spec == ConnectorSpec("mine", _Scheduler, _Worker)
        assert get_connector("mine") is spec
        assert "mine" in list_connectors()

    def test_duplicate_name_is_refused(self) -> None:
        """A second registration under a taken name raises a ValueError naming it."""
        register_connector("mine", _Scheduler, _Worker)
        with pytest.raises(DuplicateConnectorError, match="'mine' is already registered") as e:
            register_connector("mine", _Scheduler, _OtherWorker)
        assert isinstance(e.value, ValueError)
        assert get_connector("mine").worker_cls is _Worker

    def test_replace_overrides(self) -> None:
        """replace=True swaps the registration."""
        register_connector("mine", _Scheduler, _Worker)
        register_connector("mine", _Scheduler, _OtherWorker, replace=True)
        assert get_connector("mine").worker_cls is _OtherWorker

    def test_same_classes_again_is_a_no_op(self) -> None:
        """Registering the very same classes twice (a re-import) is not a duplicate."""
        first = register_connector("mine", _Scheduler, _Worker)
        assert register_connector("mine", _Scheduler, _Worker) == first

    def test_builtin_name_is_taken(self) -> None:
        """A built-in name cannot be silently shadowed; replace=True overrides it."""
        with pytest.raises(DuplicateConnectorError, match="'recording'"):
            register_connector("recording", _Scheduler, _Worker)
        register_connector("recording", _Scheduler, _Worker, replace=True)
        assert get_connector("recording").scheduler_cls is _Scheduler

    @pytest.mark.parametrize(
        ("name", "scheduler_cls", "worker_cls", "field"),
        [
            ("", _Scheduler, _Worker, "connector name"),
            ("x", _Worker, _Worker, "scheduler_cls"),
            ("x", _Scheduler, _Scheduler, "worker_cls"),
            ("x", _Scheduler, object(), "worker_cls"),
        ],
    )
    def test_invalid_registration_is_refused(
        self, name: str, scheduler_cls: Any, worker_cls: Any, field: str
    ) -> None:
        """An empty name or a class of the wrong role raises naming the field."""
        with pytest.raises(InvalidConfigError) as info:
            register_connector(name, scheduler_cls, worker_cls)
        assert info.value.field == field

    def test_unregister_removes(self) -> None:
        """unregister_connector forgets a name; unknown names raise."""
        register_connector("mine", _Scheduler, _Worker)
        unregister_connector("mine")
        assert "mine" not in list_connectors()
        with pytest.raises(UnknownConnectorError):
            unregister_connector("mine")


class TestGetConnector:
    def test_unknown_name_lists_the_known_ones(self) -> None:
        """An unknown name raises a KeyError whose message lists registered names."""
        register_connector("mine", _Scheduler, _Worker)
        with pytest.raises(UnknownConnectorError) as info:
            get_connector("nope")
        assert isinstance(info.value, KeyError)
        assert info.value.name == "nope"
        assert {"mine", "recording"} <= set(info.value.known)
        assert "unknown connector 'nope'; registered: " in str(info.value)
        assert "recording" in str(info.value)

    def test_recording_is_builtin(self) -> None:
        """The "recording" connector is available by name."""
        spec = get_connector("recording")
        assert spec.scheduler_cls is RecordingConnector.Scheduler
        assert spec.worker_cls is RecordingConnector.Worker

    def test_builtin_module_is_imported_on_first_lookup(
        self, fake_builtins: dict[str, str]
    ) -> None:
        """A built-in's module is imported only when its name is first looked up."""
        assert "kvstep_fake_builtin" not in sys.modules
        assert get_connector("fake").worker_cls is RecordingConnector.Worker
        assert "kvstep_fake_builtin" in sys.modules

    def test_builtin_with_absent_module_is_not_listed(self, fake_builtins: dict[str, str]) -> None:
        """A built-in whose module does not exist yet is neither listed nor found."""
        with structlog.testing.capture_logs() as logs:
            names = list_connectors()
        assert "ghost" not in names
        assert {"fake", "recording"} <= set(names)
        with pytest.raises(UnknownConnectorError):
            get_connector("ghost")
        assert "broken" in [e["connector"] for e in logs]

    def test_builtin_with_missing_dependency_raises_on_lookup(
        self, fake_builtins: dict[str, str]
    ) -> None:
        """A built-in whose dependency is missing is skipped by list, loud on lookup."""
        with structlog.testing.capture_logs() as logs:
            assert "broken" not in list_connectors()
        assert logs[0]["event"] == "connector_import_failed"
        assert logs[0]["log_level"] == "warning"
        with pytest.raises(ModuleNotFoundError, match="kvstep_no_such_dependency"):
            get_connector("broken")

    def test_list_is_sorted_tuple(self) -> None:
        """list_connectors returns the names sorted, as a tuple."""
        register_connector("aaa", _Scheduler, _Worker)
        names = list_connectors()
        assert isinstance(names, tuple)
        assert list(names) == sorted(names)

    @pytest.mark.parametrize(
        "code",
        [
            # the module imported directly first: it registers itself once, cleanly
            "import connectors.testing as t\n"
            "from connectors import get_connector\n"
            "assert get_connector('recording').worker_cls is t.RecordingConnector.Worker\n",
            # a built-in name is taken before any lookup imported its module
            "import sys\n"
            "from connectors import register_connector\n"
            "from connectors import KVConnectorScheduler as S, KVConnectorWorker as W\n"
            "from pipeline.errors import DuplicateConnectorError\n"
            "assert 'connectors.testing' not in sys.modules\n"
            "try:\n"
            "    register_connector('recording', S, W)\n"
            "except DuplicateConnectorError:\n"
            "    pass\n"
            "else:\n"
            "    raise SystemExit('not refused')\n",
        ],
        ids=["import-first", "register-first"],
    )
    def test_builtin_registration_in_a_fresh_interpreter(self, code: str) -> None:
        """Lazy built-in registration works whichever comes first: import or lookup."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
        assert proc.returncode == 0, proc.stderr


class TestBuiltinTable:
    def test_every_listed_module_exists_imports_and_registers_its_name(self) -> None:
        """Each built-in names a module that exists, imports, and registers that name
        (in a fresh interpreter: this process's registry is a per-test copy)."""
        code = (
            "import importlib.util\n"
            "from connectors import KVConnectorScheduler, KVConnectorWorker, registry\n"
            "table = dict(registry._BUILTIN_MODULES)\n"
            "missing = [m for m in table.values() if importlib.util.find_spec(m) is None]\n"
            "assert missing == [], missing\n"
            "assert set(table) <= set(registry.list_connectors()), registry.list_connectors()\n"
            "for name, module in table.items():\n"
            "    importlib.import_module(module)\n"
            "    spec = registry.get_connector(name)\n"
            "    assert spec.name == name\n"
            "    assert issubclass(spec.scheduler_cls, KVConnectorScheduler)\n"
            "    assert issubclass(spec.worker_cls, KVConnectorWorker)\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 0, proc.stderr

    def test_the_runtime_does_not_import_the_testing_package(self) -> None:
        """Importing pipeline, stages and connectors imports no testing or fault module."""
        code = (
            "import sys, pipeline, stages, connectors\n"
            "ours = [m for m in sys.modules if m.split('.')[0] in {'pipeline', 'stages', "
            "'connectors'}]\n"
            "loaded = [m for m in ours if 'testing' in m or 'fault' in m]\n"
            "assert loaded == [], loaded\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
        assert proc.returncode == 0, proc.stderr


class TestCreateConnector:
    def test_builds_the_scheduler_half(self) -> None:
        """role=SCHEDULER builds scheduler_cls(context)."""
        register_connector("mine", _Scheduler, _Worker)
        ctx = ConnectorContext(role=KVConnectorRole.SCHEDULER)
        half = create_connector("mine", KVConnectorRole.SCHEDULER, ctx)
        assert isinstance(half, _Scheduler)
        assert half.context is ctx

    def test_builds_the_worker_half_from_a_role_string(self) -> None:
        """role="worker" builds worker_cls(context), unguarded."""
        register_connector("mine", _Scheduler, _Worker)
        ctx = ConnectorContext(role=KVConnectorRole.WORKER, rank=2)
        half = create_connector("mine", "worker", ctx)
        assert type(half) is _Worker
        assert half.context.rank == 2

    def test_role_must_match_the_context(self) -> None:
        """A role that disagrees with context.role is refused."""
        ctx = ConnectorContext(role=KVConnectorRole.WORKER)
        with pytest.raises(InvalidConfigError, match=r"context\.role='worker'"):
            create_connector("recording", KVConnectorRole.SCHEDULER, ctx)

    def test_unknown_role_is_refused(self) -> None:
        """A role that is not a KVConnectorRole value raises naming the allowed ones."""
        ctx = ConnectorContext(role=KVConnectorRole.WORKER)
        with pytest.raises(InvalidConfigError, match="'scheduler' \\| 'worker'"):
            create_connector("recording", "driver", ctx)

    def test_unknown_name_is_refused(self) -> None:
        """An unknown name raises UnknownConnectorError."""
        ctx = ConnectorContext(role=KVConnectorRole.WORKER)
        with pytest.raises(UnknownConnectorError, match="'nope'"):
            create_connector("nope", "worker", ctx)
