"""The nixl transfer key (its sources and their checks) and the producers a consumer may
connect to, without NIXL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from connectors.nixl import NixlOptions
from connectors.nixl.transfer_key import KEY_FILE_NAME, TransferKey, default_key_path
from pipeline.errors import InvalidConfigError


class TestKeyFile:
    def test_the_default_key_is_made_once_private_and_shared(self, tmp_path: Path) -> None:
        """First use makes a 0600 file of 32 random bytes; later uses (another engine of
        this user) read the same key; it never shows in a repr."""
        path = tmp_path / "cache" / KEY_FILE_NAME
        first = TransferKey.default(path)
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o077 == 0
        second = TransferKey.default(path)
        assert first.sign(b"x") == second.sign(b"x")
        assert first.verify(first.sign(b"a", b"b"), b"a", b"b")
        assert not first.verify(first.sign(b"a", b"b"), b"ab")  # parts are framed
        assert path.read_bytes().hex() not in repr(first)
        assert "hidden" in repr(first)

    def test_a_key_file_others_can_read_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / KEY_FILE_NAME
        TransferKey.default(path)
        path.chmod(0o644)
        with pytest.raises(InvalidConfigError, match="group or others"):
            TransferKey.default(path)

    def test_a_planted_symlink_is_refused(self, tmp_path: Path) -> None:
        """A symlink where the key file goes (to a file the attacker can read) is never
        followed."""
        target = tmp_path / "attacker-readable"
        target.write_bytes(b"k" * 32)
        target.chmod(0o600)
        link = tmp_path / KEY_FILE_NAME
        link.symlink_to(target)
        with pytest.raises(InvalidConfigError, match="cannot be used"):
            TransferKey.default(link)

    def test_a_truncated_key_file_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / KEY_FILE_NAME
        path.write_bytes(b"short")
        path.chmod(0o600)
        with pytest.raises(InvalidConfigError, match="32 bytes"):
            TransferKey.default(path)

    def test_the_default_path_follows_the_cache_directory(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("KVSTEP_CACHE_DIR", str(tmp_path))
        assert default_key_path() == tmp_path / KEY_FILE_NAME


class TestKeyFromEnvironment:
    def test_engines_sharing_the_variable_share_the_key(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("KV_KEY", "0123456789abcdef0123")
        options = NixlOptions.from_options({"role": "consumer", "transfer_key_env": "KV_KEY"})
        a, b = options.transfer_key(), TransferKey.from_env("transfer_key_env", "KV_KEY")
        assert a.sign(b"m") == b.sign(b"m")
        assert "0123456789abcdef" not in repr(a)

    @pytest.mark.parametrize(("value", "match"), [(None, "not set"), ("short", "at least 16")])
    def test_an_unset_or_short_key_is_refused_by_name(
        self, monkeypatch: pytest.MonkeyPatch, value: str | None, match: str
    ) -> None:
        """The error names the option and the variable, never the value."""
        if value is None:
            monkeypatch.delenv("KV_KEY", raising=False)
        else:
            monkeypatch.setenv("KV_KEY", value)
        options = NixlOptions.from_options({"role": "consumer", "transfer_key_env": "KV_KEY"})
        with pytest.raises(InvalidConfigError, match=match) as info:
            options.transfer_key()
        assert "KV_KEY" in str(info.value) and (value is None or value not in str(info.value))

    def test_a_bad_variable_name_is_refused(self) -> None:
        with pytest.raises(InvalidConfigError, match="transfer_key_env"):
            NixlOptions.from_options({"role": "consumer", "transfer_key_env": "A=B"})


class TestPeers:
    def test_by_default_only_producers_on_this_host(self) -> None:
        """No ``peers``: loopback addresses only (checked without any connection)."""
        options = NixlOptions.from_options({"role": "consumer"})
        for host in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"):
            assert options.allows(host, 5600) == ""
        for host in ("10.0.0.5", "169.254.169.254", "producer.example", "0.0.0.0"):
            assert "not on this host" in options.allows(host, 5600)

    def test_configured_peers_are_the_only_ones(self) -> None:
        options = NixlOptions.from_options(
            {"role": "consumer", "peers": ["10.0.0.5:5600", "[::1]:5700"]}
        )
        assert options.allows("10.0.0.5", 5600) == ""
        assert options.allows("::1", 5700) == ""
        assert "not one of the configured peers" in options.allows("10.0.0.5", 5601)
        assert "not one of the configured peers" in options.allows("127.0.0.1", 5600)
        joined = NixlOptions.from_options({"role": "consumer", "peers": "10.0.0.5:1,h:2"})
        assert joined.peers == frozenset({("10.0.0.5", 1), ("h", 2)})

    @pytest.mark.parametrize("peers", [[], ["10.0.0.5"], ["h:0"], ["h:99999"], [5600], "x:y"])
    def test_bad_peers_are_refused(self, peers: object) -> None:
        with pytest.raises(InvalidConfigError, match="peers"):
            NixlOptions.from_options({"role": "consumer", "peers": peers})


def test_the_key_file_is_not_world_readable_under_a_permissive_umask(tmp_path: Path) -> None:
    """The file is created 0600 whatever the umask."""
    old = os.umask(0)
    try:
        path = tmp_path / KEY_FILE_NAME
        TransferKey.default(path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o077 == 0
