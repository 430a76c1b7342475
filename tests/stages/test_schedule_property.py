"""Stateful property test of the scheduler against a fake model and a fake paged KV cache.

The fake worker writes, for every computed position, a digest of the request's prefix
into the block slot the scheduler assigned; before computing, it checks that every
position the scheduler claims is already computed (prefix hits included) holds the right
digest. A failed step writes garbage instead, so a cache entry that survived a failure
would be caught. Block ownership, budgets and ref counts are checked after every step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pipeline.artifacts import FanInOutput, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.request import Request, RequestOutput
from stages.scheduler import Scheduler, SchedulerSettings

BASES = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5])
STOP_TOKEN = 17
GARBAGE = -1


def model_token(req_id: str, k: int) -> int:
    """The fake model: output ``k`` of ``req_id``, independent of batching."""
    return (int(req_id[1:]) * 7 + k * 13) % 20 + 1


def digest(tokens: list[int]) -> int:
    return hash(tuple(tokens))


class Expected(NamedTuple):
    tokens: list[int]
    reason: str


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, aborts, steps and failed steps keep every scheduler invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler
        self.kv: dict[tuple[int, int], int] = {}
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.final: dict[str, RequestOutput] = {}
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(6, 16),
        block_size=st.sampled_from([2, 3, 4]),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(3, 12),
        caching=st.booleans(),
    )
    def build(
        self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int, caching: bool
    ) -> None:
        self.block_size = block_size
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.max_len = min(40, num_blocks * block_size)
        self.scheduler = Scheduler(
            SchedulerSettings(
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=40,
                enable_prefix_caching=caching,
                hash_seed=0,
            ),
            num_blocks=num_blocks,
        )

    @rule(
        base=st.sampled_from(BASES),
        keep=st.sampled_from([1, 4, 6, 8, 12]),
        suffix=st.one_of(st.just([]), st.lists(st.integers(1, 20), max_size=4)),
        max_tokens=st.integers(1, 8),
        stop=st.booleans(),
    )
    def add(
        self, base: list[int], keep: int, suffix: list[int], max_tokens: int, stop: bool
    ) -> None:
        prompt = (base[:keep] + suffix)[: self.max_len]
        req_id = f"r{self.next_id}"
        self.next_id += 1
        # (a dict: attrs' converter=tuple on stop_token_ids confuses mypy's inference)
        stops: dict[str, Any] = {"stop_token_ids": (STOP_TOKEN,) if stop else ()}
        params = SamplingParams(max_tokens=max_tokens, **stops)
        self.scheduler.add_request(Request(req_id, prompt, params))
        self.tokens[req_id] = list(prompt)
        self.params[req_id] = params

    @precondition(lambda self: bool(self.scheduler.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self._record(self.scheduler.abort_requests([req_id]))

    @rule(abort_in_flight=st.booleans(), fail=st.booleans(), data=st.data())
    def step(self, abort_in_flight: bool, fail: bool, data: st.DataObject) -> None:
        so = self.scheduler.schedule()
        self._check_output(so)
        if abort_in_flight and so.requests:
            victim = data.draw(st.sampled_from([r.req_id for r in so.requests]))
            self._record(self.scheduler.abort_requests([victim]))
        if fail and so.requests:
            self._execute(so, failed=True)
            self._record(self.scheduler.fail_requests([r.req_id for r in so.requests], "boom"))
        else:
            self._update(so, self._execute(so, failed=False))

    def _update(self, so: SchedulerOutput, sampled: dict[str, int]) -> None:
        outs = self.scheduler.update_from_output(
            so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled)
        )
        self._record(outs)

    def _check_output(self, so: SchedulerOutput) -> None:
        ids = [r.req_id for r in so.requests]
        assert len(ids) == len(set(ids))
        assert len(ids) <= self.max_num_seqs
        assert so.total_num_scheduled_tokens <= self.budget
        for req_id in so.finished_req_ids:
            self.tables.pop(req_id, None)
        for item in so.requests:
            tokens = self.tokens[item.req_id]
            start = item.num_computed_tokens
            assert item.token_ids, "a scheduled request computes at least one token"
            assert item.token_ids == tuple(tokens[start : start + len(item.token_ids)])
            assert item.sample == (start + len(item.token_ids) == len(tokens))
            if item.new:
                self.tables[item.req_id] = list(item.block_ids)
            else:
                self.tables[item.req_id].extend(item.block_ids)
            assert self.tables[item.req_id] == self.scheduler.kv_cache_manager.get_block_ids(
                item.req_id
            )

    def _execute(self, so: SchedulerOutput, *, failed: bool) -> dict[str, int]:
        """Check the KV every claimed-computed position holds, then write this chunk's.

        A failed step writes garbage and skips the checks (its requests all fail)."""
        bs = self.block_size
        sampled: dict[str, int] = {}
        for item in so.requests:
            tokens = self.tokens[item.req_id]
            table = self.tables[item.req_id]
            start = item.num_computed_tokens
            for pos in range(0 if failed else start):
                got = self.kv.get((table[pos // bs], pos % bs))
                assert got == digest(tokens[: pos + 1]), (item.req_id, pos)
            for pos in range(start, start + len(item.token_ids)):
                value = GARBAGE if failed else digest(tokens[: pos + 1])
                self.kv[(table[pos // bs], pos % bs)] = value
            if item.sample:
                sampled[item.req_id] = model_token(item.req_id, item.num_output_tokens)
        return sampled

    def _record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            prompt = self.tokens[out.request_id][: len(out.prompt_token_ids)]
            self.tokens[out.request_id] = prompt + list(out.token_ids)
            if out.finished:
                self.final[out.request_id] = out

    @invariant()
    def blocks_are_owned_consistently(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        kv = self.scheduler.kv_cache_manager
        owners: dict[int, int] = {}
        for block_ids in kv.owners().values():
            assert len(block_ids) == len(set(block_ids))
            for block_id in block_ids:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in kv.block_pool.blocks:
            assert block.ref_cnt == owners.get(block.block_id, 0)
            if block.ref_cnt > 1:
                assert block.block_hash is not None  # only cached prefix blocks are shared
        for block_hash, block in kv.block_pool.cached.items():
            assert block.block_hash == block_hash
        in_use = sum(1 for b in kv.block_pool.blocks if b.ref_cnt)
        assert in_use + self.scheduler.num_free_blocks == self.scheduler.num_blocks
        for req_id, request in self.scheduler.requests.items():
            held = len(kv.get_block_ids(req_id)) * self.block_size
            assert held >= request.num_computed_tokens

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(2000):
            if not self.scheduler.has_unfinished_requests():
                break
            so = self.scheduler.schedule()
            self._check_output(so)
            self._update(so, self._execute(so, failed=False))
        assert not any(self.scheduler.leak_report().values())
        assert all(b.ref_cnt == 0 for b in self.scheduler.kv_cache_manager.block_pool.blocks)
        for req_id, out in self.final.items():
            expected = self._expected(req_id, len(out.prompt_token_ids))
            if out.finish_reason in ("abort", "error"):
                assert out.token_ids == tuple(expected.tokens[: len(out.token_ids)])
            else:
                assert (out.token_ids, out.finish_reason) == (
                    tuple(expected.tokens),
                    expected.reason,
                )

    def _expected(self, req_id: str, num_prompt: int) -> Expected:
        params = self.params[req_id]
        tokens: list[int] = []
        while True:
            tokens.append(model_token(req_id, len(tokens)))
            if tokens[-1] in params.stop_token_ids:
                reason = "stop"
                break
            if len(tokens) >= params.max_tokens or num_prompt + len(tokens) >= self.max_len:
                reason = "length"
                break
        return Expected(tokens, reason)


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerProperties = SchedulerMachine.TestCase
