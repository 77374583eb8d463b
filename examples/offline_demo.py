"""Generate text with vLLM on the Spyre backend (the `make run` demo).

Runs the built-in default model, SmolLM2-135M-Instruct, through
``vllm.LLM`` with Spyre static batching, then prints every prompt with its
completion and a timing line per phase.  The Spyre settings come from the
environment; the defaults below keep the demo within a couple of minutes on
a 2-core CPU (the ``eager`` backend: compiling the 30-layer model with
``inductor`` takes minutes per shape).

    python examples/offline_demo.py [MODEL_DIR]
"""
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / \
    "SmolLM2-135M-Instruct"

os.environ.setdefault("VLLM_SPYRE_DYNAMO_BACKEND", "eager")
os.environ.setdefault("VLLM_SPYRE_WARMUP_PROMPT_LENS", "64")
os.environ.setdefault("VLLM_SPYRE_WARMUP_NEW_TOKENS", "24")
os.environ.setdefault("VLLM_SPYRE_WARMUP_BATCH_SIZES", "4")
os.environ.setdefault("VLLM_USE_V1", "0")

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "The three primary colors are",
    "def fibonacci(n):",
]


def main() -> None:
    from vllm import LLM, SamplingParams

    model = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT_MODEL)
    start = time.perf_counter()
    llm = LLM(model=model)
    startup = time.perf_counter() - start
    timings = llm.collective_rpc("get_startup_timings")[0]

    params = SamplingParams(temperature=0.0, max_tokens=24)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)

    for out in outputs:
        print(f"\nPrompt:     {out.prompt!r}")
        print(f"Completion: {out.outputs[0].text!r}")
    print()
    for phase, seconds in timings.items():
        print(f"[timing] {phase}: {seconds:.1f} s")
    print(f"[timing] engine start-up in all: {startup:.1f} s")
    print(f"[timing] generation: {new_tokens} tokens for {len(PROMPTS)} "
          f"prompts in {elapsed:.2f} s ({new_tokens / elapsed:.1f} tokens/s)")


if __name__ == "__main__":
    main()
