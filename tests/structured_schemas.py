"""Helper for tests (not a test file): random JSON schemas of the shapes structured
output must handle (issue 26)."""

from __future__ import annotations

import random
from typing import Any


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random schema of the shapes the issue names: nested objects, enums, arrays with
    ``maxItems``, strings with ``maxLength``, integer ranges; every property required and
    no others allowed, so a valid output is short."""
    kinds = ["integer", "string", "enum", "boolean", "number"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "y z", "ok"], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "maxItems": rng.randint(1, 3)}  # fmt: skip
    names = rng.sample(["a", "b", "name", "n", "items", "ok", "v"], rng.randint(1, 3))
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": names,
        "additionalProperties": False,
    }
