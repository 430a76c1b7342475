"""Where the event sockets bind, and what the events carry: a replica binds the endpoint it
is given (loopback by default) so a router's connect delivers; ``connect: true`` publishes
into a forwarder that binds; ``BlockStored`` carries token ids only when asked."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq
from kv_events_helpers import PREFIXES, drain, events_config
from ports import free_port

from pipeline import LLM, SamplingParams
from pipeline.kv_events import (
    DEFAULT_ENDPOINT,
    BlockRemoved,
    BlockStored,
    KVBlockIndex,
    KVEventsConfig,
    KVEventSubscriber,
    ZmqEventPublisher,
    kv_events_config,
)

LIMIT_S = 30.0  # a bound on a hang, never a timing assertion


def _receive(sub: KVEventSubscriber, pub: ZmqEventPublisher) -> list[int]:
    """Publish until the subscriber (which joins asynchronously) gets a batch."""
    give_up = time.monotonic() + LIMIT_S
    while time.monotonic() < give_up:
        pub.publish([BlockRemoved(block_hashes=[1], medium="GPU")])
        got = sub.poll(0.1)
        if got:
            return [b.seq for b in got]
    raise AssertionError("no event arrived")


class TestBind:
    def test_a_plain_host_and_port_is_bound_and_delivers(self) -> None:
        """tcp://127.0.0.1:PORT is bound by the publisher, so a subscriber that connects
        there (what the proxy does with /health's endpoint) receives the batches."""
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub = ZmqEventPublisher(KVEventsConfig(endpoint=endpoint))
        try:
            assert pub.bound and pub.endpoint == endpoint
            assert pub.describe()["bound"] is True
            with KVEventSubscriber(endpoint) as sub:
                assert _receive(sub, pub)
        finally:
            pub.close()

    def test_the_default_is_loopback_and_a_wildcard_only_when_asked(self) -> None:
        """The default endpoint (and that of a config naming only a replay endpoint) is
        loopback; tcp://*:* binds every interface when it is asked for."""
        assert DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
        assert KVEventsConfig().endpoint == DEFAULT_ENDPOINT
        only_replay = kv_events_config({"replay_endpoint": "tcp://127.0.0.1:*"})
        assert only_replay is not None and only_replay.endpoint == DEFAULT_ENDPOINT
        pub = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"))
        try:
            assert pub.endpoint.startswith("tcp://127.0.0.1:")
        finally:
            pub.close()
        wide = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://*:*"))
        try:
            assert wide.endpoint.startswith("tcp://0.0.0.0:")
        finally:
            wide.close()

    def test_an_ipv6_wildcard_binds(self) -> None:
        """tcp://[::]:* binds (ZeroMQ needs IPv6 switched on for it)."""
        pub = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://[::]:*"))
        try:
            assert pub.endpoint.startswith("tcp://[::]:")
        finally:
            pub.close()

    def test_connect_publishes_into_a_forwarder_that_binds(self) -> None:
        """connect: true connects the PUB socket to a bound XSUB (a forwarder's input),
        vLLM's way; /health's entry then says bound: false."""
        ctx = zmq.Context()
        xsub = ctx.socket(zmq.XSUB)
        xsub.setsockopt(zmq.LINGER, 0)
        xsub.bind("tcp://127.0.0.1:*")
        endpoint = xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        xsub.send(b"\x01")  # subscribe to everything, as a forwarder relays its SUBs'
        config = kv_events_config({"endpoint": endpoint, "connect": True})
        assert config is not None
        pub = ZmqEventPublisher(config)
        try:
            assert not pub.bound and pub.describe()["bound"] is False
            give_up = time.monotonic() + LIMIT_S
            while not xsub.poll(100):
                assert time.monotonic() < give_up, "the forwarder got nothing"
                pub.publish([BlockRemoved(block_hashes=[1], medium="GPU")])
            topic, seq, payload = xsub.recv_multipart()
            assert topic == b"" and len(seq) == 8 and payload
        finally:
            pub.close()
            xsub.close()
            ctx.term()

    @pytest.mark.parametrize("value", [1, "yes", None])
    def test_the_flags_are_booleans(self, value: object) -> None:
        """connect and include_token_ids refuse anything but true/false, naming the field."""
        for field in ("connect", "include_token_ids"):
            with pytest.raises(ValueError, match=f"kv_events.{field}"):
                kv_events_config({field: value})


class TestTokenIds:
    def _stored(self, directory: Path, **events: object) -> list[BlockStored]:
        config = events_config(str(directory), **events)
        assert config.kv_events is not None
        kv = config.kv_events
        index = KVBlockIndex()
        with KVEventSubscriber(kv.endpoint, kv.replay_endpoint) as sub, LLM(config) as llm:
            llm.generate([PREFIXES[0] + [30]], SamplingParams(max_tokens=2, temperature=0.0))
            publisher = llm.engine.core.kv_events.publisher
            events = drain(sub, publisher, index)
        return [e for e in events if isinstance(e, BlockStored)]

    def test_events_carry_hashes_only_by_default(self, tmp_path: Path) -> None:
        """A real engine's BlockStored have block hashes and no token ids unless
        include_token_ids is set; then they carry the prompt's tokens."""
        stored = self._stored(tmp_path)
        assert stored and all(e.block_hashes and e.token_ids == [] for e in stored)
        stored = self._stored(tmp_path, include_token_ids=True)
        assert stored[0].token_ids == PREFIXES[0][: len(stored[0].block_hashes) * 4]
