"""Unit tests of vllm/entrypoints/openai/spyre_error_status.py: an error
answered as HTTP 200 in a whole JSON body gets the status its body names;
everything else, event streams included, is untouched."""
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm.entrypoints.openai.spyre_error_status import (ErrorStatusMiddleware,
                                                        error_status)

ERROR = {"error": {"message": "no", "type": "BadRequestError",
                   "param": None, "code": 400}}


def events(*items):
    async def gen():
        for item in items:
            yield f"data: {item}\n\n"
    return gen()


async def error_as_200(request):
    return JSONResponse(ERROR)


async def ok_json(request):
    return JSONResponse({"error_free": True, "id": 1})


async def real_404(request):
    return JSONResponse({"error": {"code": 404}}, status_code=404)


async def stream_error_first(request):
    return StreamingResponse(events(json.dumps(ERROR), "[DONE]"),
                             media_type="text/event-stream")


async def stream_ok(request):
    later_error = json.dumps({"error": {"code": 500}})
    return StreamingResponse(events('{"id": 1}', later_error, "[DONE]"),
                             media_type="text/event-stream")


APP = Starlette(routes=[
    Route("/error-as-200", error_as_200, methods=["POST"]),
    Route("/ok", ok_json, methods=["POST"]),
    Route("/404", real_404, methods=["POST"]),
    Route("/stream-error", stream_error_first, methods=["POST"]),
    Route("/stream-ok", stream_ok, methods=["POST"]),
])
APP.add_middleware(ErrorStatusMiddleware)


@pytest.mark.parametrize("path,status", [
    ("/error-as-200", 400),
    ("/ok", 200),
    ("/404", 404),
    # Streams pass untouched: their error is an event, as upstream sends it.
    ("/stream-error", 200),
    ("/stream-ok", 200),
])
def test_status_follows_the_error_body(path, status):
    with TestClient(APP) as client:
        resp = client.post(path)
    assert resp.status_code == status
    if path == "/stream-ok":
        assert resp.text.count("data: ") == 3  # nothing lost


def test_body_is_passed_through_unchanged():
    with TestClient(APP) as client:
        assert client.post("/error-as-200").json() == ERROR
        assert client.post("/ok").json() == {"error_free": True, "id": 1}


@pytest.mark.parametrize("body,code", [
    (b'{"error":{"message":"x","code":400}}', 400),
    (b'{"error": {"message": "x", "code": 503}}', 503),
    (b'{"error":{"message":"x","code":200}}', None),
    (b'{"error":{"message":"x"}}', None),
    (b'{"error": "plain"}', None),
    (b'{"error":{"code":400', None),
    (b'{"id":"cmpl-1","choices":[]}', None),
    (b'data: {"id": "cmpl-1"}\n\n', None),
    (b"", None),
])
def test_error_status(body, code):
    assert error_status(body) == code
