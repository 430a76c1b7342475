"""Where every benchmark writes its JSON (``benchmarks/results/``, not tracked), and how."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "cpu", "save"]

RESULTS = Path(__file__).parent / "results"


def cpu() -> str:
    """This machine's CPU as a performance note needs it: the model name and which of
    avx2, avx512f, avx512_bf16 and amx_bf16 it has (Linux's ``/proc/cpuinfo``)."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "unknown CPU"
    fields = dict(
        line.split(":", 1) for line in info.splitlines()[:64] if ":" in line
    )  # the first processor's block
    name = " ".join(fields.get("model name\t", fields.get("model name", "?")).split())
    flags = set(fields.get("flags\t\t", fields.get("flags", "")).split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return f"{name}; " + (", ".join(f for f in wanted if f in flags) or "no avx2")


def save(path: Path, result: Any) -> None:
    """Write ``result`` as indented JSON to ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
