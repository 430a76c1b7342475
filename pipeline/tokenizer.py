"""Text in and out: the model directory's ``tokenizer.json``, through ``tokenizers``.

``tokenizer_config.json`` beside it, when present, gives the chat template and the
special tokens the template refers to (``bos_token``, ``eos_token``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import ModelLoadError

__all__ = ["Tokenizer", "load_tokenizer"]

#: Texts longer than this are encoded with the GIL released (:meth:`Tokenizer.encode`).
_GIL_FREE_CHARS = 2048


class Tokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``). Thread-safe for encode/decode.

    Attributes:
        path: The ``tokenizer.json`` file.
        chat_template: The Jinja chat template of ``tokenizer_config.json``, or ``None``.
        special_tokens: ``bos_token``, ``eos_token``, ... as strings (the template's
            variables), from ``tokenizer_config.json``.
    """

    def __init__(self, path: Path) -> None:
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(path, f"unreadable tokenizer.json: {exc}") from exc
        self.path = path
        config = _read_config(path.parent / "tokenizer_config.json")
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(key)
            if isinstance(value, dict):  # an AddedToken written out
                value = value.get("content")
            if isinstance(value, str):
                self.special_tokens[key] = value

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens as the tokenizer's post-processor adds).

        Blocks the calling thread. A text over 2048 characters is
        encoded with the GIL released (``tokenizers``' ``encode`` holds it throughout:
        3.8 MiB on a worker thread stopped the event loop for 3.7 s; its
        ``encode_batch`` releases it), so a worker thread encoding it lets the loop run.
        """
        if len(text) <= _GIL_FREE_CHARS:
            return list(self._tok.encode(text).ids)
        return list(self._tok.encode_batch([text])[0].ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"unreadable tokenizer_config.json: {exc}") from exc
    return config if isinstance(config, dict) else {}


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a model directory, or ``None`` when it has no ``tokenizer.json``.

    ``builtin:`` names are not directories: pass the directory
    ``stages.model.resolve_model_path`` gives (the builtin models carry a tokenizer).
    """
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
