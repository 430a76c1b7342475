"""Block hashes a router can compute: a prompt's hashes exactly as a replica's pool has them.

A replica's prefix-cache hash of block ``i`` is a pure function of the prompt's token ids
up to the end of that block, the ``block_size`` and the engine's ``hash_seed``: SHA-256
over the canonical CBOR of ``(parent digest or root, tuple(block tokens), None)``, the root
being SHA-256 of the CBOR of ``str(hash_seed)`` (vLLM's ``sha256_cbor`` chain of
:mod:`pipeline.block_hashes`, which the engine's scheduler uses too).
The device tier's hashes do not include the model fingerprint: a router compares hashes
only among replicas that serve the same model with the same ``block_size`` and
``hash_seed``.

This module stands alone (the proxy may import it; it must not import the scheduler).
Pure and thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeline.block_hashes import hash_request_tokens
from pipeline.checks import check_int
from pipeline.errors import InvalidRequestError
from pipeline.kv_events.events import ExternalBlockHash, external_block_hash

__all__ = ["prompt_block_digests", "prompt_block_hashes"]


def prompt_block_digests(
    token_ids: Sequence[int], block_size: int, *, hash_seed: int = 0
) -> list[bytes]:
    """The 32-byte chained digest of every full block of ``token_ids`` (a trailing
    partial block has none), equal to a replica's ``request.block_hashes``.

    Raises:
        InvalidRequestError: ``block_size`` is not a positive int, or ``hash_seed`` is
            not an int.
    """
    check_int("hash_seed", hash_seed, InvalidRequestError)
    return hash_request_tokens(token_ids, block_size, hash_seed=hash_seed)


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_seed: int = 0,
    hash_format: Literal["int", "bytes"] = "int",
) -> list[ExternalBlockHash]:
    """The hashes of ``token_ids``' full blocks as a replica's events carry them (the
    replica's ``KVEventsConfig.hash_format``): what a router looks up in its index."""
    return [
        external_block_hash(d, hash_format)
        for d in prompt_block_digests(token_ids, block_size, hash_seed=hash_seed)
    ]
