"""The README's multi-engine command blocks, run verbatim (``tests/readme_commands.py``):
P/D disaggregation and KV-aware routing on one host with default options.

One file, so that the blocks (which name fixed ports, as the README does) never run at
the same time under pytest-xdist (``--dist loadfile``).
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from readme_commands import ROOT, BlockProcess, readme_block, run_block, run_python_block
from server_process import launch

_PROMPT_TOKENS = 300
_NUM_REQUESTS = 16
_SIDE_CHANNEL_PORTS = range(5600, 5616)  # the nixl default (5600 + rank) and its ranks


def _metric(url: str, name: str) -> float:
    """The value of an unlabelled metric of ``url``'s ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in {url}/metrics"
    return float(found.group(1))


def _listening_ports() -> dict[int, set[int]]:
    """pid → the TCP ports its sockets listen on (IPv4 and IPv6), from ``/proc``."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    inodes[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    ports: dict[int, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            links = [str(fd.readlink()) for fd in (proc / "fd").iterdir()]
        except OSError:  # gone, or not ours
            continue
        for link in links:
            if link.startswith("socket:[") and link[8:-1] in inodes:
                ports.setdefault(int(proc.name), set()).add(inodes[link[8:-1]])
    return ports


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "builtin:tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return list(choice["token_ids"])


@contextlib.contextmanager
def _pd_block(tmp: Path, containing: str) -> Iterator[dict[str, Any]]:
    """The README's P/D block that contains ``containing`` running, a plain reference
    server beside it, the requests sent to both, and the consumer's metrics around them."""
    pytest.importorskip("nixl_cu12")
    pytest.importorskip("zmq")
    text = readme_block(containing)
    prompts = [
        [5 + (i * 31 + j * 7) % 240 for j in range(_PROMPT_TOKENS)] for i in range(_NUM_REQUESTS)
    ]
    with (
        launch("serve", ["--model", "builtin:tiny"], tmp / "reference.log") as reference,
        run_block(text, tmp) as block,
    ):
        for url in ("http://127.0.0.1:8100", "http://127.0.0.1:8200", "http://127.0.0.1:8000"):
            block.wait_healthy(url)
        reference.wait_healthy(time.monotonic() + 180)
        consumer = "http://127.0.0.1:8200"
        before = {n: _metric(consumer, n) for n in ("kvstep_scheduled_tokens_total",
                                                     "kvstep_kv_loaded_tokens_total")}  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            via_proxy = list(pool.map(lambda p: _complete("http://127.0.0.1:8000", p), prompts))
            alone = list(pool.map(lambda p: _complete(reference.url, p), prompts))
        after = {n: _metric(consumer, n) for n in before}
        yield {
            "block": block,
            "sent": sum(map(len, prompts)),
            "delta": {n: after[n] - before[n] for n in before},
            "via_proxy": via_proxy,
            "alone": alone,
            "ports": _listening_ports(),
        }


@pytest.fixture(scope="class")
def pd_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The README's P/D block with default options."""
    with _pd_block(tmp_path_factory.mktemp("pd"), "# prefill; its side channel") as run:
        yield run


@pytest.fixture(scope="class")
def keyed_pd_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The README's P/D block with a transfer key in the environment and --kv-peers."""
    with _pd_block(tmp_path_factory.mktemp("pd_key"), "--kv-transfer-key-env") as run:
        yield run


class TestKeyedDisaggregationCommands:
    """The README's P/D block of "Running P/D and routing safely" (a shared transfer key
    from the environment, the consumer's --kv-peers), typed as is, on one host."""

    def test_kv_moves_and_tokens_equal_a_single_servers(self, keyed_pd_run: dict[str, Any]) -> None:
        sent, delta = keyed_pd_run["sent"], keyed_pd_run["delta"]
        block: BlockProcess = keyed_pd_run["block"]
        assert delta["kvstep_scheduled_tokens_total"] < 0.3 * sent, block.tail()
        assert delta["kvstep_kv_loaded_tokens_total"] >= 0.8 * sent, block.tail()
        assert keyed_pd_run["via_proxy"] == keyed_pd_run["alone"]


class TestDisaggregationCommands:
    """The README's P/D block (producer, consumer, proxy), typed as is, on one host."""

    def test_kv_moves_from_producer_to_consumer(self, pd_run: dict[str, Any]) -> None:
        """The consumer computes < 30% of the prompt tokens and loads >= 80% of them."""
        sent, delta = pd_run["sent"], pd_run["delta"]
        block: BlockProcess = pd_run["block"]
        assert delta["kvstep_scheduled_tokens_total"] < 0.3 * sent, block.tail()
        assert delta["kvstep_kv_loaded_tokens_total"] >= 0.8 * sent, block.tail()

    def test_tokens_equal_a_single_servers(self, pd_run: dict[str, Any]) -> None:
        """Greedy tokens through the proxy are a plain server's, request by request."""
        assert pd_run["via_proxy"] == pd_run["alone"]

    def test_only_the_producer_binds_a_side_channel(self, pd_run: dict[str, Any]) -> None:
        """The producer listens on 5600; the consumer binds no side-channel port."""
        ports: dict[int, set[int]] = pd_run["ports"]
        consumer = [pid for pid, bound in ports.items() if 8200 in bound]
        producer = [pid for pid, bound in ports.items() if 8100 in bound]
        assert len(consumer) == 1 and len(producer) == 1
        assert 5600 in ports[producer[0]]
        assert not ports[consumer[0]] & set(_SIDE_CHANNEL_PORTS)


_ROUTING_URLS = ("http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://127.0.0.1:8103")
_PROXY_URL = "http://127.0.0.1:8000"


def _routed_tokens(url: str, prompt: list[int]) -> list[int]:
    """Greedy token ids of ``prompt`` from ``url``'s ``/v1/completions``."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def _labelled_sum(url: str, name: str) -> float:
    """The sum over labels of a labelled metric of ``url``'s ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


@pytest.fixture(scope="class")
def routing_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The README's routing block running (three replicas, the kv-aware proxy), prompts
    with shared prefixes sent through the proxy once it follows the replicas' events,
    and the same prompts sent to one replica directly."""
    pytest.importorskip("zmq")
    tmp = tmp_path_factory.mktemp("routing")
    text = readme_block("--policy kv-aware")
    systems = [[7 + (s * 13 + j * 5) % 200 for j in range(64)] for s in range(2)]
    prompts = [systems[i % 2] + [210 + i, 220 + i, 230 + i] for i in range(8)]
    with run_block(text, tmp) as block:
        for url in (*_ROUTING_URLS, _PROXY_URL):
            block.wait_healthy(url)
        # The proxy subscribes once it has read each replica's /health; batches sent
        # before it joined are not replayed (no replay socket): warm up until some arrive.
        deadline = time.monotonic() + 60
        warm = 0
        while _labelled_sum(_PROXY_URL, "kvstep_proxy_indexed_blocks") == 0:
            assert time.monotonic() < deadline, f"no KV event reached the proxy: {block.tail()}"
            _routed_tokens(_PROXY_URL, [240 - warm % 30] * 40)
            warm += 1
            time.sleep(0.2)
        via_proxy = [_routed_tokens(_PROXY_URL, p) for p in prompts]
        yield {
            "block": block,
            "indexed": _labelled_sum(_PROXY_URL, "kvstep_proxy_indexed_blocks"),
            "hit_blocks": _labelled_sum(_PROXY_URL, "kvstep_proxy_routed_hit_blocks_total"),
            "via_proxy": via_proxy,
            "alone": [_routed_tokens(_ROUTING_URLS[0], p) for p in prompts],
        }


class TestRoutingCommands:
    """The README's routing block (three replicas with plain loopback event endpoints,
    the kv-aware proxy), typed as is, on one host."""

    def test_events_arrive_at_the_proxy(self, routing_run: dict[str, Any]) -> None:
        """The proxy indexes the replicas' blocks and routes prompts onto cached prefixes."""
        assert routing_run["indexed"] > 0, routing_run["block"].tail()
        assert routing_run["hit_blocks"] > 0, routing_run["block"].tail()

    def test_tokens_equal_a_single_servers(self, routing_run: dict[str, Any]) -> None:
        """Greedy token ids through the proxy are one replica's, asked directly."""
        assert routing_run["via_proxy"] == routing_run["alone"]


class TestContributingCommands:
    """The README's "run one test" block of "Contributing", typed as is from the root."""

    def test_one_test_runs(self, tmp_path: Path) -> None:
        """The block runs the one fusion test it names, and it passes."""
        text = readme_block("python -m pytest -q tests/pipeline/test_compute_fusion.py")
        with run_block(text, tmp_path, cwd=ROOT) as block:
            assert block.process.wait(timeout=240) == 0, block.log_text()
        assert "1 passed" in block.log_text(), block.log_text()


class TestChatCommands:
    """The README's "chat with it" server block and the Python blocks that talk to it:
    the first chat, structured output, a forced tool call; typed as is."""

    def test_the_openai_client_blocks_run(self, tmp_path: Path) -> None:
        """With the server of the "fresh machine" block up, each Python block runs and
        prints what it promises: a reply, a JSON object valid against the example's
        schema, one get_weather call whose arguments are valid."""
        pytest.importorskip("openai")
        pytest.importorskip("llguidance")
        jsonschema = pytest.importorskip("jsonschema")
        with run_block(readme_block("kvstep serve --port 8000 &"), tmp_path) as block:
            block.wait_healthy("http://127.0.0.1:8000")
            chat = run_python_block(readme_block('"content": "Hello!"', "python"), tmp_path)
            structured = readme_block("response_format=", "python")
            city = run_python_block(structured, tmp_path)
            tools = readme_block("tool_choice=", "python")
            call = run_python_block(tools, tmp_path)
        assert chat.strip(), "the first chat printed its reply"
        schema = _block_value(structured, "schema")
        jsonschema.validate(ast.literal_eval(city.strip()), schema)
        reason, name, arguments = call.strip().split(" ", 2)
        assert (reason, name) == ("tool_calls", "get_weather")
        parameters = _block_value(tools, "weather")["function"]["parameters"]
        jsonschema.validate(ast.literal_eval(arguments), parameters)


def _block_value(text: str, name: str) -> Any:
    """The value a README Python block assigns to ``name`` (a literal)."""
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            name
        ]:
            return ast.literal_eval(node.value)
    raise LookupError(f"the block assigns no {name}")


class TestSpeculativeDecodingBlock:
    def test_the_block_runs_and_keeps_the_tokens(self, tmp_path: Path) -> None:
        """The "Speculative decoding" block, typed as is (default model): the engine
        with n-gram drafts gives the tokens of the one without."""
        out = run_python_block(readme_block('"method": "ngram"', "python"), tmp_path)
        assert out.strip() == "same tokens"


class TestLoRABlocks:
    """The "LoRA adapters" blocks, typed as is, with a peft adapter of the embedded
    model at ``./sql-adapter`` (what the user brings)."""

    @pytest.fixture
    def adapter_dir(self, tmp_path: Path) -> tuple[Path, Path]:
        from lora_adapters import ADAPTERS, build_adapter

        from stages.model.builtin import resolve_model_path

        base = Path(resolve_model_path("builtin:tiny"))
        return base, build_adapter(base, tmp_path / "sql-adapter", **ADAPTERS["qv"])

    def test_the_python_block(self, adapter_dir: tuple[Path, Path], tmp_path: Path) -> None:
        """The block's adapter changes the greedy tokens of its row only."""
        out = run_python_block(readme_block('LoRARequest("sql"', "python"), tmp_path)
        assert out.strip() == "True"

    def test_the_serve_block(self, adapter_dir: tuple[Path, Path], tmp_path: Path) -> None:
        """``--lora-modules sql=./sql-adapter``: ``model: "sql"`` gets the adapter's
        tokens (transformers + peft), the base model's name the base model's."""
        from lora_adapters import peft_greedy

        base, adapter = adapter_dir
        prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        url = "http://127.0.0.1:8000"
        with run_block(readme_block("--lora-modules sql=./sql-adapter"), tmp_path) as block:
            block.wait_healthy(url)
            got = {}
            for model in ("sql", "builtin:tiny"):
                body = {"model": model, "prompt": prompt, "max_tokens": 6, "min_tokens": 6,
                        "temperature": 0, "return_token_ids": True}  # fmt: skip
                response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                assert response.status_code == 200, response.text + block.tail()
                got[model] = response.json()["choices"][0]["token_ids"]
            models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["builtin:tiny", "sql"]
        assert got["sql"] == peft_greedy(base, adapter, prompt, 6)
        assert got["builtin:tiny"] == peft_greedy(base, None, prompt, 6)
