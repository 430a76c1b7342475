"""``EngineConfig.logits_processors`` (issue 25): vLLM's setting for custom logits stages.

Construction checks each entry's shape (a ``LogitsStage`` subclass or a ``"module:Class"``
/ ``"module.Class"`` path) and, for worker processes, turns classes into paths that cross
the wire; :func:`resolve_logits_processors` imports and builds them, naming the entry
that fails and why; ``kvstep serve --logits-processors`` sets the field.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

from pipeline import EngineConfig
from pipeline.cli.config_flags import config_error
from pipeline.cli.main import build_parser, main, serve_config
from pipeline.errors import InvalidConfigError
from pipeline.executors import wire
from pipeline.executors.remote import init_message
from pipeline.logits import LogitsStage
from pipeline.logits_processors import resolve_logits_processors

HERE = __name__


@attrs.frozen
class ForceZero(LogitsStage):
    """A logits stage built with no arguments."""

    name: ClassVar[str] = "force_zero"

    def apply(self, logits: Any, batch: Any) -> Any:
        return logits


@attrs.frozen
class AlsoForceZero(ForceZero):
    """Another class whose stages take ForceZero's name."""


@attrs.frozen
class NeedsToken(LogitsStage):
    name: ClassVar[str] = "needs_token"
    token: int

    def apply(self, logits: Any, batch: Any) -> Any:
        return logits


class Abstract(LogitsStage):
    name: ClassVar[str] = "abstract"


class Nameless(LogitsStage):
    def apply(self, logits: Any, batch: Any) -> Any:
        return logits


class Exploding(LogitsStage):
    name: ClassVar[str] = "exploding"

    def __init__(self) -> None:
        raise RuntimeError("no GPU here")

    def apply(self, logits: Any, batch: Any) -> Any:
        return logits


class NotAStage:
    name: ClassVar[str] = "not_a_stage"


def _local_stage() -> type:
    @attrs.frozen
    class Local(ForceZero):
        name: ClassVar[str] = "local"

    return Local


@pytest.fixture
def raising_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of a module whose import raises ValueError."""
    name = "kvstep_test_raising_module"
    (tmp_path / f"{name}.py").write_text('raise ValueError("bad module")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


class TestConstruction:
    def test_default_is_none(self) -> None:
        """Without the setting there are no logits processors to resolve."""
        config = EngineConfig()
        assert config.logits_processors == ()
        assert resolve_logits_processors(config) == ()

    def test_classes_and_paths_are_kept_in_order(self) -> None:
        """A list of classes and paths becomes a tuple, in the order given."""
        config = EngineConfig(logits_processors=[ForceZero, "pkg.mod:Cls", "pkg.mod.Cls"])
        assert config.logits_processors == (ForceZero, "pkg.mod:Cls", "pkg.mod.Cls")

    @pytest.mark.parametrize(
        ("value", "field"),
        [
            ("pkg.mod:Cls", "logits_processors"),
            (ForceZero, "logits_processors"),
            ({"pkg.mod:Cls"}, "logits_processors"),
            (["Cls"], r"logits_processors\[0\]"),
            ([ForceZero, "pkg.mod:"], r"logits_processors\[1\]"),
            ([":Cls"], r"logits_processors\[0\]"),
            (["pkg mod:Cls"], r"logits_processors\[0\]"),
            (["pkg.mod:Cls:x"], r"logits_processors\[0\]"),
            (["pkg..mod"], r"logits_processors\[0\]"),
            ([""], r"logits_processors\[0\]"),
            ([3], r"logits_processors\[0\]"),
            ([ForceZero()], r"logits_processors\[0\]"),
            ([NotAStage], r"logits_processors\[0\]"),
        ],
    )
    def test_bad_entries_are_refused_naming_them(self, value: object, field: str) -> None:
        """Not a list, a malformed path, or neither class nor path: InvalidConfigError."""
        with pytest.raises(InvalidConfigError, match=field) as info:
            EngineConfig(logits_processors=value)  # type: ignore[arg-type]
        assert info.value.field.startswith("logits_processors")

    @pytest.mark.parametrize("executor", ["multiproc", "ray"])
    def test_classes_become_paths_for_worker_processes(self, executor: str) -> None:
        """With worker processes a class is stored as the path that imports it."""
        config = EngineConfig(executor=executor, logits_processors=[ForceZero, "pkg.mod.Cls"])
        assert config.logits_processors == (f"{HERE}:ForceZero", "pkg.mod.Cls")

    def test_a_class_defined_in_a_function_cannot_cross(self) -> None:
        """A class no path imports is refused for worker processes, kept in-process."""
        local = _local_stage()
        with pytest.raises(InvalidConfigError, match=r"logits_processors\[0\]"):
            EngineConfig(executor="multiproc", logits_processors=[local])
        assert EngineConfig(logits_processors=[local]).logits_processors == (local,)

    def test_config_crosses_to_workers_as_it_does_today(self) -> None:
        """The worker's Init carries the entries as strings and rebuilds the same config."""
        config = EngineConfig(
            executor="multiproc", world_size=2, logits_processors=[ForceZero, "a.b:C"]
        )
        message = init_message(
            config,
            1,
            device="cpu",
            backend="gloo",
            init_method="file:///tmp/x",
            worker_graph=None,
            connector_classes=None,
        )
        received = wire.decode(wire.encode(message))
        assert isinstance(received, wire.Init)
        rebuilt = EngineConfig(**received.config)
        assert rebuilt.logits_processors == (f"{HERE}:ForceZero", "a.b:C")
        assert rebuilt == attrs.evolve(config, step_log=None)


class TestResolution:
    def test_classes_and_paths_are_built_in_order(self) -> None:
        """Each entry, class or either path form, becomes one instance, in order."""
        config = EngineConfig(executor="multiproc", logits_processors=[f"{HERE}.ForceZero"])
        assert resolve_logits_processors(config) == (ForceZero(),)
        stages = resolve_logits_processors(
            EngineConfig(logits_processors=[f"{HERE}:ForceZero", _local_stage()])
        )
        assert [s.name for s in stages] == ["force_zero", "local"]
        assert isinstance(stages[0], ForceZero)

    @pytest.mark.parametrize(
        ("entry", "why"),
        [
            ("kvstep_no_such_module:Cls", "cannot be imported"),
            ("kvstep_no_such_module.Cls", "cannot be imported"),
            (f"{HERE}:Missing", "has no attribute"),
            (f"{HERE}:ForceZero.missing", "has no attribute"),
            ("pipeline.errors:InvalidConfigError", "subclass of pipeline.LogitsStage"),
            (f"{HERE}:NotAStage", "subclass of pipeline.LogitsStage"),
            (f"{HERE}:HERE", "subclass of pipeline.LogitsStage"),
            (f"{HERE}:Abstract", "is abstract: it must implement apply"),
            (f"{HERE}:NeedsToken", "needs arguments"),
            (f"{HERE}:Exploding", r"raised RuntimeError\('no GPU here'\)"),
            (f"{HERE}:Nameless", "no stage name"),
            (Abstract, "is abstract"),
            (NeedsToken, "needs arguments"),
        ],
    )
    def test_failures_name_the_entry_and_why(self, entry: object, why: str) -> None:
        """An entry that does not give a stage built with no arguments is named, with why."""
        config = EngineConfig(logits_processors=[ForceZero, entry])  # type: ignore[list-item]
        with pytest.raises(InvalidConfigError, match=why) as info:
            resolve_logits_processors(config)
        assert info.value.field == "logits_processors[1]"
        assert info.value.value == entry

    def test_a_module_that_raises_on_import_is_named(self, raising_module: str) -> None:
        """A module whose import raises is a typed error, not its exception."""
        config = EngineConfig(logits_processors=[f"{raising_module}:Cls"])
        with pytest.raises(
            InvalidConfigError, match=r"its module raised ValueError\('bad module'\)"
        ):
            resolve_logits_processors(config)

    def test_two_stages_of_one_name_are_refused(self) -> None:
        """Two entries building stages of the same name: the second is named."""
        config = EngineConfig(logits_processors=[ForceZero, AlsoForceZero])
        with pytest.raises(InvalidConfigError, match=r"logits_processors\[0\]") as info:
            resolve_logits_processors(config)
        assert info.value.field == "logits_processors[1]"


class TestCommandLine:
    def _config(self, *flags: str) -> EngineConfig:
        return serve_config(build_parser().parse_args(["serve", *flags]))

    def test_flag_takes_one_or_more_paths_and_repeats(self) -> None:
        """--logits-processors A B --logits-processors C gives (A, B, C)."""
        config = self._config(
            "--logits-processors", "a.b:C", "d.E", "--logits-processors", f"{HERE}:ForceZero"
        )
        assert config.logits_processors == ("a.b:C", "d.E", f"{HERE}:ForceZero")
        assert self._config().logits_processors == ()

    def test_a_malformed_path_names_the_flag(self) -> None:
        """A path of the wrong shape is a config error shown against its flag."""
        args = build_parser().parse_args(["serve", "--logits-processors", "a.b:C", "nodots"])
        with pytest.raises(InvalidConfigError) as info:
            serve_config(args)
        message = config_error(args, info.value)
        assert "argument --logits-processors" in message
        assert "logits_processors[1]='nodots'" in message

    def test_help_names_the_flag(self, capsys: pytest.CaptureFixture[str]) -> None:
        """kvstep serve --help shows the flag with its metavar and default."""
        with pytest.raises(SystemExit):
            main(["serve", "--help"])
        out = capsys.readouterr().out
        assert "--logits-processors MODULE:CLASS [MODULE:CLASS ...]" in out
