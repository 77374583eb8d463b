"""Prompt log-probabilities (``prompt_logprobs``) in static and continuous
batching, ``eager`` and ``inductor``, and over two tensor-parallel ranks:
a value for every prompt token (the
first one None) equal to transformers' log-softmax over the same tokens,
the top entries of each position too, a prompt longer than the head's
512-position slice, a one-token prompt; requests that do not ask are
unchanged beside those that do, every generated id is transformers'
greedy one, and nothing compiles after warm-up.  Tiny random Llama."""
from __future__ import annotations

import pytest

from spyre_support.engines import compile_count, mode_llm
from spyre_support.reference import HFReference

NEW = 4
SHORT = [11, 42, 99, 7, 250, 31, 8]
PLAIN = [5, 9] * 10
LONG = [(37 * i + 11) % 380 + 4 for i in range(600)]
#: (prompt, prompt_logprobs) of every request, in one generate call.
REQUESTS = [(SHORT, 3), (PLAIN, None), (LONG, 0), ([42], 1)]


@pytest.fixture(scope="module", params=[("static", "eager", 1),
                                        ("static", "inductor", 1),
                                        ("cb", "eager", 1),
                                        ("cb", "inductor", 1),
                                        ("static", "eager", 2),
                                        ("cb", "eager", 2)],
                ids=lambda p: f"{p[0]}-{p[1]}-tp{p[2]}")
def run(request, tiny_llama):
    from vllm import SamplingParams, TokensPrompt
    mode, backend, tp = request.param
    with mode_llm(tiny_llama, mode, backend, [64, 640], [NEW, NEW], [2, 2],
                  max_model_len=1024, tensor_parallel_size=tp) as llm:
        before = compile_count()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in REQUESTS], [
                SamplingParams(temperature=0.0, max_tokens=NEW,
                               ignore_eos=True, prompt_logprobs=k)
                for _, k in REQUESTS
            ], use_tqdm=False)
        compiled = compile_count() - before
    yield dict(outs=outs, compiled=compiled)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return HFReference(tiny_llama)


def hf_logprobs(hf, prompt):
    """transformers' log-softmax at every position of ``prompt``."""
    import torch
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("index", [0, 2, 3])
def test_every_prompt_token_has_transformers_logprob(run, hf, index):
    prompt, k = REQUESTS[index]
    got = run["outs"][index].prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    want = hf_logprobs(hf, prompt)
    for pos in range(1, len(prompt)):
        entry = got[pos]
        token = prompt[pos]
        assert token in entry, f"position {pos}"
        assert abs(entry[token].logprob - want[pos - 1, token].item()) < 1e-3
        assert entry[token].rank == int((want[pos - 1] >
                                         want[pos - 1, token]).sum()) + 1
        # The prompt token, and the k most likely.
        top = want[pos - 1].topk(k)
        for rank, (value, tok) in enumerate(zip(top.values.tolist(),
                                                top.indices.tolist()), 1):
            assert tok in entry and entry[tok].rank == rank
            assert abs(entry[tok].logprob - value) < 1e-3
        assert len(entry) in (k, k + 1)


def test_requests_that_do_not_ask_get_none(run):
    assert run["outs"][1].prompt_logprobs is None


def test_generated_ids_are_transformers_greedy(run, hf):
    for (prompt, _), out in zip(REQUESTS, run["outs"]):
        assert list(out.outputs[0].token_ids) == hf.greedy(prompt, NEW)[0]


def test_nothing_compiles_after_warmup(run):
    assert run["compiled"] == 0
