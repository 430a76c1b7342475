"""The step log: one structured record per stage and one per step, from a StepReport,
after one ``model`` record of what the engine runs (:meth:`StepLog.record_model`).

Records go to a JSON-lines file when a path is given, through a private structlog
logger built with :func:`structlog.wrap_logger` (never global configuration), and also to
kvstep's logger at debug level (:mod:`pipeline.logger`: structlog's ``kvstep`` logger when
the application configured structlog, else ``logging.getLogger("kvstep")`` when it is
enabled for debug). An unconfigured host application gets nothing on its stdout or
stderr. The library never configures structlog globally.

Each file record carries ``ts`` (unix time when it was written) and ``start_ts`` (unix
time when the step or stage started), enough to draw a timeline later::

    {"event": "stage", "step_id": 7, "rank": 0, "kind": "worker", "stage": "forward",
     "outcome": "ok", "start_s": 0.0011, "duration_s": 0.0123, "finalizer": false,
     "error": null, "start_ts": 1718000000.12, "ts": 1718000000.15}
    {"event": "step", "step_id": 7, "rank": 0, "kind": "worker", "outcome": "ok",
     "duration_s": 0.0151, "failed_stage": null, "finalizer_failures": [],
     "batch_size": 4, ..., "start_ts": 1718000000.12, "ts": 1718000000.15}
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import structlog

from pipeline.errors import InvalidConfigError
from pipeline.kernel.report import StepReport
from pipeline.logger import debug_enabled, get_logger

__all__ = ["RESERVED_FIELDS", "StepLog", "bind_step"]

RESERVED_FIELDS = frozenset(
    {"event", "ts", "start_ts", "step_id", "rank", "kind", "outcome", "duration_s",
     "failed_stage", "finalizer_failures"}
)  # fmt: skip
"""Keys of a step record that ``record_step(**fields)`` may not override."""


class _BoundStep:
    """The context manager of :func:`bind_step`: binds on enter, restores on exit."""

    __slots__ = ("_tokens", "_values")

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values
        self._tokens: Mapping[str, Any] = {}

    def __enter__(self) -> None:
        self._tokens = structlog.contextvars.bind_contextvars(**self._values)

    def __exit__(self, *exc_info: object) -> None:
        structlog.contextvars.reset_contextvars(**self._tokens)


def bind_step(step_id: int, rank: int | None = None) -> contextlib.AbstractContextManager[None]:
    """Bind ``step_id`` (and ``rank``, when given) in structlog's contextvars for the block.

    Every structlog call inside the block (in this task, or in tasks it starts) carries
    them, provided the application's processors include ``merge_contextvars``. The
    previous values are restored on exit, also on error or cancellation (by the
    contextvars' reset tokens: a third of the cost of ``bound_contextvars``, twice a step).
    """
    values: dict[str, Any] = {"step_id": step_id}
    if rank is not None:
        values["rank"] = rank
    return _BoundStep(values)


class _LineWriter:
    """The wrapped logger of the file: writes rendered lines, flushing is the caller's."""

    __slots__ = ("_file",)

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    def msg(self, message: str) -> None:
        self._file.write(message + "\n")


class StepLog:
    """Writes the per-stage and per-step records of each :class:`StepReport`.

    Thread-safe: workers may record from threads; the records of one step are written
    together under a lock and flushed once per step.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        """Open the log.

        Args:
            path: A JSON-lines file, opened for appending (parent folders are created);
                ``None`` writes no file (records still reach a configured ``kvstep``
                logger).
        """
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._writer: Any = None
        # Called as listener(report, kind, fields) after each record_step (e.g. metrics).
        self.listeners: list[Callable[[StepReport, str, dict[str, Any]], None]] = []
        # One logger for the log's lifetime: it picks structlog or stdlib per record.
        self._app_log = get_logger()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
            self._writer = structlog.wrap_logger(
                _LineWriter(self._file),
                processors=[
                    structlog.contextvars.merge_contextvars,
                    structlog.processors.TimeStamper(fmt=None, utc=True, key="ts"),
                    structlog.processors.JSONRenderer(),
                ],
                wrapper_class=structlog.BoundLogger,
                context_class=dict,
                cache_logger_on_first_use=True,
            )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a log without a path is never closed)."""
        return self.path is not None and self._file is None

    def record_step(self, report: StepReport, *, kind: str, **fields: Any) -> None:
        """Write one record per stage of ``report``, then one for the step.

        Called by the engine (``kind="engine"``) or a worker (``kind="worker"``) once per
        step, after the step ended; may block briefly on the file write. After
        :meth:`close`, records no longer go to the file (they still reach a configured
        ``kvstep`` logger).

        Args:
            report: The runner's report of the step.
            kind: ``"engine"`` or ``"worker"``: which graph the report is of.
            **fields: Extra values of the step record (batch_size, num_tokens,
                loaded_tokens, saved_tokens, loaded_bytes, saved_bytes, finished, errors;
                the engine's ``request_times`` maps each request finished in the step to
                its ``[arrival, first_scheduled, first_token]`` unix times).

        Raises:
            InvalidConfigError: A field uses a reserved key (see ``RESERVED_FIELDS``).
        """
        clash = RESERVED_FIELDS.intersection(fields)
        if clash:
            raise InvalidConfigError(
                "step record field",
                sorted(clash)[0],
                f"reserved keys are {', '.join(sorted(RESERVED_FIELDS))}",
            )
        for listener in list(self.listeners):
            try:
                listener(report, kind, fields)
            except Exception as exc:  # a failing listener must not fail the step
                self._app_log.error("step listener failed", error=repr(exc))
        to_app = debug_enabled()
        if self._writer is None and not to_app:
            return  # nobody reads the records: do not build them
        self._emit(self._records(report, kind, fields), to_app)

    def _emit(self, records: list[dict[str, Any]], to_app: bool) -> None:
        """Write ``records`` to the file (together, one flush) and, when ``to_app``, to
        the application's ``kvstep`` logger at debug level."""
        if self._writer is not None:
            with self._lock:
                if self._file is not None:
                    for record in records:
                        self._writer.msg(**record)
                    self._file.flush()
        if to_app:
            for record in records:
                self._app_log.debug(**record)

    @staticmethod
    def _records(report: StepReport, kind: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
        head = {"step_id": report.step_id, "rank": report.rank, "kind": kind}
        records: list[dict[str, Any]] = [
            {
                "event": "stage",
                **head,
                "stage": s.name,
                "outcome": s.outcome,
                "start_s": s.start_s,
                "duration_s": s.duration_s,
                "finalizer": s.finalizer,
                "error": s.error,
                "start_ts": report.start_ts + s.start_s,
            }
            for s in report.stages
        ]
        records.append(
            {
                "event": "step",
                **head,
                "outcome": report.outcome,
                "duration_s": report.duration_s,
                "failed_stage": report.failed_stage,
                "finalizer_failures": list(report.finalizer_failures),
                **fields,
                "start_ts": report.start_ts,
            }
        )
        return records

    def record_model(self, **fields: Any) -> None:
        """Write the log's ``model`` record: what the engine runs and on what (model,
        dtype, device, ranks, KV blocks, the linear kernel its projections were put on,
        whether its passes run compiled: ``torch_compile``, ``false`` where it fell back).

        Written once, when the engine has started, before its first step::

            {"event": "model", "model": "builtin:tiny", "dtype": "auto", "device": "auto",
             "world_size": 1, "executor": "inprocess", "num_blocks": 512,
             "block_size": 16, "linear_kernel": "onednn", "compiled": false,
             "ts": 1718000000.1}
        """
        self._emit([{"event": "model", **fields}], debug_enabled())

    def close(self) -> None:
        """Flush and close the file; idempotent. Thread-safe."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StepLog(path={str(self.path) if self.path else None!r})"
