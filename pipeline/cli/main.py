"""The ``kvstep`` command line: ``run``, ``logs``, ``serve`` and ``proxy``.

Every ``EngineConfig`` field is also a flag of ``run`` and ``serve``
(``--max-num-seqs 8``, ``--no-enable-prefix-caching``, ``--connector-options '{...}'``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from pipeline.cli.config_flags import (
    add_config_flags,
    config_error,
    config_fields,
    serve_config,
)
from pipeline.cli.flag_help import RUN_DEFAULTS, SERVE_DEFAULTS, finish_help
from pipeline.errors import InvalidConfigError, KvstepError
from pipeline.logger import cli_logging

__all__ = ["build_parser", "main", "serve_config"]


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstep`` argument parser (sub-commands ``run``, ``logs``, ``serve``, ``proxy``)."""
    parser = argparse.ArgumentParser(prog="kvstep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a shared-prefix workload twice, across a restart")
    add_config_flags(run, RUN_DEFAULTS)
    run.add_argument("--num-prompts", type=int, default=16, help="prompts per pass")
    run.add_argument("--prefix-len", type=int, default=192, help="shared prefix tokens")
    run.add_argument("--suffix-len", type=int, default=32, help="unique suffix tokens")
    run.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    run.add_argument("--keep-store", action="store_true", help="do not clear the store first")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--json", type=Path, default=None, help="write the results here")

    logs = sub.add_parser("logs", help="summarize a step log; export a trace or a plot")
    logs.add_argument("file", type=Path, help="a JSON-lines step log (--step-log)")
    logs.add_argument("--trace", type=Path, default=None, help="Chrome trace-event JSON")
    logs.add_argument("--plot", type=Path, default=None, help="PNG stage timeline")
    logs.add_argument(
        "--steps",
        default=None,
        help="only steps A:B (A: or :B open) in the summary, trace and plot",
    )

    serve = sub.add_parser("serve", help="OpenAI-compatible server (kvstep[server])")
    add_config_flags(serve, SERVE_DEFAULTS)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--kv-role",
        choices=("producer", "consumer", "both"),
        default=None,
        help="disaggregated serving: shorthand for --connector nixl with this role "
        "(kvstep[nixl]; --connector-options adds the others, e.g. the side-channel "
        '{"port": 5601}); default: off',
    )
    serve.add_argument(
        "--kv-transfer-key-env",
        metavar="NAME",
        default=None,
        help="with --kv-role: the environment variable holding the key that producers "
        "and consumers share (side channel and transfer tickets are signed with it; "
        "e.g. `openssl rand -hex 32`); default: this user's key file in kvstep's cache "
        "directory, which engines of one user on one host share",
    )
    serve.add_argument(
        "--kv-peers",
        metavar="HOST:PORT",
        nargs="+",
        default=None,
        help="with --kv-role consumer: the producers' side-channel addresses (rank 0) "
        "this engine may read KV from; default: any producer on this host (loopback)",
    )
    _add_server_flags(serve)

    proxy = sub.add_parser(
        "proxy", help="route each request to a prefill server, then a decode server"
    )
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on")
    _add_proxy_flags(proxy)
    finish_help(parser)
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from pipeline.cli.run_job import RunOptions, default_run_config, run_job

    options = RunOptions(
        num_prompts=args.num_prompts,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        max_tokens=args.max_tokens,
        keep_store=args.keep_store,
    )
    config = default_run_config(**config_fields(args))
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    with Progress(console=console, disable=args.no_progress, transient=True) as progress:
        task = progress.add_task("requests (2 passes)", total=2 * options.num_prompts)
        with cli_logging(logging.WARNING):  # kvstep's warnings and errors on stderr
            results = anyio.run(run_job, config, options, lambda: progress.advance(task))
    table = Table(
        title="kvstep run: shared prefixes; 2nd pass on a restarted engine",
        caption="TTFT: median time to first token; loaded: tokens loaded from the store",
    )
    columns = [
        ("name", "pass"),
        ("requests", "reqs"),
        ("tokens", "tokens"),
        ("tokens_per_s", "tok/s"),
        ("ttft_ms_median", "TTFT ms"),
        ("loaded_tokens", "loaded"),
        ("steps", "steps"),
        ("finalizer_runs", "finalizers"),
    ]
    for _, title in columns:
        table.add_column(title, justify="right")
    for r in results:
        row = attrs.asdict(r)
        table.add_row(*(_fmt(row[key]) for key, _ in columns))
    console.print(table)
    if config.step_log is not None:
        console.print(f"step log: {Path(str(config.step_log)).resolve()}", soft_wrap=True)
    if args.json is not None:
        args.json.write_text(json.dumps([attrs.asdict(r) for r in results], indent=2))
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    from pipeline.steplog_tools.summary import (
        load_step_log,
        parse_steps,
        print_summary,
        write_plot,
        write_trace,
    )

    records = load_step_log(args.file)
    steps = parse_steps(args.steps)
    print_summary(records, steps=steps)
    if args.trace is not None:
        n = write_trace(records, args.trace, steps=steps)
        print(f"trace: {args.trace} ({n} events)")
    if args.plot is not None:
        write_plot(records, args.plot, steps=steps)
        print(f"plot: {args.plot}")
    return 0


_SERVER_PACKAGES = frozenset({"uvicorn", "starlette", "fastapi", "prometheus_client", "httpx"})


def _missing_server_extra(exc: ImportError) -> int:
    print(
        f"kvstep: error: the server needs extra packages ({exc}); "
        "install them with: pip install 'kvstep[server]'",
        file=sys.stderr,
    )
    return 2


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    try:
        from pipeline.server import add_server_flags
    except ImportError:  # no server extra: `serve` says so when it runs
        return
    add_server_flags(parser)


def _add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    try:
        from pipeline.proxy import add_proxy_flags
    except ImportError:  # no server extra: `proxy` says so when it runs
        return
    add_proxy_flags(parser)
    _add_server_flags(parser)


def _cmd_proxy(args: argparse.Namespace) -> int:
    try:
        from pipeline.proxy import proxy_options, serve_proxy
        from pipeline.server import server_options
    except ImportError as exc:
        return _missing_server_extra(exc)
    access = {"access_log": True} if getattr(args, "access_log", False) else {}
    if isinstance(args.tokenizer, str) and args.tokenizer.startswith("builtin:"):
        from stages.model.builtin import tokenizer_dir  # builds it once, like serve

        args.tokenizer = str(tokenizer_dir(args.tokenizer))
    with cli_logging(logging.INFO):  # the ready line and upstream failures on stderr
        serve_proxy(proxy_options(args), args.host, args.port, server_options(args), **access)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    try:
        from pipeline.server import serve, server_options
    except ImportError as exc:
        return _missing_server_extra(exc)
    try:
        access = {"access_log": True} if getattr(args, "access_log", False) else {}
        with cli_logging(logging.INFO):  # the ready, shutdown and request lines on stderr
            serve(config, args.host, args.port, server_options(args), **access)
    except ModuleNotFoundError as exc:  # a lazy import inside serve()
        if (exc.name or "").split(".")[0] not in _SERVER_PACKAGES:
            raise
        return _missing_server_extra(exc)
    return 0


def _fmt(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstep`` console script; returns the exit status.

    Errors of kvstep (bad config, unreadable step log) print ``kvstep: error: ...`` on
    stderr and return 2; a bad value of a flag given names the flag, like argparse's
    own errors (which exit with status 2).
    """
    args = build_parser().parse_args(argv)
    commands = {"run": _cmd_run, "logs": _cmd_logs, "serve": _cmd_serve, "proxy": _cmd_proxy}
    try:
        return commands[args.command](args)
    except InvalidConfigError as exc:
        print(config_error(args, exc), file=sys.stderr)
        return 2
    except KvstepError as exc:
        print(f"kvstep: error: {exc}", file=sys.stderr)
        return 2
