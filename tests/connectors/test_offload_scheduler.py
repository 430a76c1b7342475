"""OffloadScheduler driven by the real scheduler with a fake model (no workers)."""

from __future__ import annotations

import pytest

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.offload import OffloadMetadata, OffloadScheduler, SlotIndex
from pipeline.artifacts import FanInOutput, SchedulerOutput
from pipeline.block_hashes import hash_request_tokens
from pipeline.config import SamplingParams
from pipeline.errors import InvalidConfigError
from pipeline.request import Request
from stages.scheduler import Scheduler, SchedulerSettings

BS = 4


def fingerprint(dtype: str = "float32", rank: int = 0) -> ModelFingerprint:
    return ModelFingerprint(
        architecture="LlamaForCausalLM", weights_id="w", dtype=dtype, block_size=BS, tp_rank=rank
    )


def make(
    num_slots: int = 16, fp: ModelFingerprint | None = None, budget: int = 64, **opts
) -> Scheduler:
    context = ConnectorContext(
        role=KVConnectorRole.SCHEDULER,
        options={"num_blocks": num_slots, **opts},
        block_size=BS,
        fingerprint=fp or fingerprint(),
    )
    return Scheduler(
        SchedulerSettings(
            block_size=BS,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=256,
            enable_prefix_caching=False,
        ),
        num_blocks=64,
        connector=OffloadScheduler(context),
    )


def offload(scheduler: Scheduler) -> OffloadScheduler:
    connector = scheduler.connector
    assert isinstance(connector, OffloadScheduler)
    return connector


def add(scheduler: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 1) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, **output) -> SchedulerOutput:
    """One step; every sampling request gets token 7; ``output`` goes into the fan-in."""
    so = scheduler.schedule()
    sampled = {r.req_id: 7 for r in so.requests if r.sample}
    scheduler.update_from_output(
        so, FanInOutput(step_id=so.step_id, sampled_token_ids=sampled, **output)
    )
    return so


def meta(so: SchedulerOutput) -> OffloadMetadata:
    assert isinstance(so.kv_connector_metadata, OffloadMetadata)
    return so.kv_connector_metadata


def drain(scheduler: Scheduler) -> list[SchedulerOutput]:
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(step(scheduler))
    return steps


PROMPT = list(range(1, 18))  # 17 tokens: 4 full blocks + 1 token


class TestSaves:
    def test_full_blocks_are_saved_once_and_committed_after_the_step(self):
        """The prompt's 4 full blocks get slots in the step that fills them; they are
        loadable only once that step's output came back."""
        scheduler = make()
        add(scheduler, "a", PROMPT)
        so = scheduler.schedule()
        saves = meta(so).saves()
        assert [c.block_id for c in saves] == list(so.requests[0].block_ids[:4])
        assert offload(scheduler).index.usage().pending == 4
        assert len(offload(scheduler).index) == 0
        scheduler.update_from_output(
            so, FanInOutput(step_id=so.step_id, sampled_token_ids={"a": 7})
        )
        assert len(offload(scheduler).index) == 4

    def test_chunked_prefill_saves_each_block_in_the_step_it_fills(self):
        """With 6-token chunks, block 0 is saved in step 0, block 1 in step 1, ..."""
        scheduler = make(budget=6)
        add(scheduler, "a", PROMPT)
        saved = [[c.block_id for c in meta(so).saves()] for so in drain(scheduler)]
        assert [len(s) for s in saved[:3]] == [1, 2, 1]

    def test_failed_save_frees_its_slots(self):
        """A request reported in failed_save_req_ids commits nothing."""
        scheduler = make()
        add(scheduler, "a", PROMPT)
        step(scheduler, failed_save_req_ids=frozenset({"a"}))
        usage = offload(scheduler).index.usage()
        assert usage.committed == 0 and usage.free == 16

    def test_a_step_that_never_came_back_drops_its_saves(self):
        """A failed step (no update) leaves no index entry pointing at garbage."""
        scheduler = make()
        add(scheduler, "a", PROMPT)
        so = scheduler.schedule()
        scheduler.fail_requests([r.req_id for r in so.requests], "boom")
        scheduler.schedule()
        usage = offload(scheduler).index.usage()
        assert usage.committed == 0 and usage.pending == 0 and usage.free == 16


class TestMatching:
    def test_second_request_loads_the_shared_prefix(self):
        """A prompt sharing 2 full blocks loads exactly those 2 blocks."""
        scheduler = make()
        add(scheduler, "a", PROMPT)
        drain(scheduler)
        request = add(scheduler, "b", [*PROMPT[:8], 99, 98, 97, 96, 95])
        so = step(scheduler)
        loads = meta(so).loads()
        assert [c.req_id for c in loads] == ["b", "b"]
        assert request.num_cached_tokens == 8 and so.requests[0].num_computed_tokens == 8

    def test_never_the_whole_prompt(self):
        """A prompt of exactly 4 stored blocks loads 3: its last token is computed."""
        scheduler = make()
        add(scheduler, "a", PROMPT)
        drain(scheduler)
        add(scheduler, "b", PROMPT[:16])
        so = step(scheduler)
        assert len(meta(so).loads()) == 3 and so.requests[0].token_ids == tuple(PROMPT[12:16])

    def test_another_fingerprint_never_matches(self):
        """A scheduler of another model (dtype) sharing the index finds nothing."""
        scheduler = make()
        add(scheduler, "a", PROMPT)
        drain(scheduler)
        shared: SlotIndex = offload(scheduler).index
        context = ConnectorContext(
            role=KVConnectorRole.SCHEDULER,
            options={"num_blocks": 16},
            block_size=BS,
            fingerprint=fingerprint(dtype="bfloat16"),
        )
        other = OffloadScheduler(context, index=shared)
        probe = Request("p", PROMPT, SamplingParams())
        probe.block_hashes = hash_request_tokens(PROMPT, BS)
        assert other.get_num_new_matched_tokens(probe, 0).num_tokens == 0
        assert offload(scheduler).get_num_new_matched_tokens(probe, 0).num_tokens == 16

    def test_invalid_block_is_dropped_and_recomputed(self):
        """A block that failed to load leaves the index; the request recomputes it and
        saves it again."""
        scheduler = make()
        add(scheduler, "a", PROMPT)
        drain(scheduler)
        add(scheduler, "b", PROMPT, max_tokens=2)
        so = scheduler.schedule()
        loads = meta(so).loads()
        bad = loads[1]
        scheduler.update_from_output(
            so,
            FanInOutput(
                step_id=so.step_id,
                sampled_token_ids={"b": 7},
                invalid_block_ids=frozenset({bad.block_id}),
            ),
        )
        connector = offload(scheduler)
        assert connector.index.lookup((connector.fingerprint_key, bad.block_hash)) is None
        assert len(connector.index) == 3
        so = step(scheduler)
        assert so.requests[0].num_computed_tokens == 4  # truncated to the valid block
        assert [c.block_id for c in meta(so).saves()] == [bad.block_id]

    def test_eviction_never_takes_a_slot_loaded_this_step(self):
        """With a full tier, a save in the step of a load evicts another entry."""
        scheduler = make(num_slots=4)
        add(scheduler, "a", PROMPT)
        drain(scheduler)
        add(scheduler, "b", [*PROMPT[:4], 50, 51, 52, 53, 54, 55, 56, 57, 58])
        so = step(scheduler)
        (load,) = meta(so).loads()
        assert load.slot not in {c.slot for c in meta(so).saves()}
        assert len(meta(so).saves()) == 2

    def test_request_finished_forgets_the_request(self):
        """Finished requests leave no tracker behind."""
        scheduler = make()
        add(scheduler, "a", PROMPT, max_tokens=3)
        add(scheduler, "b", PROMPT[:5], max_tokens=2)
        drain(scheduler)
        assert offload(scheduler).num_tracked_requests == 0
        assert offload(scheduler).index.usage().pinned == 0


class TestAsync:
    def test_async_load_parks_the_request_until_every_rank_received(self):
        """With async_load, a hit parks the request; its slots stay pinned until
        finished_recving names it, then it runs from the loaded prefix."""
        scheduler = make(async_load=True)
        add(scheduler, "a", PROMPT)
        drain(scheduler)
        request = add(scheduler, "b", PROMPT)
        so = step(scheduler)
        assert so.requests == () and meta(so).async_req_ids == ("b",)
        assert offload(scheduler).index.usage().pinned == 4
        assert offload(scheduler).has_pending_work()
        step(scheduler, finished_recving=frozenset({"b"}))
        assert offload(scheduler).index.usage().pinned == 0
        so = step(scheduler)
        assert so.requests[0].num_computed_tokens == 16 and request.num_cached_tokens == 16
        drain(scheduler)

    def test_abort_while_loading_unpins(self):
        """An aborted parked request releases its pins at once."""
        scheduler = make(async_load=True)
        add(scheduler, "a", PROMPT)
        drain(scheduler)
        add(scheduler, "b", PROMPT)
        step(scheduler)
        scheduler.abort_requests(["b"])
        assert offload(scheduler).index.usage().pinned == 0
        assert not offload(scheduler).has_pending_work()


class TestConstruction:
    def test_fingerprint_is_required(self):
        """Without a fingerprint the scheduler half refuses to build."""
        context = ConnectorContext(role=KVConnectorRole.SCHEDULER, options={"num_blocks": 2})
        with pytest.raises(InvalidConfigError, match="fingerprint"):
            OffloadScheduler(context)
