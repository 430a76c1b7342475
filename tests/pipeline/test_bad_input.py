"""Bad input raises a typed error naming the value; the engine keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import (
    LLM,
    EngineConfig,
    InvalidConfigError,
    InvalidRequestError,
    ModelLoadError,
    SamplingParams,
    UnknownConnectorError,
)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints: dict[str, Path]):
    with LLM(
        EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=64)
    ) as engine:
        yield engine


class TestBadRequests:
    @pytest.mark.parametrize(
        ("prompt", "match"),
        [
            ([], "at least one token"),
            ([1, 2, 256], "256"),
            ([1, -1], "-1"),
            (list(range(64)), "max_model_len=64"),
            ("not tokenized", "tokenizer"),
            ([1, 2.5], "2.5"),
        ],
    )
    def test_bad_prompt_raises_and_engine_keeps_serving(self, llm: LLM, prompt, match) -> None:
        """Each bad prompt raises InvalidRequestError naming it; a good one then works."""
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([prompt], SamplingParams(max_tokens=2))
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].token_ids) == 2
        assert not any(v for k, v in llm.leak_report().items() if k != "cached_blocks")

    @pytest.mark.parametrize(
        ("fields", "match"),
        [
            ({"max_tokens": -1}, "max_tokens=-1"),
            ({"max_tokens": 0}, "max_tokens=0"),
            ({"temperature": -0.5}, "temperature=-0.5"),
            ({"top_p": 0.0}, "top_p=0.0"),
            ({"top_k": -3}, "top_k=-3"),
        ],
    )
    def test_bad_sampling_params(self, fields, match) -> None:
        """SamplingParams validates at construction and names the field and value."""
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(**fields)


class TestBadConfig:
    def test_unknown_connector_lists_known(self, tiny_checkpoints: dict[str, Path]) -> None:
        """An unknown connector name is refused, naming it and the registered ones."""
        config = EngineConfig(model=str(tiny_checkpoints["llama"]), connector="nope")
        with pytest.raises(UnknownConnectorError, match=r"nope.*recording"):
            LLM(config)

    def test_model_dir_without_config_json(self, tmp_path: Path) -> None:
        """A model directory without config.json raises ModelLoadError naming the path."""
        with pytest.raises(ModelLoadError, match=str(tmp_path)):
            LLM(EngineConfig(model=str(tmp_path)))

    @pytest.mark.parametrize(
        ("fields", "match"),
        [
            ({"block_size": 0}, "block_size=0"),
            ({"executor": "threads"}, "executor='threads'"),
            ({"dtype": "int8"}, "dtype='int8'"),
            ({"device": "tpu"}, "device='tpu'"),
        ],
    )
    def test_bad_config_fields(self, fields, match) -> None:
        """EngineConfig validates each field at construction."""
        with pytest.raises(InvalidConfigError, match=match):
            EngineConfig(**fields)
