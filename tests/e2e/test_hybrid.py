"""Hybrid Mamba-2 and attention models (Bamba) end to end: a tiny random
``BambaForCausalLM`` (Mamba-2 layers around an attention layer, two
groups, a projection bias, its scan in chunks of 16 positions) generates
transformers' greedy ids under static batching (two shapes, ``eager``;
``inductor`` without recompiling), continuous batching with a pool small
enough to preempt (its states rebuilt by recompute), on ``inductor``
without recompiling, and with chunked prefill (the state carried from
chunk to chunk); prompt log-probabilities equal transformers'; a
request's state slot is freed once it finishes; tensor parallelism and
prefix caching are refused, naming why."""
from __future__ import annotations

import pytest
import torch

from conftest import (HFReference, backend_env, build_tiny_family,
                      compile_count, greedy_requests, model_runner,
                      prompt_logprobs_match_transformers, spyre_env, spyre_llm)

pytestmark = pytest.mark.e2e

STATIC = dict(prompt_lens=[64, 128], new_tokens=[16, 32], batch_sizes=[4, 2])
ONE_SHAPE = dict(prompt_lens=[128], new_tokens=[32], batch_sizes=[3])
CB = {"VLLM_SPYRE_USE_CB": "1"}
CB_ARGS = dict(max_model_len=160, max_num_seqs=3)


def _requests() -> list[tuple[list[int], int]]:
    """Prompts of 2 to 100 tokens (up to 7 chunks of the scan, two blocks
    of the pool), answers of 1 to 30 tokens."""
    gen = torch.Generator().manual_seed(13)
    plan = [(9, 16), (60, 8), (2, 5), (33, 16), (100, 30), (17, 1)]
    return [(torch.randint(4, 380, (n, ), generator=gen).tolist(), m)
            for n, m in plan]


REQUESTS = _requests()
# Static shapes hold at most 64 + 16 or 128 + 32 tokens.
STATIC_REQUESTS = [(p, min(m, 16)) if len(p) <= 64 else (p, m)
                   for p, m in REQUESTS]


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """(checkpoint folder, transformers' greedy ids of REQUESTS and of
    STATIC_REQUESTS)."""
    path = build_tiny_family("bamba", tmp_path_factory.mktemp("bamba"))
    hf = HFReference(path)
    expected = {tuple(map(tuple, (p, [m]))): hf.greedy(p, m)[0]
                for p, m in REQUESTS + STATIC_REQUESTS}
    del hf
    return path, expected


def _expected(bamba, requests):
    _, table = bamba
    return [table[(tuple(p), (m, ))] for p, m in requests]


def _run(bamba, env, requests, **kwargs):
    path, _ = bamba
    with spyre_llm(path, env, **kwargs) as llm:
        before = compile_count()
        got = greedy_requests(llm, requests)
        compiled = compile_count() - before
        scheduler = llm.llm_engine.scheduler[0]
        info = dict(compiled=compiled,
                    preempted=scheduler.num_cumulative_preemption)
        runner = model_runner(llm)
        if getattr(runner, "state_slots", None) is not None:
            # vLLM names a step's finished requests to the next step: one
            # more request frees every slot but its own.
            greedy_requests(llm, requests[:1])
            info["slots_held"] = runner.state_slots.held
    return got, info


def test_static_eager(bamba):
    got, _ = _run(bamba, spyre_env("eager", **STATIC), STATIC_REQUESTS)
    assert got == _expected(bamba, STATIC_REQUESTS)


def test_static_inductor_without_recompiling(bamba):
    got, info = _run(bamba, spyre_env("inductor", **ONE_SHAPE),
                     STATIC_REQUESTS)
    assert got == _expected(bamba, STATIC_REQUESTS)
    assert info["compiled"] == 0, info


def test_continuous_batching_preempted_and_recomputed(bamba):
    """Four blocks of 64 tokens for three sequences of up to 130: the
    scheduler preempts, and the recomputed sequence rebuilds its state in
    the slot it holds."""
    got, info = _run(bamba, {**CB, **backend_env("eager")}, REQUESTS,
                     num_gpu_blocks_override=4, **CB_ARGS)
    assert got == _expected(bamba, REQUESTS)
    assert info["preempted"] > 0, info
    assert info["slots_held"] == 1, info


def test_continuous_batching_inductor_without_recompiling(bamba):
    got, info = _run(bamba, {**CB, **backend_env("inductor")}, REQUESTS,
                     **CB_ARGS)
    assert got == _expected(bamba, REQUESTS)
    assert info["compiled"] == 0, info
    assert info["slots_held"] == 1, info


def test_chunked_prefill_carries_the_state(bamba):
    """64-token chunks interleaved with decodes: the 100-token prompt's
    second chunk starts from the state its first left."""
    got, _ = _run(bamba, {**CB, **backend_env("eager")}, REQUESTS,
                  enable_chunked_prefill=True, max_num_batched_tokens=64,
                  **CB_ARGS)
    assert got == _expected(bamba, REQUESTS)


def test_prompt_logprobs(bamba):
    path, _ = bamba
    with spyre_llm(path, spyre_env("eager", **STATIC)) as llm:
        prompt_logprobs_match_transformers(llm, path, REQUESTS[1][0])


@pytest.mark.parametrize("kwargs, words", [
    (dict(tensor_parallel_size=3), ["BambaForCausalLM", "one card",
                                    "--tensor-parallel-size 3"]),
    (dict(enable_prefix_caching=True, **CB_ARGS),
     ["Prefix caching of BambaForCausalLM", "states"]),
])
def test_refused(bamba, kwargs, words):
    path, _ = bamba
    env = {**CB, **backend_env("eager")} if "enable_prefix_caching" in \
        kwargs else spyre_env("eager", **ONE_SHAPE)
    with pytest.raises(NotImplementedError) as info:
        with spyre_llm(path, env, **kwargs):
            pass
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("options, words", [
    (dict(layer_types=["mamba", "attention"]), ["Mamba-2 layers (1 of 2"]),
    (dict(experts=4), ["4 experts per layer"]),
])
def test_granite4_forms_fms_lacks_are_refused(tmp_path, options, words):
    path = build_tiny_family("granite4", tmp_path / "g4", **options)
    with pytest.raises(NotImplementedError) as info:
        with spyre_llm(path, spyre_env("eager", **ONE_SHAPE)):
            pass
    assert "GraniteMoeHybridForCausalLM" in str(info.value)
    for word in words:
        assert word in str(info.value)
