"""DecodeMirror: decode attention over the mirror gives the logits of the paged gather.

Two runners of one checkpoint, the mirror on and off, are driven through the same random
schedule (requests joining and leaving mid-decode, chunked prefills next to decode
tokens, drafts whose tail is rejected, preemption and resumption, a budget too small)
and must give the same logits every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from stages.model import ModelRunner
from stages.model.decode_mirror import DecodeMirror, MirrorStep

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 4


@attrs.define
class _Req:
    req_id: str
    tokens: list[int]  # every token known (prompt + outputs)
    computed: int = 0
    blocks: list[int] = attrs.Factory(list)
    started: bool = False


class _Driver:
    """A toy scheduler: random chunks, decode tokens, drafts, rollbacks, preemptions."""

    def __init__(self, seed: int, num_blocks: int, *, drafts: bool, preempt: bool) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks))
        self.live: dict[str, _Req] = {}
        self.drafts, self.preempt = drafts, preempt
        self.count = 0
        self.step_id = 0

    def _alloc(self, r: _Req, end: int) -> list[int]:
        new = []
        while len(r.blocks) * BLOCK < end:
            block = self.free.pop()
            r.blocks.append(block)
            new.append(block)
        return new

    def _release(self, r: _Req) -> None:
        self.free.extend(r.blocks)
        r.blocks = []

    def next(self, max_live: int) -> SchedulerOutput:
        rng = self.rng
        finished: set[str] = set()
        for r in list(self.live.values()):
            if r.started and rng.random() < 0.06:  # finished or aborted
                finished.add(r.req_id)
                self._release(self.live.pop(r.req_id))
            elif self.preempt and r.started and rng.random() < 0.04:  # preempted
                finished.add(r.req_id)
                self._release(r)
                r.computed, r.started = 0, False
        while len(self.live) < max_live and rng.random() < 0.5:
            self.count += 1
            prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
            rid = f"r{self.count}"
            self.live[rid] = _Req(rid, prompt)
        requests = []
        for r in self.live.values():
            if rng.random() < 0.1:
                continue  # not scheduled this step
            if self.drafts and r.computed > 1 and rng.random() < 0.05:
                # Rolled back (as drafts rejected after they were written): the positions
                # from there are rewritten, with other tokens.
                r.computed = rng.randrange(max(1, r.computed - 5), r.computed)
                r.tokens[r.computed :] = [rng.randrange(256) for _ in r.tokens[r.computed :]]
            left = len(r.tokens) - r.computed
            if left > 1:
                n = min(left, rng.choice((left, rng.randrange(1, left + 1))))
                drafts: tuple[int, ...] = ()
            else:
                n = 1
                k = rng.randrange(0, 4) if self.drafts and rng.random() < 0.4 else 0
                drafts = tuple(rng.randrange(256) for _ in range(k))
            end = r.computed + n + len(drafts)
            if end > 200 or len(self.free) * BLOCK < end + 8:
                continue
            new = not r.started
            blocks = self._alloc(r, end)
            sample = r.computed + n == len(r.tokens)
            requests.append(
                ScheduledRequest(
                    req_id=r.req_id,
                    token_ids=tuple(r.tokens[r.computed : r.computed + n]),
                    num_computed_tokens=r.computed,
                    block_ids=tuple(r.blocks) if new else tuple(blocks),
                    new=new,
                    sampling=GREEDY,
                    sample=sample,
                    num_output_tokens=0,
                    draft_token_ids=drafts if sample else (),
                )
            )
            r.started = True
            r.computed += n
            if sample:
                accepted = rng.randrange(0, len(drafts) + 1) if drafts else 0
                r.tokens += [*drafts[:accepted], rng.randrange(256)]
                r.computed += accepted  # the rejected drafts' KV is rewritten later
        self.step_id += 1
        return SchedulerOutput(
            step_id=self.step_id, requests=tuple(requests), finished_req_ids=frozenset(finished)
        )


def _runners(path: Path, dtype: str, **mirror: Any) -> Iterator[tuple[ModelRunner, ModelRunner]]:
    common = dict(device="cpu", dtype=dtype, num_blocks=400, max_model_len=256, block_size=BLOCK)
    on = ModelRunner.load(str(path), decode_mirror=True, **common, **mirror)
    off = ModelRunner.load(str(path), decode_mirror=False, **common)
    try:
        yield on, off
    finally:
        on.close()
        off.close()


def _drive(
    on: ModelRunner, off: ModelRunner, seed: int, steps: int, *, max_live: int = 6, **kw: Any
) -> int:
    """Run both through one schedule; returns the decode tokens the mirror attended to."""
    driver = _Driver(seed, on.num_blocks, **kw)
    mirror = on.decode_mirror
    assert mirror is not None and off.decode_mirror is None
    mirrored = 0
    for _ in range(steps):
        out = driver.next(max_live)
        a, b = on.execute(out), off.execute(out)
        assert a.req_ids == b.req_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        if a.draft_logits is not None:
            torch.testing.assert_close(a.draft_logits, b.draft_logits, rtol=1e-5, atol=1e-5)
        mirrored += len(mirror)
    return mirrored


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint: Callable[[str], tuple[Any, Path]]) -> Path:
    return hf_checkpoint("llama_gqa")[1]


class TestDecodeMirror:
    @pytest.mark.parametrize("seed", [0, 1])
    def test_joins_leaves_chunks_drafts_preemption(self, llama_dir: Path, seed: int) -> None:
        """Mirror on and off give the same logits through joins, leaves, mixed steps,
        rejected drafts and preemptions; the mirror grows past its first size."""
        for on, off in _runners(llama_dir, "float32"):
            mirrored = _drive(on, off, seed, 120, drafts=True, preempt=True, max_live=12)
            assert mirrored > 100  # it was used, not fallen back from
            mirror = on.decode_mirror
            assert mirror is not None and mirror.fallbacks == 0
            assert mirror._len_cap > 2 * BLOCK and mirror._slots_cap > 2  # it grew

    def test_budget_fallback_is_counted(self, llama_dir: Path) -> None:
        """Past its memory budget the step gathers from the paged cache (same logits),
        counted in ``fallbacks``; back within it, the mirror catches up."""
        # 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes = 512 bytes a token: 16 tokens.
        for on, off in _runners(llama_dir, "float32", decode_mirror_memory_bytes=512 * 16):
            _drive(on, off, 3, 60, drafts=False, preempt=False, max_live=3)
            mirror = on.decode_mirror
            assert mirror is not None and mirror.fallbacks > 0

    def test_sliding_window_layers(self, hf_checkpoint: Callable[[str], tuple[Any, Path]]) -> None:
        """Gemma 3's sliding layers (window 8) read the mirror's window alike."""
        for on, off in _runners(hf_checkpoint("gemma3")[1], "float32"):
            assert _drive(on, off, 4, 80, drafts=True, preempt=True) > 50

    def test_bfloat16_bit_identical(self, llama_dir: Path) -> None:
        """In bfloat16 the mirror attends over the same keys in the same order: equal
        logits, bit for bit."""
        for on, off in _runners(llama_dir, "bfloat16"):
            driver = _Driver(5, on.num_blocks, drafts=True, preempt=True)
            for _ in range(60):
                out = driver.next(6)
                assert torch.equal(on.execute(out).logits, off.execute(out).logits)

    def test_fresh_steps_copy_the_new_tokens(
        self, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Steady decoding (each slot lacking its new token only) copies the step's own
        keys and values into the mirror; a slot lacking more (joined after its prefill,
        cut back by rejected drafts) reads them from the paged cache. Both occur in the
        random schedule, and the logits stay the gather's (bit for bit in bfloat16)."""
        seen: list[bool] = []
        step = DecodeMirror.step

        def recording(self: DecodeMirror, *args: Any) -> MirrorStep | None:
            result = step(self, *args)
            if result is not None:
                seen.append(result.fresh)
            return result

        monkeypatch.setattr(DecodeMirror, "step", recording)
        for on, off in _runners(llama_dir, "bfloat16"):
            driver = _Driver(7, on.num_blocks, drafts=True, preempt=False)
            for _ in range(60):
                out = driver.next(4)
                assert torch.equal(on.execute(out).logits, off.execute(out).logits)
        assert seen.count(True) > 10 and seen.count(False) > 5

    def test_dropped_requests_leave(self, llama_dir: Path) -> None:
        """Finished requests free their slots; ``drop_requests`` and ``close`` too."""
        for on, off in _runners(llama_dir, "float32"):
            _drive(on, off, 6, 30, drafts=False, preempt=False)
            mirror = on.decode_mirror
            assert mirror is not None
            on.drop_requests([f"r{i}" for i in range(100)])
            assert len(mirror) == 0
