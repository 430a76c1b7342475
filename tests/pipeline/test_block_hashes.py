"""Chained block hashes: determinism, seeding, chaining and the prefix property."""

from __future__ import annotations

import hashlib

import cbor2
import numpy as np
import pytest

from pipeline.block_hashes import (
    NONE_HASH,
    BlockHasher,
    hash_block_tokens,
    hash_fn,
    hash_request_tokens,
    none_hash,
)
from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.request import Request

# Pinned once, after checking them against an independent sha256(cbor2(...)) below.
ROOT_SEED_0 = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
BLOCK_1234_SEED_0 = "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb"


def _independent_sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


class TestHashFn:
    def test_is_sha256_of_canonical_cbor(self) -> None:
        """hash_fn equals sha256 over the canonical CBOR encoding."""
        obj = (b"\x00" * 32, (5, 6, 7), None)
        assert hash_fn(obj) == _independent_sha256_cbor(obj)

    def test_root_hash_for_seed_zero_is_pinned(self) -> None:
        """The root of seed 0 is sha256(cbor("0")), the value vLLM uses for PYTHONHASHSEED=0."""
        assert none_hash(0) == _independent_sha256_cbor("0")
        assert none_hash(0).hex() == ROOT_SEED_0
        assert none_hash(0) == NONE_HASH

    def test_first_block_hash_for_seed_zero_is_pinned(self) -> None:
        """Block 0 of [1, 2, 3, 4] hashes (root, tokens, None) to a known digest."""
        expected = _independent_sha256_cbor((none_hash(0), (1, 2, 3, 4), None))
        assert hash_block_tokens(None, [1, 2, 3, 4]) == expected
        assert expected.hex() == BLOCK_1234_SEED_0


class TestHashBlockTokens:
    def test_same_inputs_same_hash(self) -> None:
        """Hashing is deterministic for equal inputs."""
        assert hash_block_tokens(None, [9, 8, 7]) == hash_block_tokens(None, (9, 8, 7))

    def test_numpy_ints_hash_like_python_ints(self) -> None:
        """Token ids of numpy integer types give the same hash as Python ints."""
        tokens = np.array([3, 1, 4, 1], dtype=np.int64)
        assert hash_block_tokens(None, tokens) == hash_block_tokens(None, [3, 1, 4, 1])

    def test_parent_changes_hash(self) -> None:
        """The same tokens under a different parent hash differently."""
        parent = hash_block_tokens(None, [1, 2])
        assert hash_block_tokens(parent, [3, 4]) != hash_block_tokens(None, [3, 4])

    def test_extra_keys_change_hash(self) -> None:
        """Extra keys take part in the hash."""
        assert hash_block_tokens(None, [1, 2], ("lora-a",)) != hash_block_tokens(None, [1, 2])

    def test_root_selects_seed(self) -> None:
        """A different root (seed) gives a different hash for block 0."""
        assert hash_block_tokens(None, [1, 2], root=none_hash(1)) != hash_block_tokens(None, [1, 2])


class TestHashRequestTokens:
    def test_only_full_blocks_are_hashed(self) -> None:
        """A trailing partial block gets no hash."""
        assert len(hash_request_tokens(list(range(11)), 4)) == 2
        assert hash_request_tokens([1, 2, 3], 4) == []

    def test_same_seed_same_hashes_across_calls(self) -> None:
        """An explicit seed reproduces the same chain (keys survive restarts)."""
        tokens = list(range(40))
        assert hash_request_tokens(tokens, 8, hash_seed=7) == hash_request_tokens(
            tokens, 8, hash_seed=7
        )

    def test_different_seed_different_hashes(self) -> None:
        """Every block hash depends on the seed."""
        tokens = list(range(16))
        a = hash_request_tokens(tokens, 4, hash_seed=0)
        b = hash_request_tokens(tokens, 4, hash_seed=1)
        assert all(x != y for x, y in zip(a, b, strict=True))

    def test_prefix_property(self) -> None:
        """Two sequences sharing a prefix share the hashes of its full blocks, then diverge."""
        common = list(range(12))
        a = hash_request_tokens([*common, 100, 101, 102, 103], 4)
        b = hash_request_tokens([*common, 200, 201, 202, 203], 4)
        assert a[:3] == b[:3]
        assert a[3] != b[3]

    def test_change_in_first_block_changes_whole_chain(self) -> None:
        """Changing one token of block 0 changes every later hash (chaining)."""
        a = hash_request_tokens(list(range(16)), 4)
        b = hash_request_tokens([99, *range(1, 16)], 4)
        assert all(x != y for x, y in zip(a, b, strict=True))

    def test_rejects_bad_block_size(self) -> None:
        """A non-positive block size is refused with an error naming it."""
        with pytest.raises(InvalidRequestError, match="block_size"):
            hash_request_tokens([1], 0)


class TestBlockHasher:
    def test_incremental_updates_match_one_shot(self) -> None:
        """Hashing as tokens arrive gives the same chain as hashing all at once."""
        hasher = BlockHasher(4, hash_seed=3)
        request = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams())
        assert hasher.update(request) == request.block_hashes[:1]
        for token in range(7, 20):
            request.append_output_token(token)
            hasher.update(request)
        assert request.block_hashes == hash_request_tokens(request.all_token_ids, 4, hash_seed=3)
        assert len(request.block_hashes) == 19 // 4

    def test_update_without_new_full_block_adds_nothing(self) -> None:
        """No hash is added until a block is full."""
        hasher = BlockHasher(4)
        request = Request("r", [1, 2, 3], SamplingParams())
        assert hasher.update(request) == []
        request.append_output_token(4)
        assert len(hasher.update(request)) == 1
        assert hasher.update(request) == []

    def test_rejects_bad_block_size(self) -> None:
        """A non-positive block size is refused."""
        with pytest.raises(InvalidRequestError):
            BlockHasher(0)
