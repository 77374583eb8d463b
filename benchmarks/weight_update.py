"""New weights into a running engine: pushed in place against a restart.

A co-located trainer can refresh the engine's weights two ways: push them
into the running engine (``LLM.collective_rpc("update_weights_in_place",
...)``, nothing recompiled) or restart the engine on a new checkpoint,
which with the graph cache on (``TORCH_SENDNN_CACHE_ENABLE=1``) loads every
compiled graph instead of compiling it.  This benchmark measures both for
one rank (TP=1):

1. an engine starts in a fresh process on an empty graph cache (filling
   it), then takes ``--pushes`` pushes of a state dict (the checkpoint's
   tensors moved by small noise, Hugging Face naming, built in that
   process as a trainer would hold it), each timed; the greedy ids of a
   prompt before and after pushing the original weights back must be the
   same, and the dynamo compilations counted over all pushes must be 0;
2. a restart: a fresh process starts the same engine on the now warm
   graph cache, timed from the process's spawn to a ready engine (imports
   included), and ``vllm.LLM``'s construction alone.

    python benchmarks/weight_update.py [--model DIR] [--backend inductor]
        [--prompt-len 64] [--new-tokens 64] [--batch-sizes 1,4,8]
        [--pushes 5] [--json PATH]
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from spyre_support.bench import (Child, add_json_option, add_shape_options,
                                 benchmark_parser, cores, machine_info,
                                 parse_ints, table, text_ids, write_json)
from spyre_support.engines import compile_count
from spyre_support.envs import warmup_env


class Pusher:
    """Lives in the child: the engine, and the state dicts it is given."""

    def __init__(self, model: str) -> None:
        from vllm import LLM
        start = time.perf_counter()
        self.llm = LLM(model=model)
        self.engine_s = time.perf_counter() - start
        self.model = model
        self.original = self._checkpoint()

    def info(self) -> dict:
        return dict(engine_s=self.engine_s,
                    graphs=self.llm.collective_rpc("get_graph_cache_stats")[0],
                    tensors=len(self.original),
                    bytes=sum(t.numel() * t.element_size()
                              for t in self.original.values()))

    def _checkpoint(self) -> dict:
        from safetensors.torch import load_file
        state_dict = {}
        for path in sorted(Path(self.model).glob("*.safetensors")):
            state_dict.update(load_file(path))
        return state_dict

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        from vllm import SamplingParams
        out = self.llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, max_tokens=new_tokens,
                           ignore_eos=True), use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def push(self, seed: int) -> float:
        """Seconds to push the checkpoint moved by noise of 1e-3 of each
        tensor's scale (seed 0: the original weights)."""
        import torch
        state_dict = self.original
        if seed:
            g = torch.Generator().manual_seed(seed)
            state_dict = {
                k: v + torch.randn(v.shape, generator=g, dtype=v.dtype) *
                (1e-3 * float(v.float().std()) if v.numel() > 1 else 0.0)
                for k, v in state_dict.items()
            }
        start = time.perf_counter()
        self.llm.collective_rpc("update_weights_in_place",
                                args=(state_dict, ))
        return time.perf_counter() - start

    def compiles(self) -> int:
        return compile_count()


class Restart:
    """Lives in the child: starts the engine, times its construction."""

    def __init__(self, model: str) -> None:
        from vllm import LLM
        start = time.perf_counter()
        llm = LLM(model=model)
        self.engine_s = time.perf_counter() - start
        self.graphs = llm.collective_rpc("get_graph_cache_stats")[0]

    def info(self) -> dict:
        return dict(engine_s=self.engine_s, graphs=self.graphs)


def main() -> int:
    ap = benchmark_parser(__doc__, backend=True)
    add_shape_options(ap)
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--pushes", type=int, default=5)
    add_json_option(ap, "weight-update.json")
    args = ap.parse_args()
    shapes = [(args.prompt_len, args.new_tokens, b)
              for b in parse_ints(args.batch_sizes)]
    graphs = tempfile.mkdtemp(prefix="weight-update-graph-cache-")
    env = dict(warmup_env(args.backend, shapes), VLLM_SPYRE_USE_CB="0",
               TORCH_SENDNN_CACHE_ENABLE="1", TORCH_SENDNN_CACHE_DIR=graphs)
    prompt = text_ids(args.model)[:args.prompt_len]
    try:
        print("[engine] starting on an empty graph cache ...", flush=True)
        child = Child("engine", Pusher, args.model, env=env)
        try:
            first = child.result()
            before = child.call("greedy", prompt, args.new_tokens)
            compiles = child.call("compiles")
            pushes = [child.call("push", seed)
                      for seed in range(1, args.pushes + 1)]
            child.call("push", 0)
            compiles = child.call("compiles") - compiles
            after = child.call("greedy", prompt, args.new_tokens)
        finally:
            child.close()
        print("[restart] starting on the warm graph cache ...", flush=True)
        start = time.perf_counter()
        child = Child("restart", Restart, args.model, env=env)
        try:
            restart = child.result()
            restart["wall_s"] = time.perf_counter() - start
        finally:
            child.close()
    finally:
        shutil.rmtree(graphs, ignore_errors=True)

    push_s = statistics.median(pushes)
    result = dict(
        args=vars(args), machine=machine_info(), cold_start=first,
        pushes_s=pushes, push_median_s=push_s, restart=restart,
        push_compiles=compiles, same_ids_after_restoring=before == after,
        ratios=dict(restart_wall_over_push=restart["wall_s"] / push_s,
                    restart_engine_over_push=restart["engine_s"] / push_s))
    write_json(args.json, result)
    print(f"\nmodel {Path(args.model).name} (TP=1, {first['tensors']} "
          f"tensors, {first['bytes'] / 2**20:.0f} MiB), backend "
          f"{args.backend}, {len(shapes)} static shape(s), {cores()} cores; "
          f"compilations over all pushes: {compiles}; ids after restoring "
          f"the original weights {'equal' if before == after else 'DIFFER'}")
    print(table(["new weights by", "seconds", "restart / push"], [
        [f"push in place (median of {len(pushes)})", f"{push_s:.2f}", ""],
        ["restart, warm graph cache: LLM() only",
         f"{restart['engine_s']:.1f}",
         f"{result['ratios']['restart_engine_over_push']:.0f}x"],
        ["restart, warm graph cache: new process to ready",
         f"{restart['wall_s']:.1f}",
         f"{result['ratios']['restart_wall_over_push']:.0f}x"],
    ]))
    return 0 if compiles == 0 and before == after else 1


if __name__ == "__main__":
    sys.exit(main())
