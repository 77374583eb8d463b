"""The client examples, each run as a user would run it, against a live
server on the default model (SmolLM2-135M-Instruct, eager backend)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, spyre_env
from server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.smollm2]


@pytest.fixture(scope="module")
def server(smollm2):
    # SmolLM2's chat template adds a system prompt: chat prompts need 128.
    with Server(smollm2, spyre_env("eager", [128], [16], [2])) as srv:
        yield srv


def run_example(name: str, server) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), "--base-url",
         server.url + "/v1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_openai_client_example(server):
    out = run_example("openai_client.py", server)
    assert "completion: ' Paris" in out
    assert "streamed: " in out
    chat = [line for line in out.splitlines() if line.startswith("chat:")]
    assert chat and "Paris" in chat[0]


def test_langchain_example(server):
    out = run_example("langchain_chat.py", server)
    answer = [line for line in out.splitlines()
              if line.startswith("answer:")]
    assert answer and "Paris" in answer[0]
    streamed = [line for line in out.splitlines()
                if line.startswith("streamed: ")]
    assert streamed and len(streamed[0]) > len("streamed: ")
