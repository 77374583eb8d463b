"""Shared pieces of the offline benchmarks (offline.py, roofline.py,
warmup.py) and of the mixed workload of serving_load.py.

* the workload: prompts of exactly P tokens cut from ``data/text.txt``;
  for the server, requests of random but exact prompt lengths and
  ``max_tokens`` (``mixed_requests``);
* engine drivers with one interface, ``run(prompts) -> Run``: our Spyre
  engine stepped by hand, under static batching (``SpyreDriver``) or
  continuous batching (``SpyreCBDriver``), Hugging Face ``generate``
  (``HFDriver``) and FMS ``generate`` on a compiled FMS model
  (``FMSDriver``);
* ``Child``: one engine per process (multiprocessing 'spawn' and a Pipe),
  so that engines never share threads, compiled graphs or dynamo state;
* the zero-compilation check, medians, fixed-width tables, JSON output.

Nothing here imports torch, transformers or vLLM at module level: a child
process must be able to set its environment before vLLM is imported.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import platform
import random
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(REPO / "models" / "SmolLM2-135M-Instruct")
TEXT = Path(__file__).resolve().parent / "data" / "text.txt"
RESULTS = REPO / "benchmarks" / "results"
STRIDE = 13  # row i of a batch starts at token i * STRIDE of the text
PROMPT_LEN_MULTIPLE = 64  # Spyre warm-up prompt lengths are multiples of 64


# ---- workload --------------------------------------------------------------

def parse_ints(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8]."""
    return [int(x) for x in text.split(",") if x.strip()]


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


def text_ids(model: str) -> list[int]:
    """The benchmark text, tokenized by the model's tokenizer."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return tok(TEXT.read_text(), add_special_tokens=False)["input_ids"]


def build_prompts(ids: list[int], batch: int, prompt_len: int,
                  stride: int = STRIDE) -> list[list[int]]:
    """``batch`` prompts of exactly ``prompt_len`` token ids: row i is the
    window of ``ids`` (the tokenized text) starting at ``i * stride``."""
    need = (batch - 1) * stride + prompt_len
    if need > len(ids):
        raise ValueError(
            f"{TEXT} has {len(ids)} tokens, but {batch} prompts of "
            f"{prompt_len} tokens at stride {stride} need {need}; lower "
            "--prompt-len or the batch sizes.")
    return [ids[i * stride:i * stride + prompt_len] for i in range(batch)]


def mixed_requests(ids: list[int], n: int, prompt_lens: tuple[int, int],
                   max_tokens: tuple[int, int],
                   seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` requests ``(prompt ids, max_tokens)``: the prompt length and
    ``max_tokens`` drawn uniformly from the inclusive ranges, the prompt a
    window of exactly that many tokens of ``ids`` at a random offset; the
    same ``seed`` gives the same requests."""
    lo, hi = prompt_lens
    if not 1 <= lo <= hi <= len(ids):
        raise ValueError(
            f"prompt lengths {lo}..{hi} must satisfy 1 <= min <= max <= "
            f"{len(ids)}, the tokens of {TEXT}")
    if not 1 <= max_tokens[0] <= max_tokens[1]:
        raise ValueError(f"max_tokens {max_tokens[0]}..{max_tokens[1]} must "
                         "satisfy 1 <= min <= max")
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randint(0, len(ids) - length)
        requests.append((ids[start:start + length],
                         rng.randint(*max_tokens)))
    return requests


@dataclass(frozen=True)
class Workload:
    """What every engine runs: for each batch size B, the same B prompts,
    ``new_tokens`` greedy tokens each, EOS ignored."""

    model: str
    prompt_len: int
    new_tokens: int
    prompts: dict[int, list[list[int]]]  # batch size -> its rows

    @classmethod
    def build(cls, model: str, prompt_len: int, new_tokens: int,
              batch_sizes: Sequence[int]) -> "Workload":
        ids = text_ids(model)
        return cls(model, prompt_len, new_tokens,
                   {b: build_prompts(ids, b, prompt_len)
                    for b in batch_sizes})

    @property
    def batch_sizes(self) -> list[int]:
        return list(self.prompts)


@dataclass
class Run:
    """One timed generation of a batch."""

    # seconds until every row has its first generated token: the batch's
    # prefill (one step, except under continuous batching: one per row)
    ttft: float
    total: float  # seconds until every row has all its tokens
    ids: list[list[int]]  # generated ids, one list per row, in row order
    compiles: int = 0  # dynamo compilations during the run (must be 0)
    # rows the scheduler preempted (ours only; the work is then recomputed)
    preemptions: int = 0


@dataclass
class Timings:
    """The timed repetitions of one (engine, batch size)."""

    batch: int
    new_tokens: int
    runs: list[dict] = field(default_factory=list)  # Run fields, no ids

    def summary(self) -> dict[str, float]:
        """Medians over the repetitions of: decode tokens/s
        B*(G-1)/(total-TTFT), TTFT, total, overall tokens/s B*G/total and
        the decode step (total-TTFT)/(G-1); compilations and preemptions
        are summed."""
        b, g = self.batch, self.new_tokens

        def med(f: Callable[[dict], float]) -> float:
            return statistics.median(f(r) for r in self.runs)
        return dict(
            decode_tok_s=med(lambda r: b * (g - 1) / (r["total"] - r["ttft"])),
            ttft_s=med(lambda r: r["ttft"]),
            total_s=med(lambda r: r["total"]),
            tok_s=med(lambda r: b * g / r["total"]),
            step_s=med(lambda r: (r["total"] - r["ttft"]) / (g - 1)),
            compiles=sum(r["compiles"] for r in self.runs),
            preemptions=sum(r.get("preemptions", 0) for r in self.runs))


def compile_count() -> int:
    """Frames dynamo has compiled so far in this process."""
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values()) + sum(counters["stats"].values())


# ---- engine drivers (run inside a child process) ---------------------------

def padded_prompt_len(prompt_len: int) -> int:
    """The Spyre warm-up prompt length holding ``prompt_len`` tokens."""
    return -(-prompt_len // PROMPT_LEN_MULTIPLE) * PROMPT_LEN_MULTIPLE


def cb_max_model_len(prompt_len: int, new_tokens: int) -> int:
    """``--max-model-len`` of a continuous-batching engine for prompts of
    ``prompt_len`` tokens and ``new_tokens`` outputs: their sum, rounded up
    to whole 64-token blocks."""
    return padded_prompt_len(prompt_len + new_tokens)


def spyre_env(backend: str,
              shapes: Sequence[tuple[int, int, int]]) -> dict[str, str]:
    """Environment selecting our engine's backend and warm-up shapes,
    given as (prompt_len, new_tokens, batch_size); prompt lengths are
    rounded up to the Spyre multiple of 64."""
    def join(i: int) -> str:
        return ",".join(str(s[i]) for s in shapes)
    shapes = [(padded_prompt_len(p), g, b) for p, g, b in shapes]
    return {
        "VLLM_SPYRE_DYNAMO_BACKEND": backend,
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": join(0),
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": join(1),
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": join(2),
    }


def spyre_cb_env(backend: str) -> dict[str, str]:
    """Environment selecting continuous batching with ``backend``."""
    return {"VLLM_SPYRE_DYNAMO_BACKEND": backend, "VLLM_SPYRE_USE_CB": "1"}


class SpyreDriver:
    """Our vLLM engine (V0 ``LLMEngine``, Spyre platform), stepped by hand,
    with one warm-up shape per batch size; start-up compiles them all."""

    def __init__(self, work: Workload, backend: str) -> None:
        # Before vLLM is first imported (the platform reads it at start-up).
        os.environ.update(self.env(work, backend))
        from vllm import EngineArgs, LLMEngine
        self.work = work
        # No periodic stats logging inside timed steps (vllm.LLM's default).
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(model=work.model, disable_log_stats=True,
                       **self.engine_args(work)))
        self.next_id = 0

    @staticmethod
    def env(work: Workload, backend: str) -> dict[str, str]:
        # Static batching even if the caller's environment says otherwise.
        return dict(spyre_env(backend, [(work.prompt_len, work.new_tokens, b)
                                        for b in work.batch_sizes]),
                    VLLM_SPYRE_USE_CB="0")

    @staticmethod
    def engine_args(work: Workload) -> dict[str, Any]:
        return dict(max_num_seqs=max(work.batch_sizes))

    def run(self, prompts: list[list[int]]) -> Run:
        from vllm import SamplingParams, TokensPrompt
        ids: dict[int, list[int]] = {}
        started: set[str] = set()  # rows that have their first token
        ttft = None
        scheduler = self.engine.scheduler[0]
        preempted = scheduler.num_cumulative_preemption
        start = time.perf_counter()
        for prompt in prompts:
            self.engine.add_request(
                str(self.next_id), TokensPrompt(prompt_token_ids=prompt),
                SamplingParams(temperature=0, max_tokens=self.work.new_tokens,
                               ignore_eos=True))
            self.next_id += 1
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            started.update(o.request_id for o in outputs
                           if o.outputs and o.outputs[0].token_ids)
            if ttft is None and len(started) == len(prompts):
                ttft = time.perf_counter() - start  # the last prefill step
            for o in outputs:
                if o.finished:
                    ids[int(o.request_id)] = list(o.outputs[0].token_ids)
        total = time.perf_counter() - start
        assert ttft is not None, "some row got no token"
        return Run(ttft, total, [ids[k] for k in sorted(ids)],
                   preemptions=scheduler.num_cumulative_preemption -
                   preempted)


class SpyreCBDriver(SpyreDriver):
    """The same engine under continuous batching: a block pool instead of
    warm-up shapes, ``max_num_seqs`` the largest batch size and
    ``max_model_len`` P + G in whole blocks, so that each of a batch's
    prefills runs alone and then every decode step runs the whole batch,
    as a static shape does.  Start-up compiles the prefill-chunk graph and
    the one decode graph whatever the batch sizes."""

    @staticmethod
    def env(work: Workload, backend: str) -> dict[str, str]:
        return spyre_cb_env(backend)

    @staticmethod
    def engine_args(work: Workload) -> dict[str, Any]:
        return dict(max_num_seqs=max(work.batch_sizes),
                    max_model_len=cb_max_model_len(work.prompt_len,
                                                   work.new_tokens))


class _FirstTokenTimer:
    """A transformers streamer (duck-typed: ``generate`` only calls put and
    end) that notes when the first new token arrives; ``generate`` puts the
    prompt first, then one token per step."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: Optional[float] = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFDriver:
    """Hugging Face transformers ``generate``, greedy, sdpa attention."""

    def __init__(self, work: Workload) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        self.work = work
        self.model = AutoModelForCausalLM.from_pretrained(
            work.model, dtype=torch.float32,
            attn_implementation="sdpa").eval()
        pad = self.model.generation_config.pad_token_id
        # No EOS at all: it neither stops generation nor is suppressed.
        self.config = GenerationConfig(
            do_sample=False, max_new_tokens=work.new_tokens,
            eos_token_id=None, pad_token_id=0 if pad is None else pad)

    def run(self, prompts: list[list[int]]) -> Run:
        import torch
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        ids = torch.tensor(prompts)  # [B, P]
        # eos_token_id=None again as a keyword: generate() refills a None
        # EOS of generation_config from the model's own config.
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                  generation_config=self.config,
                                  use_model_defaults=False,
                                  eos_token_id=None, streamer=timer)
        total = time.perf_counter() - start
        assert timer.first is not None
        return Run(timer.first - start, total,
                   out[:, self.work.prompt_len:].tolist())

    def weight_bytes(self) -> int:
        return unique_parameter_bytes(self.model)


def load_fms_model(model_dir: str):
    """FMS's float32 model of a Hugging Face folder, with the config
    corrections the Spyre loader applies for its family
    (``spyre_families.fms_model_args``: FMS's own mapping loads some
    families wrong), and FMS's own layers otherwise."""
    import torch
    from fms.models import get_model
    from transformers import AutoConfig

    from vllm.model_executor.model_loader.spyre_families import (
        fms_model_args)
    args = fms_model_args(model_dir, AutoConfig.from_pretrained(model_dir))
    return get_model(**args, data_type=torch.float32, device_type="cpu")


class FMSDriver:
    """IBM FMS ``generate`` on the FMS model compiled with ``backend``."""

    def __init__(self, work: Workload, backend: str) -> None:
        import torch
        self.work = work
        # One prefill and one (dynamic-length) decode graph per batch size:
        # more than dynamo's default of 8 graphs per frame.
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, 64)
        model = load_fms_model(work.model)
        model.eval()
        model.requires_grad_(False)
        self.fms_model = model
        self.model = torch.compile(model, backend=backend)

    def run(self, prompts: list[list[int]]) -> Run:
        import torch
        from fms.utils.generation import generate, pad_input_ids
        start = time.perf_counter()
        # All rows have P tokens: no padding, only positions and the
        # causal mask.  [B, P], mask [B, P, P]
        ids, kwargs = pad_input_ids([torch.tensor(p) for p in prompts])
        kwargs["last_n_tokens"] = 1
        with torch.no_grad():
            out, times = generate(
                self.model, ids, max_seq_len=self.work.prompt_len +
                self.work.new_tokens, max_new_tokens=self.work.new_tokens,
                use_cache=True, do_sample=False, timing="per-token",
                extra_kwargs=kwargs)
        total = time.perf_counter() - start
        # times[0] is the prefill step (it excludes the few microseconds
        # of input preparation above).
        return Run(times[0], total, out[:, self.work.prompt_len:].tolist())

    def weight_bytes(self) -> int:
        return unique_parameter_bytes(self.fms_model)


def unique_parameter_bytes(model) -> int:
    """Bytes of the model's weights, each storage once (tied embeddings
    count once)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = max(seen.get(p.data_ptr(), 0),
                                 p.numel() * p.element_size())
    return sum(seen.values())


@dataclass(frozen=True)
class Engine:
    """How to build one engine of the comparison."""

    driver: Callable[..., Any]  # (Workload[, backend]) -> driver
    backend: Optional[str] = None  # torch.compile backend, if it compiles
    ours: bool = False
    # continuous batching: the static-batching engine it is compared with
    static_peer: Optional[str] = None


ENGINES: dict[str, Engine] = {
    "spyre-inductor": Engine(SpyreDriver, "inductor", ours=True),
    "spyre-eager": Engine(SpyreDriver, "eager", ours=True),
    "spyre-cb-inductor": Engine(SpyreCBDriver, "inductor", ours=True,
                                static_peer="spyre-inductor"),
    "spyre-cb-eager": Engine(SpyreCBDriver, "eager", ours=True,
                             static_peer="spyre-eager"),
    "hf": Engine(HFDriver),
    "fms": Engine(FMSDriver, "inductor"),
    "fms-eager": Engine(FMSDriver, "eager"),
}


def is_ours(engine: str) -> bool:
    return ENGINES[engine].ours


class EngineWorker:
    """The object living in an engine's child process: loads the engine,
    runs one untimed batch per batch size (compiling whatever is left to
    compile), then serves timed runs."""

    def __init__(self, engine: str, work: Workload) -> None:
        spec = ENGINES[engine]
        self.engine = engine
        self.work = work
        start = time.perf_counter()
        self.driver = (spec.driver(work) if spec.backend is None else
                       spec.driver(work, spec.backend))
        self.load_s = time.perf_counter() - start
        start = time.perf_counter()
        for batch in work.batch_sizes:
            self.driver.run(work.prompts[batch])
        self.warm_s = time.perf_counter() - start

    def info(self) -> dict[str, Any]:
        import torch
        info = dict(engine=self.engine, load_s=self.load_s,
                    warm_s=self.warm_s, threads=torch.get_num_threads())
        if hasattr(self.driver, "weight_bytes"):
            info["weight_bytes"] = self.driver.weight_bytes()
        return info

    def run(self, batch: int) -> dict[str, Any]:
        """One timed run; compilations during it are counted, not
        forgiven: the caller fails the benchmark if any happened."""
        before = compile_count()
        run = self.driver.run(self.work.prompts[batch])
        run.compiles = compile_count() - before
        return run.__dict__


# ---- child processes -------------------------------------------------------

def _serve(conn, env: dict[str, str], target: Callable, args: tuple) -> None:
    """Body of a child: environment, threads, ``target(*args)``, then
    method calls from the parent until 'stop'."""
    try:
        os.environ.update(env)
        import torch
        torch.set_num_threads(cores())  # intra-op threads = cores
        obj = target(*args)
        conn.send(("ok", obj.info()))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                return
            conn.send(("ok", getattr(obj, msg[0])(*msg[1:])))
    except Exception:  # noqa: BLE001  reported to the parent
        conn.send(("error", traceback.format_exc()))


class Child:
    """A process started with 'spawn' that builds ``target(*args)`` and
    answers method calls over a Pipe."""

    def __init__(self, name: str, target: Callable, *args,
                 env: Optional[dict[str, str]] = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, name=name,
                                args=(theirs, env or {}, target, args))
        self.proc.start()
        theirs.close()

    def result(self) -> Any:
        """The next answer; raises if the child failed or died."""
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name} exited with code "
                                   f"{self.proc.exitcode}")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.name} failed:\n{payload}")
        return payload

    def call(self, method: str, *args) -> Any:
        self.conn.send((method, *args))
        return self.result()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


def start_engines(engines: Sequence[str], work: Workload) -> dict:
    """One child per engine, started one after the other (so start-up
    compilations never compete for the cores); returns name -> (child,
    its info).  On failure every child started so far is stopped."""
    children: dict[str, tuple[Child, dict]] = {}
    try:
        for engine in engines:
            print(f"[{engine}] starting: load, compile, warm up ...",
                  flush=True)
            child = Child(engine, EngineWorker, engine, work)
            children[engine] = (child, None)
            info = child.result()
            children[engine] = (child, info)
            print(f"[{engine}] ready: load {info['load_s']:.1f} s, warm-up "
                  f"runs {info['warm_s']:.1f} s, {info['threads']} threads",
                  flush=True)
    except BaseException:
        stop_engines(children)
        raise
    return children


def stop_engines(children: dict) -> None:
    for child, _ in children.values():
        child.close()


def measure(children: dict, work: Workload, repetitions: int) -> tuple:
    """Alternated repetitions; returns (engine, B) -> Timings and
    (engine, B) -> the ids of every repetition."""
    timings, ids = {}, {}
    for rep, engine, batch in itertools.product(
            range(repetitions), children, work.batch_sizes):
        child, _ = children[engine]
        run = child.call("run", batch)
        key = (engine, batch)
        timings.setdefault(key, Timings(batch, work.new_tokens))
        timings[key].runs.append({k: v for k, v in run.items()
                                  if k != "ids"})
        ids.setdefault(key, []).append(run["ids"])
        print(f"[{engine}] rep {rep + 1}/{repetitions} B={batch}: "
              f"TTFT {run['ttft'] * 1e3:.1f} ms, total {run['total']:.3f} s"
              f", compilations {run['compiles']}" + (
                  f", preemptions {run['preemptions']}"
                  if run["preemptions"] else ""), flush=True)
    return timings, ids


# ---- reporting -------------------------------------------------------------

def leading_matches(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Fixed-width text table; the first column left-aligned, the rest
    right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def machine_info() -> dict[str, Any]:
    import torch
    return dict(cpu_count=os.cpu_count(), usable_cores=cores(),
                processor=platform.processor() or platform.machine(),
                python=platform.python_version(), torch=torch.__version__,
                intra_op_threads=cores())


def write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
