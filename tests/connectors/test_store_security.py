"""Issue 10, findings 11, 13 and 15: the stores' privacy, temp-file cleanup and secrets.

11: shared_storage creates directories 0700 and files 0600, refuses a root another user
    owns or others may write unless ``allow_shared``, and a planted symlink is a logged
    miss (the request completes with the reference output).
13: the stale-temp cleanup never removes another host's fresh temp file.
15: the redis password comes from ``password_env``/``password_file``, works against a
    ``--requirepass`` server, and never shows in reprs or logs (even when connecting
    fails); a literal ``password`` (or one in the URL) is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import structlog
from ports import free_port
from store_workload import PARAMS, PROMPTS, engine_config

from connectors.shared_storage import DiskStore, SharedStorageOptions
from pipeline import LLM, EngineConfig
from pipeline.errors import InvalidConfigError

FP = "ab" * 16


@pytest.fixture(scope="module")
def reference(llama_path) -> list:
    with LLM(engine_config(llama_path, None, {})) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ------------------------------------------------------------------ finding 11


class TestPrivateStore:
    def test_modes_after_a_save(self, tmp_path):
        """Finding 11: the root, its directories and a value are 0700/0600 (umask 022)."""
        old = os.umask(0o022)
        try:
            store = DiskStore(tmp_path / "new" / "store")
            store.write(FP, b"\x01" * 32, b"kv bytes")
        finally:
            os.umask(old)
        value = store.path_for(FP, b"\x01" * 32)
        assert mode(value) == 0o600
        assert [mode(d) for d in (value.parent, value.parent.parent, store.root)] == [0o700] * 3

    @pytest.mark.parametrize("bits", [0o777, 0o775, 0o1777])
    def test_writable_root_is_refused_unless_shared(self, tmp_path, bits):
        """Finding 11: a group/world-writable root is InvalidConfigError naming
        allow_shared; with allow_shared=True it is accepted (group modes 0770/0660)."""
        root = tmp_path / "store"
        root.mkdir()
        os.chmod(root, bits)
        with pytest.raises(InvalidConfigError, match="allow_shared"):
            DiskStore(root)
        opts = SharedStorageOptions.from_options({"path": str(root), "allow_shared": True})
        store = DiskStore(opts.path, allow_shared=opts.allow_shared)
        store.write(FP, b"\x02" * 32, b"kv")
        assert mode(store.path_for(FP, b"\x02" * 32)) == 0o660

    @pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
    def test_another_users_root_is_refused(self, tmp_path):
        """Finding 11: a root owned by another user is refused unless allow_shared."""
        root = tmp_path / "store"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        with pytest.raises(InvalidConfigError, match="another user"):
            DiskStore(root)
        DiskStore(root, allow_shared=True)

    def test_hash_seed_secrecy_is_documented(self):
        """Finding 11: the options document that a secret hash_seed makes keys
        unguessable, and allow_shared."""
        doc = SharedStorageOptions.__doc__ or ""
        assert "hash_seed" in doc and "secret" in doc and "allow_shared" in doc

    @pytest.mark.parametrize("target", ["outside", "inside"])
    def test_planted_symlink_is_a_logged_miss(self, llama_path, reference, tmp_path, target):
        """Finding 11: a symlink planted at every value's path (to the genuine frame moved
        out of the root, or to another value inside it) is a logged miss; the requests
        complete with the reference output and nothing loads."""
        store = tmp_path / "store"
        with LLM(engine_config(llama_path, "shared_storage", {"path": str(store)})) as llm:
            llm.generate(PROMPTS, PARAMS)
        values = sorted(store.glob("*/*/*.kv"))
        assert len(values) >= 2
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        for n, path in enumerate(values):
            if target == "outside":
                moved = outside / path.name
                path.rename(moved)
                path.symlink_to(moved)
            else:
                other = values[(n + 1) % len(values)]
                keep = other.with_suffix(".kept")
                if not keep.exists():
                    keep.write_bytes(other.read_bytes())
                path.unlink()
                path.symlink_to(keep)
        config = engine_config(llama_path, "shared_storage", {"path": str(store)})
        with structlog.testing.capture_logs() as logs, LLM(config) as llm:
            outs = llm.generate(PROMPTS, PARAMS)
            (worker,) = [w.connector.inner for w in llm.engine.core.workers]
            stats = worker.stats
        assert [o.token_ids for o in outs] == reference
        assert all(o.finish_reason != "error" for o in outs)
        assert stats.loaded_blocks == 0
        planted = [e for e in logs if "treated as a miss" in e["event"]]
        assert planted and all(e["log_level"] == "warning" for e in planted)


# ------------------------------------------------------------------ finding 13


def dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def temp(target: str, host: str, pid: int) -> str:
    """A temp name as documented in connectors.shared_storage.naming."""
    return f".{target}.{host}.{pid}.{uuid.uuid4().hex}.tmp"


def test_other_hosts_fresh_temps_survive_cleanup(tmp_path):
    """Finding 13: another host's fresh temp (its pid dead here) survives; another
    host's old one and this host's temps of dead writers are removed; a live one stays."""
    from connectors.shared_storage.naming import parse_temp, temp_name, this_host

    store = DiskStore(tmp_path / "store")
    folder = store.root / FP / "00"
    folder.mkdir(parents=True)
    pid = dead_pid()
    other_fresh = folder / temp("00aa.kv", "node-b_1", pid)
    other_old = folder / temp("00bb.kv", "node-b_1", pid)
    legacy_fresh = folder / f".00cc.kv.{pid}.{uuid.uuid4().hex}.tmp"  # no host: age only
    mine_dead = folder / temp_name("00dd.kv", pid=pid)
    mine_live = folder / temp_name("00ee.kv")
    for path in (other_fresh, other_old, legacy_fresh, mine_dead, mine_live):
        path.write_bytes(b"partial")
    os.utime(other_old, (time.time() - 1000, time.time() - 1000))
    assert temp_name("00aa.kv", host="node-b_1", pid=pid)[:-37] == other_fresh.name[:-37]
    assert parse_temp(other_fresh.name).host == "node-b_1"  # type: ignore[union-attr]
    assert parse_temp(mine_dead.name).host == this_host()  # type: ignore[union-attr]
    assert store.clean_stale_temps(max_age_s=300) == 2
    assert sorted(folder.iterdir()) == sorted([other_fresh, legacy_fresh, mine_live])


# ------------------------------------------------------------------ finding 15

PW_ENV = "KVSTEP_TEST_REDIS_PASSWORD"


@attrs.frozen
class AuthServer:
    """A ``redis-server --requirepass PASSWORD`` on a loopback port."""

    port: int
    password: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def redis_auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    """A module's password-protected redis-server; skips like the conftest fixture."""
    redis = pytest.importorskip("redis", reason="the redis package is not installed")
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = AuthServer(free_port(), f"pw-{uuid.uuid4().hex}")
    args = [executable, "--port", str(server.port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--requirepass", server.password]
    workdir = tmp_path_factory.mktemp("redis-auth")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
    try:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                client = redis.Redis(port=server.port, password=server.password)
                with client:
                    if client.ping():
                        break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield server
    finally:
        proc.kill()
        proc.wait()


def redis_config(model: Path, url: str, prefix: str, **options) -> EngineConfig:
    return engine_config(model, "redis", {"url": url, "key_prefix": prefix, **options})


def shown(logs: list[dict], caplog: pytest.LogCaptureFixture) -> str:
    return repr(logs) + caplog.text


class TestRedisPassword:
    def test_literal_password_is_refused(self):
        """Finding 15: a literal password option (or one in the URL) is refused,
        pointing at password_env/password_file, never echoing it."""
        from connectors.redis_store import RedisOptions

        with pytest.raises(InvalidConfigError, match="password_env") as info:
            RedisOptions.from_options({"url": "redis://h:1/0", "password": "hunter2-xyz"})
        assert "password_file" in str(info.value) and "hunter2" not in str(info.value)
        with pytest.raises(InvalidConfigError, match="password_env") as info:
            RedisOptions.from_options({"url": "redis://user:hunter2-xyz@h:1/0"})
        assert "hunter2" not in str(info.value)

    def test_ttl_default_is_documented(self):
        """Finding 15: ttl_s has a documented default (a day); None still means never."""
        from connectors.redis_store import RedisOptions
        from connectors.redis_store.options import DEFAULT_TTL_S

        assert RedisOptions.from_options({"url": "redis://h:1/0"}).ttl_s == DEFAULT_TTL_S == 86400
        assert RedisOptions.from_options({"url": "redis://h:1/0", "ttl_s": None}).ttl_s is None
        assert "DEFAULT_TTL_S" in (RedisOptions.__doc__ or "")

    def test_password_env_against_requirepass(
        self, llama_path, reference, redis_auth_server, monkeypatch, caplog
    ):
        """Finding 15: password_env authenticates with a --requirepass server (the second
        engine loads the first's KV); the password is in no repr and no log."""
        password = redis_auth_server.password
        monkeypatch.setenv(PW_ENV, password)
        caplog.set_level(logging.DEBUG)
        prefix = f"auth-{uuid.uuid4().hex[:8]}:"
        config = redis_config(llama_path, redis_auth_server.url, prefix, password_env=PW_ENV)
        with structlog.testing.capture_logs() as logs:
            with LLM(config) as llm:
                assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
            with LLM(config) as llm:
                outs = llm.generate(PROMPTS, PARAMS)
                (worker,) = [w.connector.inner for w in llm.engine.core.workers]
                assert [o.token_ids for o in outs] == reference
                assert worker.stats.loaded_blocks > 0 and worker.stats.load_errors == 0
                texts = [
                    repr(config),
                    str(config),
                    repr(worker.options),
                    repr(worker),
                    repr(worker.store),
                    repr(worker.store.client),
                    repr(worker.store.client.connection_pool),
                ]
        assert all(password not in text for text in texts)
        assert password not in shown(logs, caplog)

    @pytest.mark.parametrize("failure", ["wrong-password", "server-down"])
    def test_password_never_logged_when_connecting_fails(
        self, llama_path, reference, redis_auth_server, monkeypatch, caplog, failure
    ):
        """Finding 15: a wrong password or an unreachable server is logged (misses,
        failed saves) without the password; outputs stay identical."""
        password = f"wrong-{uuid.uuid4().hex}" if failure == "wrong-password" else "pw-real"
        monkeypatch.setenv(PW_ENV, password)
        caplog.set_level(logging.DEBUG)
        url = redis_auth_server.url
        if failure == "server-down":
            url = "redis://127.0.0.1:1/0"
        config = redis_config(llama_path, url, "x:", password_env=PW_ENV)
        with structlog.testing.capture_logs() as logs, LLM(config) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
        warnings = [e for e in logs if e["log_level"] == "warning" and "redis" in e["event"]]
        assert warnings
        assert password not in shown(logs, caplog)

    def test_password_file(self, redis_auth_server, tmp_path):
        """Finding 15: password_file (one trailing newline dropped) authenticates; the
        options' repr shows the path, never the password."""
        from connectors.redis_store import RedisOptions, RedisStore

        path = tmp_path / "pw"
        path.write_text(redis_auth_server.password + "\n")
        opts = RedisOptions.from_options({"url": redis_auth_server.url, "password_file": path})
        store = RedisStore(opts, 2.0)
        try:
            assert store.exists_many([b"nothing-here"]) == [False]
        finally:
            store.close()
        assert redis_auth_server.password not in repr(opts) + repr(store)
        with pytest.raises(InvalidConfigError, match="password_file"):
            RedisOptions.from_options({"url": redis_auth_server.url, "password_file": "/none"})
