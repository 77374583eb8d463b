"""Embed and rank texts with vLLM on the Spyre backend (the `make embed`
demo).

Runs the built-in embedding model, all-MiniLM-L6-v2, through
``vllm.LLM(..., task="embed")`` with Spyre warm-up shapes (short texts are
packed several to a row), embeds a handful of passages and questions, and
prints, for each question, the passages ranked by cosine similarity.  The
Spyre settings come from the environment; the defaults below are two
shapes that start in seconds on a 2-core CPU.

    python examples/embedding_demo.py [MODEL_DIR]
"""
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / \
    "all-MiniLM-L6-v2"

os.environ.setdefault("VLLM_SPYRE_DYNAMO_BACKEND", "eager")
os.environ.setdefault("VLLM_SPYRE_WARMUP_PROMPT_LENS", "64,256")
os.environ.setdefault("VLLM_SPYRE_WARMUP_BATCH_SIZES", "8,2")
os.environ.setdefault("VLLM_USE_V1", "0")

PASSAGES = [
    "Paris is the capital and largest city of France.",
    "IBM Z and Power machines can be fitted with Spyre accelerator cards.",
    "Photosynthesis turns light, water and carbon dioxide into sugar.",
    "vLLM serves language models through an OpenAI-compatible API.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Which accelerator goes into IBM mainframes?",
    "How do plants make their food?",
]


def main() -> None:
    import torch
    from vllm import LLM

    model = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT_MODEL)
    start = time.perf_counter()
    llm = LLM(model=model, task="embed")
    startup = time.perf_counter() - start

    start = time.perf_counter()
    outputs = llm.embed(PASSAGES + QUESTIONS, use_tqdm=False)
    elapsed = time.perf_counter() - start
    vectors = torch.tensor([o.outputs.embedding for o in outputs])
    passages, questions = vectors[:len(PASSAGES)], vectors[len(PASSAGES):]
    # The model's vectors are normalised: the dot product is the cosine.
    similarity = questions @ passages.T

    for question, row in zip(QUESTIONS, similarity):
        best = int(row.argmax())
        print(f"\nQuestion: {question!r}")
        print(f"Best:     {PASSAGES[best]!r} (cosine {row[best]:.3f})")
    print(f"\n{len(outputs)} texts of dimension {vectors.shape[1]} embedded "
          f"in {elapsed:.2f} s; start-up {startup:.1f} s")


if __name__ == "__main__":
    main()
