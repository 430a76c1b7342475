"""Where every benchmark writes its JSON (``benchmarks/results/``, not tracked), and how."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "save"]

RESULTS = Path(__file__).parent / "results"


def save(path: Path, result: Any) -> None:
    """Write ``result`` as indented JSON to ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
