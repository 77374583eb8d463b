"""The engines the offline benchmarks compare (offline.py, roofline.py),
by name (``ENGINES``): the drivers of ``_drivers.py`` (ours, Hugging Face,
FMS), llama.cpp at five precisions (``_peers.LlamaCppDriver``), and ours on
the default model quantized by the quantized-checkpoint writer
(``QUANT_FORMATS``, ``quantized_model``).
``start_engines`` starts one per child process (``spyre_support.bench.Child``),
``measure`` alternates their timed runs.

Nothing here imports torch, transformers or vLLM at module level: a child
process must be able to set its environment before vLLM is imported.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from spyre_support.bench import Child, Timings, Workload
from spyre_support.engines import compile_count
from spyre_support.envs import TORCH_OPS
from spyre_support.paths import REPO

from _drivers import (FMSDriver, HFDriver, SpyreCBDriver, SpyreDriver,
                      SpyreGraphCacheDriver)
from _peers import LlamaCppDriver


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
        if work.kernel_target and spec.ours:
            from vllm.spyre_kernels import ops
            if not ops.load_for(work.kernel_target):
                raise RuntimeError("the kernels could not be built for "
                                   f"{work.kernel_target}")
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
