"""A small byte-level BPE tokenizer trained locally (no downloads), for text-prompt tests."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "kv caches are saved and loaded block by block",
    "naïve café façade résumé — déjà vu",
    "日本語のテキストと中文文本",
    "emoji 🙂🚀🎉 and symbols ∑ ∫ ≠ €",
    "Ελληνικά και русский текст",
] * 20


def build_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    """Train a GPT-2-style byte-level BPE (all 256 byte symbols + merges); save as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def build_text_checkpoint(root: Path) -> Path:
    """A tiny random Llama (vocab 512) with the tokenizer above in its directory."""
    from checkpoints import build_checkpoint

    model = build_checkpoint("llama", root, vocab_size=512)
    build_tokenizer(model / "tokenizer.json")
    return model
