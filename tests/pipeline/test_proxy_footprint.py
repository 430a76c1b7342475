"""Tests of the kv-aware policy's model of what each replica still caches
(:class:`pipeline.proxy.footprint.Footprint`)."""

from __future__ import annotations

from pipeline.proxy.footprint import Footprint


def test_recent_prefixes_are_kept_to_the_capacity_oldest_first() -> None:
    footprint = Footprint(["a", "b"])
    footprint.routed("a", "p1", 40, None)
    footprint.routed("a", "p2", 40, None)
    footprint.routed("a", "p3", 40, None)  # capacity unknown: all three kept
    assert (footprint.blocks("a"), footprint.prefixes("a")) == (120, 3)
    assert footprint.overflow("a", "p4", 40, None) == 0
    footprint.routed("a", "p1", 38, 84)  # p1 again, now the newest: p2 drops
    assert (footprint.blocks("a"), footprint.prefixes("a")) == (78, 2)
    footprint.routed("a", "p2", 40, 84)  # p3 is the oldest now
    assert (footprint.blocks("a"), footprint.prefixes("a")) == (38 + 40, 2)
    assert footprint.overflow("a", "p1", 40, 84) == 0  # its own blocks are not evicted
    assert footprint.overflow("a", "p3", 40, 84) == 38 + 40 + 40 - 84
    assert footprint.blocks("b") == 0
    footprint.cleared("a")
    assert (footprint.blocks("a"), footprint.prefixes("a")) == (0, 0)
