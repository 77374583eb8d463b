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
    #: More fields of the request's body, as JSON (``feature_soak``).
    extra: str = ""

    @property
    def fields(self) -> dict:
        return json.loads(self.extra) if self.extra else {}

    @property
    def streams(self) -> bool:
        """Whether the soak streams it (vLLM returns prompt
        log-probabilities only in a whole answer)."""
        return "prompt_logprobs" not in self.fields


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
    return {**dict(model=model, prompt=list(req.prompt),
                   max_tokens=req.max_tokens, temperature=0, ignore_eos=True,
                   logprobs=0, return_tokens_as_token_ids=True),
            **req.fields, **extra}


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


def tree_size(pid: int) -> int:
    """How many processes a process and its descendants are."""
    import psutil
    return 1 + len(psutil.Process(pid).children(recursive=True))


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
    #: How far from 1 ``rss_ratio`` may be.
    rss_within: float = 0.05
    #: The server's processes after the baseline requests and at the end
    #: (a process left behind, such as a grammar's compiler, shows here).
    processes_baseline: Optional[int] = None
    processes_end: Optional[int] = None

    @property
    def problems(self) -> list[str]:
        """Each check the run failed, with its figures (a failing test's
        message: the dataclass's repr is cut short)."""
        found = []
        if self.errors:
            found.append(f"{self.errors} request(s) failed: "
                         + " | ".join(self.error_samples))
        if self.mismatched:
            found.append(f"{self.mismatched} answer(s) differ from the "
                         "request run alone")
        busy = {name: v for name, v in self.end_metrics.items() if v}
        if busy:
            found.append(f"not idle at the end: {busy}")
        if (self.rss_ratio is not None
                and abs(self.rss_ratio - 1) > self.rss_within):
            found.append(
                f"resident memory {self.rss_baseline_mib:.0f} -> "
                f"{self.rss_end_mib:.0f} MiB (x{self.rss_ratio:.3f}, "
                f"within {self.rss_within:g} allowed)")
        if self.processes_end != self.processes_baseline:
            found.append(f"processes {self.processes_baseline} -> "
                         f"{self.processes_end}")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Answer:
    """Token ids per choice, and the prompt's log-probabilities if asked
    for (``{token id: logprob}`` per prompt position)."""
    choices: dict[int, list[int]]
    prompt_logprobs: Optional[list] = None

    def matches(self, ref: "Answer", complete: bool) -> bool:
        """Equal to ``ref`` (``complete``), or each choice a prefix of
        ref's (a dropped stream); prompt log-probabilities equal within
        1e-4 (another batch may sum in another order)."""
        # A dropped stream may not have reached every choice.
        if (set(self.choices) != set(ref.choices) if complete else
                not set(self.choices) <= set(ref.choices)):
            return False
        for i, ids in self.choices.items():
            if (ids != ref.choices[i] if complete else
                    ids != ref.choices[i][:len(ids)]):
                return False
        if (self.prompt_logprobs is None) != (ref.prompt_logprobs is None):
            return False
        for got, want in zip(self.prompt_logprobs or (),
                             ref.prompt_logprobs or ()):
            if (got is None) != (want is None):
                return False
            if got is not None and (set(got) != set(want) or any(
                    abs(got[t] - want[t]) > 1e-4 for t in got)):
                return False
        return len(self.prompt_logprobs or ()) == len(
            ref.prompt_logprobs or ())


def _whole(data: dict) -> Answer:
    choices = {c["index"]: token_ids(c["logprobs"]) for c in data["choices"]}
    plp = data["choices"][0].get("prompt_logprobs")
    if plp is not None:
        plp = [None if p is None else
               {int(t): v["logprob"] for t, v in p.items()} for p in plp]
    return Answer(choices, plp)


async def alone(url: str, model: str, pool: list[Request]) -> list[Answer]:
    """Each request run by itself: the greedy reference."""
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for req in pool:
            resp = await client.post(url + "/v1/completions",
                                     json=body(model, req))
            if resp.status_code != 200:
                raise RuntimeError(f"alone: HTTP {resp.status_code}: "
                                   f"{resp.text[:300]}")
            out.append(_whole(resp.json()))
    return out


async def _stream(client, url: str, payload: dict,
                  drop: Optional[int]) -> Answer:
    ids: dict[int, list[int]] = {}
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
                ids.setdefault(choice["index"], []).extend(
                    token_ids(choice.get("logprobs")))
            if drop is not None and len(ids.get(0, ())) >= drop:
                break  # leaving the block drops the connection
    return Answer(ids)


async def _ask(client, url: str, model: str, req: Request,
               drop: Optional[int]) -> Answer:
    if req.streams:
        return await _stream(client, url, body(model, req, stream=True),
                             drop)
    resp = await client.post(url + "/v1/completions", json=body(model, req))
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return _whole(resp.json())


async def soak(url: str, model: str, pool: list[Request],
               plan: list[tuple[int, Optional[int]]], concurrency: int,
               baseline_after: int,
               rss: Optional[Callable[[], int]] = None,
               processes: Optional[Callable[[], int]] = None,
               rss_within: float = 0.05) -> SoakResult:
    """The plan's requests at ``concurrency``, each compared with the
    request run alone; a request that does not stream (``Request.streams``)
    is never dropped."""
    reference = await alone(url, model, pool)
    counts = dict(completed=0, dropped=0, errors=0, mismatched=0, done=0)
    samples: list[str] = []
    baseline: list[int] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(i: int, drop: Optional[int]) -> None:
            if not pool[i].streams:
                drop = None
            async with sem:
                try:
                    got = await _ask(client, url, model, pool[i], drop)
                except (httpx.HTTPError, RuntimeError) as exc:
                    counts["errors"] += 1
                    samples.append(f"request {i}: {type(exc).__name__}: "
                                   f"{exc}")
                    got = None
            if got is not None:
                counts["dropped" if drop is not None else "completed"] += 1
                if not got.matches(reference[i], complete=drop is None):
                    counts["mismatched"] += 1
                    samples.append(f"request {i}: {got} != {reference[i]}")
            counts["done"] += 1
            if counts["done"] == baseline_after:
                baseline.append((rss() if rss is not None else None,
                                 processes() if processes else None))

        start = time.perf_counter()
        await asyncio.gather(*(one(i, d) for i, d in plan))
        wall = time.perf_counter() - start
    end_metrics = wait_idle(url)
    base_rss, base_procs = baseline[0] if baseline else (None, None)
    base = base_rss / MIB if base_rss else None
    end = rss() / MIB if rss is not None else None
    counts.pop("done")
    return SoakResult(
        requests=len(plan), rss_baseline_mib=base, rss_end_mib=end,
        rss_ratio=end / base if base else None, end_metrics=end_metrics,
        wall_s=wall, error_samples=samples[:5], rss_within=rss_within,
        processes_baseline=base_procs,
        processes_end=processes() if processes else None, **counts)
