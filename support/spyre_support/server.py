"""A real ``vllm serve`` process on loopback, for the online tests and the
serving benchmarks, and client helpers: a Prometheus metric's value, a
streamed completion, an abort storm, and small runs of the burst and soak
(``spyre_support.soak``)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx
import requests

from spyre_support import preloaded
from spyre_support.soak import metric as url_metric
from spyre_support.soak import (burst, random_requests, soak,
                                soak_plan, tree_rss)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """Starts ``vllm serve MODEL`` under ``env`` and waits until healthy."""

    def __init__(self, model: Path, env: dict, args: tuple = (),
                 log_path: Optional[Path] = None, fork_engine: bool = True):
        self.model = str(model)
        self.fork_engine = fork_engine
        self.env = dict(os.environ, **env)
        self.env.setdefault("VLLM_USE_V1", "0")
        self.args = args
        self.given_log_path = log_path
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.given_log_path or Path(
            f"/tmp/vllm-serve-{self.port}.log")
        # The engine process a fork of the API server (forked_serve), or
        # started as ``vllm serve`` starts it.
        entry = ("spyre_support.forked_serve" if self.fork_engine
                 else "vllm.entrypoints.cli.main")
        argv = ["-m", entry, "serve", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "w")
        # The API server, forked from a server that has imported vLLM.
        self.proc = preloaded.Popen(argv, self.env, self.log_path,
                                    new_session=True)

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n"
                    + self.log()[-4000:])
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy in {timeout} s:\n"
                           + self.log()[-4000:])

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def __enter__(self) -> "Server":
        for attempt in range(3):
            try:
                self.wait_healthy()
                return self
            except BaseException as e:
                self.stop()
                # The free port was taken (by another process's outgoing
                # connection) between choosing it and binding it.
                if attempt < 2 and "Address already in use" in str(e):
                    self._start()
                    continue
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def openai_client(server: Server):
    """The openai client of ``server``'s API as the tests use it: no
    retries, two minutes a call."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                         max_retries=0, timeout=120)


def served_ids(server: Server, prompt: list[int], max_tokens: int) -> list:
    """Greedy ids of one completion of token ids, EOS ignored, read
    exactly from its logprobs (``return_tokens_as_token_ids``)."""
    reply = requests.post(server.url + "/v1/completions", json=dict(
        model=server.model, prompt=prompt, max_tokens=max_tokens,
        temperature=0.0, ignore_eos=True, logprobs=0,
        return_tokens_as_token_ids=True), timeout=300)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def metric(server, name: str) -> float:
    """The sum of a Prometheus metric's samples on ``server``."""
    return url_metric(server.url, name)


async def stream(client, url, model, prompt, max_tokens, cancel_after):
    """Streams a completion; closes the connection after ``cancel_after``
    tokens (None: read to the end).  Returns the tokens received."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens,
                temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    got = 0
    usage = None
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                got += 1
                if cancel_after is not None and got >= cancel_after:
                    return got, None  # leaving the block drops the stream
    return got, usage


def abort_storm(server, n: int, seed: int, max_prompt: int,
                max_tokens: int) -> list:
    """``n`` concurrent streams of random lengths, about a third dropped by
    the client at a random token.  Asserts that every other stream got all
    its tokens and each dropped one exactly the tokens before its drop;
    returns the plan, [(prompt, max_tokens, drop_after or None)]."""
    rng = random.Random(seed)
    plan = []
    for _ in range(n):
        prompt = [rng.randint(3, 380) for _ in range(rng.randint(1,
                                                                 max_prompt))]
        tokens = rng.randint(2, max_tokens)
        drop = rng.randint(1, tokens - 1) if rng.random() < 0.35 else None
        plan.append((prompt, tokens, drop))
    url = server.url + "/v1/completions"

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(
                stream(client, url, server.model, p, m, d)
                for p, m, d in plan))

    results = asyncio.run(asyncio.wait_for(main(), timeout=300))
    assert any(d is not None for _, _, d in plan)
    for (_, m, d), got in zip(plan, results):
        assert got == ((m, m) if d is None else (d, None))
    return plan


def wait_until_zero(server, names: tuple[str, ...], timeout: float = 30):
    """Polls /metrics until the sum of the named metrics is 0."""
    deadline = time.monotonic() + timeout
    while sum(metric(server, name) for name in names) > 0:
        assert time.monotonic() < deadline, f"{names} not back to 0"
        time.sleep(0.2)


def check_burst(server, n: int, max_prompt: int, max_tokens: int) -> None:
    """n requests at once: each completes once, under the id it was sent
    with, and the server counts each as finished."""
    reqs = random_requests(n, seed=5, max_prompt=max_prompt,
                           tokens=(2, max_tokens))
    result = asyncio.run(burst(server.url, server.model, reqs))
    assert result.ok, result
    assert result.completed == n and result.server_finished == n


def check_soak(server, n: int, max_prompt: int, max_tokens: int) -> None:
    """n streams from a pool of 30 requests at concurrency 16, a third
    dropped: memory after the run within 5 % of that after the first
    fifth, every slot or block free, completed streams equal to alone."""
    pool = random_requests(30, seed=6, max_prompt=max_prompt,
                           tokens=(2, max_tokens))
    plan = soak_plan(n, pool, seed=6)
    result = asyncio.run(soak(server.url, server.model, pool, plan,
                              concurrency=16, baseline_after=n // 5,
                              rss=lambda: tree_rss(server.proc.pid)))
    assert not result.problems, result.problems
    assert result.completed + result.dropped == n
    assert result.dropped > n // 5
    assert result.end_metrics["vllm:gpu_cache_usage_perc"] == 0


def check_echo_logprobs(server, model_dir: Path) -> None:
    """The request lm-evaluation-harness's ``local-completions`` sends for
    a log-likelihood (``echo``, ``logprobs=1``, ``max_tokens=1``), through
    the openai client: the prompt comes back with a log-probability per
    token (the first None) equal to transformers', then the greedy
    token."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    prompt = [11, 42, 99, 7, 250, 31, 8]
    out = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=1, temperature=0,
        echo=True, logprobs=1,
        extra_body=dict(return_tokens_as_token_ids=True))
    lp = out.choices[0].logprobs
    ids = [int(t.split(":")[1]) for t in lp.tokens]
    hf = AutoModelForCausalLM.from_pretrained(model_dir,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(),
                                 dim=-1)
    assert ids[:-1] == prompt and ids[-1] == int(want[-1].argmax())
    assert lp.token_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] -
                   want[pos - 1, ids[pos]].item()) < 1e-3, f"position {pos}"
