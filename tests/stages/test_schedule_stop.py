"""``Scheduler.stop_requests`` (a stop string matched) and the ``stop_reason`` of stop tokens."""

from __future__ import annotations

from schedule_driver import add, assert_idle, make_scheduler, step
from test_schedule_connector import FakeConnector, make, update

from pipeline.config import SamplingParams
from pipeline.request import Request, RequestStatus


class TestStopRequests:
    def test_stops_through_the_abort_path(self) -> None:
        """A stopped request ends with "stop", tells the connector, frees its blocks at
        once and reaches the workers in the next finished_req_ids."""
        connector = FakeConnector()
        scheduler = make(connector)
        request = Request("a", list(range(6)), SamplingParams(max_tokens=8))
        scheduler.add_request(request)
        so = scheduler.schedule()
        update(scheduler, so)
        outs = scheduler.stop_requests(["a", "unknown"])
        assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "stop")]
        assert request.status == RequestStatus.FINISHED_STOPPED
        assert connector.calls[-1] == ("finished", "a", so.requests[0].block_ids)
        assert "a" in scheduler.schedule().finished_req_ids
        assert scheduler.num_free_blocks == scheduler.num_blocks
        assert not scheduler.has_unfinished_requests()

    def test_other_requests_go_on(self) -> None:
        """Stopping one request leaves the others running."""
        scheduler = make_scheduler()
        add(scheduler, "a", [1, 2, 3], max_tokens=3)
        add(scheduler, "b", [4, 5, 6], max_tokens=3)
        step(scheduler)
        scheduler.stop_requests(["a"])
        assert [o.request_id for o in step(scheduler).outputs] == ["b"]
        step(scheduler)
        assert_idle(scheduler)


class TestStopReason:
    def test_stop_token_is_the_stop_reason(self) -> None:
        """A stop_token_ids token ending the request is its stop_reason; EOS gives None."""
        scheduler = make_scheduler()
        first = 1234
        params = SamplingParams(max_tokens=4, stop_token_ids=[first])
        scheduler.add_request(Request("s", [1, 2], params))
        (out,) = step(scheduler, lambda item: first).outputs
        assert (out.finish_reason, out.stop_reason) == ("stop", first)
        scheduler.add_request(Request("e", [1, 2], SamplingParams(max_tokens=4), eos_token_id=7))
        (out,) = step(scheduler, lambda item: 7).outputs
        assert (out.finish_reason, out.stop_reason) == ("stop", None)
        assert_idle(scheduler)
