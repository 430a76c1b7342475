"""builtin:tiny's tokenizer: deterministic, inside the model's vocabulary, in the cache key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.tokenizer import Tokenizer
from stages.model import builtin, builtin_tokenizer
from stages.model.builtin import TINY_CONFIG, resolve_model_path

FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors")


class TestBuiltinTokenizer:
    def test_two_builds_are_byte_identical(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Building twice (two cache dirs) writes the same bytes, tokenizer included."""
        dirs = []
        for name in ("a", "b"):
            monkeypatch.setenv("KVSTEP_CACHE_DIR", str(tmp_path / name))
            dirs.append(resolve_model_path("builtin:tiny"))
        assert dirs[0].name == dirs[1].name
        for file in FILES:
            assert (dirs[0] / file).read_bytes() == (dirs[1] / file).read_bytes(), file

    def test_vocab_and_special_ids_fit_the_model(self) -> None:
        """The ids are exactly the model's (each one the model emits decodes); BOS and
        EOS are the model's ids."""
        path = resolve_model_path("builtin:tiny")
        tok = Tokenizer(path / "tokenizer.json")
        vocab = tok._tok.get_vocab(with_added_tokens=True)
        assert sorted(vocab.values()) == list(range(TINY_CONFIG["vocab_size"]))
        bos, eos = tok.special_tokens["bos_token"], tok.special_tokens["eos_token"]
        assert vocab[bos] == TINY_CONFIG["bos_token_id"]
        assert vocab[eos] == TINY_CONFIG["eos_token_id"]
        assert tok.chat_template is not None
        config = json.loads((path / "tokenizer_config.json").read_text())
        assert config["chat_template"] == tok.chat_template

    @pytest.mark.parametrize("text", ["hello world", "naïve café 🙂 日本", " two  spaces\n"])
    def test_round_trip(self, text: str) -> None:
        """Byte-level BPE: any text decodes back to itself."""
        tok = Tokenizer(resolve_model_path("builtin:tiny") / "tokenizer.json")
        assert tok.decode(tok.encode(text)) == text

    def test_special_tokens_encode_to_one_id(self) -> None:
        tok = Tokenizer(resolve_model_path("builtin:tiny") / "tokenizer.json")
        ids = tok.encode("<|begin_of_text|>hi<|end_of_text|>")
        assert (ids[0], ids[-1]) == (1, 2)
        assert 1 not in ids[1:-1] and 2 not in ids[1:-1]

    def test_tokenizer_changes_change_the_cache_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A different template (or text) is a different cache directory, never reused."""
        before = builtin._version()
        monkeypatch.setattr(builtin_tokenizer, "CHAT_TEMPLATE", "{{ messages }}")
        assert builtin._version() != before
        monkeypatch.undo()
        monkeypatch.setattr(builtin_tokenizer, "TRAINING_TEXT", "other text")
        assert builtin._version() != before
