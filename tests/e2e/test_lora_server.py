"""LoRA adapters through ``vllm serve`` on the default model (SmolLM2),
driven by the openai client as users drive it (docs/lora.md).

One server, continuous batching on ``eager``, ``--enable-lora`` with one
adapter given at start-up under two names (``--lora-modules name=path``
and the JSON form naming the base model's second
``--served-model-name`` as its ``base_model_name``) and run-time loading on
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):

* ``/v1/models`` lists both names beside the base model, each with its
  parent;
* a completion naming the adapter as its ``model`` equals transformers
  with the adapter merged, token for token, and one naming the base
  model equals the base model's;
* an adapter loaded at run time serves, is refused after it is unloaded
  (404, as vLLM answers an unknown model), and the base model's answers
  are unchanged at the end;
* an adapter above ``--max-lora-rank`` is refused at loading (400 naming
  the rank) and the server serves on.
"""
from __future__ import annotations

import json

import pytest
import requests

from spyre_support.envs import cb_env
from spyre_support.server import Server
from spyre_support.tiny_lora import MergedReference, build_adapter

pytestmark = pytest.mark.smollm2

PROMPT = "The three primary colors are"
#: The base model's second name (``--served-model-name``), which the
#: adapter given in ``--lora-modules``' JSON form names as its base.
BASE_NAME = "smollm2"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(smollm2, tmp_path_factory) -> dict:
    """Rank-8 adapters of SmolLM2 over every projection, small enough
    (standard deviation 0.05) to keep its answers fluent; one of rank
    16."""
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {
        "tutor": build_adapter(smollm2, root / "tutor", seed=1, rank=8,
                               scale=0.05),
        "poet": build_adapter(smollm2, root / "poet", seed=2, rank=8,
                              scale=0.05),
        "wide": build_adapter(smollm2, root / "wide", seed=3, rank=16,
                              scale=0.05),
    }


@pytest.fixture(scope="module")
def server(smollm2, adapters):
    env = dict(cb_env("eager"), VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    args = ("--model-impl", "vllm", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules",
            f"tutor={adapters['tutor']}",
            json.dumps(dict(name="tutor-json", path=str(adapters["tutor"]),
                            base_model_name=BASE_NAME)),
            "--max-num-seqs", "4",
            "--max-model-len", "256")
    # The model's path first: the name the tests ask for.
    args += ("--served-model-name", str(smollm2), BASE_NAME)
    with Server(smollm2, env, args=args) as srv:
        yield srv


@pytest.fixture(scope="module")
def prompt_ids(smollm2) -> list[int]:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2)(PROMPT)["input_ids"]


def completion_ids(client, model: str, prompt: list[int]) -> list[int]:
    """Greedy ids of one completion, read exactly from its logprobs."""
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
        logprobs=0, extra_body=dict(ignore_eos=True,
                                    return_tokens_as_token_ids=True))
    return [int(t.removeprefix("token_id:"))
            for t in reply.choices[0].logprobs.tokens]


def test_adapters_over_the_openai_api(server, smollm2, adapters,
                                      prompt_ids):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    base_ref = MergedReference(smollm2, None).greedy(prompt_ids,
                                                     NEW_TOKENS)[0]
    refs = {name: MergedReference(smollm2, adapters[name]).greedy(
        prompt_ids, NEW_TOKENS)[0] for name in ("tutor", "poet")}
    assert base_ref not in refs.values()

    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {server.model, BASE_NAME, "tutor", "tutor-json"}
    assert models["tutor"].parent == server.model
    assert models["tutor-json"].parent == BASE_NAME

    assert completion_ids(client, "tutor", prompt_ids) == refs["tutor"]
    assert completion_ids(client, "tutor-json", prompt_ids) == refs["tutor"]
    assert completion_ids(client, server.model, prompt_ids) == base_ref

    loaded = requests.post(server.url + "/v1/load_lora_adapter", json=dict(
        lora_name="poet", lora_path=str(adapters["poet"])), timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert completion_ids(client, "poet", prompt_ids) == refs["poet"]
    assert completion_ids(client, "tutor", prompt_ids) == refs["tutor"]

    wide = requests.post(server.url + "/v1/load_lora_adapter", json=dict(
        lora_name="wide", lora_path=str(adapters["wide"])), timeout=60)
    assert wide.status_code == 400, wide.text
    assert "rank 16" in wide.text and "max_lora_rank 8" in wide.text

    unloaded = requests.post(server.url + "/v1/unload_lora_adapter",
                             json=dict(lora_name="poet"), timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        completion_ids(client, "poet", prompt_ids)
    with pytest.raises(openai.NotFoundError):
        completion_ids(client, "nobody", prompt_ids)
    assert {m.id for m in client.models.list().data} == {
        server.model, BASE_NAME, "tutor", "tutor-json"}
    assert completion_ids(client, server.model, prompt_ids) == base_ref
    assert server.proc.poll() is None
