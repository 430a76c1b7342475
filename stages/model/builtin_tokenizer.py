"""``builtin:tiny``'s tokenizer: a byte-level BPE trained on ``builtin_text``, and its chat.

:func:`write_tokenizer` trains the BPE with ``tokenizers`` (same bytes on every build:
the trainer is deterministic for a given text and settings) and writes
``tokenizer.json`` and ``tokenizer_config.json`` (special tokens and a Jinja
``chat_template``) into a model directory. The special tokens take the first ids, so
``<|begin_of_text|>`` and ``<|end_of_text|>`` are the model's ``bos_token_id`` (1) and
``eos_token_id`` (2). No post-processor: ``encode`` adds no BOS; the chat template
writes it.

The chat format (one turn per message; the generation prompt opens an assistant
turn, and the model ends its turn with the EOS token)::

    <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nhello<|end_of_text|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n

With ``tools``, a system turn first lists them (one JSON object a line between
``<tools>`` and ``</tools>``) and says how to call one: hermes' format,
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, in which an
assistant message's ``tool_calls`` are written back; a ``tool`` message is a turn of
role ``tool``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from stages.model.builtin_text import TRAINING_TEXT

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "VOCAB_SIZE", "tokenizer_version", "write_tokenizer"]

VOCAB_SIZE = 512  # the builtin model's vocab_size: every id the model can emit decodes
# The ids are the positions: 1 and 2 are the model's bos/eos ids.
SPECIAL_TOKENS = (
    "<|pad|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{ 'You may call these tools. To call one, write <tool_call>\\n"
    '{"name": NAME, "arguments": {...}}'
    "\\n</tool_call>\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools>' }}{{ eos_token }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>\\n' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson }}"
    "{{ '\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
_SCHEME = "byte-bpe-v1"


def _config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def tokenizer_version() -> str:
    """A hash of everything the tokenizer files depend on (part of the cache key)."""
    import tokenizers

    spec = {
        "text": TRAINING_TEXT,
        "vocab": VOCAB_SIZE,
        "special": SPECIAL_TOKENS,
        "config": _config(),
        "scheme": _SCHEME,
        "tokenizers": tokenizers.__version__.split(".")[:2],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def write_tokenizer(directory: Path) -> None:
    """Train the BPE and write ``tokenizer.json`` and ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    (directory / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    config = json.dumps(_config(), indent=2, sort_keys=True)
    (directory / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
