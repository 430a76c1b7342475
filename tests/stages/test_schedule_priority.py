"""The priority policy and tenant fair share in the scheduler: admission order,
preemption of lower-priority running requests, fair slots per tenant."""

from __future__ import annotations

import time

import pytest
from schedule_driver import assert_idle, make_scheduler, run_to_completion, step

from pipeline.config import SamplingParams
from pipeline.errors import InvalidConfigError
from pipeline.request import Request, RequestStatus
from stages.scheduler import Scheduler
from stages.scheduler.tenants import TenantLedger


def add(
    scheduler: Scheduler,
    req_id: str,
    *,
    priority: int = 0,
    tenant: str | None = None,
    arrival_time: float | None = None,
    prompt: list[int] | None = None,
    max_tokens: int = 2,
) -> Request:
    request = Request(
        req_id,
        prompt or [1, 2, 3],
        SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival_time,
        priority=priority,
        tenant=tenant,
    )
    scheduler.add_request(request)
    return request


def start_order(scheduler: Scheduler, max_steps: int = 500) -> list[str]:
    """Run every request to completion; the ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return order
        for item in step(scheduler).scheduled.requests:
            if item.req_id not in order:
                order.append(item.req_id)
    raise AssertionError("requests did not finish")


class TestConstruction:
    def test_unknown_policy_is_refused_by_name(self) -> None:
        """Only fcfs and priority are policies; the error names the field."""
        with pytest.raises(InvalidConfigError, match=r"scheduling_policy.*fcfs, priority"):
            make_scheduler(scheduling_policy="lifo")

    def test_fair_share_must_be_a_bool(self) -> None:
        """tenant_fair_share is true or false, nothing else."""
        with pytest.raises(InvalidConfigError, match="tenant_fair_share"):
            make_scheduler(tenant_fair_share=1)


class TestPriorityOrder:
    def test_lower_priority_number_starts_first(self) -> None:
        """Waiting requests start by priority, lower first, whatever their arrival."""
        scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
        for req_id, priority in (("p5", 5), ("p1", 1), ("p-2", -2), ("p3", 3)):
            add(scheduler, req_id, priority=priority)
        assert start_order(scheduler) == ["p-2", "p1", "p3", "p5"]
        assert_idle(scheduler)

    def test_ties_go_by_arrival_time(self) -> None:
        """Equal priorities start by arrival time, then by the order they were added."""
        scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
        now = time.monotonic()
        add(scheduler, "late", priority=1, arrival_time=now - 1)
        add(scheduler, "early", priority=1, arrival_time=now - 5)
        add(scheduler, "same-1", priority=1, arrival_time=now - 3)
        add(scheduler, "same-2", priority=1, arrival_time=now - 3)
        assert start_order(scheduler) == ["early", "same-1", "same-2", "late"]

    def test_fcfs_ignores_priority(self) -> None:
        """Under fcfs the order is the order of arrival, priorities notwithstanding."""
        scheduler = make_scheduler(max_num_seqs=1)
        for req_id, priority in (("p5", 5), ("p1", 1), ("p-2", -2)):
            add(scheduler, req_id, priority=priority)
        assert start_order(scheduler) == ["p5", "p1", "p-2"]


class TestPriorityPreemption:
    def test_higher_priority_preempts_the_worst_running_request(self) -> None:
        """With every slot taken, a better request preempts the worst running one (the
        largest priority number), and the other keeps running."""
        scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=2)
        worst = add(scheduler, "worst", priority=5, max_tokens=8)
        add(scheduler, "middle", priority=3, max_tokens=8)
        step(scheduler)
        add(scheduler, "urgent", priority=0, max_tokens=8)
        so = step(scheduler).scheduled
        ids = {item.req_id for item in so.requests}
        assert ids == {"urgent", "middle"}
        assert "worst" in so.finished_req_ids  # the workers drop its state
        assert worst.status == RequestStatus.PREEMPTED
        assert scheduler.num_preemptions == 1
        finals = run_to_completion(scheduler)
        assert {out.finish_reason for out in finals.values()} == {"length"}
        assert len(finals["worst"].token_ids) == 8
        assert_idle(scheduler)

    def test_equal_priority_never_preempts(self) -> None:
        """A waiting request of the same priority waits for a slot: no thrashing."""
        scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
        add(scheduler, "first", priority=1, max_tokens=4)
        step(scheduler)
        add(scheduler, "second", priority=1, max_tokens=4, arrival_time=0.0)
        assert start_order(scheduler) == ["first", "second"]
        assert scheduler.num_preemptions == 0

    def test_fcfs_never_preempts_for_a_waiting_request(self) -> None:
        """The same arrivals under fcfs: the late request waits, nobody is preempted."""
        scheduler = make_scheduler(max_num_seqs=2)
        add(scheduler, "worst", priority=5, max_tokens=8)
        add(scheduler, "middle", priority=3, max_tokens=8)
        step(scheduler)
        add(scheduler, "urgent", priority=0, max_tokens=8)
        assert {item.req_id for item in step(scheduler).scheduled.requests} == {
            "worst",
            "middle",
        }
        assert scheduler.num_preemptions == 0

    def test_higher_priority_preempts_for_blocks(self) -> None:
        """With slots free but the pool full, a better request preempts the worst
        running one for its blocks."""
        scheduler = make_scheduler(
            scheduling_policy="priority", num_blocks=4, block_size=4, max_num_seqs=4
        )
        low = add(scheduler, "low", priority=2, prompt=list(range(1, 13)), max_tokens=3)
        step(scheduler)  # 12 prompt tokens: 3 of the 4 blocks
        add(scheduler, "high", priority=1, prompt=list(range(20, 28)), max_tokens=3)
        so = step(scheduler).scheduled
        assert [item.req_id for item in so.requests] == ["high"]
        assert low.status == RequestStatus.PREEMPTED
        finals = run_to_completion(scheduler)
        assert set(finals) == {"low", "high"}
        assert_idle(scheduler)

    @pytest.mark.parametrize(("policy", "victim"), [("priority", "low"), ("fcfs", "high")])
    def test_pool_exhaustion_preempts_the_worst_not_the_last_admitted(
        self, policy: str, victim: str
    ) -> None:
        """When running requests outgrow the pool, priority preempts the lowest priority
        (here admitted first); fcfs preempts the last admitted."""
        scheduler = make_scheduler(
            scheduling_policy=policy, num_blocks=4, block_size=4, max_num_seqs=4
        )
        requests = {"low": add(scheduler, "low", priority=2, prompt=[8] * 7, max_tokens=4)}
        step(scheduler)
        requests["high"] = add(scheduler, "high", priority=1, prompt=[9] * 7, max_tokens=4)
        for _ in range(3):
            step(scheduler)
            if scheduler.num_preemptions:
                break
        assert scheduler.num_preemptions == 1
        assert requests[victim].num_preemptions == 1
        run_to_completion(scheduler)
        assert_idle(scheduler)


class TestTenantFairShare:
    @pytest.mark.parametrize("fair", [True, False])
    def test_a_late_tenant_gets_the_next_free_slots(self, fair: bool) -> None:
        """Tenant B's requests, queued behind tenant A's flood, start as slots free up
        (fair share) instead of after all of A's (FCFS)."""
        scheduler = make_scheduler(max_num_seqs=2, tenant_fair_share=fair)
        for i in range(6):
            add(scheduler, f"a{i}", tenant="A")
        step(scheduler)
        for i in range(2):
            add(scheduler, f"b{i}", tenant="B")
        order = start_order(scheduler)  # a0 and a1 run already
        if fair:
            assert order == ["a0", "a1", "b0", "a2", "b1", "a3", "a4", "a5"]
        else:
            assert order == [*(f"a{i}" for i in range(6)), "b0", "b1"]
        assert_idle(scheduler)

    def test_a_lone_tenant_gets_every_slot(self) -> None:
        """Fair share is work-conserving: one tenant alone fills max_num_seqs."""
        scheduler = make_scheduler(max_num_seqs=4, tenant_fair_share=True)
        for i in range(6):
            add(scheduler, f"a{i}", tenant="A")
        assert len(step(scheduler).scheduled.requests) == 4

    def test_priority_comes_before_the_tenant_share(self) -> None:
        """Under the priority policy a better priority starts first, fair share or not."""
        scheduler = make_scheduler(
            scheduling_policy="priority", max_num_seqs=1, tenant_fair_share=True
        )
        add(scheduler, "a0", tenant="A", priority=1)
        add(scheduler, "a1", tenant="A", priority=1)
        add(scheduler, "b0", tenant="B", priority=2)
        add(scheduler, "a2", tenant="A", priority=0)
        assert start_order(scheduler) == ["a2", "a0", "a1", "b0"]

    def test_one_slot_goes_round_robin(self) -> None:
        """With one slot, tenants take turns (least recently served first); requests
        without a tenant count as one tenant among the named ones."""
        scheduler = make_scheduler(max_num_seqs=1, tenant_fair_share=True)
        for i in range(3):
            add(scheduler, f"n{i}")
        add(scheduler, "t0", tenant="T")
        assert start_order(scheduler) == ["n0", "t0", "n1", "n2"]

    def test_the_ledger_forgets_the_least_recently_served(self) -> None:
        """The tenant ledger is bounded: past its capacity the tenant served longest
        ago is forgotten first (it counts as never served)."""
        ledger = TenantLedger(capacity=2)
        for tenant in ("x", "y", "x", "z"):
            ledger.served(tenant)
        assert len(ledger) == 2
        assert ledger.last_served("y") == -1
        assert ledger.last_served("x") < ledger.last_served("z")
