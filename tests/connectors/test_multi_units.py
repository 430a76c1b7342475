"""The multi connector's parts on their own: options, metadata bytes, the choice of the
tier, promotion and failure routing in the scheduler half, fan-out in the worker half."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import msgspec
import pytest

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
    ModelFingerprint,
)
from connectors.multi import MultiMetadata, MultiOptions, MultiScheduler, MultiWorker
from connectors.offload import BlockCopy, OffloadMetadata
from connectors.registry import register_connector, unregister_connector
from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.errors import FrameError, InvalidConfigError, StageError, UnknownConnectorError
from pipeline.request import Request

BS = 4
FP = ModelFingerprint(architecture="Llama", weights_id="w", dtype="float32", block_size=BS)


@attrs.frozen
class StubMeta(KVConnectorMetadata):
    step_id: int
    tier: int


class StubScheduler(KVConnectorScheduler):
    """Options: ``hit`` (tokens, or None), ``raise`` (every call raises), ``tier``."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.hit = context.options.get("hit", 0)
        self.fail = context.options.get("raise", False)
        self.tier = context.options.get("tier", 0)
        self.allocs: list[int] = []
        self.built: list[SchedulerOutput] = []
        self.outputs: list[KVConnectorOutput] = []

    def _check(self) -> None:
        if self.fail:
            raise RuntimeError(f"tier {self.tier} is broken")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        self._check()
        return MatchResult(self.hit, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.allocs.append(num_external_tokens)
        self._check()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StubMeta:
        self.built.append(scheduler_output)
        self._check()
        return StubMeta(scheduler_output.step_id, self.tier)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.outputs.append(output)
        self._check()


class StubWorker(KVConnectorWorker):
    """Records its calls; option ``raise`` makes every hook but clear raise."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.fail = context.options.get("raise", False)
        self.calls: list[str] = []

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self.calls.append("bind")
        super().bind_connector_metadata(metadata)

    async def start_load_kv(self, ctx: ForwardContext) -> None:
        self.calls.append("start_load_kv")
        if self.context.options.get("raise_start", False):
            raise RuntimeError("broken start")

    def save_kv_layer(self, layer: int, kv_layer: Any, ctx: ForwardContext) -> None:
        self.calls.append("save_kv_layer")

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append("wait_for_layer_load")
        if self.fail:
            raise RuntimeError("broken load")

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear")
        super().clear_connector_metadata()
        if self.fail:
            raise RuntimeError("broken clear")


@pytest.fixture(autouse=True)
def stub() -> Iterator[None]:
    register_connector("multi_stub", StubScheduler, StubWorker, replace=True)
    yield
    unregister_connector("multi_stub")


def context(role: KVConnectorRole, *tiers: dict[str, Any]) -> ConnectorContext:
    specs = [{"connector": "multi_stub", "options": {"tier": i, **t}} for i, t in enumerate(tiers)]
    return ConnectorContext(role=role, options={"tiers": specs}, block_size=BS, fingerprint=FP)


def multi(*tiers: dict[str, Any]) -> MultiScheduler:
    return MultiScheduler(context(KVConnectorRole.SCHEDULER, *tiers))


def stubs(sched: MultiScheduler) -> list[StubScheduler]:
    assert all(isinstance(t, StubScheduler) for t in sched.tiers)
    return list(sched.tiers)  # type: ignore[arg-type]


def request(n: int = 14) -> Request:
    return Request("r", list(range(1, n + 1)), SamplingParams(max_tokens=1))


def scheduled(req: Request, computed: int, blocks: Sequence[int]) -> SchedulerOutput:
    item = ScheduledRequest(
        req_id=req.request_id,
        token_ids=tuple(req.all_token_ids[computed:]),
        num_computed_tokens=computed,
        block_ids=tuple(blocks),
        new=True,
        sampling=req.sampling_params,
        sample=True,
        num_output_tokens=0,
    )
    return SchedulerOutput(step_id=1, requests=(item,))


class TestOptions:
    @pytest.mark.parametrize(
        "options",
        [
            {},
            {"tiers": []},
            {"tiers": "offload"},
            {"tiers": [{"connector": "offload"}], "extra": 1},
            {"tiers": [{"connector": ""}]},
            {"tiers": [{"connector": "multi"}]},
            {"tiers": [{"connector": "offload", "opts": {}}]},
            {"tiers": [{"connector": "offload", "options": 3}]},
            {"tiers": ["offload"]},
        ],
    )
    def test_bad_options_are_refused(self, options):
        """Every malformed option set raises InvalidConfigError (a ValueError)."""
        with pytest.raises(InvalidConfigError):
            MultiOptions.from_options(options)

    def test_an_unknown_tier_connector_names_the_known_ones(self):
        """A tier naming an unregistered connector fails when the tiers are built."""
        ctx = ConnectorContext(
            role=KVConnectorRole.SCHEDULER, options={"tiers": [{"connector": "nope"}]}
        )
        with pytest.raises(UnknownConnectorError, match="nope"):
            MultiScheduler(ctx)

    def test_each_tier_gets_its_own_options(self):
        """Tier options reach that tier only."""
        first, second = stubs(multi({"hit": 4}, {"hit": 8}))
        assert (first.hit, second.hit) == (4, 8)


class TestMetadata:
    def test_round_trip_through_bytes(self):
        """Tier metadata (an offload one, a stub, a missing one) survives to_bytes."""
        offload = OffloadMetadata.build(3, [BlockCopy("r", 1, 2, b"h" * 32)], [], set())
        meta = MultiMetadata(
            step_id=3, tiers=(offload, StubMeta(3, 1), None), load_block_ids=((1,), (), ())
        )
        again = MultiMetadata.from_bytes(meta.to_bytes())
        assert again == meta

    def test_an_unimported_type_is_refused(self):
        """A tier type name outside the imported modules is a FrameError, not an import."""
        raw = msgspec.msgpack.encode(
            {"step_id": 1, "tiers": [["os:system", b""]], "load_block_ids": [[]]}
        )
        with pytest.raises(FrameError):
            MultiMetadata.from_bytes(raw)


class TestScheduler:
    def test_longest_hit_wins(self):
        """The tier with the most matched tokens is chosen."""
        sched = multi({"hit": 4}, {"hit": 8})
        assert sched.get_num_new_matched_tokens(request(), 0) == MatchResult(8, False)

    def test_ties_go_to_the_first_tier(self):
        """Equal hits: the first (fastest) tier loads; the others are told 0."""
        sched = multi({"hit": 8}, {"hit": 8})
        req = request()
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, [5, 6, 7, 8], 8)
        assert [t.allocs for t in stubs(sched)] == [[8], [0]]
        meta = sched.build_connector_meta(scheduled(req, 8, [5, 6, 7, 8]))
        assert meta.load_block_ids == ((5, 6), ())

    def test_undecided_tier_makes_the_answer_undecided(self):
        """A tier answering None (ask again) makes the whole answer None."""
        assert multi({"hit": 8}, {"hit": None}).get_num_new_matched_tokens(request(), 0) == (
            MatchResult(None, False)
        )

    def test_a_raising_tier_counts_as_a_miss(self):
        """A tier that raises in the lookup is skipped; the other tier's hit stands."""
        sched = multi({"raise": True}, {"hit": 4})
        assert sched.get_num_new_matched_tokens(request(), 0) == MatchResult(4, False)

    def test_the_chosen_tier_raising_in_alloc_propagates(self):
        """Its loads would never happen, so the error reaches the engine."""
        sched = multi({"hit": 0}, {"hit": 4})
        req = request()
        sched.get_num_new_matched_tokens(req, 0)
        stubs(sched)[1].fail = True
        with pytest.raises(RuntimeError, match="tier 1"):
            sched.update_state_after_alloc(req, [5, 6, 7, 8], 4)

    def test_promotion_widens_the_chunk_for_faster_tiers_only(self):
        """A hit from tier 1: tier 0 sees the loaded tokens as computed in this step, tier
        1 sees the real chunk; a failed load of a promoted block fails tier 0's save."""
        sched = multi({"hit": 0}, {"hit": 8})
        req = request()
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, [5, 6, 7, 8], 8)
        meta = sched.build_connector_meta(scheduled(req, 8, [5, 6, 7, 8]))
        assert meta.load_block_ids == ((), (5, 6))
        fast, slow = stubs(sched)
        (wide,) = fast.built[-1].requests
        (real,) = slow.built[-1].requests
        assert (wide.num_computed_tokens, wide.token_ids) == (0, tuple(req.all_token_ids))
        assert real.num_computed_tokens == 8
        sched.update_connector_output(KVConnectorOutput(invalid_block_ids=frozenset({6})))
        assert fast.outputs[-1].failed_save_req_ids == {"r"}
        assert slow.outputs[-1].failed_save_req_ids == frozenset()

    def test_a_tier_failing_to_build_sends_no_metadata(self):
        """build_connector_meta of a broken tier yields None for it; others still build."""
        sched = multi({}, {"raise": True})
        meta = sched.build_connector_meta(SchedulerOutput(step_id=1))
        assert meta.tiers == (StubMeta(1, 0), None)


class TestWorker:
    def test_fan_out_keeps_going_and_reports_the_broken_tiers_loads(self):
        """A tier that raises in its layer hook and its clear: the other tier still gets
        every call, the broken tier's blocks are load errors, clear reaches both."""
        worker = MultiWorker(context(KVConnectorRole.WORKER, {"raise": True}, {}))
        broken, healthy = worker.tiers
        assert isinstance(broken, StubWorker) and isinstance(healthy, StubWorker)
        worker.bind_connector_metadata(
            MultiMetadata(
                step_id=1, tiers=(StubMeta(1, 0), StubMeta(1, 1)), load_block_ids=((3, 4), ())
            )
        )
        worker.wait_for_layer_load(0)
        assert worker.get_block_ids_with_load_errors() == {3, 4}
        worker.clear_connector_metadata()
        assert healthy.calls == broken.calls == ["bind", "wait_for_layer_load", "clear"]
        assert worker.connector_metadata is None and healthy.connector_metadata is None

    def test_a_tier_without_metadata_sits_the_step_out(self):
        """A tier whose metadata is missing is not called, and its loads are errors."""
        worker = MultiWorker(context(KVConnectorRole.WORKER, {}, {}))
        worker.bind_connector_metadata(
            MultiMetadata(step_id=1, tiers=(None, StubMeta(1, 1)), load_block_ids=((7,), ()))
        )
        worker.wait_for_layer_load(0)
        assert worker.get_block_ids_with_load_errors() == {7}
        first, second = worker.tiers
        assert isinstance(first, StubWorker) and isinstance(second, StubWorker)
        assert first.calls == [] and second.calls == ["bind", "wait_for_layer_load"]
        worker.clear_connector_metadata()

    def test_wrong_metadata_is_a_stage_error(self):
        """Metadata that is not a MultiMetadata for these tiers is refused at bind."""
        worker = MultiWorker(context(KVConnectorRole.WORKER, {}))
        with pytest.raises(StageError):
            worker.bind_connector_metadata(StubMeta(1, 0))

    @pytest.mark.anyio
    async def test_a_tier_whose_start_fails_sits_out_and_fails_the_steps_saves(self):
        """start_load_kv raises in tier 0: its loads are errors, its save hooks are not
        called (its step state may be stale), and every request's save is reported
        failed; tier 1 still gets every call."""
        worker = MultiWorker(context(KVConnectorRole.WORKER, {"raise_start": True}, {}))
        broken, healthy = worker.tiers
        assert isinstance(broken, StubWorker) and isinstance(healthy, StubWorker)
        req = request()
        so = scheduled(req, 0, [1, 2, 3, 4])
        ctx = ForwardContext(step_id=1, rank=0, kv_caches=[], scheduler_output=so)
        worker.bind_connector_metadata(
            MultiMetadata(
                step_id=1, tiers=(StubMeta(1, 0), StubMeta(1, 1)), load_block_ids=((2,), ())
            )
        )
        await worker.start_load_kv(ctx)
        worker.wait_for_layer_load(0)
        worker.save_kv_layer(0, None, ctx)  # type: ignore[arg-type]
        assert await worker.wait_for_save() == {"r"}
        assert worker.get_block_ids_with_load_errors() == {2}
        worker.clear_connector_metadata()
        assert broken.calls == ["bind", "start_load_kv", "clear"]
        assert healthy.calls == [
            "bind",
            "start_load_kv",
            "wait_for_layer_load",
            "save_kv_layer",
            "clear",
        ]
