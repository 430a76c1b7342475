"""``RedisStore``: the keys and the pipelined round trips both halves make.

One synchronous ``redis`` client per store (thread-safe: a connection pool), binary
values (no ``decode_responses``), and at most one retry of a command whose connection
broke (a server restarted since the connection was pooled); timeouts are not retried,
so every call is bounded by the store's socket timeout (about twice it, at worst, for a
connect plus a command).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from connectors.redis_store.options import RedisOptions
from pipeline.logger import get_logger

__all__ = ["RateLimitedLog", "RedisStore", "store_key"]

log = get_logger()


def store_key(prefix: str, fingerprint_key: str, block_hash: bytes) -> bytes:
    """The key of one block: ``prefix + fingerprint_key + ":" + block hash (hex)``."""
    return f"{prefix}{fingerprint_key}:{block_hash.hex()}".encode()


class RateLimitedLog:
    """Logs each event (by name) once per ``interval_s`` at most, counting the ones it
    held back, so a dead server does not flood the log with one line per step.

    Thread-safe; never blocks.
    """

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, event: str, **fields: object) -> None:
        """Log ``event`` unless it was logged less than ``interval_s`` ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(event, -float("inf")) < self.interval_s:
                self._held[event] = self._held.get(event, 0) + 1
                return
            held = self._held.pop(event, 0)
            self._last[event] = now
        log.warning(event, suppressed=held, **fields)


class RedisStore:
    """A client of one Redis/Valkey server with the connector's round trips.

    Args:
        options: The connector's options (url, password, TLS, pool size, TTL). The
            password is revealed to the client only; nothing of this store prints it.
        timeout_s: Socket (and connect) timeout of every command of this store.

    Every method blocks for at most about ``timeout_s`` (twice on a reconnect), is
    thread-safe, and raises ``redis.RedisError`` (never anything else from the server)
    when the server is down, slow or refuses.
    """

    def __init__(self, options: RedisOptions, timeout_s: float) -> None:
        self.options = options
        self.client = redis.Redis.from_url(
            options.client_url,
            password=None if options.password is None else options.password.reveal(),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=options.pool_size,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            decode_responses=False,
        )

    def __repr__(self) -> str:
        return f"RedisStore({self.options.url!r}, key_prefix={self.options.key_prefix!r})"

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key exists: one pipelined round trip of ``EXISTS``."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key (``None`` when missing): one pipelined round trip."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return list(pipe.execute())

    def set_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store every ``(key, value)``, with the configured TTL: one round trip."""
        if not items:
            return
        ttl = self.options.ttl_s
        px = None if ttl is None else max(1, round(ttl * 1000))
        pipe = self.client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, px=px)
        pipe.execute()

    def close(self) -> None:
        """Close every pooled connection. Idempotent; never raises."""
        try:
            self.client.close()
        except Exception as exc:  # closing a broken connection is not an error
            log.debug("redis: close failed", error=repr(exc))
