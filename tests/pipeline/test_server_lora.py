"""LoRA adapters served as models: ``--lora-modules``, ``/v1/models``, the request's
``model`` picking the adapter, and the runtime load/unload routes behind the API key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from asgi_client import client_for
from checkpoints import build_checkpoint
from lora_adapters import ADAPTERS, build_adapter, peft_greedy

from pipeline import EngineConfig
from pipeline.errors import InvalidConfigError
from pipeline.server import create_app
from pipeline.server.lora import parse_lora_module
from pipeline.server.options import ServerOptions

N = 6
PROMPT = [5, 9, 17, 33, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 7, 8]
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("server_lora")
    base = build_checkpoint("llama", root / "base")
    paths = {n: build_adapter(base, root / n, seed=i + 1, **lora)
             for i, (n, lora) in enumerate(ADAPTERS.items())}  # fmt: skip
    refs = {n: peft_greedy(base, paths.get(n), PROMPT, N) for n in (None, *paths)}
    return {"base": base, "paths": paths, "refs": refs}


def app(made: dict[str, Any], **options: Any) -> Any:
    options.setdefault("lora_modules", (("qv", str(made["paths"]["qv"])),))
    config = EngineConfig(model=str(made["base"]), max_model_len=128, max_loras=2)
    return create_app(config, model_name="base", options=ServerOptions(**options))


async def tokens(client: Any, model: str | None, **headers: str) -> Any:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": N, "min_tokens": N, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    if model is not None:
        body["model"] = model
    return await client.post("/v1/completions", json=body, headers=headers)


class TestServedAdapters:
    @pytest.mark.anyio
    async def test_model_picks_the_adapter(self, made: dict[str, Any]) -> None:
        """``--lora-modules qv=PATH`` turns LoRA on; ``model: "qv"`` gets that adapter's
        tokens (transformers + peft) and names it in the response; the base model's
        name, or none, the base model's; another name is a 404 listing both."""
        async with client_for(app(made)) as client:
            got = {}
            for model in ("qv", "base", None):
                resp = await tokens(client, model)
                assert resp.status_code == 200, resp.text
                got[model] = resp.json()["choices"][0]["token_ids"]
                assert resp.json()["model"] == (model or "base")
            missing = await tokens(client, "od")
        assert got == {"qv": made["refs"]["qv"], "base": made["refs"][None],
                       None: made["refs"][None]}  # fmt: skip
        assert missing.status_code == 404
        assert "'base', 'qv'" in missing.json()["error"]["message"]

    @pytest.mark.anyio
    async def test_models_lists_the_adapters(self, made: dict[str, Any]) -> None:
        """``/v1/models``: the base model, then each adapter with its parent and root."""
        async with client_for(app(made)) as client:
            data = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == ["base", "qv"]
        assert data[1]["parent"] == "base" and data[1]["root"] == str(made["paths"]["qv"])

    @pytest.mark.anyio
    async def test_chat_with_an_adapter(self, made: dict[str, Any]) -> None:
        """Chat completions check ``model`` against the adapters too (the tiny checkpoint
        has no tokenizer, so chat itself is refused after that check)."""
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with client_for(app(made)) as client:
            served = await client.post("/v1/chat/completions", json={**body, "model": "qv"})
            other = await client.post("/v1/chat/completions", json={**body, "model": "od"})
        assert served.json()["error"]["code"] != "model_not_found", served.text
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"

    def test_a_bad_module_fails_the_start(self, made: dict[str, Any], tmp_path: Path) -> None:
        """An adapter directory that is not one stops the server from starting."""
        import anyio

        bad = app(made, lora_modules=(("x", str(tmp_path)),))

        async def start() -> None:
            async with client_for(bad):
                pass

        with pytest.raises(Exception, match="adapter_config"):
            anyio.run(start)


class TestRuntimeLoading:
    @pytest.mark.anyio
    async def test_load_use_unload(self, made: dict[str, Any]) -> None:
        """With the API key: load ``od``, serve it, refuse loading it twice, unload it,
        then it is a 404 again; unloading it twice is a 404."""
        od = str(made["paths"]["od"])
        async with client_for(app(made, api_key=KEY)) as client:
            load = {"lora_name": "od", "lora_path": od}
            resp = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
            assert resp.status_code == 200, resp.text
            resp = await tokens(client, "od", **AUTH)
            assert resp.json()["choices"][0]["token_ids"] == made["refs"]["od"]
            models = (await client.get("/v1/models", headers=AUTH)).json()["data"]
            assert [m["id"] for m in models] == ["base", "qv", "od"]
            again = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
            assert again.status_code == 400 and "served already" in again.text
            unload = {"lora_name": "od"}
            resp = await client.post("/v1/unload_lora_adapter", json=unload, headers=AUTH)
            assert resp.status_code == 200, resp.text
            assert (await tokens(client, "od", **AUTH)).status_code == 404
            resp = await client.post("/v1/unload_lora_adapter", json=unload, headers=AUTH)
            assert resp.status_code == 404

    @pytest.mark.anyio
    async def test_callers_without_the_key(self, made: dict[str, Any]) -> None:
        """Without the key the routes are 401; on a server with no API key at all they
        are refused (403): loading reads the server's disk."""
        load = {"lora_name": "od", "lora_path": str(made["paths"]["od"])}
        async with client_for(app(made, api_key=KEY)) as client:
            resp = await client.post("/v1/load_lora_adapter", json=load)
            assert resp.status_code == 401
        async with client_for(app(made)) as client:
            resp = await client.post("/v1/load_lora_adapter", json=load)
            assert resp.status_code == 403
            assert "api key" in resp.json()["error"]["message"].lower()
            assert (await tokens(client, "od")).status_code == 404

    @pytest.mark.anyio
    async def test_a_bad_directory_is_a_400(self, made: dict[str, Any], tmp_path: Path) -> None:
        """A directory that is not an adapter: 400 naming what is wrong; nothing new is
        served."""
        (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
        (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
        load = {"lora_name": "evil", "lora_path": str(tmp_path)}
        async with client_for(app(made, api_key=KEY)) as client:
            resp = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
            models = (await client.get("/v1/models", headers=AUTH)).json()["data"]
        assert resp.status_code == 400
        assert "target_modules" in resp.text or "pickle" in resp.text
        assert [m["id"] for m in models] == ["base", "qv"]


class TestModulesFlag:
    def test_forms(self) -> None:
        """vLLM's two forms of a ``--lora-modules`` entry."""
        assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
        assert parse_lora_module('{"name": "sql", "path": "/a/b"}') == ("sql", "/a/b")
        for bad in ("sql", "=x", "sql=", '{"name": 1}', "{"):
            with pytest.raises(InvalidConfigError, match="lora_modules"):
                parse_lora_module(bad)

    def test_names_are_unique(self) -> None:
        with pytest.raises(InvalidConfigError, match="unique"):
            ServerOptions(lora_modules=(("a", "/x"), ("a", "/y")))
