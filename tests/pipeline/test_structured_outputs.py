"""Structured outputs through the engine (issue 26): the ``structured`` logits stage masks
each constrained row to its grammar; ``builtin:tiny`` has random weights, so only the
mask can make its outputs valid.

Every output is checked by an oracle that is not the backend: ``jsonschema`` for JSON
schemas, ``re.fullmatch`` for regexes, membership for choices.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from typing import Any

import anyio
import attrs
import jsonschema
import pytest
from structured_schemas import random_schema

from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.grammar.compiler import compiler_for
from pipeline.request import RequestStatus
from pipeline.structured_outputs import StructuredOutputsParams
from pipeline.tokenizer import load_tokenizer
from stages.model.builtin import tokenizer_dir
from stages.model.builtin_tokenizer import VOCAB_SIZE
from stages.scheduler.state import SchedulerState
from stages.structured import tokenizer_info

pytest.importorskip("llguidance")

MODEL = "builtin:tiny"


def constrained(spec: StructuredOutputsParams, seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=kw.pop("max_tokens", 400), temperature=1.0, seed=seed,
        structured_outputs=spec, **kw,
    )  # fmt: skip


BACKENDS = [
    "llguidance",
    pytest.param(
        "xgrammar",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"
        ),
    ),
]
# The same language in each backend's grammar syntax (xgrammar reads GBNF/EBNF, not Lark).
CALC = {
    "llguidance": 'start: "(" expr ")"\nexpr: NUM (("+" | "*") NUM)*\nNUM: /[1-9][0-9]?/',
    "xgrammar": 'root ::= "(" num (("+" | "*") num)* ")"\nnum ::= [1-9] [0-9]?',
}
UNDEFINED = {"llguidance": "start: nothing_defined", "xgrammar": "root ::= nothing_defined"}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def llm(backend: str) -> LLM:
    return LLM(EngineConfig(model=MODEL, structured_outputs_backend=backend))


def test_thirty_random_json_schemas_all_valid(llm: LLM) -> None:
    rng = random.Random(26)
    schemas = [random_schema(rng) for _ in range(30)]
    schemas = [s if s.get("type") == "object" else {"type": "object", "properties": {"v": s},
               "required": ["v"], "additionalProperties": False} for s in schemas]  # fmt: skip
    params = [constrained(StructuredOutputsParams(json=s), seed=i) for i, s in enumerate(schemas)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params)
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", (out.finish_reason, out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_json_object(llm: LLM) -> None:
    regex = r"[a-z]{3,6}-[0-9]{2}( [A-Z]+)?"
    choices = ("yes", "no", "maybe so")
    params = [constrained(StructuredOutputsParams(regex=regex), seed=s) for s in range(6)]
    params += [constrained(StructuredOutputsParams(choice=choices), seed=s) for s in range(6)]
    params += [constrained(StructuredOutputsParams(json_object=True), seed=s) for s in range(4)]
    outs = llm.generate(["x"] * len(params), params)
    for out in outs[:6]:
        assert re.fullmatch(regex, out.text), out.text
    for out in outs[6:12]:
        assert out.text in choices
    for out in outs[12:]:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


def test_grammar(llm: LLM, backend: str) -> None:
    """A context-free grammar (Lark for llguidance, EBNF for xgrammar)."""
    grammar = CALC[backend]
    params = [constrained(StructuredOutputsParams(grammar=grammar), seed=s) for s in range(5)]
    for out in llm.generate(["calc:"] * 5, params):
        assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:[+*][1-9][0-9]?)*\)", out.text), out.text


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    plain = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i) for i in range(3)]
    alone = [o.token_ids for o in llm.generate(["hello there"] * 3, plain)]
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}},
              "required": ["k"], "additionalProperties": False}  # fmt: skip
    mixed = [constrained(StructuredOutputsParams(json=schema), seed=i) for i in range(3)]
    outs = llm.generate(["hello there"] * 6, [mixed[0], plain[0], mixed[1], plain[1], plain[2],
                                              mixed[2]])  # fmt: skip
    assert [outs[1].token_ids, outs[3].token_ids, outs[4].token_ids] == alone
    for out in (outs[0], outs[2], outs[5]):
        jsonschema.validate(json.loads(out.text), schema)


def test_bad_specs_fail_alone_naming_the_field(llm: LLM, backend: str) -> None:
    compiler = compiler_for(tokenizer_info(MODEL, VOCAB_SIZE, 2), backend)
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex.*does not compile"):
        compiler.get(StructuredOutputsParams(regex="a[b"))
    good = SamplingParams(max_tokens=8, seed=1)
    bad = constrained(StructuredOutputsParams(grammar=UNDEFINED[backend]), seed=1)
    try:
        outs = llm.generate(["x", "y"], [good, bad])
    except InvalidRequestError as exc:  # a compile that finished at once fails at admission
        assert "structured_outputs.grammar" in str(exc)
    else:
        assert outs[0].finish_reason == "length"
        assert outs[1].finish_reason == "error"
        assert "structured_outputs.grammar" in (outs[1].error or "")


def test_preempted_constrained_request_stays_valid(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """A KV pool so small that running requests are preempted and recomputed: each
    matcher is rebuilt from the accepted tokens and every output stays valid."""
    preempted: list[str] = []
    preempt = SchedulerState.preempt

    def counting(self: SchedulerState, request: Any) -> None:
        preempted.append(request.request_id)
        preempt(self, request)

    monkeypatch.setattr(SchedulerState, "preempt", counting)
    config = EngineConfig(
        model=MODEL, num_gpu_blocks=12, block_size=16, max_num_seqs=4,
        structured_outputs_backend=backend,
    )  # fmt: skip
    llm = LLM(config)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30},
              "t": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 6}},
              "required": ["s", "t"], "additionalProperties": False}  # fmt: skip
    params = [constrained(StructuredOutputsParams(json=schema), seed=i, max_tokens=120)
              for i in range(4)]  # fmt: skip
    outs = llm.generate(["p" * 40] * 4, params)
    assert preempted, "the pool was big enough: nothing was preempted"
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_engine_compiles_while_others_run(async_scheduling: bool, backend: str) -> None:
    """The grammar compiles off the loop while the request waits in
    ``WAITING_FOR_GRAMMAR``; an unconstrained request admitted at the same time runs."""

    async def main() -> None:
        config = EngineConfig(
            model=MODEL, async_scheduling=async_scheduling, structured_outputs_backend=backend
        )
        async with AsyncEngine(config) as engine:
            # A spec no other test compiles: a cache miss.
            schema = {
                "type": "object",
                "properties": {f"k{async_scheduling}": {"enum": [1, 2]}},
                "required": [f"k{async_scheduling}"],
                "additionalProperties": False,
            }
            stream = engine.generate("z", constrained(StructuredOutputsParams(json=schema), 3))
            request = engine.core.scheduler._state.requests.get(stream.request_id)
            assert request is not None
            waited = request.status == RequestStatus.WAITING_FOR_GRAMMAR
            plain = engine.generate("z", SamplingParams(max_tokens=4, seed=1))
            texts = {}
            async with anyio.create_task_group() as tg:

                async def drain(s: Any, key: str) -> None:
                    async for out in s:
                        texts[key] = out

                tg.start_soon(drain, stream, "c")
                tg.start_soon(drain, plain, "p")
            assert texts["p"].finish_reason == "length"
            jsonschema.validate(json.loads(texts["c"].text), schema)
            assert waited or request.grammar_wait is None

    anyio.run(main)


def test_multiproc_two_ranks_driver_masks(backend: str) -> None:
    config = EngineConfig(
        model=MODEL, world_size=2, executor="multiproc", structured_outputs_backend=backend
    )
    llm = LLM(config)
    try:
        schema = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 1,
                  "maximum": 99}}, "required": ["q"], "additionalProperties": False}  # fmt: skip
        params = [constrained(StructuredOutputsParams(json=schema), seed=i) for i in range(3)]
        for out in llm.generate(["m"] * 3, params):
            jsonschema.validate(json.loads(out.text), schema)
    finally:
        llm.close()


def test_no_token_allowed_fails_alone(llm: LLM) -> None:
    """``min_tokens`` past the end of a one-word choice: once the choice is written only
    EOS fits the grammar, and min_tokens bans it: the request fails alone, named."""
    good = SamplingParams(max_tokens=6, seed=5)
    stuck = attrs.evolve(
        constrained(StructuredOutputsParams(choice=["ok"]), seed=5, max_tokens=20), min_tokens=10
    )
    outs = llm.generate(["x", "y"], [good, stuck])
    assert outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "error"
    assert outs[1].error


def test_reasoning_before_the_constraint(backend: str) -> None:
    """llguidance lets a <think> section come first (free text up to the first
    </think>, then the schema); xgrammar has no lazy rule and refuses it, naming the
    field."""
    compiler = compiler_for(tokenizer_info(MODEL, VOCAB_SIZE, 2), backend)
    spec = StructuredOutputsParams(json={"type": "integer"}, reasoning="required")
    if backend == "xgrammar":
        with pytest.raises(InvalidRequestError, match=r"structured_outputs\.reasoning"):
            compiler.get(spec)
        return
    tokenizer = load_tokenizer(tokenizer_dir(MODEL))
    assert tokenizer is not None
    texts = [
        "<think>a {b} </thin</think>12",
        "opened by the template</think>7",
        "<think>x</think>ab",
    ]
    accepted = [compiler.get(spec).matcher().accept(tokenizer.encode(t)) for t in texts]
    assert accepted == [True, True, False]
