"""LangChain's OpenAIEmbeddings pointed at a Spyre-backed vLLM server, in
a small in-memory retrieval.

Start an embedding server first (see examples/openai_embeddings.py), then:

    python examples/langchain_embeddings.py [--base-url http://127.0.0.1:8000/v1]

``check_embedding_ctx_length=False`` makes LangChain send the texts as
they are: by default it first tokenizes them with OpenAI's own tokenizer
(tiktoken, fetched online) and sends those token ids, which mean nothing
to another model's vocabulary.
"""
import argparse

import openai
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_openai import OpenAIEmbeddings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()

    model = openai.OpenAI(base_url=args.base_url,
                          api_key="EMPTY").models.list().data[0].id
    embeddings = OpenAIEmbeddings(model=model, base_url=args.base_url,
                                  api_key="EMPTY",
                                  check_embedding_ctx_length=False)
    store = InMemoryVectorStore(embeddings)
    store.add_documents([
        Document(page_content="Paris is the capital and largest city of "
                 "France."),
        Document(page_content="Spyre accelerator cards fit IBM Z and Power "
                 "machines."),
        Document(page_content="Photosynthesis turns light into chemical "
                 "energy."),
    ])
    for question in ("What is the capital of France?",
                     "Which accelerator goes into IBM mainframes?"):
        best = store.similarity_search(question, k=1)[0]
        print(f"question: {question!r} -> {best.page_content!r}")
    vector = embeddings.embed_query("hello")
    print(f"query vector: {len(vector)} floats")


if __name__ == "__main__":
    main()
