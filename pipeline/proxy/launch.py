"""``serve_proxy``: run the proxy under uvicorn (``kvstep proxy``), and its flags."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pipeline.logs import get_logger
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
    Logs ``listening on http://HOST:PORT`` once listening.

    Raises:
        SystemExit: The server did not start (e.g. the port is in use).
    """
    import uvicorn

    from pipeline.server.protocol import header_timeout_protocol

    options = options or ServerOptions()

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                bound = [s.getsockname()[1] for srv in self.servers for s in srv.sockets]
                shown = f"[{host}]" if ":" in host else host
                _log.info(f"proxy listening on http://{shown}:{bound[0] if bound else port}")

    server = Server(
        uvicorn.Config(
            create_proxy_app(proxy, options),
            host=host,
            port=port,
            log_level="warning",
            access_log=access_log,
            lifespan="on",
            http=header_timeout_protocol(options.header_timeout_s),
            timeout_keep_alive=max(1, round(options.timeout_keep_alive_s)),
            limit_concurrency=options.limit_concurrency,
        )
    )
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server.run()
    if not server.started:
        raise SystemExit(3)


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
    fields = _defaults()
    flags = (
        ("--health-interval", float, "health_interval_s", "seconds between health polls"),
        ("--health-timeout", float, "health_timeout_s", "seconds one health poll may take"),
        ("--connect-timeout", float, "connect_timeout_s", "seconds to open a backend connection"),
        ("--upstream-timeout", float, "upstream_timeout_s", "seconds a backend may stay silent"),
        ("--max-response-bytes", int, "max_response_bytes", "largest producer answer read; 502"),
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
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        connect_timeout_s=args.connect_timeout,
        upstream_timeout_s=args.upstream_timeout,
        max_response_bytes=args.max_response_bytes,
    )
