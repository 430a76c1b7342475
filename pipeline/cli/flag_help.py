"""Help text of the ``kvstep`` flags: each says what it does, its default and its choices.

The ``EngineConfig`` flags take their text from the Attributes section of
``EngineConfig``'s docstring (a field it omits falls back to ``_FALLBACK``), plus the
field's default and, for the fields with a fixed set of values, the allowed values.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import attrs

from pipeline.config import (
    DTYPES,
    EXECUTORS,
    LOAD_FAILURE_POLICIES,
    SCHEDULING_POLICIES,
    EngineConfig,
)

__all__ = ["CHOICES", "RUN_DEFAULTS", "SERVE_DEFAULTS", "config_flag_help", "finish_help"]

#: The allowed values of the fields that have a fixed set of them.
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "executor": EXECUTORS,
    "load_failure_policy": LOAD_FAILURE_POLICIES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "device": ("auto", "cpu", "cuda", "cuda:N"),
}

#: The defaults ``kvstep run`` uses where they differ from ``EngineConfig``'s, as shown
#: in its help (``pipeline.cli.run_job.default_run_config`` applies them).
RUN_DEFAULTS: dict[str, str] = {
    "connector": "shared_storage",
    "connector_options": '{"path": "<cache dir>/run-store"} with shared_storage',
    "enable_prefix_caching": "off",
    "inline_forward": "on with executor inprocess",
    "max_model_len": "1024",
    "step_log": "<cache dir>/run-steps.jsonl",
}

#: The defaults ``kvstep serve`` uses where they differ from ``EngineConfig``'s, as shown
#: in its help (``pipeline.cli.config_flags.serve_config`` applies them).
SERVE_DEFAULTS: dict[str, str] = {"torch_compile": "on"}

_FALLBACK = {
    "kv_cache_memory_bytes": "Bytes of KV cache per rank when num_gpu_blocks is not given.",
}


def _attribute_docs() -> dict[str, str]:
    """Field name -> its text in the Attributes section of ``EngineConfig.__doc__``."""
    doc = EngineConfig.__doc__ or ""
    section = doc.split("Attributes:", 1)[-1]
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in section.splitlines():
        match = re.match(r"^\s{8}(\w+): (.*)$", line)
        if match:
            current = docs.setdefault(match.group(1), [match.group(2)])
        elif current is not None and line.strip():
            current.append(line.strip())
        elif current is not None:
            current = None
    return {name: " ".join(lines) for name, lines in docs.items()}


def _default_text(field: attrs.Attribute[Any]) -> str:
    default: Any = field.default
    factory = getattr(default, "factory", None)
    if callable(factory):  # attrs.Factory
        default = factory()
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, dict):
        return "{}"
    if isinstance(default, tuple) and not default:
        return "none"
    return str(default)


def config_flag_help(field: attrs.Attribute[Any], defaults: dict[str, str] | None = None) -> str:
    """The help of ``field``'s flag: its docstring text, allowed values and default.

    ``defaults`` overrides the shown default of some fields (``RUN_DEFAULTS``).
    """
    text = _attribute_docs().get(field.name) or _FALLBACK.get(field.name, field.name)
    text = text.replace("``", "").replace("%", "%%")
    if field.name in CHOICES:
        text += f" Choices: {', '.join(CHOICES[field.name])}."
    shown = (defaults or {}).get(field.name) or _default_text(field)
    return f"{text} (default: {shown.replace('%', '%%')})"


def finish_help(parser: argparse.ArgumentParser) -> None:
    """Append its default to the help of every flag of ``parser`` (and its sub-commands)
    whose help does not state one already."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                finish_help(sub)
            continue
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        help_text = action.help or ""
        if "default" in help_text.lower():
            continue
        if action.default is None:
            shown = "none"
        elif isinstance(action.default, bool):
            shown = "on" if action.default else "off"
        else:
            shown = "%(default)s"
        action.help = f"{help_text} (default: {shown})".strip()
