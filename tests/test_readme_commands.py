"""The README's multi-engine command blocks, run verbatim (``tests/readme_commands.py``):
P/D disaggregation and KV-aware routing on one host with default options.

One file, so that the blocks (which name fixed ports, as the README does) never run at
the same time under pytest-xdist (``--dist loadfile``).
"""

from __future__ import annotations
