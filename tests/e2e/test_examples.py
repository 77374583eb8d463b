"""The examples, each run as a user would run it: the clients against a
live server on the default model (SmolLM2-135M-Instruct, eager backend),
and the trainer loop on the default model and under torchrun."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spyre_support.envs import spyre_env
from spyre_support.paths import REPO
from spyre_support.server import Server

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def server(smollm2):
    # SmolLM2's chat template adds a system prompt: chat prompts need 128.
    # The README's ``vllm serve``, its engine process spawned.
    with Server(smollm2, spyre_env("eager", [128], [16], [2]),
                fork_engine=False) as srv:
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


def run_trainer_loop(launcher: list[str], model) -> list[str]:
    proc = subprocess.run(
        [*launcher, str(REPO / "examples" / "trainer_loop.py"), "--model",
         str(model)],
        env={k: v for k, v in os.environ.items()
             if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines()
            if line.startswith(("before training:", "step "))]


def check_trainer_loop(lines: list[str]) -> None:
    """Every step's pushed weights give the trainer's own greedy ids, and
    training moved the model (lower loss, another completion)."""
    before, steps = lines[0], lines[1:]
    assert len(steps) == 3
    disagree = [s for s in steps if not s.endswith("trainer agrees: True")]
    assert not disagree, disagree
    losses = [float(re.search(r"loss ([\d.]+)", s).group(1)) for s in steps]
    assert losses == sorted(losses, reverse=True)
    completion = before.split(": ", 1)[1]
    assert completion not in steps[-1]


def test_trainer_loop_example(smollm2):
    check_trainer_loop(run_trainer_loop([sys.executable], smollm2))


def test_trainer_loop_example_under_torchrun(tiny_llama_3kv):
    from vllm.utils import get_open_port
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    check_trainer_loop(run_trainer_loop(
        [torchrun, "--nproc-per-node", "3", "--master-port",
         str(get_open_port())], tiny_llama_3kv))
