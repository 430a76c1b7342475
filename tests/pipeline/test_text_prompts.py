"""Text prompts: encoded with the model directory's tokenizer.json, same tokens as ids."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline import LLM, EngineConfig, InvalidRequestError, SamplingParams
from pipeline.tokenizer import load_tokenizer

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "and",
    "runs",
    "far",
    "away",
]


def build_tokenizer(directory: Path) -> None:
    """A word-level tokenizer.json (vocabulary inside the tiny model's 256 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_with_tokenizer(tiny_checkpoints, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("with-tokenizer") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    build_tokenizer(path)
    return path


class TestTextPrompts:
    def test_text_prompt_equals_its_token_ids(self, model_with_tokenizer: Path) -> None:
        """A str prompt generates exactly what its encoded token ids generate."""
        text = "the quick brown fox jumps over the lazy dog"
        ids = load_tokenizer(model_with_tokenizer).encode(text)  # type: ignore[union-attr]
        assert ids == [1, 2, 3, 4, 5, 6, 1, 7, 8]
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        config = EngineConfig(model=str(model_with_tokenizer), dtype="float32", max_model_len=128)
        with LLM(config) as llm:
            by_text, by_ids = llm.generate([text, ids], params)
        assert by_text.prompt_token_ids == tuple(ids)
        assert by_text.token_ids == by_ids.token_ids

    def test_text_without_tokenizer_is_refused(self, tiny_checkpoints) -> None:
        """Without tokenizer.json a str prompt raises a typed error saying what to pass."""
        config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32")
        with LLM(config) as llm, pytest.raises(InvalidRequestError, match=r"tokenizer\.json"):
            llm.generate(["some text"], SamplingParams(max_tokens=2))

    def test_no_tokenizer_for_a_directory_without_one(self, tiny_checkpoints) -> None:
        """A model directory without tokenizer.json has no tokenizer (ids only)."""
        assert load_tokenizer(tiny_checkpoints["llama"]) is None

    def test_builtin_tiny_takes_text_out_of_the_box(self) -> None:
        """builtin:tiny carries a tokenizer: a text prompt generates what its ids do."""
        from stages.model.builtin import tokenizer_dir

        tok = load_tokenizer(tokenizer_dir("builtin:tiny"))
        assert tok is not None
        ids = tok.encode("hello world")
        assert tok.decode(ids) == "hello world"
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with LLM(EngineConfig(model="builtin:tiny", max_model_len=128)) as llm:
            by_text, by_ids = llm.generate(["hello world", ids], params)
        assert by_text.prompt_token_ids == tuple(ids)
        assert by_text.token_ids == by_ids.token_ids
