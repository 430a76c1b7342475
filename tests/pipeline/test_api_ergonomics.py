"""Python API ergonomics (issue 12): single prompts, typed errors, registration checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from connectors.base import KVConnectorScheduler, KVConnectorWorker
from connectors.registry import register_connector
from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.engine.inputs import as_prompt_list
from pipeline.engine.llm import LLM
from pipeline.errors import (
    EngineDeadError,
    EngineNotStartedError,
    InvalidConfigError,
    InvalidRequestError,
)

_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(EngineConfig(num_gpu_blocks=64, max_model_len=128)) as engine:
        yield engine


class TestSinglePrompt:
    def test_token_list_is_one_prompt(self, llm: LLM) -> None:
        """``LLM.generate([1, 2, 3])`` is one prompt and returns a list of one output."""
        outs = llm.generate([1, 2, 3], _PARAMS)
        assert len(outs) == 1 and list(outs[0].prompt_token_ids) == [1, 2, 3]

    def test_list_of_token_lists_is_many(self, llm: LLM) -> None:
        """``LLM.generate([[1, 2], [3]])`` is two prompts, in order."""
        outs = llm.generate([[1, 2], [3]], _PARAMS)
        assert [list(o.prompt_token_ids) for o in outs] == [[1, 2], [3]]

    def test_empty_list_is_a_typed_error(self, llm: LLM) -> None:
        """An empty list is ambiguous: ``InvalidRequestError`` naming ``prompts``."""
        with pytest.raises(InvalidRequestError, match=r"prompts=\[\].*empty"):
            llm.generate([], _PARAMS)

    def test_strings_are_prompts(self) -> None:
        """A string is one prompt, a list of strings several; mixing is refused."""
        assert as_prompt_list("hi") == ["hi"]
        assert as_prompt_list(["a", "b"]) == ["a", "b"]
        assert as_prompt_list((4, 5)) == [[4, 5]]
        with pytest.raises(InvalidRequestError, match="mixes token ids"):
            as_prompt_list([1, [2]])

    @pytest.mark.anyio
    async def test_async_engine_refuses_a_list_of_prompts(self) -> None:
        """``AsyncEngine.generate`` takes one prompt and says so for a list of prompts."""
        async with AsyncEngine(EngineConfig(num_gpu_blocks=64, max_model_len=128)) as engine:
            with pytest.raises(InvalidRequestError, match="once per prompt"):
                engine.generate([[1, 2], [3]], _PARAMS)
            outs = [o async for o in engine.generate((1, 2), _PARAMS)]
            assert outs[-1].finished


class TestSamplingParamsType:
    def test_llm_dict_params_is_one_typed_error(self, llm: LLM) -> None:
        """A dict for params is one ``InvalidRequestError`` naming sampling_params and dict."""
        with pytest.raises(InvalidRequestError, match=r"sampling_params='dict'") as info:
            llm.generate([[1, 2]], {"max_tokens": 3})  # type: ignore[arg-type]
        assert not isinstance(info.value, BaseExceptionGroup)

    @pytest.mark.anyio
    async def test_async_engine_dict_params(self) -> None:
        """``AsyncEngine.generate`` refuses a dict (even an empty one) naming its type."""
        async with AsyncEngine(EngineConfig(num_gpu_blocks=64, max_model_len=128)) as engine:
            for bad in ({}, {"max_tokens": 3}):
                with pytest.raises(InvalidRequestError, match=r"sampling_params='dict'"):
                    engine.generate([1, 2], bad)  # type: ignore[arg-type]


class TestNotStarted:
    @pytest.mark.anyio
    async def test_generate_before_and_after_async_with(self) -> None:
        """Before ``async with`` and after it, generate says not started / closed, not dead."""
        engine = AsyncEngine(EngineConfig(num_gpu_blocks=64, max_model_len=128))
        with pytest.raises(EngineNotStartedError, match="not started") as info:
            engine.generate([1, 2], _PARAMS)
        assert not isinstance(info.value, EngineDeadError)
        async with engine:
            pass
        with pytest.raises(EngineNotStartedError, match="closed"):
            engine.generate([1, 2], _PARAMS)

    def test_server_maps_not_started_to_503(self) -> None:
        """The server's exception handlers answer ``EngineNotStartedError`` (a 503)."""
        pytest.importorskip("starlette")
        from pipeline.server.errors import exception_handlers

        assert EngineNotStartedError in exception_handlers()


class _AbstractScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return None


class _Worker(KVConnectorWorker):
    pass


class TestRegisterAbstract:
    def test_abstract_scheduler_is_refused(self) -> None:
        """A scheduler half with unimplemented abstract methods is refused, naming them."""
        with pytest.raises(InvalidConfigError, match="_AbstractScheduler is abstract") as info:
            register_connector("abstract-test", _AbstractScheduler, _Worker)
        assert "build_connector_meta" in str(info.value)
        assert "update_state_after_alloc" in str(info.value)


class TestCliHelp:
    @pytest.mark.parametrize("command", ["run", "serve", "logs"])
    def test_every_flag_has_help_with_its_default(self, command: str) -> None:
        """Every flag of run / serve / logs has help text that states its default."""
        from pipeline.cli.main import build_parser

        parser = build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and "default" in action.help.lower(), action.option_strings

    def test_help_lists_choices_and_run_defaults(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--help`` shows the allowed dtypes, executors and policies, and run's own defaults."""
        from pipeline.cli.main import main

        with pytest.raises(SystemExit):
            main(["run", "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Choices: auto, float32, float16, bfloat16" in text
        assert "Choices: inprocess, multiproc, ray" in text
        assert "Choices: recompute, fail" in text
        assert "(default: shared_storage)" in text and "(default: 1024)" in text
