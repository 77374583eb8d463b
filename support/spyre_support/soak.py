"""The clients of the server's burst and soak (``benchmarks/serving_soak.py``
runs them at full size, the online tests in small runs): random requests
and the soak's plan, the burst and the soak themselves with their checks,
Prometheus metrics read from ``/metrics``, and a process tree's resident
memory."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

MIB = 1 << 20
# Token ids valid in every model here (the tiny test models hold 384).
LOW_ID, HIGH_ID = 3, 380


# ---- workload --------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int


def random_requests(n: int, seed: int, max_prompt: int,
                    tokens: tuple[int, int]) -> list[Request]:
    rng = random.Random(seed)
    return [Request(tuple(rng.randint(LOW_ID, HIGH_ID)
                          for _ in range(rng.randint(1, max_prompt))),
                    rng.randint(*tokens)) for _ in range(n)]


def soak_plan(n: int, pool: list[Request], seed: int,
              drop_share: float = 1 / 3) -> list[tuple[int, Optional[int]]]:
    """(index into ``pool``, token after which the client drops the stream
    or None) for each of ``n`` requests."""
    rng = random.Random(seed + 1)
    plan = []
    for _ in range(n):
        i = rng.randrange(len(pool))
        m = pool[i].max_tokens
        drop = (rng.randint(1, m - 1)
                if m > 1 and rng.random() < drop_share else None)
        plan.append((i, drop))
    return plan


def body(model: str, req: Request, **extra) -> dict:
    return dict(model=model, prompt=list(req.prompt),
                max_tokens=req.max_tokens, temperature=0, ignore_eos=True,
                logprobs=0, return_tokens_as_token_ids=True, **extra)


def token_ids(logprobs: Optional[dict]) -> list[int]:
    """Token ids of a completion asked with return_tokens_as_token_ids."""
    return [int(t.split(":")[1]) for t in (logprobs or {}).get("tokens", [])]


# ---- server-side figures ---------------------------------------------------

def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (through ``requests``: a
    new httpx client per call is too slow for polling loops)."""
    import requests
    return metric_in(requests.get(url + "/metrics", timeout=10).text, name)


def metric_in(text: str, name: str) -> float:
    """The sum of metric ``name``'s samples in one scrape's ``text``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


IDLE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:gpu_cache_usage_perc")


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    """Polls until no request runs or waits and no KV slot or block is in
    use; returns those metrics as last seen."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {name: metric(url, name) for name in IDLE_METRICS}
        if not any(seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    import psutil
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


# ---- burst -----------------------------------------------------------------

@dataclass
class BurstResult:
    requests: int
    completed: int
    http_errors: int  # explicit error answers
    lost: int  # no answer, a transport error, or a wrong token count
    duplicated_or_crossed: int  # an id answered twice or not as sent
    server_finished: int  # growth of vllm:request_success_total
    wall_s: float
    error_samples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.duplicated_or_crossed == 0
                and self.completed + self.http_errors == self.requests
                and self.server_finished == self.completed)


async def burst(url: str, model: str, reqs: list[Request],
                tag: str = "burst") -> BurstResult:
    """Sends every request at once; counts each answer by its id."""
    before = metric(url, "vllm:request_success_total")
    answers: dict[str, list[str]] = {}
    samples: list[str] = []
    counts = dict(completed=0, http_errors=0, lost=0)
    limits = httpx.Limits(max_connections=len(reqs))
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:

        async def one(i: int, req: Request) -> None:
            rid = f"{tag}-{i}"
            try:
                resp = await client.post(url + "/v1/completions",
                                         json=body(model, req,
                                                   request_id=rid))
            except httpx.HTTPError as exc:
                counts["lost"] += 1
                samples.append(f"{rid}: {type(exc).__name__}: {exc}")
                return
            data = resp.json()
            if resp.status_code != 200:
                counts["http_errors"] += 1
                samples.append(f"{rid}: HTTP {resp.status_code} "
                               f"{str(data)[:200]}")
                return
            answers.setdefault(data["id"], []).append(rid)
            got = len(token_ids(data["choices"][0]["logprobs"]))
            if got != req.max_tokens:
                counts["lost"] += 1
                samples.append(f"{rid}: {got} of {req.max_tokens} tokens")
                return
            counts["completed"] += 1

        start = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        wall = time.perf_counter() - start
    wrong = sum(len(rids) != 1 or answer != f"cmpl-{rids[0]}"
                for answer, rids in answers.items())
    wait_idle(url)
    finished = metric(url, "vllm:request_success_total") - before
    return BurstResult(requests=len(reqs), duplicated_or_crossed=wrong,
                       server_finished=int(finished), wall_s=wall,
                       error_samples=samples[:5], **counts)


# ---- soak ------------------------------------------------------------------

@dataclass
class SoakResult:
    requests: int
    completed: int
    dropped: int
    errors: int
    mismatched: int  # completed streams whose tokens differ from alone
    rss_baseline_mib: Optional[float]
    rss_end_mib: Optional[float]
    rss_ratio: Optional[float]
    end_metrics: dict[str, float]
    wall_s: float
    error_samples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.errors == 0 and self.mismatched == 0
                and not any(self.end_metrics.values())
                and (self.rss_ratio is None
                     or abs(self.rss_ratio - 1) <= 0.05))


async def alone(url: str, model: str, pool: list[Request]) -> list[list[int]]:
    """Each request run by itself: the greedy reference."""
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for req in pool:
            resp = await client.post(url + "/v1/completions",
                                     json=body(model, req))
            resp.raise_for_status()
            out.append(token_ids(resp.json()["choices"][0]["logprobs"]))
    return out


async def _stream(client, url: str, payload: dict,
                  drop: Optional[int]) -> list[int]:
    ids: list[int] = []
    async with client.stream("POST", url + "/v1/completions",
                             json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: "
                               f"{(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:200])
            for choice in chunk.get("choices", ()):
                ids += token_ids(choice.get("logprobs"))
            if drop is not None and len(ids) >= drop:
                break  # leaving the block drops the connection
    return ids


async def soak(url: str, model: str, pool: list[Request],
               plan: list[tuple[int, Optional[int]]], concurrency: int,
               baseline_after: int,
               rss: Optional[Callable[[], int]] = None) -> SoakResult:
    reference = await alone(url, model, pool)
    counts = dict(completed=0, dropped=0, errors=0, mismatched=0, done=0)
    samples: list[str] = []
    baseline: list[int] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(i: int, drop: Optional[int]) -> None:
            async with sem:
                try:
                    ids = await _stream(client, url,
                                        body(model, pool[i], stream=True),
                                        drop)
                except (httpx.HTTPError, RuntimeError) as exc:
                    counts["errors"] += 1
                    samples.append(f"{type(exc).__name__}: {exc}")
                    ids = None
            if ids is not None and drop is not None:
                counts["dropped"] += 1
                if ids[:drop] != reference[i][:drop]:
                    counts["mismatched"] += 1
            elif ids is not None:
                counts["completed"] += 1
                if ids != reference[i]:
                    counts["mismatched"] += 1
                    samples.append(f"request {i}: {ids} != {reference[i]}")
            counts["done"] += 1
            if counts["done"] == baseline_after and rss is not None:
                baseline.append(rss())

        start = time.perf_counter()
        await asyncio.gather(*(one(i, d) for i, d in plan))
        wall = time.perf_counter() - start
    end_metrics = wait_idle(url)
    base = baseline[0] / MIB if baseline else None
    end = rss() / MIB if rss is not None else None
    counts.pop("done")
    return SoakResult(
        requests=len(plan), rss_baseline_mib=base, rss_end_mib=end,
        rss_ratio=end / base if base else None, end_metrics=end_metrics,
        wall_s=wall, error_samples=samples[:5], **counts)
