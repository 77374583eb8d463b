"""A LangChain chat model pointed at a Spyre-backed vLLM server.

Start a server first (`make serve`, or `vllm serve MODEL_DIR`), then:

    python examples/langchain_chat.py [--base-url http://127.0.0.1:8000/v1]

Nothing here is Spyre-specific: `ChatOpenAI` talks to vLLM's
OpenAI-compatible API as it would to any other.
"""
import argparse

import openai
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()

    model = openai.OpenAI(base_url=args.base_url,
                          api_key="EMPTY").models.list().data[0].id
    llm = ChatOpenAI(model=model, base_url=args.base_url, api_key="EMPTY",
                     temperature=0, max_tokens=16)
    answer = llm.invoke([
        SystemMessage(content="You answer in one short sentence."),
        HumanMessage(content="What is the capital of France?"),
    ])
    print(f"answer: {answer.content!r}")
    print("streamed: ", end="", flush=True)
    for part in llm.stream("Name a color of the rainbow."):
        print(part.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
