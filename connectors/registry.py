"""The connector registry: name → (scheduler class, worker class).

A connector module registers itself at import with :func:`register_connector`. The
built-in connectors are registered lazily: the first lookup of a built-in name imports
its module (listed in ``_BUILTIN_MODULES``, one line per connector, each an existing
module). A listed module that cannot be found is skipped, not an error.

All functions are thread-safe. Imports happen outside the registry's lock, so a module
that registers itself while being imported from another thread cannot deadlock.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Mapping
from typing import Literal, overload

import attrs

from connectors.base import (
    ConnectorContext,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from pipeline.errors import DuplicateConnectorError, InvalidConfigError, UnknownConnectorError
from pipeline.logger import get_logger

__all__ = [
    "ConnectorSpec",
    "create_connector",
    "get_connector",
    "list_connectors",
    "register_connector",
    "unregister_connector",
]

_log = get_logger()

# Built-in connector name -> module that registers it on import. Add a connector here,
# once its module exists (tests/connectors/test_registry.py imports every one listed).
# The testing package is listed by path only: nothing imports it until it is looked up.
_BUILTIN_MODULES: Mapping[str, str] = {
    "recording": "connectors.testing.recording",
    "faulty": "connectors.testing.faulty",
    "shared_storage": "connectors.shared_storage",
    "offload": "connectors.offload",
    "redis": "connectors.redis_store",
    "multi": "connectors.multi",
    "nixl": "connectors.nixl",
}

_lock = threading.RLock()
_registry: dict[str, ConnectorSpec] = {}
_builtins_tried: set[str] = set()  # built-in names whose module was imported (or absent)


@attrs.frozen
class ConnectorSpec:
    """A registered connector: its name and the class of each half."""

    name: str
    scheduler_cls: type[KVConnectorScheduler]
    worker_cls: type[KVConnectorWorker]


def _load_builtin(name: str) -> None:
    """Import the module of built-in ``name`` once; absent modules are remembered.

    Raises:
        ImportError: The module exists but failed to import (retried on the next call).
    """
    module = _BUILTIN_MODULES.get(name)
    if module is None:
        return
    with _lock:
        if name in _builtins_tried:
            return
        # Marked before the import: the module's own register_connector() call re-enters.
        _builtins_tried.add(name)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # a dependency is missing, not the module itself
            with _lock:
                _builtins_tried.discard(name)
            raise
    except BaseException:
        with _lock:
            _builtins_tried.discard(name)
        raise


def _check_half(what: str, cls: object, base: type) -> None:
    """Refuse ``cls`` unless it is a subclass of ``base``."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise InvalidConfigError(what, cls, f"a subclass of connectors.{base.__name__}")


def _check_concrete(what: str, cls: type, base: type) -> None:
    """Refuse ``cls`` if it leaves abstract methods of ``base`` unimplemented."""
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise InvalidConfigError(
            what,
            cls,
            f"{cls.__qualname__} is abstract: implement {missing} "
            f"(the abstract methods of connectors.{base.__name__})",
        )


def register_connector(
    name: str,
    scheduler_cls: type[KVConnectorScheduler],
    worker_cls: type[KVConnectorWorker],
    *,
    replace: bool = False,
) -> ConnectorSpec:
    """Register a connector under ``name``; usually called at the import of its module.

    Args:
        name: The name ``EngineConfig.connector`` refers to.
        scheduler_cls: The scheduler half, built as ``scheduler_cls(context)``.
        worker_cls: The worker half, built as ``worker_cls(context)``.
        replace: Override an existing registration of ``name`` (built-ins included).

    Registering the very same classes again under the same name is a no-op.

    Returns:
        The registered spec.

    Raises:
        DuplicateConnectorError: ``name`` is taken and ``replace`` is false.
        InvalidConfigError: An empty name, or a class that is not the right half: not a
            subclass of ``KVConnectorScheduler`` / ``KVConnectorWorker``, or abstract (the
            message names the class and its unimplemented abstract methods).
    """
    if not isinstance(name, str) or not name:
        raise InvalidConfigError("connector name", name, "a non-empty string")
    _check_half("scheduler_cls", scheduler_cls, KVConnectorScheduler)
    _check_half("worker_cls", worker_cls, KVConnectorWorker)
    try:
        _load_builtin(name)  # a built-in name is taken even before its first lookup
    except ImportError as exc:  # a broken built-in does not take its name
        _log.warning("connector_import_failed", connector=name, error=repr(exc))
    spec = ConnectorSpec(name, scheduler_cls, worker_cls)
    with _lock:
        existing = _registry.get(name)
        if existing is not None and not replace and existing != spec:
            raise DuplicateConnectorError(name, existing)
        _check_concrete("scheduler_cls", scheduler_cls, KVConnectorScheduler)
        _check_concrete("worker_cls", worker_cls, KVConnectorWorker)
        _registry[name] = spec
    return spec


def unregister_connector(name: str) -> None:
    """Remove ``name`` (mostly for tests); a built-in name is not re-imported afterwards.

    Raises:
        UnknownConnectorError: ``name`` is not registered; lists the registered names.
    """
    _load_builtin(name)
    with _lock:
        if name not in _registry:
            raise UnknownConnectorError(name, _registry)
        del _registry[name]


def get_connector(name: str) -> ConnectorSpec:
    """The spec registered under ``name``, importing a built-in's module on first use.

    Raises:
        UnknownConnectorError: ``name`` is not registered; lists the registered names.
        ImportError: A built-in's module exists but failed to import.
    """
    with _lock:
        spec = _registry.get(name)
    if spec is None:
        _load_builtin(name)
        with _lock:
            spec = _registry.get(name)
    if spec is None:
        raise UnknownConnectorError(name, list_connectors())
    return spec


def list_connectors() -> tuple[str, ...]:
    """The registered names, sorted; built-ins whose module is absent are not listed.

    A built-in whose module fails to import is logged and left out.
    """
    for name in _BUILTIN_MODULES:
        try:
            _load_builtin(name)
        except ImportError as exc:
            _log.warning("connector_import_failed", connector=name, error=repr(exc))
    with _lock:
        return tuple(sorted(_registry))


@overload
def create_connector(
    name: str,
    role: Literal[KVConnectorRole.SCHEDULER, "scheduler"],
    context: ConnectorContext,
) -> KVConnectorScheduler: ...


@overload
def create_connector(
    name: str, role: Literal[KVConnectorRole.WORKER, "worker"], context: ConnectorContext
) -> KVConnectorWorker: ...


@overload
def create_connector(
    name: str, role: KVConnectorRole | str, context: ConnectorContext
) -> KVConnectorScheduler | KVConnectorWorker: ...


def create_connector(
    name: str, role: KVConnectorRole | str, context: ConnectorContext
) -> KVConnectorScheduler | KVConnectorWorker:
    """Build the ``role`` half of connector ``name`` with ``context``.

    The worker half comes back unguarded; wrap it with
    :func:`connectors.lifecycle.make_worker`.

    Args:
        name: A registered connector name.
        role: ``KVConnectorRole`` (or its value ``"scheduler"`` / ``"worker"``); must
            equal ``context.role``.
        context: What the half is built with.

    Raises:
        UnknownConnectorError: ``name`` is not registered.
        InvalidConfigError: ``role`` is not a role, or disagrees with ``context.role``.
    """
    try:
        role = KVConnectorRole(role)
    except ValueError:
        allowed = " | ".join(repr(r.value) for r in KVConnectorRole)
        raise InvalidConfigError("connector role", role, allowed) from None
    if role is not context.role:
        raise InvalidConfigError(
            "connector role", role.value, f"must equal context.role={context.role.value!r}"
        )
    spec = get_connector(name)
    cls = spec.scheduler_cls if role is KVConnectorRole.SCHEDULER else spec.worker_cls
    return cls(context)
