"""Embeddings from a Spyre-backed vLLM server with the official OpenAI
client.

Start an embedding server first, for instance on the built-in model:

    VLLM_SPYRE_WARMUP_PROMPT_LENS=64,256 VLLM_SPYRE_WARMUP_BATCH_SIZES=8,2 \\
        vllm serve models/all-MiniLM-L6-v2 --task embed

then:

    python examples/openai_embeddings.py [--base-url http://127.0.0.1:8000/v1]

Embeds passages and a question given as text, embeds the question again
given as token ids, and prints the passages ranked by cosine similarity.
"""
import argparse
import math

import httpx
import openai


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key="EMPTY")
    model = client.models.list().data[0].id
    print(f"model: {model}")

    passages = [
        "Paris is the capital and largest city of France.",
        "Spyre accelerator cards fit IBM Z and Power machines.",
        "Photosynthesis turns light into chemical energy.",
    ]
    question = "What is the capital of France?"
    result = client.embeddings.create(model=model,
                                      input=passages + [question])
    vectors = [d.embedding for d in result.data]
    print(f"embedded {len(vectors)} texts of dimension {len(vectors[0])}, "
          f"{result.usage.prompt_tokens} tokens")
    ranked = sorted(zip(passages, vectors[:-1]),
                    key=lambda p: -cosine(vectors[-1], p[1]))
    for passage, vector in ranked:
        print(f"  {cosine(vectors[-1], vector):.3f}  {passage}")

    # The same question as token ids, as a client that tokenizes itself
    # sends it: here the server's own /tokenize gives the ids.
    root = args.base_url.rstrip("/").removesuffix("/v1")
    ids = httpx.post(f"{root}/tokenize", timeout=30, json={
        "model": model, "prompt": question}).json()["tokens"]
    by_ids = client.embeddings.create(model=model, input=[ids])
    print(f"question as {len(ids)} token ids: cosine with the text's "
          f"embedding {cosine(by_ids.data[0].embedding, vectors[-1]):.6f}")


if __name__ == "__main__":
    main()
