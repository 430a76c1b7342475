"""``kvstep serve --kv-role``: the nixl connector in a role, as a shorthand."""

from __future__ import annotations

import pytest

from pipeline.cli.main import build_parser, main, serve_config
from pipeline.errors import InvalidConfigError


def _config(*flags: str):  # type: ignore[no-untyped-def]
    return serve_config(build_parser().parse_args(["serve", *flags]))


def test_kv_role_is_the_nixl_connector_in_that_role() -> None:
    config = _config("--kv-role", "producer", "--connector-options", '{"port": 5601}')
    assert config.connector == "nixl"
    assert config.connector_options == {"port": 5601, "role": "producer"}
    plain = _config()
    assert plain.connector is None


@pytest.mark.parametrize(
    "flags",
    [
        ("--kv-role", "consumer", "--connector", "offload"),
        ("--kv-role", "consumer", "--connector-options", '{"role": "producer"}'),
    ],
)
def test_conflicting_flags_are_refused(flags: tuple[str, ...]) -> None:
    with pytest.raises(InvalidConfigError, match="kv_role"):
        _config(*flags)


def test_an_unknown_role_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-role", "prefill"])
    assert exit_info.value.code == 2
    assert "--kv-role" in capsys.readouterr().err


def test_a_conflict_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--kv-role", "consumer", "--connector", "offload"]) == 2
    assert "kv_role" in capsys.readouterr().err


def test_the_transfer_key_and_peers_are_nixl_options() -> None:
    """--kv-transfer-key-env and --kv-peers become the nixl connector's options."""
    config = _config(
        "--kv-role", "consumer", "--kv-transfer-key-env", "KV_KEY",
        "--kv-peers", "10.0.0.5:5600", "10.0.0.6:5600",
    )  # fmt: skip
    assert config.connector_options == {
        "role": "consumer",
        "transfer_key_env": "KV_KEY",
        "peers": ["10.0.0.5:5600", "10.0.0.6:5600"],
    }


def test_the_transfer_flags_need_a_role() -> None:
    with pytest.raises(InvalidConfigError, match="kv_peers"):
        _config("--kv-peers", "127.0.0.1:5600")
