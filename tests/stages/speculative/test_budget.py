"""DraftBudget: k follows acceptance per request, misses back off, budgets are dropped
with their requests."""

from __future__ import annotations

from stages.speculative.budget import MAX_PAUSE, DraftBudget


class TestLimits:
    def test_a_new_request_gets_k(self) -> None:
        assert DraftBudget(4).limit("a") == 4

    def test_k_follows_what_was_kept(self) -> None:
        budget = DraftBudget(4)
        budget.observe({"a": (4, 1), "b": (2, 2)})
        assert budget.limit("a") == 2  # one more than what held
        assert budget.limit("b") == 3  # all held: one more than it had
        budget.observe({"b": (3, 3)})
        budget.observe({"b": (4, 4)})
        assert budget.limit("b") == 4  # never above k

    def test_misses_pause_the_request_for_longer_and_longer(self) -> None:
        budget = DraftBudget(4)
        budget.observe({"a": (4, 0)})
        assert budget.limit("a") == 1  # one miss: one draft next
        pauses = []
        for _ in range(8):
            budget.observe({"a": (1, 0)})
            skipped = 0
            while budget.limit("a") == 0:
                skipped += 1
            pauses.append(skipped)
        assert pauses == [2, 4, 8, 16, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE]

    def test_a_kept_draft_ends_the_misses(self) -> None:
        budget = DraftBudget(4)
        for _ in range(3):
            budget.observe({"a": (1, 0)})
        while budget.limit("a") == 0:
            pass
        budget.observe({"a": (1, 1)})
        assert budget.limit("a") == 2
        budget.observe({"a": (2, 0)})
        assert budget.limit("a") == 1  # a first miss again: no pause

    def test_steps_without_drafts_change_nothing(self) -> None:
        budget = DraftBudget(3)
        budget.observe({"a": (0, 0)})
        assert len(budget) == 0 and budget.limit("a") == 3


class TestLifetime:
    def test_forget_and_retain_drop_budgets(self) -> None:
        budget = DraftBudget(4)
        budget.observe({"a": (4, 1), "b": (4, 1), "c": (4, 1)})
        budget.forget(["a", "zzz"])
        budget.retain(["b"])
        assert len(budget) == 1 and budget.limit("b") == 2 and budget.limit("c") == 4
