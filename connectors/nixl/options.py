"""The nixl connector's options and the ``kv_transfer_params`` it reads, checked once.

Options (``EngineConfig.connector_options``)::

    role                 "producer" (prefill), "consumer" (decode) or "both"
    host                 this engine's side-channel host, bound and advertised
                         (default "127.0.0.1")
    port                 side-channel port of rank 0; rank r serves on port + r
                         (default 5600)
    engine_id            this engine's id (default: the engine's own,
                         ``EngineConfig.engine_id``, a fresh uuid4 per engine)
    handshake_timeout_s  bound on a peer's handshake (default 5)
    read_timeout_s       bound on one request's READ (default 30)
    lease_s              how long a producer holds a finished prefill's blocks for
                         a consumer that never reads (default 60); also how long
                         its ticket is valid
    transfer_key_env     the environment variable holding the key producers and
                         consumers share (default: this user's key file;
                         :mod:`connectors.nixl.transfer_key`)
    peers                the producers a consumer may read from: a list of
                         "host:port" side-channel addresses (rank 0's); default
                         ``None``: any producer on this host (a loopback address)
    ucx_devices          the network devices UCX may listen and connect on
                         (``UCX_NET_DEVICES``, e.g. "eth0" or "mlx5_0:1", unless that
                         variable is set); default: "lo"
                         (loopback only) when ``host`` and every peer are on this
                         host, else every interface
"""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from connectors.nixl.tickets import Ticket
from connectors.nixl.transfer_key import TransferKey
from connectors.options import choice, integer, number, option, option_names, parse_options
from pipeline.checks import check_float, check_int
from pipeline.errors import InvalidConfigError, InvalidRequestError

__all__ = ["NIXL_OPTIONS", "NixlOptions", "RemotePrefill"]

Role = Literal["producer", "consumer", "both"]
_ROLES = ("producer", "consumer", "both")
_MAX_BLOCKS = 1 << 20
_seconds = number(1e-3, 86400.0, lo_open=False, allow_inf=False)


def _name(
    field: str, value: object, error: type[InvalidConfigError] | type[InvalidRequestError]
) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 256 or not value.isprintable():
        raise error(field, value, "a printable string of 1..256 characters")
    return value


def _config_name(name: str, value: object) -> str:
    return _name(name, value, InvalidConfigError)


def _fresh_engine_id() -> str:
    # Without the engine's id (a half built outside an engine) a fresh one: never an
    # id another engine on this host would derive too (a shared port, say).
    return uuid.uuid4().hex


def _key_env(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.isidentifier():
        raise InvalidConfigError(name, value, "the name of an environment variable")
    return value


def _peers(field: str, value: object) -> frozenset[tuple[str, int]] | None:
    """``["host:port", ...]`` (or a comma-separated string) as a set of addresses."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not 0 < len(items) <= 1024:
        raise InvalidConfigError(field, value, 'a list of "host:port" (1..1024 of them)')
    out = set()
    for item in items:
        host, sep, port = item.strip().rpartition(":") if isinstance(item, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidConfigError(field, item, 'a "host:port" side-channel address')
        out.add((_name(field, host.strip("[]"), InvalidConfigError), int(port)))
    return frozenset(out)


def _devices(name: str, value: object, options: NixlOptions) -> str:
    """``ucx_devices``, or by default loopback when nothing of this engine's is elsewhere."""
    if value is not None:
        if not isinstance(value, str) or not value or not value.isprintable():
            raise InvalidConfigError(name, value, 'a device list such as "eth0"')
        return value
    peers = options.peers
    local = _loopback(options.host) and all(_loopback(h) for h, _ in peers or ())
    return "lo" if local else ""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@attrs.frozen(kw_only=True)
class NixlOptions:
    """What the nixl connector was configured with (see the module docstring)."""

    role: Role = option(choice(*_ROLES))
    host: str = option(_config_name, default="127.0.0.1")
    port: int = option(integer(1, 65535), default=5600)
    engine_id: str = option(_config_name, factory=_fresh_engine_id)
    handshake_timeout_s: float = option(_seconds, default=5.0)
    read_timeout_s: float = option(_seconds, default=30.0)
    lease_s: float = option(_seconds, default=60.0)
    transfer_key_env: str | None = option(_key_env, default=None)
    peers: frozenset[tuple[str, int]] | None = option(_peers, default=None)
    ucx_devices: str = option(_devices, default=None, takes_self=True)

    def allows(self, host: str, port: int) -> str:
        """Why a consumer must not connect to the producer at ``host:port``, or ``""``."""
        if self.peers is None:
            if _loopback(host):
                return ""
            return f"{host}:{port} is not on this host; list remote producers in 'peers'"
        if (host, port) in self.peers:
            return ""
        return f"{host}:{port} is not one of the configured peers"

    def transfer_key(self) -> TransferKey:
        """The key the side channel and the tickets are signed with.

        Raises:
            InvalidConfigError: The variable is unset or too short, or the key file
                cannot be used.
        """
        if self.transfer_key_env is not None:
            return TransferKey.from_env("transfer_key_env", self.transfer_key_env)
        return TransferKey.default()

    @property
    def produces(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("consumer", "both")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], engine_id: str = "") -> NixlOptions:
        """Validate ``connector_options``, once, when a half is built; ``engine_id`` is
        the engine's (:attr:`~connectors.types.ConnectorContext.engine_id`), the default
        of the option (without it: a fresh uuid4).

        Raises:
            InvalidConfigError: An unknown option, a missing or unknown ``role``, or a
                value out of range; the message names the option.
        """
        defaults = {"engine_id": engine_id} if engine_id else None
        return parse_options(cls, options, connector="nixl", defaults=defaults)


NIXL_OPTIONS = option_names(NixlOptions)
"""Every option the nixl connector accepts."""


def _block_ids(field: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_BLOCKS:
        raise InvalidRequestError(field, value, "a list of block ids")
    return tuple(
        check_int(f"{field}[{i}]", b, InvalidRequestError, lo=0, hi=(1 << 31) - 1)
        for i, b in enumerate(value)
    )


@attrs.frozen(kw_only=True)
class RemotePrefill:
    """A consumer request's ``kv_transfer_params`` (``do_remote_prefill``), checked.

    They come from outside (a proxy, an HTTP body): every field is typed and bounded,
    else the request fails alone with :class:`~pipeline.errors.InvalidRequestError`.
    """

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    fingerprint: str
    block_size: int
    tp_size: int
    ticket: str
    expires_at: float

    def signed_fields(self, prompt_digest: str) -> Ticket:
        """What this request's ticket must sign, for a prompt of ``prompt_digest``."""
        return Ticket(
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            request_id=self.request_id,
            block_ids=self.block_ids,
            prompt_digest=prompt_digest,
            expires_at=self.expires_at,
        )

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """The remote prefill ``params`` ask for, or ``None`` when they ask for none.

        Raises:
            InvalidRequestError: ``do_remote_prefill`` is true and a field is missing
                or out of range.
        """
        if not params or params.get("do_remote_prefill") is not True:
            return None
        p = "kv_transfer_params"

        def field(key: str) -> Any:
            if key not in params:
                raise InvalidRequestError(f"{p}[{key!r}]", None, "required for remote prefill")
            return params[key]

        return cls(
            engine_id=_name(
                f"{p}['remote_engine_id']", field("remote_engine_id"), InvalidRequestError
            ),
            host=_name(f"{p}['remote_host']", field("remote_host"), InvalidRequestError),
            port=check_int(
                f"{p}['remote_port']", field("remote_port"), InvalidRequestError, lo=1, hi=65535
            ),
            request_id=_name(
                f"{p}['remote_request_id']", field("remote_request_id"), InvalidRequestError
            ),
            block_ids=_block_ids(f"{p}['remote_block_ids']", field("remote_block_ids")),
            fingerprint=_name(f"{p}['fingerprint']", field("fingerprint"), InvalidRequestError),
            block_size=check_int(
                f"{p}['block_size']", field("block_size"), InvalidRequestError, lo=1, hi=1 << 20
            ),
            tp_size=check_int(
                f"{p}['tp_size']", field("tp_size"), InvalidRequestError, lo=1, hi=1 << 16
            ),
            ticket=_name(f"{p}['ticket']", field("ticket"), InvalidRequestError),
            expires_at=check_float(
                f"{p}['expires_at']", field("expires_at"), InvalidRequestError, lo=0.0, hi=1e12
            ),
        )
