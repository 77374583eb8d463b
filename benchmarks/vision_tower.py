"""Would compiling the vision tower pay?  The tower Spyre runs (vLLM's
model code, its linear layers on the packed CPU kernels), eagerly as it
serves, against the same module compiled by ``torch.compile`` with
``inductor``, one graph per tile count.

For each tile count (LLaVA-NeXT: the base tile and a grid; one image's
tiles run through the tower at once): the eager tower's seconds, the
compiled one's (after its compile, best of ``--repetitions``), the
compile's seconds, and the speed-up.

    python benchmarks/vision_tower.py [--model models/bench/smol-vision-bf16]
        [--tiles 1,3,5] [--dtype bfloat16] [--repetitions 3]
        [--max-model-len 4096]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from spyre_support.bench import RESULTS, machine_info, table, write_json
from spyre_support.engines import spyre_llm
from spyre_support.envs import cb_env
from spyre_support.paths import REPO


def best_seconds(run, repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model",
                    default=str(REPO / "models/bench/smol-vision-bf16"))
    ap.add_argument("--tiles", default="1,3,5")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="the engine's: at most the model's own")
    ap.add_argument("--json", default=str(RESULTS / "vision_tower.json"))
    args = ap.parse_args()
    import torch
    with spyre_llm(Path(args.model), cb_env("eager"), max_num_seqs=1,
                   max_model_len=args.max_model_len, dtype=args.dtype) as llm:
        runner = llm.llm_engine.model_executor.driver_worker.worker \
            .model_runner
        model = runner.model.code.vllm_model
        config = model.config.vision_config
        layers = model.config.vision_feature_layer
        kwargs = ({"feature_sample_layers": list(layers)}
                  if isinstance(layers, (list, tuple)) else {})
        tower = model.vision_tower
        dtype = next(tower.parameters()).dtype
        rows = []
        results = {}
        for tiles in [int(t) for t in args.tiles.split(",")]:
            pixels = torch.randn(tiles, 3, config.image_size,
                                 config.image_size, dtype=dtype)
            with torch.inference_mode():
                eager = best_seconds(lambda: tower(pixels, **kwargs),
                                     args.repetitions)
                torch._dynamo.reset()
                compiled = torch.compile(tower, backend="inductor",
                                         dynamic=False)
                start = time.perf_counter()
                compiled(pixels, **kwargs)
                compile_s = time.perf_counter() - start
                fast = best_seconds(lambda: compiled(pixels, **kwargs),
                                    args.repetitions)
            results[tiles] = dict(eager=eager, compiled=fast,
                                  compile=compile_s)
            rows.append([str(tiles), f"{eager:.3f}", f"{fast:.3f}",
                         f"{eager / fast:.2f}x", f"{compile_s:.1f}"])
    print(f"\nmodel {args.model} ({args.dtype}), vision tower "
          f"{type(tower).__name__}, best of {args.repetitions}")
    print(table(["tiles", "eager s", "inductor s", "speed-up",
                 "compile s"], rows))
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               results=results))


if __name__ == "__main__":
    main()
