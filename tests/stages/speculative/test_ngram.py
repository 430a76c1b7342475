"""The n-gram proposer: vLLM's prompt lookup, with the most recent occurrence of the
longest suffix that occurred before."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import InvalidConfigError
from stages.speculative import NgramProposer


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule in plain Python: longest n first, latest earlier occurrence with a
    continuation, at most k tokens of it."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= size:
            continue
        suffix = tokens[size - n :]
        for i in range(size - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


class TestPropose:
    def test_the_longest_suffix_wins(self) -> None:
        """[1 2 3] occurred before (n=3 beats n=2's later hits): what followed it."""
        proposer = NgramProposer(k=3, min_n=2, max_n=4)
        assert proposer.propose([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]) == [4, 9, 2]

    def test_the_most_recent_occurrence_wins(self) -> None:
        proposer = NgramProposer(k=2, min_n=2, max_n=2)
        assert proposer.propose([5, 6, 7, 5, 6, 8, 5, 6]) == [8, 5]

    def test_a_continuation_cut_by_the_end_is_shorter(self) -> None:
        proposer = NgramProposer(k=3, min_n=2, max_n=2)
        assert proposer.propose([7, 1, 2, 1, 2]) == [1, 2]

    def test_no_match_proposes_nothing(self) -> None:
        proposer = NgramProposer(k=4)
        assert proposer.propose([1, 2, 3, 4, 5, 6]) == []
        assert proposer.propose([]) == [] and proposer.propose([1, 1]) == []

    def test_a_smaller_limit_per_request(self) -> None:
        """``k`` per call never exceeds the configured one."""
        proposer = NgramProposer(k=2, min_n=1, max_n=1)
        tokens = [3, 4, 5, 6, 3]
        assert proposer.propose(tokens, 1) == [4]
        assert proposer.propose(tokens, 9) == [4, 5]
        assert proposer.propose(tokens, 0) == []

    def test_numpy_input(self) -> None:
        proposer = NgramProposer(k=2, min_n=2, max_n=3)
        assert proposer.propose(np.array([8, 9, 1, 8, 9], dtype=np.int64)) == [1, 8]

    @settings(max_examples=300, deadline=None)
    @given(
        tokens=st.lists(st.integers(0, 4), max_size=40),
        k=st.integers(1, 5),
        min_n=st.integers(1, 3),
        extra=st.integers(0, 3),
    )
    def test_equals_the_plain_rule(self, tokens: list[int], k: int, min_n: int, extra: int) -> None:
        """Over random small-vocabulary texts (many repeats), the vectorised search
        proposes exactly what the plain loop does."""
        proposer = NgramProposer(k=k, min_n=min_n, max_n=min_n + extra)
        assert proposer.propose(tokens) == _reference(tokens, k, min_n, min_n + extra)


class TestConfig:
    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"k": 0}, "num_speculative_tokens"),
            ({"k": True}, "num_speculative_tokens"),
            ({"k": 2, "min_n": 0}, "prompt_lookup_min"),
            ({"k": 2, "max_n": 2.5}, "prompt_lookup_max"),
            ({"k": 2, "min_n": 5, "max_n": 3}, "prompt_lookup_min"),
        ],
    )
    def test_bad_sizes_name_the_vllm_field(self, kwargs: dict[str, object], field: str) -> None:
        with pytest.raises(InvalidConfigError, match=field):
            NgramProposer(**kwargs)  # type: ignore[arg-type]
