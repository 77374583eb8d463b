"""Shared pieces of the benchmarks (``benchmarks/``): of the offline ones
(offline.py, roofline.py, warmup.py), of the mixed workload of
serving_load.py, and the command line and kernel check the single-engine
and kernel benchmarks share.

* the workload: prompts of exactly P tokens cut from ``data/text.txt``;
  for the server, requests of random but exact prompt lengths and
  ``max_tokens`` (``mixed_requests``);
* our engine's settings are ``spyre_support.envs``'s; the engine drivers
  are ``benchmarks/_engines.py``;
* ``Child``: one engine per process (multiprocessing 'spawn' and a Pipe),
  so that engines never share threads, compiled graphs or dynamo state;
* the zero-compilation check, medians, fixed-width tables, JSON output;
* the command line's common options (``benchmark_parser``,
  ``add_shape_options``, ``add_json_option``) and the check that the C++
  kernels are there (``native_kernels_available``).

Nothing here imports torch, transformers or vLLM at module level: a child
process must be able to set its environment before vLLM is imported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from spyre_support import preloaded
from spyre_support.paths import REPO, SMOLLM2_DIR

DEFAULT_MODEL = str(SMOLLM2_DIR)
TEXT = REPO / "benchmarks" / "data" / "text.txt"
RESULTS = REPO / "benchmarks" / "results"
STRIDE = 13  # row i of a batch starts at token i * STRIDE of the text


# ---- command line ----------------------------------------------------------

def benchmark_parser(doc: str, model: str = DEFAULT_MODEL,
                     backend: bool = False) -> argparse.ArgumentParser:
    """An argument parser described by the first line of ``doc`` (the
    benchmark's module docstring), with ``--model`` (default ``model``)
    and, if ``backend``, ``--backend`` (inductor or eager, default
    inductor)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=model)
    if backend:
        ap.add_argument("--backend", default="inductor",
                        choices=["inductor", "eager"])
    return ap


def add_shape_options(ap: argparse.ArgumentParser) -> None:
    """Adds ``--prompt-len`` and ``--new-tokens``, 64 tokens each."""
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)


def add_json_option(ap: argparse.ArgumentParser, name: str) -> None:
    """Adds ``--json``, the result file, by default ``name`` in
    benchmarks/results/."""
    ap.add_argument("--json", default=str(RESULTS / name))


def native_kernels_available() -> bool:
    """Whether the C++ kernels (``spyre_kernels``) are built; if not, prints
    that a benchmark comparing them has nothing to compare."""
    from vllm.spyre_kernels import ops as native
    if not native.available():
        print("the C++ kernels could not be built; nothing to compare")
        return False
    return True


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


def repeated_spans(vocab: int, plan, seed: int = 11
                   ) -> list[tuple[list[int], int]]:
    """Requests ``(prompt ids, max_tokens)`` whose prompts repeat a span,
    what n-gram speculation finds to propose: for each ``(span length,
    repeats, tail length, max_tokens)`` of ``plan``, a random span of ids
    (4 to ``vocab - 1``) ``repeats`` times, then ``tail`` random ids."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for span, repeats, tail, max_tokens in plan:
        ids = torch.randint(4, vocab, (span, ), generator=gen).tolist()
        rest = torch.randint(4, vocab, (tail, ), generator=gen).tolist()
        reqs.append((ids * repeats + rest, max_tokens))
    return reqs


@dataclass(frozen=True)
class Workload:
    """What every engine runs: for each batch size B, the same B prompts,
    ``new_tokens`` greedy tokens each, EOS ignored."""

    model: str
    prompt_len: int
    new_tokens: int
    prompts: dict[int, list[list[int]]]  # batch size -> its rows
    # The x86 target our engines' kernels are built for (None: this CPU;
    # ``x86-64-v3``: what an AVX2-only CPU runs; ``ops.load_for``).
    kernel_target: Optional[str] = None

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


def compiled_in_timed_runs(compiled: int) -> bool:
    """Says so, and returns True, if anything compiled during the timed
    runs (none is expected after warm-up)."""
    if compiled:
        print(f"FAILED: {compiled} compilation(s) during timed runs")
    return bool(compiled)


# ---- child processes -------------------------------------------------------

def _serve(conn, env: dict[str, str], target: Callable, args: tuple) -> None:
    """Body of a child: the parent's environment with the child's own,
    threads, ``target(*args)``, then method calls from the parent until
    'stop'."""
    try:
        os.environ.clear()
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
    """A process that builds ``target(*args)`` and answers method calls
    over a Pipe: a fork of the preloaded server (``spyre_support.preloaded``:
    torch, transformers and vLLM imported once for all the children of a
    benchmark), under ``env`` on top of the benchmark's own environment."""

    def __init__(self, name: str, target: Callable, *args,
                 env: Optional[dict[str, str]] = None) -> None:
        ctx = preloaded.context()
        self.name = name
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, name=name,
            args=(theirs, dict(os.environ, **(env or {})), target, args))
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


#: The CPU flags that choose the kernels' paths (vllm/spyre_kernels/ops.py).
KERNEL_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_summary() -> str:
    """The CPU's model name, the usable cores, which of ``KERNEL_FLAGS``
    it has (read by the kernels' own ``cpu_has``) and the machine's
    memory: what a time or a speed measured on this machine depends on."""
    from vllm.spyre_kernels.ops import cpu_has
    name, mem_kib = platform.machine(), 0
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.partition(":")[2].strip() for line in f
                         if line.startswith("model name")), name)
        with open("/proc/meminfo") as f:
            mem_kib = int(next(line for line in f
                               if line.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    have = [flag for flag in KERNEL_FLAGS if cpu_has(flag)] or ["none"]
    return (f"{name}, {cores()} usable cores, {mem_kib / 2**20:.1f} GiB, "
            f"flags {' '.join(have)}")


def machine_info() -> dict[str, Any]:
    import torch
    return dict(cpu_count=os.cpu_count(), usable_cores=cores(),
                processor=platform.processor() or platform.machine(),
                cpu=cpu_summary(),
                python=platform.python_version(), torch=torch.__version__,
                intra_op_threads=cores())


def write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
