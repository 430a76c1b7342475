"""The command line, ``kvstep`` (``python -m pipeline.cli``): ``run``, ``logs``, ``serve``."""

from __future__ import annotations

from pipeline.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
