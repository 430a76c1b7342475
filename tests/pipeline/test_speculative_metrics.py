"""Speculative decoding's counts (issue 28): the drafts verified and kept, per step in the
step log, added up by ``kvstep logs`` and in ``/metrics``, equal to what the scheduler
counted."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.artifacts import SpecDecodeStats
from pipeline.steplog_tools.summary import load_step_log, summarize

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
PHRASE = [17, 93, 41, 120, 8, 66, 201]
PROMPTS = [PHRASE * 5, [5, 9, 200, 31, 77, 140, 12, 3, 99, 61, 18], PHRASE * 3 + [4, 4]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class TestSpecDecodeStats:
    def test_one_draft_counts_its_positions(self) -> None:
        stats = SpecDecodeStats().with_draft(4, 2)
        assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
        assert stats.accepted_per_position == (1, 1, 0, 0)
        assert stats.acceptance_rate == 0.5 and stats.mean_acceptance_length == 3.0

    def test_adding_pads_the_shorter_positions(self) -> None:
        total = SpecDecodeStats().with_draft(1, 1) + SpecDecodeStats().with_draft(3, 2)
        assert total.accepted_per_position == (2, 1, 0)
        assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (2, 4, 3)

    def test_no_drafts_has_no_rates(self) -> None:
        assert SpecDecodeStats().acceptance_rate is None
        assert SpecDecodeStats().mean_acceptance_length is None

    @pytest.mark.parametrize(("drafted", "accepted"), [(2, 3), (1, -1)])
    def test_more_accepted_than_drafted_is_refused(self, drafted: int, accepted: int) -> None:
        with pytest.raises(ValueError, match="accepted"):
            SpecDecodeStats().with_draft(drafted, accepted)


def _check_totals(stats: SpecDecodeStats) -> None:
    """Drafts were verified and some kept; a later position is never kept more often
    than an earlier one (a request keeps a prefix of its drafts)."""
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    per = stats.accepted_per_position
    assert len(per) == NGRAM["num_speculative_tokens"] and sum(per) == stats.num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(per)), per


class TestStepLog:
    def test_steps_carry_the_counts_and_kvstep_logs_adds_them_up(self, tmp_path: Path) -> None:
        path = tmp_path / "steps.jsonl"
        config = EngineConfig(model="builtin:tiny", speculative_config=NGRAM, step_log=path)
        with LLM(config) as llm:
            llm.generate(PROMPTS, GREEDY)
            counted = llm.engine.core.scheduler.spec_decode_stats
        _check_totals(counted)
        records = load_step_log(path)
        drafted = [r for r in records if r.get("event") == "step" and r.get("spec_drafts")]
        assert drafted and all(r["kind"] == "engine" for r in drafted)
        assert summarize(records).spec_decode == counted
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "logs", str(path)],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        rows = {
            "speculative drafts (requests / tokens)":
                f"{counted.num_drafts} / {counted.num_draft_tokens}",
            "drafts accepted (tokens / rate)":
                f"{counted.num_accepted_tokens} / {counted.acceptance_rate:.1%}",
        }  # fmt: skip
        for what, value in rows.items():
            line = next(x for x in done.stdout.splitlines() if what in x)
            assert value in line, (line, value)

    def test_without_speculation_the_steps_say_nothing_of_it(self, tmp_path: Path) -> None:
        path = tmp_path / "steps.jsonl"
        with LLM(EngineConfig(model="builtin:tiny", step_log=path)) as llm:
            llm.generate(PROMPTS, GREEDY)
        records = load_step_log(path)
        assert not any("spec_drafts" in r for r in records)
        summary = summarize(records)
        assert summary.spec_decode == SpecDecodeStats() and summary.spec_decode_rows() == []


class TestRequestsWithoutDrafts:
    def test_counted_once_by_reason_and_warned_once(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Requests whose logits are adjusted decode without drafts: each is counted once
        under its reason in the step log, and one warning per reason says so; a request
        asking for logprobs does get drafts."""
        path = tmp_path / "steps.jsonl"
        params = [
            GREEDY,
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                           repetition_penalty=1.2),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, min_tokens=3),
        ]  # fmt: skip
        config = EngineConfig(model="builtin:tiny", speculative_config=NGRAM, step_log=path)
        with caplog.at_level("WARNING", logger="kvstep"), LLM(config) as llm:
            llm.generate([*PROMPTS, PROMPTS[0]], params)
        totals: dict[str, int] = {}
        for record in load_step_log(path):
            for reason, n in (record.get("spec_without_drafts") or {}).items():
                totals[reason] = totals.get(reason, 0) + n
        assert totals == {"logits_adjusted": 2}
        warnings = [r for r in caplog.records if "get no drafts" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert match is not None, sample
    return float(match.group(1))


class TestPrometheus:
    @pytest.mark.anyio
    async def test_metrics_equal_the_scheduler_counts(self) -> None:
        pytest.importorskip("starlette")
        from pipeline.server import create_app

        config = EngineConfig(model="builtin:tiny", speculative_config=NGRAM)
        async with AsyncEngine(config) as engine:
            app = create_app(engine)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://k") as c:
                    for prompt in PROMPTS:
                        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0.0,
                                "ignore_eos": True}  # fmt: skip
                        assert (await c.post("/v1/completions", json=body)).status_code == 200
                    body = {**body, "min_tokens": 2}  # one request decodes without drafts
                    assert (await c.post("/v1/completions", json=body)).status_code == 200
                    text = (await c.get("/metrics")).text
            counted = engine.core.scheduler.spec_decode_stats
        _check_totals(counted)
        prefix = "kvstep_spec_decode_num"
        assert _value(text, f"{prefix}_drafts_total") == counted.num_drafts
        assert _value(text, f"{prefix}_draft_tokens_total") == counted.num_draft_tokens
        assert _value(text, f"{prefix}_accepted_tokens_total") == counted.num_accepted_tokens
        for position, kept in enumerate(counted.accepted_per_position):
            sample = f'{prefix}_accepted_tokens_per_pos_total{{position="{position}"}}'
            assert _value(text, sample) == kept
        sample = 'kvstep_spec_decode_requests_without_drafts_total{reason="logits_adjusted"}'
        assert _value(text, sample) == 1
