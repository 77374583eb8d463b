"""Talk to a Spyre-backed vLLM server with the official OpenAI client.

Start a server first (`make serve`, or `vllm serve MODEL_DIR`), then:

    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]

Prints a completion, a streamed completion and a chat answer.
"""
import argparse

import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = ap.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key="EMPTY")
    model = client.models.list().data[0].id
    print(f"model: {model}")

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8,
        temperature=0)
    print(f"completion: {completion.choices[0].text!r}")

    print("streamed: ", end="", flush=True)
    for chunk in client.completions.create(
            model=model, prompt="The three primary colors are",
            max_tokens=12, temperature=0, stream=True):
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
    print()

    chat = client.chat.completions.create(
        model=model, max_tokens=16, temperature=0,
        messages=[{"role": "user",
                   "content": "What is the capital of France?"}])
    print(f"chat: {chat.choices[0].message.content!r}")


if __name__ == "__main__":
    main()
