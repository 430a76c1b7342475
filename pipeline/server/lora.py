"""The LoRA adapters a server serves, each as a model of its own name (vLLM's
``--lora-modules`` and runtime ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

A request's ``model`` picks what runs it: the base model's name (or no ``model``) the
base model, an adapter's name that adapter; anything else is a 404 listing what is
served. ``/v1/models`` lists the base model, then each adapter (``parent``: the base
model, ``root``: its directory, as vLLM's). Loading and unloading at run time change
what the server reads from its disk, so the two routes answer only a caller holding the
server's API key, and with no API key set they are refused (403): start the server
with ``--api-key`` (or ``$KVSTEP_API_KEY``) to use them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from pipeline.errors import InvalidConfigError, InvalidRequestError
from pipeline.lora import LoRARequest
from pipeline.server.body import read_body
from pipeline.server.errors import HTTPProblem

if TYPE_CHECKING:
    from pipeline.engine.async_engine import AsyncEngine
    from pipeline.server.app import ServerState

__all__ = [
    "LOAD_PATH",
    "UNLOAD_PATH",
    "ServedLoRAs",
    "load_lora_adapter",
    "parse_lora_module",
    "unload_lora_adapter",
]

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def parse_lora_module(text: str) -> tuple[str, str]:
    """``(name, path)`` of one ``--lora-modules`` entry: ``name=path``, or vLLM's JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}``.

    Raises:
        InvalidConfigError: Neither form, or an empty name or path.
    """
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            raise InvalidConfigError("lora_modules", text, "is not JSON") from None
        name, path = data.get("name"), data.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            name = path = None
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise InvalidConfigError(
            "lora_modules", text, 'must be name=path or {"name": ..., "path": ...}'
        )
    return name, path


class ServedLoRAs:
    """The adapters a server serves, by name; ids are given in the order they came.

    Not thread-safe: the app's event loop only.
    """

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._by_name

    def names(self) -> list[str]:
        return list(self._by_name)

    async def add(self, engine: AsyncEngine, name: str, path: str) -> LoRARequest:
        """Read and check the adapter (off the loop), then serve it as ``name``.

        Raises:
            InvalidRequestError: The name is served already (the base model's too), or
                the adapter is refused (:meth:`AsyncEngine.add_lora`).
        """
        if name in self._by_name or name == self.base_model:
            raise InvalidRequestError("lora_name", name, "is served already")
        request = LoRARequest(name, self._next_id, path)
        await engine.add_lora(request)
        self._next_id += 1
        self._by_name[name] = request
        return request

    def remove(self, engine: AsyncEngine, name: str) -> bool:
        """Stop serving ``name`` (requests running with it finish); whether it was."""
        if self._by_name.pop(name, None) is None:
            return False
        engine.remove_lora(name)
        return True

    def for_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (``None``: the base model).

        Raises:
            HTTPProblem: 404, ``model`` is served by none of them.
        """
        if model is None or model == self.base_model:
            return None
        request = self._by_name.get(model)
        if request is None:
            served = ", ".join(repr(n) for n in (self.base_model, *self._by_name))
            message = f"model {model[:80]!r} is not served; the served models are {served}"
            raise HTTPProblem(
                404, message, kind="not_found_error", code="model_not_found", param="model"
            )
        return request

    def models(self) -> Iterable[dict[str, Any]]:
        """The ``/v1/models`` entries of the adapters."""
        for request in self._by_name.values():
            yield {"id": request.lora_name, "object": "model", "created": 0,
                   "owned_by": "kvstep", "root": request.lora_path,
                   "parent": self.base_model}  # fmt: skip


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvstep
    return state


async def _admin_body(request: Request, fields: tuple[str, ...]) -> dict[str, str] | Response:
    """The JSON body of a load/unload call, with its string ``fields``; refused unless
    the caller holds the API key (the guard checked it) and one is set."""
    state = _state(request)
    if state.options.api_key is None:
        raise HTTPProblem(
            403,
            "loading or unloading adapters at run time needs the server to have an API key "
            "(--api-key or $KVSTEP_API_KEY)",
            kind="permission_error",
            code="runtime_lora_disabled",
        )
    if not state.running_engine().config.enable_lora:
        raise InvalidRequestError("lora_name", None, "this server was started without LoRA")
    body = await read_body(request)
    if isinstance(body, Response):
        return body
    if not isinstance(body, dict):
        raise InvalidRequestError("body", type(body).__name__, "must be a JSON object")
    out: dict[str, str] = {}
    for field in fields:
        value = body.get(field)
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(field, value, "must be a non-empty string")
        out[field] = value
    return out


async def load_lora_adapter(request: Request) -> Response:
    """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: serve a new adapter."""
    body = await _admin_body(request, ("lora_name", "lora_path"))
    if isinstance(body, Response):
        return body
    state = _state(request)
    name = body["lora_name"]
    await state.loras.add(state.running_engine(), name, body["lora_path"])
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter {"lora_name"}``: stop serving an adapter."""
    body = await _admin_body(request, ("lora_name",))
    if isinstance(body, Response):
        return body
    state = _state(request)
    name = body["lora_name"]
    if not state.loras.remove(state.running_engine(), name):
        message = f"no LoRA adapter {name[:80]!r} is served"
        raise HTTPProblem(
            404, message, kind="not_found_error", code="lora_not_found", param="lora_name"
        )
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
