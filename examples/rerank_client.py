"""Scores and reranking from a Spyre-backed vLLM server that serves a
cross-encoder (``--task score``), over plain HTTP.

Start a server with a cross-encoder checkpoint (a
``BertForSequenceClassification`` or ``RobertaForSequenceClassification``
folder), for instance:

    VLLM_SPYRE_WARMUP_PROMPT_LENS=64 VLLM_SPYRE_WARMUP_BATCH_SIZES=4 \\
        vllm serve CROSS_ENCODER_DIR --task score

then:

    python examples/rerank_client.py [--base-url http://127.0.0.1:8000]

Prints the scores of a query against passages (``/score``) and the
passages reranked (``/v1/rerank``, the Jina/Cohere-style API).
"""
import argparse

import requests

QUERY = "What is the capital of France?"
PASSAGES = [
    "Photosynthesis turns light into chemical energy.",
    "Paris is the capital and largest city of France.",
    "Spyre accelerator cards fit IBM Z and Power machines.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    model = requests.get(f"{args.base_url}/v1/models",
                         timeout=30).json()["data"][0]["id"]

    scores = requests.post(f"{args.base_url}/score", timeout=60, json={
        "model": model, "text_1": QUERY, "text_2": PASSAGES}).json()
    for item in scores["data"]:
        print(f"score {item['score']:.6f}  {PASSAGES[item['index']]}")

    reranked = requests.post(f"{args.base_url}/v1/rerank", timeout=60, json={
        "model": model, "query": QUERY, "documents": PASSAGES,
        "top_n": 2}).json()
    for item in reranked["results"]:
        print(f"rank {item['relevance_score']:.6f}  "
              f"{item['document']['text']}")


if __name__ == "__main__":
    main()
