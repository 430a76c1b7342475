"""LoRA adapters: what a caller asks for (:class:`LoRARequest`, vLLM's) and what the
engine resolved it to (:class:`LoRAAdapter`, the identity every layer below uses).

A request names an adapter with a ``LoRARequest(name, int_id, path)`` of a peft
adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``). The engine
reads and checks the directory once, off its event loop
(:mod:`stages.model.lora_files`), and the request then carries the resolved
:class:`LoRAAdapter`: its name and id (KV events report them), its path (workers read
the weights from there) and ``content_id``, the SHA-256 of the weights and the
configuration that scale them. ``content_id`` is what a block hash of the request
includes (:meth:`LoRAAdapter.extra_keys`), so a prefix-cache hit, a connector load or
a transfer never crosses adapters, nor two versions of one adapter's files; a worker
that reads other bytes than the engine checked refuses them.
"""

from __future__ import annotations

import attrs

from pipeline.checks import check_int
from pipeline.errors import InvalidRequestError

__all__ = ["LORA_TARGETS", "MAX_LORA_NAME", "LoRAAdapter", "LoRARequest"]

#: The projections an adapter may target (peft's ``target_modules``), in layer order.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Longest adapter name (it is a served model name and a metrics/KV-event label).
MAX_LORA_NAME = 200


def _name(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_LORA_NAME:
        raise InvalidRequestError(
            attribute.name, value, f"must be a non-empty string of at most {MAX_LORA_NAME}"
        )
    if not value.isprintable() or value.strip() != value:
        raise InvalidRequestError(
            attribute.name, value, "must be printable, without surrounding whitespace"
        )


def _int_id(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    check_int(attribute.name, value, InvalidRequestError, lo=1)


def _path(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise InvalidRequestError(attribute.name, value, "must be a non-empty path")


@attrs.frozen
class LoRARequest:
    """A request for a LoRA adapter, as vLLM's ``LoRARequest(lora_name, lora_int_id,
    lora_path)``.

    Attributes:
        lora_name: The adapter's name (a server serves it as a model of that name).
        lora_int_id: A positive id, unique per adapter within an engine (one name, one
            path per id).
        lora_path: A local peft adapter directory: ``adapter_config.json`` and
            ``adapter_model.safetensors`` (a pickled ``adapter_model.bin`` is refused).

    Raises:
        InvalidRequestError: A bad field (named, with what is allowed).
    """

    lora_name: str = attrs.field(validator=_name)
    lora_int_id: int = attrs.field(validator=_int_id)
    lora_path: str = attrs.field(converter=str, validator=_path)


@attrs.frozen(kw_only=True)
class LoRAAdapter:
    """A checked adapter: what a request and its steps carry (small, immutable, sent to
    workers with every step of the request).

    Attributes:
        name: ``LoRARequest.lora_name``.
        int_id: ``LoRARequest.lora_int_id``.
        path: The adapter directory, absolute.
        content_id: Hex SHA-256 of the adapter's weights file and the configuration
            fields that apply them (rank, alpha, rsLoRA, targets).
        rank: The adapter's rank ``r``.
    """

    name: str
    int_id: int
    path: str
    content_id: str
    rank: int

    def extra_keys(self) -> tuple[str, str]:
        """The extra inputs of this adapter's requests' block hashes
        (:func:`~pipeline.block_hashes.hash_block_tokens`)."""
        return ("lora", self.content_id)
