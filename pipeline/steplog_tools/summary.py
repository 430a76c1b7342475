"""Reading a step log (:mod:`pipeline.steplog`) and summarizing it: ``kvstep logs FILE``.

:func:`load_step_log` reads the JSON-lines file, :func:`summarize` turns its records into
a :class:`LogSummary` (per-stage p50/p99 latency, steps, batch sizes, KV traffic,
errors), :func:`print_summary` prints it as tables. The Chrome trace export lives in
:mod:`pipeline.steplog_tools.trace`, the PNG timeline in
:mod:`pipeline.steplog_tools.plot`; both are re-exported here. Everything here is
synchronous, pure (apart from reading the file and printing) and thread-safe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from pipeline.artifacts import SpecDecodeStats
from pipeline.errors import InvalidConfigError
from pipeline.steplog_tools.plot import narrow_to_steps, parse_steps, write_plot
from pipeline.steplog_tools.trace import trace_events, write_trace

__all__ = [
    "LogSummary",
    "StageStats",
    "load_step_log",
    "parse_steps",
    "print_summary",
    "summarize",
    "trace_events",
    "write_plot",
    "write_trace",
]

Record = dict[str, Any]


def load_step_log(path: str | Path) -> list[Record]:
    """Read the records of a step log, in file order.

    A half-written last line (a log still being written) is skipped; any other line
    that is not a JSON object with an ``event`` is an error.

    Raises:
        InvalidConfigError: The file is missing, unreadable, malformed or holds no record.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfigError("step log", str(path), f"must be a readable file ({exc})") from exc
    records: list[Record] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break
            raise InvalidConfigError(
                "step log", f"{path}:{number}", "every line must be a JSON record"
            ) from None
        if not isinstance(record, dict) or "event" not in record:
            raise InvalidConfigError(
                "step log", f"{path}:{number}", "every line must be a JSON object with 'event'"
            )
        records.append(record)
    if not records:
        raise InvalidConfigError("step log", str(path), "holds no step record")
    return records


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 1] of non-empty sorted values."""
    index = max(0, math.ceil(q * len(sorted_values)) - 1)
    return sorted_values[min(index, len(sorted_values) - 1)]


@attrs.frozen(kw_only=True)
class StageStats:
    """Latency of one stage of one graph kind, over every step and rank.

    Attributes:
        kind: ``"engine"`` or ``"worker"``.
        stage: The stage's name.
        count: Records of the stage.
        p50_ms: Median duration.
        p99_ms: 99th percentile duration (nearest rank).
        max_ms: Longest duration.
        errors: Records whose outcome is not ``"ok"``.
    """

    kind: str
    stage: str
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    errors: int


@attrs.frozen(kw_only=True)
class LogSummary:
    """Everything ``kvstep logs`` prints about a step log.

    Attributes:
        stages: Per-stage latency, engine stages first, in order of first appearance.
        engine_steps: Engine steps (one engine step record each).
        worker_steps: Worker step records, all ranks together: one per rank per step, so
            ``engine_steps * len(ranks)`` when every rank logged every step.
        ranks: Worker ranks seen.
        steps: The step range ``(A, B)`` summarized (``None``: open).
        failed_steps: Step records (any kind) whose outcome is not ``"ok"``.
        batch_size_mean: Mean requests per engine step (0 without engine steps).
        batch_size_max: Most requests in one engine step.
        num_tokens: Tokens scheduled over all engine steps.
        loaded_tokens: Tokens loaded by connectors (engine step records).
        loaded_bytes: Bytes loaded by connectors.
        saved_tokens: Tokens saved by connectors.
        saved_bytes: Bytes saved by connectors.
        load_error_blocks: Blocks that failed to load.
        failed_save_requests: Requests whose save failed.
        stage_errors: ``(step_id, rank, stage, error)`` of every failed stage record.
        spec_decode: Speculative drafts verified and kept over the engine steps
            (all zero without speculative decoding).
        model: The last ``model`` record's fields (what the engine ran: model, dtype,
            linear kernel, ...), without ``event`` and ``ts``; empty when the log has none.
    """

    stages: tuple[StageStats, ...]
    engine_steps: int
    worker_steps: int
    ranks: tuple[int, ...]
    failed_steps: int
    batch_size_mean: float
    batch_size_max: int
    num_tokens: int
    loaded_tokens: int
    loaded_bytes: int
    saved_tokens: int
    saved_bytes: int
    load_error_blocks: int
    failed_save_requests: int
    stage_errors: tuple[tuple[Any, Any, str, str], ...]
    steps: tuple[int | None, int | None] = (None, None)
    spec_decode: SpecDecodeStats = attrs.field(factory=SpecDecodeStats)
    model: Mapping[str, Any] = attrs.field(factory=dict)

    def spec_decode_rows(self) -> list[tuple[str, str]]:
        """The speculative decoding rows of the totals table (none without drafts)."""
        spec = self.spec_decode
        if not spec.num_drafts:
            return []
        rate = spec.acceptance_rate or 0.0
        per_position = ", ".join(
            f"{kept / spec.num_drafts:.0%}" for kept in spec.accepted_per_position
        )
        return [
            ("speculative drafts (requests / tokens)",
             f"{spec.num_drafts} / {spec.num_draft_tokens}"),
            ("drafts accepted (tokens / rate)", f"{spec.num_accepted_tokens} / {rate:.1%}"),
            ("mean acceptance length", f"{spec.mean_acceptance_length:.2f}"),
            ("accepted per position (of drafted requests)", per_position),
        ]  # fmt: skip

    def model_line(self) -> str:
        """``model: key=value, ...`` of :attr:`model` (empty when the log has none)."""
        if not self.model:
            return ""
        return "model: " + ", ".join(f"{k}={v}" for k, v in self.model.items())

    def counts_line(self) -> str:
        """Steps and ranks in one unambiguous line."""
        ranks = len(self.ranks)
        selected = ""
        if self.steps != (None, None):
            first, stop = self.steps
            selected = f" (steps {'' if first is None else first}:{'' if stop is None else stop})"
        return (
            f"engine steps: {self.engine_steps}, worker step records: {self.worker_steps} "
            f"over {ranks} rank{'' if ranks == 1 else 's'}{selected}"
        )


def summarize(
    records: Sequence[Record], steps: tuple[int | None, int | None] = (None, None)
) -> LogSummary:
    """Summarize step-log records (as read by :func:`load_step_log`).

    ``steps`` (``A:B`` as :func:`parse_steps` returns it) keeps only the records of
    those steps.

    Raises:
        InvalidConfigError: ``steps`` selects no record of the log.
    """
    models = [r for r in records if r.get("event") == "model"]
    model = {k: v for k, v in models[-1].items() if k not in ("event", "ts")} if models else {}
    records = narrow_to_steps(records, steps)
    durations: dict[tuple[str, str], list[float]] = {}
    stage_failures: dict[tuple[str, str], int] = {}
    stage_errors: list[tuple[Any, Any, str, str]] = []
    engine_steps: list[Record] = []
    worker_steps = failed = 0
    ranks: set[int] = set()
    for rec in records:
        kind = str(rec.get("kind"))
        if rec.get("event") == "stage":
            key = (kind, str(rec.get("stage")))
            durations.setdefault(key, []).append(1000 * float(rec.get("duration_s") or 0.0))
            if rec.get("outcome") != "ok":
                stage_failures[key] = stage_failures.get(key, 0) + 1
                stage_errors.append(
                    (rec.get("step_id"), rec.get("rank"), key[1], str(rec.get("error")))
                )
        elif rec.get("event") == "step":
            failed += rec.get("outcome") != "ok"
            if kind == "engine":
                engine_steps.append(rec)
            else:
                worker_steps += 1
                if isinstance(rec.get("rank"), int):
                    ranks.add(rec["rank"])
    order = sorted(durations, key=lambda k: k[0] != "engine")
    stages = tuple(
        StageStats(
            kind=kind,
            stage=stage,
            count=len(values),
            p50_ms=_percentile(sorted(values), 0.5),
            p99_ms=_percentile(sorted(values), 0.99),
            max_ms=max(values),
            errors=stage_failures.get((kind, stage), 0),
        )
        for kind, stage in order
        for values in [durations[(kind, stage)]]
    )
    batches = [int(r.get("batch_size") or 0) for r in engine_steps]

    def total(field: str) -> int:
        return sum(int(r.get(field) or 0) for r in engine_steps)

    return LogSummary(
        stages=stages,
        engine_steps=len(engine_steps),
        worker_steps=worker_steps,
        ranks=tuple(sorted(ranks)),
        failed_steps=failed,
        batch_size_mean=sum(batches) / len(batches) if batches else 0.0,
        batch_size_max=max(batches, default=0),
        num_tokens=total("num_tokens"),
        loaded_tokens=total("loaded_tokens"),
        loaded_bytes=total("loaded_bytes"),
        saved_tokens=total("saved_tokens"),
        saved_bytes=total("saved_bytes"),
        load_error_blocks=total("load_error_blocks"),
        failed_save_requests=sum(len(r.get("failed_save_requests") or ()) for r in engine_steps),
        stage_errors=tuple(stage_errors),
        steps=steps,
        spec_decode=sum(map(_spec_decode, engine_steps), SpecDecodeStats()),
        model=model,
    )


def _spec_decode(record: Record) -> SpecDecodeStats:
    """An engine step record's speculative decoding counts (zero when it has none)."""
    if not record.get("spec_drafts"):
        return SpecDecodeStats()
    return SpecDecodeStats(
        num_drafts=int(record["spec_drafts"]),
        num_draft_tokens=int(record.get("spec_draft_tokens") or 0),
        num_accepted_tokens=int(record.get("spec_accepted_tokens") or 0),
        accepted_per_position=tuple(int(n) for n in record.get("spec_accepted_per_position") or ()),
    )


def print_summary(
    records: Sequence[Record],
    file: IO[str] | None = None,
    steps: tuple[int | None, int | None] = (None, None),
) -> LogSummary:
    """Print the summary tables of ``records`` in ``steps`` (to ``file``, default stdout).

    Returns:
        The summary printed.
    """
    from rich.console import Console
    from rich.table import Table

    summary = summarize(records, steps)
    console = Console(file=file, width=110)
    if summary.model:
        console.print(summary.model_line(), markup=False, soft_wrap=True)
    console.print(summary.counts_line(), markup=False)
    latency = Table(title="stage latency (ms)")
    for title in ("kind", "stage", "count", "p50", "p99", "max", "errors"):
        latency.add_column(title, justify="left" if title in ("kind", "stage") else "right")
    for s in summary.stages:
        latency.add_row(
            s.kind, s.stage, str(s.count), f"{s.p50_ms:.3f}", f"{s.p99_ms:.3f}",
            f"{s.max_ms:.3f}", str(s.errors),
        )  # fmt: skip
    console.print(latency)
    totals = Table(title="steps, batches, KV traffic, errors")
    totals.add_column("what")
    totals.add_column("value", justify="right")
    for what, value in (
        ("engine steps", summary.engine_steps),
        ("worker step records (one per rank per step)", summary.worker_steps),
        (f"worker ranks ({len(summary.ranks)})", ", ".join(map(str, summary.ranks)) or "-"),
        ("batch size (mean / max)", f"{summary.batch_size_mean:.1f} / {summary.batch_size_max}"),
        ("tokens scheduled", summary.num_tokens),
        ("KV loaded (tokens / bytes)", f"{summary.loaded_tokens} / {summary.loaded_bytes}"),
        ("KV saved (tokens / bytes)", f"{summary.saved_tokens} / {summary.saved_bytes}"),
        ("failed steps", summary.failed_steps),
        ("blocks failed to load", summary.load_error_blocks),
        ("requests whose save failed", summary.failed_save_requests),
        *summary.spec_decode_rows(),
    ):
        totals.add_row(what, str(value))
    console.print(totals)
    for step_id, rank, stage, error in summary.stage_errors[:20]:
        console.print(f"step {step_id} rank {rank} stage {stage}: {error}", markup=False)
    return summary
