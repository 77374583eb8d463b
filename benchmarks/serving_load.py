"""Load benchmark of the OpenAI server on the Spyre backend.

Sends N streaming completion requests with a fixed concurrency and reports
requests/s, time to first token (TTFT) and inter-token latency (ITL), p50 and
p99, plus the error count.  Without --url it starts ``vllm serve`` on the
default model itself (eager backend, one shape), on loopback.

    python benchmarks/serving_load.py [--url http://127.0.0.1:8000]
        [--requests 200] [--concurrency 16] [--max-tokens 16] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass
class LoadResult:
    requests: int
    concurrency: int
    errors: int
    wall_s: float
    tokens: int
    req_per_s: float
    tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    error_samples: list[str] = field(default_factory=list)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _one(client: httpx.AsyncClient, url: str, body: dict, ttfts: list,
               itls: list, counts: list, errors: list) -> None:
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


async def run_load(base_url: str, model: str, n_requests: int = 200,
                   concurrency: int = 16, max_tokens: int = 16,
                   prompt_words: tuple[int, int] = (3, 40),
                   seed: int = 0) -> LoadResult:
    """Sends the requests; every one must stream exactly max_tokens."""
    rng = random.Random(seed)
    words = "spyre card batch token shape prompt model cache graph".split()
    bodies = [
        dict(model=model, stream=True, temperature=0, ignore_eos=True,
             max_tokens=max_tokens,
             prompt=" ".join(rng.choice(words) for _ in range(
                 rng.randint(*prompt_words)))) for _ in range(n_requests)
    ]
    ttfts: list[float] = []
    itls: list[float] = []
    counts: list[int] = []
    errors: list[str] = []
    sem = asyncio.Semaphore(concurrency)
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def bounded(body):
            async with sem:
                await _one(client, url, body, ttfts, itls, counts, errors)

        start = time.perf_counter()
        await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - start
    tokens = sum(counts)
    return LoadResult(
        requests=n_requests, concurrency=concurrency, errors=len(errors),
        wall_s=wall, tokens=tokens, req_per_s=len(counts) / wall,
        tok_per_s=tokens / wall,
        ttft_p50_ms=1e3 * _pct(ttfts, 0.5), ttft_p99_ms=1e3 * _pct(ttfts, .99),
        itl_p50_ms=1e3 * _pct(itls, 0.5), itl_p99_ms=1e3 * _pct(itls, 0.99),
        error_samples=errors[:5])


def print_table(r: LoadResult) -> None:
    print(f"\nrequests {r.requests}  concurrency {r.concurrency}  "
          f"errors {r.errors}  wall {r.wall_s:.1f} s")
    print("| requests/s | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|")
    print(f"| {r.req_per_s:.2f} | {r.tok_per_s:.1f} | {r.ttft_p50_ms:.0f} ms "
          f"| {r.ttft_p99_ms:.0f} ms | {r.itl_p50_ms:.0f} ms "
          f"| {r.itl_p99_ms:.0f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server; default: start one")
    ap.add_argument("--model", default=str(REPO / "models" /
                                           "SmolLM2-135M-Instruct"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8,
                    help="batch size of the shape of a self-started server")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()

    server = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(REPO / "tests"))
        from server import Server
        env = {
            "VLLM_SPYRE_DYNAMO_BACKEND": "eager",
            "VLLM_SPYRE_WARMUP_PROMPT_LENS": "64",
            "VLLM_SPYRE_WARMUP_NEW_TOKENS": str(args.max_tokens),
            "VLLM_SPYRE_WARMUP_BATCH_SIZES": str(args.batch_size),
        }
        print(f"starting vllm serve {args.model} (warm-up takes a while)",
              flush=True)
        server = Server(Path(args.model), env)
        server.__enter__()
        url = server.url
    try:
        served = httpx.get(url + "/v1/models", timeout=30).json()
        model = served["data"][0]["id"]
        result = asyncio.run(
            run_load(url, model, args.requests, args.concurrency,
                     args.max_tokens))
    finally:
        if server is not None:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=2))
    print_table(result)
    if result.errors:
        print("errors:", *result.error_samples, sep="\n  ")
        sys.exit(1)


if __name__ == "__main__":
    main()
