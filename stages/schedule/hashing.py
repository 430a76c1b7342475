"""``BlockHasher``: a request's block hashes kept in step with its tokens.

The hashes themselves (vLLM-compatible chained SHA-256 over canonical CBOR, rooted in
an explicit ``hash_seed``) are :mod:`pipeline.block_hashes`', re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.block_hashes import (
    NONE_HASH,
    ExtraKeys,
    hash_block_tokens,
    hash_fn,
    hash_request_tokens,
    none_hash,
)
from pipeline.checks import check_int
from pipeline.errors import InvalidRequestError

if TYPE_CHECKING:
    from pipeline.request import Request

__all__ = [
    "NONE_HASH",
    "BlockHasher",
    "ExtraKeys",
    "hash_block_tokens",
    "hash_fn",
    "hash_request_tokens",
    "none_hash",
]


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

    def update(self, request: Request) -> list[bytes]:
        """Append the hash of every newly full block to ``request.block_hashes``.

        Returns:
            The hashes appended by this call (often empty).
        """
        hashes = request.block_hashes
        tokens = request.all_token_ids
        num_full = len(tokens) // self.block_size
        added: list[bytes] = []
        for index in range(len(hashes), num_full):
            parent = hashes[index - 1] if index else None
            start = index * self.block_size
            block_hash = hash_block_tokens(
                parent, tokens[start : start + self.block_size], root=self.root
            )
            hashes.append(block_hash)
            added.append(block_hash)
        return added
