"""The up-front memory check's estimate against the measured peak resident
memory, for a few configurations of the default model.

Each configuration starts ``vllm.LLM`` in a fresh process, serves one
batch that fills its largest shape (static batching) or ``--max-num-seqs``
long requests (continuous batching), then reports the estimate the worker
made before loading anything (``spyre_memory``) and the process's peak
resident set (``VmHWM``), and beside the estimate's activations how
much the resident set grew while serving (the peak reset once the engine
has started, Linux's ``clear_refs``).  Under continuous batching the
check sizes the smallest useful pool; the pool then takes the memory it
may, so the estimate compared here adds the blocks the worker actually
allocated.

    python benchmarks/memory.py [--model DIR] [--configs small,large,cb]
        [--json PATH]

The ``bf16`` and ``bf16-cb`` configurations are sized for the
realistic-size checkpoints ``scripts/benchmark_checkpoints.py`` writes:

    python benchmarks/memory.py --model models/bench/granite-3.3-8b-bf16 \
        --configs bf16,bf16-cb

``fp32`` serves a float32 one (``--formats fp32``) in float32.
``bf16-tp2`` serves them over two tensor-parallel ranks and adds a row
per rank: its estimate against its own process's peak (rank 0 shares its
process with the engine).  ``bf16-image`` is for the vision-language ones
``scripts/vision_checkpoints.py`` writes (requests of the largest image
its processor tiles):

    python benchmarks/memory.py \
        --model models/bench/granite-vision-3.3-2b-bf16 --configs bf16-image
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spyre_support.bench import (Child, DEFAULT_MODEL, RESULTS, machine_info,
                                 table, write_json)
from spyre_support.envs import cb_env, warmup_env

GiB = 2**30

#: name -> (environment, engine arguments, (requests, prompt, new tokens))
CONFIGS = {
    "small": (warmup_env("eager", [(64, 24, 4)]), {}, (4, 60, 24)),
    "large": (warmup_env("eager", [(1024, 64, 8), (64, 24, 4)]), {},
              (8, 1000, 64)),
    "cb": (cb_env("eager"),
           dict(max_model_len=2048, max_num_seqs=16), (16, 1800, 32)),
    "small-inductor": (warmup_env("inductor", [(64, 24, 4)]), {},
                       (4, 60, 24)),
    # Sized for the realistic-size checkpoints (``--model`` one of
    # scripts/benchmark_checkpoints.py's), whose steps are slow on a CPU.
    "bf16": (warmup_env("eager", [(64, 24, 4)]), dict(dtype="bfloat16"),
             (4, 60, 24)),
    # A float32 checkpoint (benchmark_checkpoints.py --formats fp32),
    # served in float32 as its dtype "auto" is on a CPU.
    "fp32": (warmup_env("eager", [(64, 24, 4)]), dict(dtype="float32"),
             (4, 60, 24)),
    "bf16-cb": (cb_env("eager"),
                dict(dtype="bfloat16", max_model_len=512, max_num_seqs=4),
                (4, 200, 16)),
    # The same on ``inductor``, whose graphs and compile-time peak the
    # estimate's runtime part counts.
    "bf16-inductor": (warmup_env("inductor", [(64, 24, 4)]),
                      dict(dtype="bfloat16"), (4, 60, 24)),
    # Two tensor-parallel ranks, each reading and holding its shard: each
    # rank's estimate against its own process's peak.
    "bf16-tp2": (warmup_env("eager", [(64, 24, 4)]),
                 dict(dtype="bfloat16", tensor_parallel_size=2),
                 (4, 60, 24)),
    # A vision-language model (scripts/vision_checkpoints.py): requests
    # of one image each, of the largest size its processor tiles.
    "bf16-image": (cb_env("eager"),
                   dict(dtype="bfloat16", max_model_len=4096,
                        max_num_seqs=2), (2, "image", 8)),
}


class MemoryProbe:
    """Lives in the child: starts the engine, serves one full batch."""

    def __init__(self, model: str, engine_args: dict, load: tuple) -> None:
        from vllm import LLM, SamplingParams, TokensPrompt
        llm = LLM(model=model, **engine_args)
        requests, prompt, new = load
        if prompt == "image":
            prompts = largest_images(llm, requests)
        else:
            prompts = [TokensPrompt(prompt_token_ids=[
                (i * 7 + j) % 1000 + 10 for j in range(prompt)])
                for i in range(requests)]
        # Per rank (one, unless tensor parallel): each in its own process.
        load_peaks = llm.collective_rpc(_rank_peak)
        serving_starts = llm.collective_rpc(_reset_peak)
        llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True,
                                             temperature=0.0),
                     use_tqdm=False)
        serving_peaks = llm.collective_rpc(_rank_peak)
        estimates = llm.collective_rpc("get_memory_estimate")
        self.ranks = [
            dict(estimate=e.total, parts=e.describe(),
                 peak=max(load, serving), serving_growth=serving - start)
            for e, load, start, serving in zip(estimates, load_peaks,
                                               serving_starts, serving_peaks)
        ]
        estimate = estimates[0]
        load_peak, serving_peak = load_peaks[0], serving_peaks[0]
        serving_growth = serving_peak - serving_starts[0]
        cache = llm.llm_engine.cache_config
        extra = 0
        if engine_args.get("max_num_seqs"):  # continuous batching
            from vllm.config.spyre import CB_BLOCK_SIZE
            from vllm.core.spyre_cb_blocks import blocks_needed
            block = llm.collective_rpc("get_cache_block_size_bytes")[0]
            minimum = blocks_needed(engine_args["max_model_len"],
                                    CB_BLOCK_SIZE)
            extra = (cache.num_gpu_blocks - minimum) * block
        self.result = dict(
            estimate=estimate.total + extra, parts=estimate.describe(),
            pool_blocks=cache.num_gpu_blocks if extra else None,
            activations=estimate.activations, serving_growth=serving_growth,
            peak=max(load_peak, serving_peak),
            ranks=self.ranks if len(self.ranks) > 1 else None)

    def info(self) -> dict:
        return self.result


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rank_peak(worker=None) -> int:
    """The calling process's peak resident set, in bytes (run in each rank
    by ``collective_rpc``, which passes the worker)."""
    return _status_kib("VmHWM") * 1024


def _reset_peak(worker=None) -> int:
    """Resets the calling process's peak resident set to its current one
    (Linux: ``clear_refs`` 5) and returns it, in bytes: the serving that
    follows then has a peak of its own (run in each rank by
    ``collective_rpc``)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def largest_images(llm, requests: int) -> list[dict]:
    """Prompts of one image each, of the largest grid the model's
    processor tiles (LLaVA-NeXT's ``image_grid_pinpoints``)."""
    from spyre_support.tiny_vision import image
    config = llm.llm_engine.model_config.hf_config
    side = config.vision_config.image_size
    height, width = max(getattr(config, "image_grid_pinpoints", None)
                        or [[side, side]], key=lambda g: g[0] * g[1])
    return [{"prompt": "<image>\nWhat is in this picture?",
             "multi_modal_data": {"image": image(width, height, seed=i)}}
            for i in range(requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--configs", default="small,large,cb")
    parser.add_argument("--json", type=Path,
                        default=RESULTS / "memory.json")
    args = parser.parse_args()
    rows, results = [], {}
    for name in args.configs.split(","):
        env, engine_args, load = CONFIGS[name]
        print(f"[{name}] starting ...", flush=True)
        child = Child(name, MemoryProbe, args.model, engine_args, load,
                      env={**env, "VLLM_USE_V1": "0"})
        try:
            got = child.call("info")
        finally:
            child.close()
        ratio = got["estimate"] / got["peak"]
        results[name] = dict(got, env=env, engine_args=engine_args,
                             ratio=ratio)
        rows.append([name, f"{got['estimate'] / GiB:.2f}",
                     f"{got['peak'] / GiB:.2f}", f"{ratio:.2f}",
                     f"{got['activations'] / GiB:.2f}",
                     f"{got['serving_growth'] / GiB:.2f}", got["parts"]])
        for rank, part in enumerate(got.get("ranks") or []):
            rows.append([f"  rank {rank}", f"{part['estimate'] / GiB:.2f}",
                         f"{part['peak'] / GiB:.2f}",
                         f"{part['estimate'] / part['peak']:.2f}", "",
                         f"{part['serving_growth'] / GiB:.2f}",
                         part["parts"]])
    print()
    print(table(["config", "estimate GiB", "peak RSS GiB", "est/peak",
                 "activations GiB", "serving growth GiB",
                 "estimate at start-up, by part"], rows))
    write_json(args.json, dict(machine=machine_info(), results=results))


if __name__ == "__main__":
    sys.exit(main())
