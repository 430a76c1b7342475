"""Streaming detokenization: a full re-decode per chunk against the incremental window.

The server streams one chunk per generated token. The old ``Detokenizer`` decoded the
request's whole output on every chunk (O(n) per chunk, O(n²) per stream); the new one
(``pipeline.detokenize.Detokenizer``) decodes a bounded window (O(1) per chunk).
Both run over the same random token stream, with a real ``tokenizers`` byte-level BPE
trained here (no download), and must produce the same text. Reports the total ms per
stream, µs per token and the speed-up for each stream length.

    python benchmarks/detokenize.py [--lengths 500 1000 2000 4000] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import save

from pipeline.detokenize import Detokenizer
from pipeline.tokenizer import Tokenizer

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "detokenize.json"
CORPUS = [
    "the quick brown fox jumps over the lazy dog; kv caches are saved block by block",
    "naïve café façade résumé — déjà vu; 日本語のテキストと中文文本; Ελληνικά и русский",
    "emoji 🙂🚀🎉 and symbols ∑ ∫ ≠ €, numbers 0123456789, code: def f(x): return x",
] * 50


def build_tokenizer(directory: Path, vocab_size: int = 1000) -> Tokenizer:
    """A GPT-2-style byte-level BPE trained on a small multilingual corpus."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer(path)


class FullRedecode:
    """The old server detokenizer: decode everything, emit the new suffix."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text = ""

    def step(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        if text.startswith(self._text):
            new, self._text = text[len(self._text) :], text
            return new
        self._text = text
        return ""


def stream_text(make: Callable[[], Any], ids: list[int]) -> tuple[float, str]:
    """Feed ``ids`` one token at a time; the seconds taken and the concatenated text."""
    detok = make()
    parts = []
    growing: list[int] = []  # the engine's output list, one token longer per chunk
    start = perf_counter()
    for i, token in enumerate(ids, 1):
        growing.append(token)
        parts.append(detok.step(growing, final=i == len(ids)))
    return perf_counter() - start, "".join(parts)


def measure(tokenizer: Tokenizer, length: int, repeats: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    # Generated-like text: encode corpus text, so multi-byte characters span tokens.
    pool = tokenizer.encode(" ".join(CORPUS))
    start = rng.randrange(0, max(1, len(pool) - length))
    ids = (pool * (1 + length // len(pool)))[start : start + length]
    ids = (ids + pool)[:length]
    full_s, incr_s = [], []
    for _ in range(repeats):
        t_full, text_full = stream_text(lambda: FullRedecode(tokenizer), ids)
        t_incr, text_incr = stream_text(lambda: Detokenizer(tokenizer), ids)
        reference = tokenizer.decode(ids)
        if text_incr != reference:
            raise AssertionError(f"incremental text differs from the full decode at n={length}")
        if text_full != reference:
            raise AssertionError(f"re-decode text differs from the full decode at n={length}")
        full_s.append(t_full)
        incr_s.append(t_incr)
    full, incr = statistics.median(full_s), statistics.median(incr_s)
    return {
        "tokens": length,
        "full_redecode_ms": round(full * 1e3, 3),
        "incremental_ms": round(incr * 1e3, 3),
        "full_us_per_token": round(full / length * 1e6, 2),
        "incremental_us_per_token": round(incr / length * 1e6, 2),
        "speedup": round(full / incr, 1) if incr > 0 else None,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    headers = ["tokens", "re-decode ms", "incr ms", "re-dec µs/tok", "incr µs/tok", "speedup"]
    keys = [
        "tokens",
        "full_redecode_ms",
        "incremental_ms",
        "full_us_per_token",
        "incremental_us_per_token",
        "speedup",
    ]
    print("Streaming detokenization, one chunk per token (median of repeats)")
    print("  ".join(f"{h:>14}" for h in headers))
    for row in rows:
        print("  ".join(f"{row[k]!s:>14}" for k in keys))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(Path(tmp))
        rows = [measure(tokenizer, n, args.repeats, args.seed) for n in args.lengths]
    result = {
        "benchmark": "detokenize",
        "python": platform.python_version(),
        "tokenizers": importlib.metadata.version("tokenizers"),
        "machine": platform.machine(),
        "repeats": args.repeats,
        "rows": rows,
    }
    print_table(rows)
    save(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
