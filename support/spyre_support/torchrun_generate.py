"""One rank of a torchrun job: builds a Spyre ``vllm.LLM`` with
``distributed_executor_backend="external_launcher"`` in this process,
generates greedily, and writes ``rank<RANK>.json`` into OUT_DIR: its ids,
the dynamo compilations counted after start-up, what ``LLM.collective_rpc``
of ``--rpc`` returned, and, with ``--update-from DIR``, the ids generated
after loading DIR's weights in place (``update_weights_in_place``) and the
compilations counted since.

    torchrun --nproc-per-node N -m spyre_support.torchrun_generate \\
        OUT_DIR MODEL \\
        PROMPTS_JSON MAX_TOKENS [--engine-args JSON] [--rpc METHOD] \\
        [--update-from DIR]

The Spyre settings come from the environment.  With N=1 plain ``python``
runs it too.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from spyre_support.engine_start import compile_count, greedy_ids


def main() -> None:
    os.environ.setdefault("VLLM_USE_V1", "0")
    parser = argparse.ArgumentParser()
    for name in ("out", "model", "prompts", "max_tokens"):
        parser.add_argument(name)
    parser.add_argument("--engine-args", type=json.loads, default={})
    parser.add_argument("--rpc")
    parser.add_argument("--update-from")
    args = parser.parse_args()
    from vllm import LLM
    world = int(os.environ.get("WORLD_SIZE", "1"))
    llm = LLM(model=args.model, **{
        "tensor_parallel_size": world,
        "distributed_executor_backend": "external_launcher",
        "seed": 0,
        **args.engine_args
    })
    before = compile_count()
    result = dict(
        ids=greedy_ids(llm, args.prompts, args.max_tokens),
        serving_compiles=compile_count() - before,
        rpc=llm.collective_rpc(args.rpc) if args.rpc else None,
        executor=type(llm.llm_engine.model_executor).__name__)
    if args.update_from:
        from safetensors.torch import load_file
        state_dict = {}
        for path in sorted(Path(args.update_from).glob("*.safetensors")):
            state_dict.update(load_file(path))
        before = compile_count()
        llm.collective_rpc("update_weights_in_place", args=(state_dict, ))
        result.update(
            updated_ids=greedy_ids(llm, args.prompts, args.max_tokens),
            update_compiles=compile_count() - before)
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
