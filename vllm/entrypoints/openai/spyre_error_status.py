"""Error answers of the OpenAI server carry their HTTP status.

In vLLM 0.10.1.1 a route whose API the served model does not offer (an
embeddings request to a generator, a chat request to an embedding model,
score, rerank, pooling, classify, ...) returns its ``ErrorResponse`` object
as the body of an HTTP 200, so a client that checks the status code sees
success.  ``ErrorStatusMiddleware`` gives such an answer the status code its
own body names (``{"error": {"code": 400, ...}}``).  Every other answer
passes through untouched; a streamed request the engine refuses keeps
upstream's answer, an HTTP 200 stream whose one event is the error.

vLLM's ``vllm.general_plugins`` entry point ``spyre_error_status`` calls
``install`` in every process; in the API server it wraps ``build_app`` so
that the app it builds on the Spyre platform has the middleware.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

from vllm.engine.spyre_upstream_wraps import wrap_once

_API_SERVER = "vllm.entrypoints.openai.api_server"
_ERROR_PREFIX = b'{"error"'


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    api_server = _api_server_module()
    if api_server is not None:  # else: not the API server process
        wrap_once(api_server, "build_app", _with_middleware)


def _with_middleware(original):

    def build_app(args):
        app = original(args)
        from vllm.config.spyre import is_spyre
        if is_spyre():
            app.add_middleware(ErrorStatusMiddleware)
        return app

    return build_app


def _api_server_module():
    """The API server's module if this process has imported it (``vllm
    serve``) or runs it (``python -m vllm.entrypoints.openai.api_server``)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == _API_SERVER:
        return main
    return sys.modules.get(_API_SERVER)


def error_status(body: bytes) -> Optional[int]:
    """The 4xx/5xx code an error body names, or None for any other body."""
    if not body.startswith(_ERROR_PREFIX):
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(code, int) and 400 <= code < 600:
        return code
    return None


class ErrorStatusMiddleware:
    """Pure ASGI middleware: holds back the start of a 200 JSON answer
    until its body is known, and gives an error body its own code."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: Optional[dict] = None

        async def send_checked(message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                if message["status"] == 200 and _is_json(message):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held:
                start, held = held, None
                code = error_status(message.get("body", b""))
                if code is not None:
                    start = dict(start, status=code)
                await send(start)
            await send(message)

        await self.app(scope, receive, send_checked)


def _is_json(start: dict) -> bool:
    return any(name.lower() == b"content-type"
               and value.startswith(b"application/json")
               for name, value in start.get("headers", ()))
