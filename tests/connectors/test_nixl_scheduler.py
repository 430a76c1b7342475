"""The nixl connector's options and scheduler half, without NIXL (no engine, no agent)."""

from __future__ import annotations

from typing import Any

import pytest
from nixl_tickets import signed

from connectors.base import (
    ConnectorContext,
    KVConnectorOutput,
    KVConnectorRole,
    MatchResult,
    ModelFingerprint,
)
from connectors.nixl import (
    NixlMetadata,
    NixlOptions,
    NixlScheduler,
    RemotePrefill,
)
from pipeline import SamplingParams
from pipeline.errors import InvalidConfigError, InvalidRequestError
from pipeline.lora import LoRAAdapter
from pipeline.request import Request, RequestStatus
from pipeline.transfer_params import MAX_TRANSFER_ENTRIES, check_transfer_params

BS = 4
FP = ModelFingerprint(architecture="A", weights_id="w", dtype="float32", block_size=BS)


def scheduler(role: str, **options: Any) -> NixlScheduler:
    ctx = ConnectorContext(
        role=KVConnectorRole.SCHEDULER,
        options={"role": role, "port": 7000, **options},
        block_size=BS,
        fingerprint=FP,
    )
    return NixlScheduler(ctx)


def request(req_id: str, n: int, params: dict[str, Any] | None) -> Request:
    req = Request(req_id, list(range(1, n + 1)), SamplingParams(max_tokens=1))
    req.kv_transfer_params = params
    return req


def finish(sched: NixlScheduler, req: Request, blocks: list[int]) -> Any:
    req.status = RequestStatus.FINISHED_LENGTH
    return sched.request_finished(req, blocks)


class TestOptions:
    def test_defaults_and_engine_id(self) -> None:
        """engine_id defaults to the engine's id, never to the side channel's address
        (two engines on one host would share it); without one, a fresh id each time."""
        opts = NixlOptions.from_options({"role": "both"}, "e1")
        assert (opts.produces, opts.consumes, opts.engine_id) == (True, True, "e1")
        first = NixlOptions.from_options({"role": "both"}).engine_id
        second = NixlOptions.from_options({"role": "both"}).engine_id
        assert first != second and "5600" not in first
        assert NixlOptions.from_options({"role": "both", "engine_id": "x"}, "e1").engine_id == "x"

    @pytest.mark.parametrize(
        "options",
        [
            {},
            {"role": "decoder"},
            {"role": "producer", "port": True},
            {"role": "producer", "port": 70000},
            {"role": "producer", "lease_s": 0},
            {"role": "producer", "colour": "blue"},
        ],
    )
    def test_bad_options_are_refused_by_name(self, options: dict[str, Any]) -> None:
        """A missing role, a bool port, a port out of range, an unknown option."""
        with pytest.raises(InvalidConfigError, match="connector_options"):
            NixlOptions.from_options(options)


class TestProducer:
    def test_a_finished_prefill_holds_its_prompt_blocks_and_answers_the_params(self) -> None:
        """do_remote_decode: delay_free, and the params a consumer needs."""
        sched = scheduler("producer")
        result = finish(sched, request("p1", 9, {"do_remote_decode": True}), [7, 3, 5, 8])
        assert result.delay_free
        params = result.kv_transfer_params
        assert params["do_remote_prefill"] is True
        assert params["remote_block_ids"] == [7, 3, 5]  # cdiv(9, 4) prompt blocks
        assert params["remote_request_id"] == "p1"
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 7000)
        assert (params["block_size"], params["tp_size"]) == (BS, 1)
        assert sched.has_pending_work()
        (send,) = sched.build_connector_meta(None).sends  # type: ignore[arg-type]
        assert (send.req_id, send.ticket, send.block_ids) == ("p1", params["ticket"], (7, 3, 5))
        sched.update_connector_output(KVConnectorOutput(finished_sending=frozenset({"p1"})))
        assert not sched.has_pending_work()

    def test_other_requests_free_at_once(self) -> None:
        """No params, an aborted prefill, or a consumer-only engine: nothing is held."""
        assert not finish(scheduler("producer"), request("a", 9, None), [1, 2, 3]).delay_free
        req = request("b", 9, {"do_remote_decode": True})
        req.status = RequestStatus.FINISHED_ABORTED
        assert not scheduler("producer").request_finished(req, [1, 2, 3]).delay_free
        consumer = scheduler("consumer")
        assert not finish(consumer, request("c", 9, {"do_remote_decode": True}), [1, 2, 3])[0]

    def test_the_answer_of_the_longest_prompt_passes_a_consumers_door(self) -> None:
        """The answer for the most blocks a producer hands over is accepted by
        check_transfer_params and parsed back; one block more is not held (freed at
        once, logged) rather than answered with params a consumer would refuse."""
        limit = MAX_TRANSFER_ENTRIES - 16
        sched = scheduler("producer", host="producer-0.cluster.internal", engine_id="e" * 200)
        blocks = list(range(2**31 - limit - 1, 2**31 - 1))  # the widest block ids
        req = request("p" * 200, limit * BS, {"do_remote_decode": True})
        params = check_transfer_params(finish(sched, req, blocks).kv_transfer_params)
        remote = RemotePrefill.parse(params)
        assert remote is not None and remote.block_ids == tuple(blocks)
        over = request("q", limit * BS + 1, {"do_remote_decode": True})
        result = finish(scheduler("producer"), over, [*blocks, 1])
        assert not result.delay_free and result.kv_transfer_params is None


class TestConsumer:
    def params(self, n: int = 10, **over: Any) -> dict[str, Any]:
        """A producer's answer for a prompt of ``n`` tokens, with ``over`` signed in as a
        producer holding the key would (a client's edit is refused: TestTickets)."""
        producer = scheduler("producer")
        result = finish(producer, request("p", 10, {"do_remote_decode": True}), [4, 5, 6])
        return signed({**result.kv_transfer_params, **over}, list(range(1, n + 1)))

    def test_whole_blocks_but_the_last_token_are_read_asynchronously(self) -> None:
        """10 prompt tokens, block size 4: 2 blocks (8 tokens) read into the new blocks."""
        sched = scheduler("consumer")
        req = request("c", 10, self.params())
        assert sched.get_num_new_matched_tokens(req, 0) == MatchResult(8, True)
        sched.update_state_after_alloc(req, [11, 12, 13], 8)
        meta = sched.build_connector_meta(None)  # type: ignore[arg-type]
        (read,) = meta.reads
        assert (read.remote_block_ids, read.local_block_ids) == ((4, 5), (11, 12))
        assert NixlMetadata.from_bytes(meta.to_bytes()) == meta
        assert sched.get_num_new_matched_tokens(req, 0) == MatchResult(0, False)  # in flight
        sched.update_connector_output(KVConnectorOutput(finished_recving=frozenset({"c"})))
        assert not sched.has_pending_work()
        assert sched.get_num_new_matched_tokens(req, 0) == MatchResult(0, False)  # loaded

    def test_a_local_prefix_hit_is_not_read_again(self) -> None:
        """With one block cached locally, only the second is read."""
        sched = scheduler("consumer")
        req = request("c", 10, self.params())
        assert sched.get_num_new_matched_tokens(req, 4) == MatchResult(4, True)
        sched.update_state_after_alloc(req, [11, 12, 13], 4)
        (read,) = sched.build_connector_meta(None).reads  # type: ignore[arg-type]
        assert (read.remote_block_ids, read.local_block_ids) == ((5,), (12,))

    def test_a_short_prompt_reads_nothing_but_still_frees_the_producer(self) -> None:
        """A prompt within one block: no load, an empty read that only notifies."""
        sched = scheduler("consumer")
        req = request("c", 3, self.params(3, remote_block_ids=[4]))
        assert sched.get_num_new_matched_tokens(req, 0) == MatchResult(0, False)
        sched.update_state_after_alloc(req, [11], 0)
        (read,) = sched.build_connector_meta(None).reads  # type: ignore[arg-type]
        assert read.local_block_ids == () and read.remote_request_id == "p"
        assert not sched.has_pending_work()

    @pytest.mark.parametrize(
        "over",
        [
            {"remote_port": True},
            {"remote_port": "7000"},
            {"remote_block_ids": [1, -2]},
            {"remote_block_ids": "1,2"},
            {"remote_engine_id": ""},
            {"remote_host": None},
        ],
    )
    def test_hostile_params_fail_the_request(self, over: dict[str, Any]) -> None:
        """Every field is typed and bounded: a bool is not a port."""
        with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
            RemotePrefill.parse(self.params(**over))

    @pytest.mark.parametrize(
        ("over", "field"),
        [
            ({"fingerprint": "x" * 32}, "fingerprint"),
            ({"block_size": 8}, "block_size"),
            ({"tp_size": 2}, "tp_size"),
        ],
    )
    def test_a_mismatched_producer_is_refused(self, over: dict[str, Any], field: str) -> None:
        """KV of another model, block size or TP size is never read: the read is
        refused (naming the field), so the workers report its blocks as load errors
        and load_failure_policy decides (recompute or fail), as for any failed load."""
        sched = scheduler("consumer")
        req = request("c", 10, self.params(**over))
        assert sched.get_num_new_matched_tokens(req, 0) == MatchResult(8, True)
        sched.update_state_after_alloc(req, [11, 12, 13], 8)
        (read,) = sched.build_connector_meta(None).reads  # type: ignore[arg-type]
        assert read.local_block_ids == (11, 12)
        assert f"differs in {field}" in read.refused
        assert sched.has_pending_work()  # parked until the workers report it

    def test_a_mismatched_producer_with_nothing_to_read_is_computed_here(self) -> None:
        """A prompt within one block: nothing would load, nothing is refused."""
        sched = scheduler("consumer")
        req = request("c", 3, self.params(3, block_size=8))
        assert sched.get_num_new_matched_tokens(req, 0) == MatchResult(0, False)
        sched.update_state_after_alloc(req, [11], 0)
        assert sched.build_connector_meta(None).reads == ()  # type: ignore[arg-type]

    def test_a_request_finished_while_reading_is_held_until_the_read_is_over(self) -> None:
        """Its blocks stay (delay_free) and the workers are told to cancel."""
        sched = scheduler("consumer")
        req = request("c", 10, self.params())
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, [11, 12, 13], 8)
        sched.build_connector_meta(None)  # type: ignore[arg-type]
        req.status = RequestStatus.FINISHED_ABORTED
        assert sched.request_finished(req, [11, 12, 13]).delay_free
        assert sched.build_connector_meta(None).cancels == ("c",)  # type: ignore[arg-type]
        sched.update_connector_output(KVConnectorOutput(finished_sending=frozenset({"c"})))
        assert not sched.has_pending_work()


class TestAdapters:
    def test_a_ticket_binds_the_adapter(self) -> None:
        """The params a producer answers for a LoRA adapter's request admit a consumer's
        request of the same prompt under that adapter only: under another adapter, or
        the base model, the ticket does not match (KV never crosses adapters)."""
        qv = LoRAAdapter(name="qv", int_id=1, path="/a", content_id="aa" * 32, rank=8)
        od = LoRAAdapter(name="od", int_id=2, path="/b", content_id="bb" * 32, rank=4)
        produced = request("p", 10, {"do_remote_decode": True})
        produced.lora = qv
        params = finish(scheduler("producer"), produced, [4, 5, 6]).kv_transfer_params
        for lora, admitted in ((qv, True), (od, False), (None, False)):
            consumed = request("c", 10, params)
            consumed.lora = lora
            if admitted:
                scheduler("consumer").check_request(consumed)
                continue
            with pytest.raises(InvalidRequestError, match="ticket"):
                scheduler("consumer").check_request(consumed)


class TestLostSteps:
    def test_instructions_of_a_step_whose_output_never_came_back_are_sent_again(self) -> None:
        """A step fails (no update_connector_output before the next build): its read,
        held send and cancel that still stand go out again, marked resent, with the new
        ones; those that no longer stand do not; once a step's output arrives, nothing
        is sent twice."""
        sched = scheduler("both")
        params = TestConsumer().params()
        reading = request("r", 10, params)
        sched.get_num_new_matched_tokens(reading, 0)
        sched.update_state_after_alloc(reading, [11, 12, 13], 8)
        finish(sched, request("p", 9, {"do_remote_decode": True}), [1, 2, 3])
        first = sched.build_connector_meta(None)  # type: ignore[arg-type]
        assert ([r.req_id for r in first.reads], [s.req_id for s in first.sends]) == (["r"], ["p"])
        assert not first.resent
        finish(sched, request("q", 9, {"do_remote_decode": True}), [4, 5, 6])
        again = sched.build_connector_meta(None)  # type: ignore[arg-type]
        assert ([r.req_id for r in again.reads], [s.req_id for s in again.sends]) == (
            ["r"],
            ["p", "q"],
        )
        assert again.resent
        done = frozenset({"p"})
        sched.update_connector_output(KVConnectorOutput(finished_sending=done))
        quiet = sched.build_connector_meta(None)  # type: ignore[arg-type]
        assert (quiet.reads, quiet.sends, quiet.cancels, quiet.resent) == ((), (), (), False)
        lost = sched.build_connector_meta(None)  # type: ignore[arg-type]
        assert not lost.resent  # nothing stood: an empty step is not sent again
