"""``EngineConfig`` type-checks every field and never shows a secret (issue 10, finding 18)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from pipeline import EngineConfig
from pipeline.errors import InvalidConfigError


class TestFieldTypes:
    @pytest.mark.parametrize(
        "fields",
        [
            {"enable_prefix_caching": "no"},
            {"enable_prefix_caching": 1},
            {"connector_options": [1]},
            {"connector_options": {1: "a"}},
            {"connector_options": {"path": object()}},
            {"connector_options": {"n": 2**70}},
            {"num_gpu_blocks": True},
            {"world_size": 2**64},
            {"hash_seed": "0"},
            {"hash_seed": 2**64},
            {"seed": True},
            {"seed": 2**64},
            {"device": 5},
            {"device": "cuda:x"},
            {"connector": 5},
            {"connector": ""},
            {"step_log": 5},
        ],
    )
    def test_wrong_types_are_refused(self, fields: dict[str, Any]) -> None:
        """Finding 18: each field refuses another type (a str for a bool, a list for a dict)."""
        (name,) = fields
        with pytest.raises(InvalidConfigError, match=name):
            EngineConfig(**fields)


class TestSecrets:
    def test_repr_redacts_secret_looking_options(self) -> None:
        """Finding 18: repr(EngineConfig) never shows a password, token or key."""
        config = EngineConfig(
            connector="redis",
            connector_options={
                "url": "redis://user:hunter2@db:6379/0",
                "password": "hunter2",
                "api_key": "hunter2",
                "tiers": [{"name": "redis", "options": {"auth_token": "hunter2"}}],
                "key_prefix": "visible",
            },
        )
        text = repr(config)
        assert "hunter2" not in text and "hunter2" not in str(config)
        assert "visible" in text and "redis://***@db:6379/0" in text
        assert config.connector_options["password"] == "hunter2"  # the value itself is kept

    def test_good_values_pass(self, tmp_path: Path) -> None:
        """Finding 18: the values each field documents pass, and secrets stay hidden."""
        config = EngineConfig(
            enable_prefix_caching=False,
            connector_options={"path": "x", "faults": [{"at": 1, "p": 0.5}], "token": "t0k"},
            num_gpu_blocks=8,
            step_log=tmp_path / "log.jsonl",
            transfer_lease_s=math.inf,
            device="cuda:1",
            seed=-1,
        )
        assert config.num_gpu_blocks == 8 and "t0k" not in repr(config)

    def test_repr_hides_a_secret_hash_seed(self) -> None:
        """Finding 11: a non-zero hash_seed (a secret that makes store keys unguessable)
        is not shown by repr; the default 0 is."""
        assert "9182736455" not in repr(EngineConfig(hash_seed=9182736455))
        assert "hash_seed=0" in repr(EngineConfig())

    def test_error_never_shows_a_secret(self) -> None:
        """Finding 18: an invalid secret option is named, its value is not shown."""
        with pytest.raises(InvalidConfigError, match="password") as info:
            EngineConfig(connector_options={"password": 2**70 + 12345})
        assert str(2**70 + 12345) not in str(info.value)
