"""Helper for tests (not a test file): a logits stage that makes a model write a script.

``builtin:tiny`` has random weights, so what it writes is noise; a request whose
``extra_args["script"]`` is a list of token ids writes exactly those tokens, then the
EOS token (a scripted model output, e.g. a tool call in a parser's format); with
``extra_args["then"] == "free"`` it goes on unforced after the script instead.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from pipeline import LogitsBatch, LogitsStage

EOS = 2  # builtin:tiny's eos_token_id


@attrs.frozen
class ForceScript(LogitsStage):
    """Rows with ``extra_args["script"]`` sample their script's next token, then EOS."""

    name: ClassVar[str] = "force_script"

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        for row, params in enumerate(batch.params):
            script = params.extra_args.get("script")
            if script is None:
                continue
            done = len(batch.output_token_ids[row])
            if done >= len(script) and params.extra_args.get("then") == "free":
                continue
            logits[row] = float("-inf")
            logits[row, int(script[done]) if done < len(script) else EOS] = 0.0
        return logits
