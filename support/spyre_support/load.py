"""The serving load's client: completion requests streamed at a bounded
concurrency against a running server, each checked to stream exactly its
``max_tokens``; TTFT and inter-token latency percentiles, throughput.
``benchmarks/serving_load.py`` runs it at size (and compares modes), the
robustness tests in a small run."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class LoadResult:
    requests: int
    concurrency: int
    errors: int
    wall_s: float
    tokens: int  # output tokens
    req_per_s: float
    tok_per_s: float  # output tokens/s
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def timed_stream(client: httpx.AsyncClient, url: str, body: dict,
                       times: list[float],
                       started: "asyncio.Event | None" = None) -> str:
    """Streams one completion (``body`` posted to ``url``), appending each
    token's arrival time (``time.monotonic``) to ``times`` as it comes;
    sets ``started``, if given, at the first.  Its text."""
    text = ""
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices:
                text += choices[0]["text"]
                times.append(time.monotonic())
                if started is not None:
                    started.set()
    return text


async def stream_one(client: httpx.AsyncClient, url: str, body: dict,
                     ttfts: list, itls: list, counts: list,
                     errors: list) -> None:
    """Streams one completion; appends its first-token and inter-token
    times, its token count, or an error."""
    start = time.perf_counter()
    last = None
    n = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                errors.append(f"HTTP {resp.status_code}: "
                              f"{(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    ttfts.append(now - start)
                else:
                    itls.append(now - last)
                last = now
                n += 1
    except httpx.HTTPError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        return
    if n != body["max_tokens"]:
        errors.append(f"got {n} tokens, asked for {body['max_tokens']}")
    counts.append(n)


async def send(base_url: str, bodies: list[dict],
               concurrency: int) -> LoadResult:
    """Streams every completion request, at most ``concurrency`` at once;
    every one must stream exactly its max_tokens."""
    ttfts: list[float] = []
    itls: list[float] = []
    counts: list[int] = []
    errors: list[str] = []
    sem = asyncio.Semaphore(concurrency)
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def bounded(body):
            async with sem:
                await stream_one(client, url, body, ttfts, itls, counts,
                                 errors)

        start = time.perf_counter()
        await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - start
    tokens = sum(counts)
    return LoadResult(
        requests=len(bodies), concurrency=concurrency, errors=len(errors),
        wall_s=wall, tokens=tokens, req_per_s=len(counts) / wall,
        tok_per_s=tokens / wall,
        ttft_p50_ms=1e3 * percentile(ttfts, 0.5), ttft_p99_ms=1e3 * percentile(ttfts, .99),
        itl_p50_ms=1e3 * percentile(itls, 0.5), itl_p99_ms=1e3 * percentile(itls, 0.99),
        error_samples=errors[:5])


def completion_body(model: str, prompt, max_tokens: int) -> dict:
    return dict(model=model, stream=True, temperature=0, ignore_eos=True,
                max_tokens=max_tokens, prompt=prompt)


def default_bodies(model: str, n_requests: int, max_tokens: int,
                   prompt_words: tuple[int, int] = (3, 40),
                   seed: int = 0) -> list[dict]:
    """The default workload: prompts of 3 to 40 random words."""
    rng = random.Random(seed)
    words = "spyre card batch token shape prompt model cache graph".split()
    return [completion_body(model, " ".join(rng.choice(words) for _ in range(
        rng.randint(*prompt_words))), max_tokens) for _ in range(n_requests)]


async def run_load(base_url: str, model: str, n_requests: int = 200,
                   concurrency: int = 16, max_tokens: int = 16,
                   prompt_words: tuple[int, int] = (3, 40),
                   seed: int = 0) -> LoadResult:
    """The default workload against a running server."""
    return await send(base_url, default_bodies(
        model, n_requests, max_tokens, prompt_words, seed), concurrency)
