"""Sliding-window attention applied, not refused: a tiny Mistral whose
window (16 tokens) every test sequence outgrows, prompts of 2 to 60
tokens and answers of up to 24, generates transformers' greedy ids under
static batching (two shapes, ``eager``; ``inductor`` without recompiling),
continuous batching (``eager``, and ``inductor`` on the paged kernel's
per-sequence start without recompiling), on vLLM's model code in both
modes, and gives transformers' prompt log-probabilities.  The reference
is transformers run over the whole sequence at every step (no cache), and
the same weights without a window give other ids, so a window that is not
applied fails these tests."""
from __future__ import annotations

import json

import pytest
import torch

from spyre_support.engines import compile_count, greedy_requests, spyre_llm
from spyre_support.envs import cb_env, spyre_env
from spyre_support.reference import prompt_logprobs_match_transformers
from spyre_support.tiny_models import build_tiny_family

WINDOW = 16
STATIC = dict(prompt_lens=[64, 64], new_tokens=[8, 24], batch_sizes=[4, 2])
ONE_SHAPE = dict(prompt_lens=[64], new_tokens=[24], batch_sizes=[3])
CB_ARGS = dict(max_model_len=96, max_num_seqs=3)


def _requests() -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): 2 to 60 prompt tokens, 1 to 24 new."""
    gen = torch.Generator().manual_seed(11)
    plan = [(9, 24), (60, 8), (2, 20), (33, 24), (17, 1), (48, 16)]
    return [(torch.randint(4, 380, (n, ), generator=gen).tolist(), m)
            for n, m in plan]


REQUESTS = _requests()


def full_context_greedy(model, prompt: list[int], new: int) -> list[int]:
    """Greedy ids from whole-sequence forwards (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def _reference(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return [full_context_greedy(model, p, m) for p, m in REQUESTS]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(checkpoint folder, transformers' greedy ids of REQUESTS)."""
    root = tmp_path_factory.mktemp("mistral-window")
    path = build_tiny_family("mistral", root / "windowed", window=WINDOW)
    expected = _reference(path)
    # The same weights attending over the whole context answer otherwise.
    config = json.loads((path / "config.json").read_text())
    full = root / "full"
    full.mkdir()
    for item in path.iterdir():
        (full / item.name).symlink_to(item)
    (full / "config.json").unlink()
    (full / "config.json").write_text(
        json.dumps({**config, "sliding_window": None}))
    assert _reference(full) != expected
    return path, expected


def _check(path, expected, env, recompiles_checked=False, **kwargs):
    with spyre_llm(path, env, **kwargs) as llm:
        before = compile_count()
        got = greedy_requests(llm, REQUESTS)
        compiled = compile_count() - before
    assert got == expected
    if recompiles_checked:
        assert compiled == 0, f"{compiled} compilations after warm-up"


def test_static_eager(mistral):
    _check(*mistral, spyre_env("eager", **STATIC))


def test_static_inductor_without_recompiling(mistral):
    _check(*mistral, spyre_env("inductor", **ONE_SHAPE),
           recompiles_checked=True)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_continuous_batching(mistral, backend):
    _check(*mistral, cb_env(backend),
           recompiles_checked=backend == "inductor", **CB_ARGS)


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_vllm_model_code(mistral, mode):
    env = (spyre_env("eager", **STATIC) if mode == "static" else
           cb_env("eager"))
    _check(*mistral, env, model_impl="vllm",
           **(CB_ARGS if mode == "cb" else {}))


def test_prompt_logprobs(mistral):
    """A 60-token prompt's log-probabilities, each position over its last
    WINDOW tokens, equal transformers' log-softmax."""
    path, _ = mistral
    with spyre_llm(path, spyre_env("eager", **STATIC)) as llm:
        prompt_logprobs_match_transformers(llm, path, REQUESTS[1][0])

def test_chunked_prefill(mistral):
    """Continuous batching with 64-token chunks: a 74-token prompt's
    second chunk, and the decodes interleaved with it, see each position's
    last WINDOW tokens across the chunk boundary.  (vLLM itself refuses
    prefix caching with a sliding window.)"""
    from transformers import AutoModelForCausalLM
    path, _ = mistral
    gen = torch.Generator().manual_seed(12)
    requests = [(torch.randint(4, 380, (n, ), generator=gen).tolist(), m)
                for n, m in ((74, 16), (69, 12))] + REQUESTS[:3]
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()
    expected = [full_context_greedy(model, p, m) for p, m in requests]
    with spyre_llm(path, cb_env("eager"),
                   enable_chunked_prefill=True, max_num_batched_tokens=64,
                   **CB_ARGS) as llm:
        assert greedy_requests(llm, requests) == expected
