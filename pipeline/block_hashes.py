"""vLLM-compatible chained block hashes for prefix caching and connector keys.

A block's hash covers its parent's hash, its own token ids and optional extra keys, so
block ``i``'s hash identifies the whole prefix ``all_token_ids[: (i + 1) * block_size]``.
The hash function is SHA-256 over a canonical CBOR encoding (vLLM's ``sha256_cbor``).

The root of every chain (``NONE_HASH``, the parent of block 0) comes from an explicit
seed instead of vLLM's per-process random bytes, so keys survive restarts and agree
across engines. The seed is hashed as its decimal string, exactly as vLLM hashes
``PYTHONHASHSEED``: kvstep with ``hash_seed=0`` computes the same block hashes as vLLM
started with ``PYTHONHASHSEED=0`` and ``prefix_caching_hash_algo="sha256_cbor"``.

The engine's scheduler (through :class:`BlockHasher`, which keeps a request's hashes in
step with its tokens), the connectors and a router (:mod:`pipeline.kv_events`) all hash
with these functions. The functions are pure and thread-safe.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol

import cbor2

from pipeline.checks import check_int
from pipeline.errors import InvalidRequestError

__all__ = [
    "NONE_HASH",
    "BlockHasher",
    "ExtraKeys",
    "HashedTokens",
    "hash_block_tokens",
    "hash_fn",
    "hash_request_tokens",
    "none_hash",
]

ExtraKeys = tuple[int | str | bytes, ...]
"""Extra hash inputs of a block (e.g. a LoRA name or cache salt): plain, ordered values."""


def hash_fn(obj: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj`` (vLLM's ``sha256_cbor``).

    ``obj`` must be built from deterministic CBOR types (ints, str, bytes, None,
    tuples/lists of those); canonical mode fixes the encoding of each.
    """
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@functools.lru_cache(maxsize=16)
def none_hash(hash_seed: int) -> bytes:
    """The root hash (parent of block 0) for ``hash_seed``: ``hash_fn(str(hash_seed))``."""
    return hash_fn(str(hash_seed))


NONE_HASH: bytes = none_hash(0)
"""The root hash for the default ``hash_seed=0``."""


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Iterable[int],
    extra_keys: ExtraKeys | None = None,
    *,
    root: bytes = NONE_HASH,
) -> bytes:
    """Hash one block: ``hash_fn((parent_hash or root, tuple(token_ids), extra_keys))``.

    Args:
        parent_hash: The previous block's hash, or ``None`` for block 0.
        token_ids: The block's token ids (Python or numpy ints; converted to ``int``).
        extra_keys: Extra inputs that must also match for a cache hit, or ``None``.
        root: The chain root used when ``parent_hash`` is ``None``; pass
            :func:`none_hash` of the engine's seed (the default is seed 0).

    Returns:
        The 32-byte digest.
    """
    tokens = tuple(int(t) for t in token_ids)
    return hash_fn((parent_hash or root, tokens, extra_keys))


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_seed: int = 0,
    extra_keys: ExtraKeys | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block is
    not hashed). Connectors use this to key a prompt without a :class:`Request`."""
    check_int("block_size", block_size, InvalidRequestError, lo=1)
    root = none_hash(hash_seed)
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(
            parent, token_ids[start : start + block_size], extra_keys, root=root
        )
        hashes.append(parent)
    return hashes


class HashedTokens(Protocol):
    """What :class:`BlockHasher` reads and extends: a
    :class:`~pipeline.request.Request`'s tokens and the hashes of its full blocks (a
    protocol, so that this module, which a router imports, does not import the engine's
    request and configuration)."""

    all_token_ids: list[int]
    block_hashes: list[bytes]

    @property
    def hash_extra_keys(self) -> ExtraKeys | None:
        """What every block hash of the request also covers (its LoRA adapter), or
        ``None``."""


class BlockHasher:
    """Keeps ``request.block_hashes`` in step with the request's full blocks.

    Built once per scheduler with the block size and seed; call :meth:`update` after a
    request is created and after every token appended to it. Only blocks that are
    completely filled by ``request.all_token_ids`` are hashed.

    Not thread-safe per request (it mutates ``request.block_hashes``); the scheduler
    owns requests, so this holds by construction.
    """

    __slots__ = ("block_size", "hash_seed", "root")

    def __init__(self, block_size: int, hash_seed: int = 0) -> None:
        check_int("block_size", block_size, InvalidRequestError, lo=1)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.root = none_hash(hash_seed)

    def update(self, request: HashedTokens) -> list[bytes]:
        """Append the hash of every newly full block to ``request.block_hashes``.

        Returns:
            The hashes appended by this call (often empty).
        """
        hashes = request.block_hashes
        tokens = request.all_token_ids
        num_full = len(tokens) // self.block_size
        added: list[bytes] = []
        if len(hashes) >= num_full:
            return added
        extra = request.hash_extra_keys
        for index in range(len(hashes), num_full):
            parent = hashes[index - 1] if index else None
            start = index * self.block_size
            block_hash = hash_block_tokens(
                parent, tokens[start : start + self.block_size], extra, root=self.root
            )
            hashes.append(block_hash)
            added.append(block_hash)
        return added
