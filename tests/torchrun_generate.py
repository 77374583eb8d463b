"""One rank of a torchrun job: builds a Spyre ``vllm.LLM`` with
``distributed_executor_backend="external_launcher"`` in this process,
generates greedily, and writes ``rank<RANK>.json`` (its ids, the dynamo
compilations counted after start-up, and what ``LLM.collective_rpc`` of
RPC_METHOD returned, if one is given) into OUT_DIR.

    torchrun --nproc-per-node N tests/torchrun_generate.py OUT_DIR MODEL \\
        PROMPTS_JSON MAX_TOKENS [ENGINE_ARGS_JSON [RPC_METHOD]]

The Spyre settings come from the environment.  With N=1 plain ``python``
runs it too.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from engine_start import compile_count, greedy_ids


def main() -> None:
    os.environ.setdefault("VLLM_USE_V1", "0")
    out, model, prompts, max_tokens = sys.argv[1:5]
    engine_args = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    rpc = sys.argv[6] if len(sys.argv) > 6 else None
    from vllm import LLM
    world = int(os.environ.get("WORLD_SIZE", "1"))
    llm = LLM(model=model, **{
        "tensor_parallel_size": world,
        "distributed_executor_backend": "external_launcher",
        "seed": 0,
        **engine_args
    })
    before = compile_count()
    ids = greedy_ids(llm, prompts, max_tokens)
    rank = int(os.environ.get("RANK", "0"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(dict(
        ids=ids,
        serving_compiles=compile_count() - before,
        rpc=llm.collective_rpc(rpc) if rpc else None,
        executor=type(llm.llm_engine.model_executor).__name__)))


if __name__ == "__main__":
    main()
