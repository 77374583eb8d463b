"""The engines the offline benchmarks compare (offline.py, roofline.py),
each with one interface, ``run(prompts) -> Run``: our Spyre engine stepped
by hand, under static batching (``SpyreDriver``) or continuous batching
(``SpyreCBDriver``), Hugging Face ``generate`` (``HFDriver``) and FMS
``generate`` on a compiled FMS model (``FMSDriver``), llama.cpp at five
precisions (``_peers.LlamaCppDriver``), and ours on the default model
quantized by ``scripts/quantize.py`` (``QUANT_FORMATS``, ``quantized_model``);
``ENGINES`` names them.
``start_engines`` starts one per child process (``spyre_support.bench.Child``),
``measure`` alternates their timed runs.

Nothing here imports torch, transformers or vLLM at module level: a child
process must be able to set its environment before vLLM is imported.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from spyre_support.bench import Child, Run, Timings, Workload
from spyre_support.engines import compile_count
from spyre_support.envs import TORCH_OPS, cb_env, cb_max_model_len, warmup_env
from spyre_support.paths import REPO
from _peers import LlamaCppDriver


class SpyreDriver:
    """Our vLLM engine (V0 ``LLMEngine``, Spyre platform), stepped by hand,
    with one warm-up shape per batch size; start-up compiles them all."""

    def __init__(self, work: Workload, backend: str,
                 dtype: str = "float32", model_impl: str = "auto") -> None:
        # Before vLLM is first imported (the platform reads it at start-up).
        os.environ.update(self.env(work, backend))
        from vllm import EngineArgs, LLMEngine
        self.work = work
        # No periodic stats logging inside timed steps (vllm.LLM's default).
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(model=work.model, disable_log_stats=True, dtype=dtype,
                       model_impl=model_impl, **self.engine_args(work)))
        self.next_id = 0

    @staticmethod
    def env(work: Workload, backend: str) -> dict[str, str]:
        # Static batching even if the caller's environment says otherwise.
        return dict(warmup_env(backend, [(work.prompt_len, work.new_tokens, b)
                                        for b in work.batch_sizes]),
                    VLLM_SPYRE_USE_CB="0")

    @staticmethod
    def engine_args(work: Workload) -> dict[str, Any]:
        return dict(max_num_seqs=max(work.batch_sizes))

    def weight_bytes(self) -> int:
        """What this rank's model holds in parameters and buffers (packed
        and quantized weights, norms, embeddings; not the KV cache)."""
        worker = self.engine.model_executor.driver_worker.worker
        return unique_parameter_bytes(worker.model_runner.model,
                                      buffers=True)

    def step_bytes(self) -> int:
        """The bytes a batch-1 decode step reads: the weights held
        (``weight_bytes``) less the token embeddings, of which a step reads
        one row per token."""
        worker = self.engine.model_executor.driver_worker.worker
        return decode_read_bytes(worker.model_runner.model)

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
        return cb_env(backend)

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
    """Hugging Face transformers ``generate``, greedy, sdpa attention (eager
    for a model transformers runs without it: GPT-OSS's sinks)."""

    def __init__(self, work: Workload, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        self.work = work
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                work.model, dtype=getattr(torch, dtype),
                attn_implementation="sdpa").eval()
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
            self.model = AutoModelForCausalLM.from_pretrained(
                work.model, dtype=getattr(torch, dtype),
                attn_implementation="eager").eval()
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

    from vllm.model_executor.models.spyre_families import fms_model_args
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


def unique_parameter_bytes(model, buffers: bool = False) -> int:
    """Bytes of the model's weights, each storage once (tied embeddings
    count once); with ``buffers``, its buffers too (our packed and
    quantized weights are buffers)."""
    import itertools
    seen: dict[int, int] = {}
    tensors = itertools.chain(model.parameters(),
                              model.buffers() if buffers else ())
    for p in tensors:
        seen[p.data_ptr()] = max(seen.get(p.data_ptr(), 0),
                                 p.numel() * p.element_size())
    return sum(seen.values())


def decode_read_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage once,
    that a batch-1 decode step reads: not the tables of its embedding
    modules (unless a head shares one)."""
    embedding, other = {}, {}
    for module in model.modules():
        is_embedding = "Embedding" in type(module).__name__
        tensors = list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False))
        for _, t in tensors:
            size = t.numel() * t.element_size()
            into = embedding if is_embedding else other
            into[t.data_ptr()] = max(into.get(t.data_ptr(), 0), size)
    return sum(other.values())


class SpyreGraphCacheDriver(SpyreDriver):
    """Our engine with the graph cache on (``TORCH_SENDNN_CACHE_ENABLE=1``,
    a fresh directory): graphs precompiled, weights not frozen into them;
    to compare its steps with the default engine's."""

    @staticmethod
    def env(work: Workload, backend: str) -> dict[str, str]:
        import tempfile
        return dict(SpyreDriver.env(work, backend),
                    TORCH_SENDNN_CACHE_ENABLE="1",
                    TORCH_SENDNN_CACHE_DIR=tempfile.mkdtemp(
                        prefix="bench-graph-cache-"))


@dataclass(frozen=True)
class Engine:
    """How to build one engine of the comparison."""

    driver: Callable[..., Any]  # (Workload[, backend]) -> driver
    backend: Optional[str] = None  # torch.compile backend, if it compiles
    ours: bool = False
    # continuous batching: the static-batching engine it is compared with
    static_peer: Optional[str] = None
    # the weights' precision: ours/peer ratios compare equal precisions
    precision: str = "fp32"
    # vLLM's model code (--model-impl vllm): the FMS engine it is compared
    # with
    fms_peer: Optional[str] = None
    # a quantized checkpoint: ours on the unquantized model it is compared
    # with
    unquantized_peer: Optional[str] = None


ENGINES: dict[str, Engine] = {
    "spyre-inductor": Engine(SpyreDriver, "inductor", ours=True),
    "spyre-eager": Engine(SpyreDriver, "eager", ours=True),
    "spyre-eager-torch-ops": Engine(SpyreDriver, TORCH_OPS, ours=True),
    "spyre-inductor-graph-cache": Engine(SpyreGraphCacheDriver, "inductor",
                                         ours=True),
    "spyre-cb-inductor": Engine(SpyreCBDriver, "inductor", ours=True,
                                static_peer="spyre-inductor"),
    "spyre-cb-eager": Engine(SpyreCBDriver, "eager", ours=True,
                             static_peer="spyre-eager"),
    "spyre-cb-eager-torch-ops": Engine(SpyreCBDriver, TORCH_OPS, ours=True,
                                       static_peer="spyre-eager-torch-ops"),
    "hf": Engine(HFDriver),
    "fms": Engine(FMSDriver, "inductor"),
    "fms-eager": Engine(FMSDriver, "eager"),
    "llamacpp-f32": Engine(partial(LlamaCppDriver, precision="f32")),
    "llamacpp-bf16": Engine(partial(LlamaCppDriver, precision="bf16"),
                            precision="bf16"),
    "llamacpp-q8_0": Engine(partial(LlamaCppDriver, precision="q8_0"),
                            precision="8-bit"),
    "llamacpp-q4_0": Engine(partial(LlamaCppDriver, precision="q4_0"),
                            precision="4-bit"),
    "llamacpp-q4_1": Engine(partial(LlamaCppDriver, precision="q4_1"),
                            precision="4-bit"),
    "spyre-inductor-bf16": Engine(partial(SpyreDriver, dtype="bfloat16"),
                                  "inductor", ours=True, precision="bf16"),
    "spyre-cb-inductor-bf16": Engine(
        partial(SpyreCBDriver, dtype="bfloat16"), "inductor", ours=True,
        static_peer="spyre-inductor-bf16", precision="bf16"),
    "spyre-eager-bf16": Engine(partial(SpyreDriver, dtype="bfloat16"),
                               "eager", ours=True, precision="bf16"),
    "spyre-cb-eager-bf16": Engine(
        partial(SpyreCBDriver, dtype="bfloat16"), "eager", ours=True,
        static_peer="spyre-eager-bf16", precision="bf16"),
    "hf-bf16": Engine(partial(HFDriver, dtype="bfloat16"), precision="bf16"),
}


def _with_vllm_model_code(engines: dict[str, Engine]) -> dict[str, Engine]:
    """Each of our engines, and its twin on vLLM's model code (name
    suffix ``-vllm``, ``--model-impl vllm``)."""
    out = dict(engines)
    for name, spec in engines.items():
        if not spec.ours or name.endswith("graph-cache"):
            continue
        base = getattr(spec.driver, "func", spec.driver)
        kwargs = dict(getattr(spec.driver, "keywords", {}))
        out[f"{name}-vllm"] = Engine(
            partial(base, **kwargs, model_impl="vllm"), spec.backend,
            ours=True, precision=spec.precision, fms_peer=name,
            static_peer=spec.static_peer and f"{spec.static_peer}-vllm")
    return out


ENGINES = _with_vllm_model_code(ENGINES)

#: Quantized formats of scripts/quantize.py -> the bits the ratio columns
#: compare at (llama.cpp's Q8_0 against the 8-bit ones, Q4_0 and Q4_1
#: against the 4-bit ones).
QUANT_FORMATS = {"gptq-int8": "8-bit", "fp8": "8-bit", "fp8-dynamic": "8-bit",
                 "w8a16": "8-bit", "gptq-int4": "4-bit", "w4a16": "4-bit"}


#: Group sizes other than scripts/quantize.py's defaults (GPTQ 128, with a
#: shorter last group where the features are not a multiple, as GPTQ's
#: tools write them): compressed-tensors 0.10.2 writes whole groups only,
#: and 64 divides SmolLM2's 576 features.
QUANT_GROUP_SIZES = {"w4a16": 64}


def quantized_model(model: str, fmt: str, head: bool = True,
                    root: str | None = None) -> str:
    """``model`` quantized to ``fmt`` by ``scripts/quantize.py``, written on
    first use under ``root`` (default: the git-ignored ``.quantized/``
    folder, kept for the next run); ``head``: the output head quantized
    too (as llama.cpp's GGUFs quantize theirs), else left float (the
    tools' default)."""
    name = f"{os.path.basename(model)}-{fmt}" + ("" if head else "-float-head")
    # scripts/benchmark_checkpoints.py writes <shape>-<fmt> beside
    # <shape>-bf16, the head quantized.
    written = Path(model).with_name(
        os.path.basename(model).removesuffix("-bf16") + f"-{fmt}")
    if head and model.endswith("-bf16") and (written /
                                             "config.json").exists():
        return str(written)
    out = Path(root or REPO / ".quantized") / name
    if not (out / "config.json").exists():
        from spyre_support.tiny_quantized import CALIBRATION
        from vllm.model_executor.layers.quantization.spyre_quant_writer \
            import quantize
        print(f"quantizing {model} to {fmt} in {out} ...", flush=True)
        quantize(model, out, fmt, lm_head=head,
                 group_size=QUANT_GROUP_SIZES.get(fmt),
                 calibration=str(CALIBRATION))
    return str(out)


def _quantized(driver, fmt: str):
    """A driver of ours on the ``fmt`` checkpoint of the workload's model,
    served in bfloat16 (its unquantized tensors and KV cache as our bf16
    engines hold them)."""
    def make(work: Workload, backend: str):
        work = dataclasses.replace(work,
                                   model=quantized_model(work.model, fmt))
        return driver(work, backend, dtype="bfloat16")
    make.base = driver
    return make


def _with_quantized(engines: dict[str, Engine]) -> dict[str, Engine]:
    """``spyre-<backend>-<fmt>`` and ``spyre-cb-<backend>-<fmt>`` for every
    format of ``QUANT_FORMATS``, on ``inductor`` and ``eager``."""
    out = dict(engines)
    for fmt, bits in QUANT_FORMATS.items():
        for backend in ("inductor", "eager"):
            out[f"spyre-{backend}-{fmt}"] = Engine(
                _quantized(SpyreDriver, fmt), backend, ours=True,
                precision=bits, unquantized_peer=f"spyre-{backend}-bf16")
            out[f"spyre-cb-{backend}-{fmt}"] = Engine(
                _quantized(SpyreCBDriver, fmt), backend, ours=True,
                precision=bits, unquantized_peer=f"spyre-cb-{backend}-bf16",
                static_peer=f"spyre-{backend}-{fmt}")
    return out


ENGINES = _with_quantized(ENGINES)


def is_ours(engine: str) -> bool:
    return ENGINES[engine].ours


def is_cb(engine: str) -> bool:
    """Whether the engine is ours under continuous batching."""
    driver = ENGINES[engine].driver
    base = getattr(driver, "base", None) or getattr(driver, "func", driver)
    return isinstance(base, type) and issubclass(base, SpyreCBDriver)


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
        if hasattr(self.driver, "step_bytes"):
            info["step_bytes"] = self.driver.step_bytes()
        info["rss_bytes"] = resident_bytes()
        return info

    def run(self, batch: int) -> dict[str, Any]:
        """One timed run; compilations during it are counted, not
        forgiven: the caller fails the benchmark if any happened."""
        before = compile_count()
        run = self.driver.run(self.work.prompts[batch])
        run.compiles = compile_count() - before
        return run.__dict__


def resident_bytes() -> int:
    """This process's resident memory now (after load and warm-up)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
