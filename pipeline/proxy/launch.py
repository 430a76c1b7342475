"""``serve_proxy``: run the proxy under uvicorn (``kvstep proxy``), and its flags."""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipeline.errors import InvalidConfigError
from pipeline.logger import get_logger
from pipeline.proxy.app import create_proxy_app
from pipeline.proxy.options import POLICIES, ProxyOptions
from pipeline.server.options import ServerOptions

__all__ = ["add_proxy_flags", "proxy_options", "serve_proxy"]

_log = get_logger()


def serve_proxy(
    proxy: ProxyOptions,
    host: str,
    port: int,
    options: ServerOptions | None = None,
    *,
    access_log: bool = False,
) -> None:
    """Serve the proxy on ``host:port`` until interrupted (blocks the calling thread).

    ``options`` guards the proxy as :func:`pipeline.server.serve`'s guard the server:
    body cap and timeout, API key, header and keep-alive timeouts, concurrency limit.
    Logs ``listening on http://HOST:PORT`` once listening. SIGINT/SIGTERM drain it as
    they drain a server (:mod:`pipeline.server.draining`): new requests get 503 with
    ``Retry-After``, ``/health`` 503 ``draining``, and the requests in flight run on
    for at most ``options.shutdown_timeout_s``, then are cut.

    Raises:
        SystemExit: The server did not start (e.g. the port is in use).
    """
    from pipeline.server.draining import DrainingServer
    from pipeline.server.protocol import run_uvicorn

    options = options or ServerOptions()

    class Server(DrainingServer):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                bound = [s.getsockname()[1] for srv in self.servers for s in srv.sockets]
                shown = f"[{host}]" if ":" in host else host
                _log.info(f"proxy listening on http://{shown}:{bound[0] if bound else port}")

    app = create_proxy_app(proxy, options)
    run_uvicorn(app, host, port, options, access_log, Server, app.state.kvstep.drain)


def add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    """The :class:`ProxyOptions` flags (``--backend`` or ``--prefill`` and ``--decode``,
    ``--policy``, ``--health-interval``, ...)."""
    parser.add_argument(
        "--backend", nargs="+", default=[], metavar="URL",
        help="base URLs of replicas that each serve whole requests (or --prefill/--decode)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", nargs="+", default=[], metavar="URL",
        help="base URLs of the producer (prefill) servers (with --decode)",
    )  # fmt: skip
    parser.add_argument(
        "--decode", nargs="+", default=[], metavar="URL",
        help="base URLs of the consumer (decode) servers (with --prefill)",
    )  # fmt: skip
    parser.add_argument(
        "--policy", choices=POLICIES, default="round-robin",
        help="how a pool picks a healthy backend (default: round-robin)",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="kv-aware: the model's directory (tokenizer.json) or builtin:NAME, to hash text "
        "prompts and chats as the replicas do (default: token-id prompts only)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-events", nargs="+", default=[], metavar="ENDPOINT",
        help="kv-aware: each --backend's event endpoint (tcp://HOST:PORT), in order "
        "(default: read from each backend's /health)",
    )  # fmt: skip
    parser.add_argument(
        "--hash-format", choices=("int", "bytes"), default="int",
        help="kv-aware: the replicas' kv_events hash format (default: int)",
    )  # fmt: skip
    parser.add_argument(
        "--backend-api-key", default=None, metavar="KEY",
        help="the bearer key sent to the backends (default: $KVSTEP_BACKEND_API_KEY, else "
        "none; prefer the variable, argv is visible to other users); the client's "
        "Authorization is never passed on",
    )  # fmt: skip
    parser.add_argument(
        "--hash-seed", type=int, default=None,
        help="kv-aware: the replicas' hash_seed (default: $KVSTEP_HASH_SEED, else 0; prefer "
        "the variable, argv is visible to other users)",
    )  # fmt: skip
    fields = _defaults()
    flags = (
        ("--health-interval", float, "health_interval_s", "seconds between health polls"),
        ("--health-timeout", float, "health_timeout_s", "seconds one health poll may take"),
        ("--connect-timeout", float, "connect_timeout_s", "seconds to open a backend connection"),
        ("--upstream-timeout", float, "upstream_timeout_s", "seconds a backend may stay silent"),
        ("--max-response-bytes", int, "max_response_bytes", "largest producer answer read; 502"),
        ("--block-size", int, "block_size", "kv-aware: the replicas' block_size"),
        ("--load-weight", float, "load_weight", "kv-aware: blocks of work per open request"),
        ("--max-index-blocks", int, "max_index_blocks", "kv-aware: block hashes kept"),
        (
            "--max-backend-blocks",
            int,
            "max_backend_blocks",
            "kv-aware: block hashes kept per backend",
        ),
        (
            "--kv-events-silent-after",
            float,
            "events_silent_s",
            "kv-aware: seconds without an event, after a request that should have stored "
            "blocks, before a backend is reported silent",
        ),
    )
    for flag, kind, field, text in flags:
        default = fields[field]
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")


def _defaults() -> dict[str, Any]:
    """The defaults of the :class:`ProxyOptions` fields that have one."""
    import attrs

    return {f.name: f.default for f in attrs.fields(ProxyOptions) if f.default is not attrs.NOTHING}


def proxy_options(args: argparse.Namespace) -> ProxyOptions:
    """:class:`ProxyOptions` from the flags of :func:`add_proxy_flags`."""
    return ProxyOptions(
        backend=tuple(args.backend),
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        policy=args.policy,
        tokenizer=args.tokenizer,
        kv_events=tuple(args.kv_events),
        hash_format=args.hash_format,
        hash_seed=_hash_seed(args.hash_seed),
        block_size=args.block_size,
        load_weight=args.load_weight,
        max_index_blocks=args.max_index_blocks,
        max_backend_blocks=args.max_backend_blocks,
        events_silent_s=args.kv_events_silent_after,
        backend_api_key=_backend_api_key(args.backend_api_key),
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        connect_timeout_s=args.connect_timeout,
        upstream_timeout_s=args.upstream_timeout,
        max_response_bytes=args.max_response_bytes,
    )


def _backend_api_key(given: str | None) -> str | None:
    """``--backend-api-key``, else ``$KVSTEP_BACKEND_API_KEY``, else ``None``."""
    if given is not None:
        return given
    return os.environ.get("KVSTEP_BACKEND_API_KEY", "").strip() or None


def _hash_seed(given: int | None) -> int:
    """``--hash-seed``, else ``$KVSTEP_HASH_SEED``, else 0.

    Raises:
        InvalidConfigError: The variable is not an int (its value is not shown).
    """
    if given is not None:
        return given
    text = os.environ.get("KVSTEP_HASH_SEED", "").strip()
    if not text:
        return 0
    try:
        return int(text)
    except ValueError:
        raise InvalidConfigError("KVSTEP_HASH_SEED", "<hidden>", "must be an int") from None
