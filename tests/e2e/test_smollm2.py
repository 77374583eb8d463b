"""End to end on the default model, SmolLM2-135M-Instruct (eager backend):
greedy ids identical to Hugging Face transformers for several prompts over
two batches, "Paris", and end-of-sequence handling."""
from __future__ import annotations

import pytest

from spyre_support.engines import shared_llm
from spyre_support.envs import spyre_env
from spyre_support.reference import HFReference

pytestmark = pytest.mark.smollm2

MAX_NEW = 16
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "My favourite book is",
]


@pytest.fixture
def llm(smollm2):
    return shared_llm(smollm2, spyre_env("eager", [64], [MAX_NEW], [4]))


@pytest.fixture(scope="module")
def hf(smollm2):
    return HFReference(smollm2)


def test_greedy_ids_match_transformers(llm, hf):
    from vllm import SamplingParams
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS,
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                       ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        ref, _ = hf.greedy(ids, MAX_NEW)
        assert list(out.outputs[0].token_ids) == ref, prompt


def test_capital_of_france_is_paris(llm):
    from vllm import SamplingParams
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0.0, max_tokens=8),
                       use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_eos_ends_a_row_unless_ignored(llm):
    """A chat answer ends with <|im_end|>: the row stops there (the batch
    mate keeps going) unless ignore_eos is set."""
    from vllm import SamplingParams
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    stop, keep_going = llm.generate(
        [chat, chat],
        [SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
         SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                        ignore_eos=True)],
        use_tqdm=False)
    ids = stop.outputs[0].token_ids
    assert stop.outputs[0].finish_reason == "stop"
    assert ids[-1] == tok.eos_token_id and len(ids) < MAX_NEW
    assert "Paris" in stop.outputs[0].text
    assert keep_going.outputs[0].finish_reason == "length"
    assert len(keep_going.outputs[0].token_ids) == MAX_NEW
    assert keep_going.outputs[0].token_ids[:len(ids)] == ids
