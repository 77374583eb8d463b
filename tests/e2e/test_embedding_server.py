"""Pooling models through ``vllm serve`` on loopback: ``/v1/embeddings``
from the OpenAI client and LangChain, ``/score`` and ``/rerank`` from a
cross-encoder, the examples, and bad requests answered with HTTP 400
while the server keeps serving."""
from __future__ import annotations

import base64
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch

from spyre_support.paths import MINILM_DIR, REPO
from spyre_support.server import Server
from spyre_support.tiny_encoders import build_tiny_encoder, hf_scores

SHAPES = {"VLLM_SPYRE_DYNAMO_BACKEND": "eager",
          "VLLM_SPYRE_WARMUP_PROMPT_LENS": "64,256",
          "VLLM_SPYRE_WARMUP_BATCH_SIZES": "8,2"}
SENTENCES = ["The capital of France is Paris.", "a",
             "Spyre cards fit IBM Z and Power machines. " * 20,
             "How do plants make their food?", "vLLM serves models."]
QUERY = "spyre card batch"
DOCUMENTS = ["the batch of tokens", "red green blue", "compile the graph",
             "spyre", "a fast kernel in the cache"]


@pytest.fixture(scope="module")
def embedder():
    with Server(MINILM_DIR, SHAPES, args=("--task", "embed")) as srv:
        yield srv


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = build_tiny_encoder("bert-cross",
                              tmp_path_factory.mktemp("cross") / "bc")
    with Server(path, SHAPES, args=("--task", "score")) as srv:
        srv.path = path
        yield srv


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(MINILM_DIR), device="cpu").encode(
        SENTENCES, convert_to_tensor=True)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")


def min_cosine(vectors, reference) -> float:
    got = torch.tensor(vectors)
    return torch.nn.functional.cosine_similarity(got, reference,
                                                 dim=1).min().item()


def run_example(name: str, base_url: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), "--base-url",
         base_url], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.smollm2
def test_openai_client_embeddings_match_sentence_transformers(
        embedder, reference):
    c = client(embedder)
    model = c.models.list().data[0].id
    result = c.embeddings.create(model=model, input=SENTENCES)
    assert [d.index for d in result.data] == list(range(len(SENTENCES)))
    assert min_cosine([d.embedding for d in result.data],
                      reference) >= 0.9999
    # Token ids, as a client that tokenizes itself sends them.
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(MINILM_DIR)(SENTENCES)["input_ids"]
    by_ids = c.embeddings.create(model=model, input=ids)
    assert min_cosine([d.embedding for d in by_ids.data],
                      reference) >= 0.9999
    # Asked for base64, the client hands back the server's packed floats.
    packed = c.embeddings.create(model=model, input=SENTENCES[:1],
                                 encoding_format="base64")
    floats = torch.frombuffer(bytearray(base64.b64decode(
        packed.data[0].embedding)), dtype=torch.float32)
    assert min_cosine([floats.tolist()], reference[:1]) >= 0.9999


@pytest.mark.smollm2
def test_concurrent_clients_share_steps(embedder, reference):
    """Sixteen clients at once: their texts are packed together, and each
    gets its own text's embedding."""
    c = client(embedder)
    model = c.models.list().data[0].id
    jobs = [SENTENCES[i % len(SENTENCES)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(
            lambda text: c.embeddings.create(model=model, input=[text]),
            jobs))
    got = [r.data[0].embedding for r in results]
    expected = torch.stack([reference[i % len(SENTENCES)]
                            for i in range(16)])
    assert min_cosine(got, expected) >= 0.9999


@pytest.mark.smollm2
@pytest.mark.parametrize("path, body, message", [
    ("/v1/embeddings", {"input": []}, "at least one"),
    ("/v1/embeddings", {"input": "word " * 300},
     "The input has 302 tokens, more than the longest compiled Spyre "
     "warm-up shape holds (256; prompt lengths: 64, 256)"),
    ("/v1/embeddings", {"input": "word " * 600}, "maximum context length "
     "is 512 tokens"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "matryoshka"),
    ("/v1/embeddings", {"input": {"not": "text"}}, ""),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4},
     "does not support Completions"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}]}, "does not support"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(
        embedder, reference, path, body, message):
    model = client(embedder).models.list().data[0].id
    response = requests.post(embedder.url + path, timeout=60,
                             json={"model": model, **body})
    assert response.status_code == 400, response.text
    assert message in response.text
    good = client(embedder).embeddings.create(model=model,
                                              input=SENTENCES[:2])
    assert min_cosine([d.embedding for d in good.data],
                      reference[:2]) >= 0.9999


@pytest.mark.smollm2
def test_openai_and_langchain_examples(embedder):
    out = run_example("openai_embeddings.py", embedder.url + "/v1")
    ranked = [line for line in out.splitlines() if line.startswith("  ")]
    assert "Paris" in ranked[0]
    assert "cosine with the text's embedding 1.000000" in out
    out = run_example("langchain_embeddings.py", embedder.url + "/v1")
    assert ("'What is the capital of France?' -> 'Paris is the capital"
            in out)
    assert "-> 'Spyre accelerator cards" in out
    assert "query vector: 384 floats" in out


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_matches_the_cross_encoder(cross_encoder, path):
    model = client(cross_encoder).models.list().data[0].id
    response = requests.post(cross_encoder.url + path, timeout=60, json={
        "model": model, "text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    data = sorted(response.json()["data"], key=lambda d: d["index"])
    assert [d["score"] for d in data] == pytest.approx(
        hf_scores(cross_encoder.path, QUERY, DOCUMENTS), abs=1e-4)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_order_matches_the_cross_encoder(cross_encoder, path):
    model = client(cross_encoder).models.list().data[0].id
    response = requests.post(cross_encoder.url + path, timeout=60, json={
        "model": model, "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    reference = hf_scores(cross_encoder.path, QUERY, DOCUMENTS)
    expected = sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])
    assert [r["index"] for r in results] == expected
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [reference[i] for i in expected], abs=1e-4)


@pytest.mark.parametrize("path, body, message", [
    ("/rerank", {"query": QUERY, "documents": []}, "At least one"),
    ("/score", {"text_1": "x " * 150, "text_2": ["y"]},
     "more than the longest compiled Spyre warm-up shape holds"),
    ("/v1/embeddings", {"input": ["hi"]}, "does not support Embeddings"),
    ("/v1/completions", {"prompt": "hi"}, "does not support Completions"),
])
def test_cross_encoder_bad_requests_get_400(cross_encoder, path, body,
                                            message):
    model = client(cross_encoder).models.list().data[0].id
    response = requests.post(cross_encoder.url + path, timeout=60,
                             json={"model": model, **body})
    assert response.status_code == 400, response.text
    assert message in response.text
    good = requests.post(cross_encoder.url + "/score", timeout=60, json={
        "model": model, "text_1": QUERY, "text_2": DOCUMENTS[:2]})
    assert good.status_code == 200


def test_rerank_example(cross_encoder):
    out = run_example("rerank_client.py", cross_encoder.url)
    assert out.count("score ") == 3 and out.count("rank ") == 2


@pytest.mark.smollm2
def test_embedding_demo():
    """`make embed`: each question's best passage is the right one."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "embedding_demo.py")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = [line for line in proc.stdout.splitlines()
            if line.startswith("Best:")]
    assert len(best) == 3
    assert "Paris" in best[0] and "Spyre" in best[1]
    assert "Photosynthesis" in best[2]
