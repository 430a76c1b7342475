"""A step a worker cannot decode, or a reply it cannot encode, fails that step's requests;
the worker process lives on (issue 10, findings 1 and 2)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.artifacts import ScheduledRequest, SchedulerOutput, WorkerOutput
from pipeline.executors import wire
from pipeline.executors.remote_worker import Records, answer, encode_reply
from pipeline.kernel.report import StepReport

PROMPT = [3, 1, 4, 1, 5, 9]
OTHER = [2, 7, 1, 8, 2, 8]
GOOD = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _config(path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        enable_prefix_caching=False,
        executor="multiproc",
        world_size=1,
        fan_in_timeout_s=30.0,
    )


def _altered(**fields: Any) -> SamplingParams:
    """Params changed after their checks (what admission exists to stop)."""
    params = SamplingParams(max_tokens=6, temperature=0.5, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.fixture
def no_admission_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bypass the engine's wire check at admission, so the bad bytes really go out."""
    from pipeline.engine.core import EngineCore

    monkeypatch.setattr(EngineCore, "validate_params", lambda self, params: params, raising=False)


class TestMultiprocWorkerSurvives:
    def test_a_step_the_worker_cannot_decode_fails_alone(
        self, llama_path: Path, no_admission_check: None
    ) -> None:
        """Finding 1: temperature=True reaches the worker; its step fails, the worker lives."""
        with LLM(_config(llama_path)) as llm:
            alone = llm.generate([PROMPT], GOOD)[0]
            pids = llm.engine.core.executor.pids
            bad = llm.generate([OTHER], _altered(temperature=True))[0]
            after = llm.generate([PROMPT], GOOD)[0]
            assert llm.engine.core.executor.pids == pids
            assert llm.engine.core.executor.check_alive() is None
        assert bad.finish_reason == "error"
        assert bad.error is not None and "could not be decoded" in bad.error
        assert after.finish_reason == "length" and after.token_ids == alone.token_ids

    def test_a_request_that_cannot_be_encoded_fails_alone(
        self, llama_path: Path, no_admission_check: None
    ) -> None:
        """Finding 2: seed=2**64 fails its own request; its step's other row completes."""
        with LLM(_config(llama_path)) as llm:
            alone = llm.generate([PROMPT], GOOD)[0]
            outs = llm.generate([PROMPT, OTHER], [GOOD, _altered(seed=2**64)])
        assert outs[1].finish_reason == "error"
        assert outs[1].error is not None and "cannot be sent" in outs[1].error
        assert outs[0].finish_reason == "length" and outs[0].token_ids == alone.token_ids

    def test_admission_refuses_params_the_wire_would_refuse(self, llama_path: Path) -> None:
        """Finding 1: without the bypass, altered params are refused before any step."""
        from pipeline.errors import InvalidRequestError

        with LLM(_config(llama_path)) as llm:
            with pytest.raises(InvalidRequestError, match="sampling params"):
                llm.generate([OTHER], _altered(temperature=True))
            assert llm.generate([PROMPT], GOOD)[0].finish_reason == "length"


_WORKER: Any = SimpleNamespace(rank=0, connector=None)


def _bad_step_frame(step_id: int) -> bytes:
    request = ScheduledRequest(
        req_id="r",
        token_ids=(1,),
        num_computed_tokens=0,
        block_ids=(0,),
        new=True,
        sampling=_altered(top_k=True),
        sample=True,
        num_output_tokens=0,
    )
    return wire.encode_step(SchedulerOutput(step_id=step_id, requests=(request,)))


class TestAnswer:
    @pytest.mark.anyio
    async def test_an_undecodable_step_gets_a_step_failed_reply(self) -> None:
        """Finding 1: a Step with a field the decoder rejects is answered, non-fatally."""
        result = await answer(_WORKER, _bad_step_frame(17), Records(), 5.0)
        reply = wire.decode(result.reply or b"")
        assert isinstance(reply, wire.StepFailed)
        assert (reply.step_id, reply.fatal, result.stop) == (17, False, False)
        assert "top_k" in reply.reason

    @pytest.mark.anyio
    async def test_a_frame_that_is_no_step_is_answered_for_no_step(self) -> None:
        """Finding 1: bytes that are not a Step at all do not kill the worker either."""
        for body in (b"\xc1garbage", wire.encode(wire.InitFailed(0, "X", "y"))):
            result = await answer(_WORKER, body, Records(), 5.0)
            reply = wire.decode(result.reply or b"")
            assert isinstance(reply, wire.StepFailed) and reply.step_id == -1
            assert not result.stop

    def test_a_reply_that_cannot_be_encoded_becomes_step_failed(self) -> None:
        """Finding 1: an unencodable reply fails its step instead of killing the worker."""
        report = StepReport(
            step_id=9,
            rank=0,
            outcome="ok",
            duration_s=0.0,
            stages=(),
            failed_stage=None,
            finalizer_failures=(),
        )
        record = wire.WorkerRecord(report=report, fields={"x": object()})
        done = wire.StepDone(WorkerOutput(rank=0, step_id=9), [record])
        reply = wire.decode(encode_reply(_WORKER, done))
        assert isinstance(reply, wire.StepFailed)
        assert (reply.step_id, reply.fatal) == (9, False)
        assert "could not be encoded" in reply.reason
