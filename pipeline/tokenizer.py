"""Text in and out: the model directory's ``tokenizer.json``, through ``tokenizers``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import ModelLoadError

__all__ = ["Tokenizer", "load_tokenizer"]


class Tokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``). Thread-safe for encode/decode."""

    def __init__(self, path: Path) -> None:
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(path, f"unreadable tokenizer.json: {exc}") from exc
        self.path = path

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens as the tokenizer's post-processor adds)."""
        return list(self._tok.encode(text).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def load_tokenizer(model: str | Path) -> Tokenizer | None:
    """The model directory's tokenizer, or ``None`` when it has no ``tokenizer.json``
    (``builtin:`` models have none)."""
    if str(model).startswith("builtin:"):
        return None
    path = Path(model) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
