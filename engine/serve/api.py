"""OpenAI-compatible HTTP API over any Flotilla Engine (FastAPI + uvicorn + SSE).

Endpoints: GET /v1/models, GET /v1/models/{model}, POST /v1/chat/completions,
POST /v1/completions. `stream: true` answers with Server-Sent Events
(`data: {chunk}` lines, then `data: [DONE]`); otherwise with one JSON body.

Request fields used: model, messages / prompt, max_tokens, max_completion_tokens
(wins over max_tokens), temperature (0..2), top_p, seed, stop (a string or a
list), n (must be 1), stream, stream_options.include_usage, logprobs and
top_logprobs (chat; an integer logprobs on /v1/completions: each answer token's
logprob under the model's raw distribution and the likeliest alternatives; such a
request does not speculate: engine/serve/logprobs.py), and the extensions
top_k, repetition_penalty and speculative ({"mode": "draft"|"lookup"|"off",
"k": 1..16, "adaptive": bool}, or just the mode as a string; absent = the
engine's default; docs/speculative.md). Without max_tokens the engine's default
(SamplingParams.max_tokens) applies. Message roles: system, user, assistant (with
its tool_calls), tool (with tool_call_id); "developer" is read as "system"; content
is a string or a list of text parts. Chat also takes tools, tool_choice,
parallel_tool_calls and response_format: a JSON answer or a required call is held to
a grammar, calls come back as tool_calls (engine/serve/tool_calls.py, docs/api.md).
Any other field is a 400 naming it (code "unsupported_parameter"), unless it holds
the value that asks for nothing (functions [], frequency/presence_penalty 0, ...) or
is bookkeeping that leaves the answer alone (user, metadata): engine/serve/fields.py.

Every error is OpenAI's JSON `{"error": {"message", "type", "param", "code"}}`:
400 malformed JSON / invalid values, 401 missing or wrong API key (when one is
configured; a server bound beyond loopback always has one unless the user chose
--no-auth: engine/serve/auth.py), 404 unknown model or URL, 405 wrong method, 429 the engine's queue
is full (with Retry-After: engine/core/backpressure.py), 503 engine refused
(closed, broken), 500 anything else (no traceback in the body).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.datastructures import Headers

from engine.core.interface import Engine
from engine.serve.errors import ApiError, error_response, install_error_handlers
from engine.serve.generation import generate
from engine.serve.request_models import ChatCompletionRequest, CompletionRequest
from engine.serve.response_models import (
    ERROR_RESPONSES, ChatCompletion, Completion, ModelCard, ModelList, generation_responses,
)

API_TITLE = "Flotilla OpenAI-compatible API"
API_VERSION = "1.0"


# -- the app ----------------------------------------------------------------------------
class _ApiKeyMiddleware:
    """Pure ASGI: checks `Authorization: Bearer <key>` on /v1 before the body is read."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if not auth:
                err = ApiError(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
            elif scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.key):
                err = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
            else:
                err = None
            if err is not None:
                await error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engines: Mapping[str, Engine] | Engine, api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over one engine or several, keyed by model id."""
    table: dict[str, Engine] = (
        {engines.info.model_id: engines} if isinstance(engines, Engine) else dict(engines)
    )
    if not table:
        raise ValueError("create_app needs at least one engine")
    created = int(time.time())
    app = FastAPI(
        title=API_TITLE, version=API_VERSION,
        description="Chat and text completions from Flotilla engines (local, pipeline, MoE "
                    "offloading, sparse), wire-compatible with the OpenAI API.",
        openapi_tags=[{"name": "models", "description": "Which models this server answers with"},
                      {"name": "generation", "description": "Chat and text completions"}],
    )
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    install_error_handlers(app)
    app.state.engines = table

    def engine_for(model: str) -> Engine:
        engine = table.get(model)
        if engine is None:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return engine

    def card(model_id: str, engine: Engine) -> dict[str, Any]:
        info = engine.info
        return {"id": model_id, "object": "model", "created": created, "owned_by": "flotilla",
                "engine": info.engine, "device": info.device, "context_length": info.context_length}

    @app.get("/v1/models", tags=["models"], summary="List models", response_model=ModelList,
             responses={401: ERROR_RESPONSES[401]})
    async def list_models() -> Any:
        return {"object": "list", "data": [card(k, e) for k, e in table.items()]}

    @app.get("/v1/models/{model}", tags=["models"], summary="Retrieve a model", response_model=ModelCard,
             responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
    async def get_model(model: str) -> Any:
        return card(model, engine_for(model))

    @app.post("/v1/chat/completions", tags=["generation"], summary="Create a chat completion",
              responses=generation_responses(ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await generate(body, request, engine_for(body.model), chat=True)

    @app.post("/v1/completions", tags=["generation"], summary="Create a text completion",
              responses=generation_responses(Completion))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await generate(body, request, engine_for(body.model), chat=False)

    return app


# -- serving ----------------------------------------------------------------------------
def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve in the foreground until Ctrl-C (binds 127.0.0.1 unless told otherwise)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class ApiServer:
    """uvicorn in a background thread: start() returns once it listens; port 0
    picks a free port (read it from .port afterwards); stop() shuts it down."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.app, self.host, self.port = app, host, port
        self.access = None  # engine.serve.auth.Access of whoever decided the key (client.start_api_server)
        self._config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                      timeout_graceful_shutdown=2, lifespan="off")
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ApiServer":
        if self._thread is not None:
            raise RuntimeError("the server is already started")
        # Bind here, in the caller's thread: a port in use is an OSError the caller
        # sees at once (one line), not an exception dying in the server thread, and
        # port 0 is resolved before start() returns.
        sock = _listen_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(self._config)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="flotilla-api",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive():
                self._thread = None
                sock.close()
                raise OSError(f"the API server could not start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the API server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "ApiServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn; OSError ("address already in use") if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name == "posix":  # as asyncio does: quick restarts; on Windows it would allow port theft
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
