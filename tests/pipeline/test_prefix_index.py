"""Tests of the router's ``PrefixIndex`` against a plain model: per replica, a set."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import InvalidConfigError
from pipeline.proxy.prefix_index import PrefixIndex

REPLICAS = ("a", "b", "c")
HASHES = [bytes([i]) * 32 for i in range(12)]

events = st.lists(
    st.tuples(
        st.sampled_from(["stored", "removed", "cleared"]),
        st.sampled_from(REPLICAS),
        st.lists(st.sampled_from(HASHES), max_size=6),
    ),
    max_size=40,
)
prompts = st.lists(st.lists(st.sampled_from(HASHES), max_size=8), min_size=1, max_size=5)


def model_depth(held: set[bytes], prompt: list[bytes]) -> int:
    depth = 0
    while depth < len(prompt) and prompt[depth] in held:
        depth += 1
    return depth


def replay(index: PrefixIndex, model: dict[str, set[bytes]], script: list[Any]) -> None:
    for kind, replica, hashes in script:
        if kind == "stored":
            index.stored(replica, hashes)
            model[replica].update(hashes)
        elif kind == "removed":
            index.removed(replica, hashes)
            model[replica].difference_update(hashes)
        else:
            index.cleared(replica)
            model[replica].clear()


class TestPrefixIndex:
    @settings(max_examples=300, deadline=None)
    @given(script=events, asked=prompts)
    def test_equals_a_set_per_replica(self, script: list[Any], asked: list[list[bytes]]) -> None:
        """Any sequence of events, duplicates and removals of unknown hashes included:
        each replica's depth is the run of the prompt's hashes it holds, its count the
        size of its set, and the index keeps only hashes someone holds."""
        index = PrefixIndex(REPLICAS)
        model: dict[str, set[bytes]] = {r: set() for r in REPLICAS}
        replay(index, model, script)
        for prompt in asked:
            assert index.match(prompt) == {r: model_depth(model[r], prompt) for r in REPLICAS}
        assert {r: index.num_blocks(r) for r in REPLICAS} == {r: len(model[r]) for r in REPLICAS}
        assert len(index) == len(set().union(*model.values()))

    @settings(max_examples=200, deadline=None)
    @given(script=events, asked=prompts, cap=st.integers(1, 6))
    def test_a_bounded_index_never_invents_a_hit(
        self, script: list[Any], asked: list[list[bytes]], cap: int
    ) -> None:
        """With max_blocks below the hashes in use, the index stays within it and its
        depths never exceed the truth; the counts match what it kept."""
        index = PrefixIndex(REPLICAS, max_blocks=cap)
        model: dict[str, set[bytes]] = {r: set() for r in REPLICAS}
        replay(index, model, script)
        assert len(index) <= cap
        for prompt in asked:
            found = index.match(prompt)
            assert all(found[r] <= model_depth(model[r], prompt) for r in REPLICAS)
        full = [h for h in HASHES if any(h in s for s in model.values())]
        kept = {r: sum(index.match([h])[r] for h in full) for r in REPLICAS}
        assert kept == {r: index.num_blocks(r) for r in REPLICAS}

    def test_the_oldest_stored_is_forgotten_first(self) -> None:
        index = PrefixIndex(["a"], max_blocks=2)
        index.stored("a", HASHES[:2])
        index.stored("a", HASHES[:1])  # stored again: now the newest
        index.stored("a", HASHES[2:3])
        assert index.match(HASHES[:1]) == {"a": 1} and index.match(HASHES[1:2]) == {"a": 0}
        assert (index.forgotten, index.num_blocks("a")) == (1, 2)

    @pytest.mark.parametrize(
        ("replicas", "cap"), [((), 10), (("a", "a"), 10), (("a",), 0), (("a",), True)]
    )
    def test_bad_arguments(self, replicas: tuple[str, ...], cap: int) -> None:
        with pytest.raises(InvalidConfigError):
            PrefixIndex(replicas, max_blocks=cap)


class TestExpected:
    """Blocks routed but not yet announced (:meth:`PrefixIndex.expect`) and the cache
    size learnt from evictions (:meth:`PrefixIndex.capacity`)."""

    def test_expected_blocks_count_until_announced_or_lapsed(self) -> None:
        index = PrefixIndex(REPLICAS)
        prompt = HASHES[:4]
        index.expect("a", prompt, until=10.0, now=0.0)
        assert index.match(prompt) == {"a": 0, "b": 0, "c": 0}  # events alone: nothing
        assert index.match(prompt, now=5.0) == {"a": 4, "b": 0, "c": 0}
        assert index.match(prompt, now=10.0)["a"] == 0  # lapsed
        index.expect("b", prompt, until=20.0, now=10.0)
        index.stored("b", prompt[:2])  # announced: held now, expected no more
        assert index.match(prompt, now=11.0)["b"] == 4
        assert (index.expected["b"], index.confirmed["b"]) == (4, 2)
        index.removed("b", prompt[2:3])  # evicted before it was announced
        assert index.match(prompt, now=11.0)["b"] == 2
        index.cleared("b")
        assert index.match(prompt, now=11.0)["b"] == 0

    def test_a_renewed_expectation_outlives_the_first(self) -> None:
        index = PrefixIndex(REPLICAS)
        index.expect("a", HASHES[:2], until=10.0, now=0.0)
        index.expect("a", HASHES[:2], until=30.0, now=5.0)
        assert index.match(HASHES[:2], now=20.0)["a"] == 2
        assert index.expected["a"] == 2  # the same blocks, counted once

    def test_expectations_are_bounded(self) -> None:
        index = PrefixIndex(REPLICAS, max_blocks=4)
        for i in range(3):
            index.expect("a", HASHES[4 * i : 4 * i + 4], until=100.0, now=0.0)
        assert index.match(HASHES[8:12], now=1.0)["a"] == 4  # the newest kept
        assert index.match(HASHES[:4], now=1.0)["a"] == 0

    def test_capacity_is_known_once_a_replica_evicted(self) -> None:
        index = PrefixIndex(REPLICAS)
        index.stored("a", HASHES[:6])
        assert index.capacity("a") is None  # not full yet, as far as anyone knows
        index.removed("a", HASHES[:2])
        index.stored("a", HASHES[6:8])
        assert index.capacity("a") == 6
        index.cleared("a")
        assert index.capacity("a") is None and index.clears["a"] == 1
