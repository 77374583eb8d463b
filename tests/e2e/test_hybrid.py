"""Hybrid Mamba-2 and attention models end to end.  A tiny random
``BambaForCausalLM`` (Mamba-2 layers around an attention layer, two
groups, a projection bias, its scan in chunks of 16 positions) and a
tiny Granite 4 in its hybrid form (``GraniteMoeHybridForCausalLM``: the
same layer pattern, attention without position embeddings, top-2 of 4
experts beside the shared MLP, Granite's multipliers) generate
transformers' greedy ids under static batching (two shapes, ``eager``),
continuous batching with a pool small enough to preempt (its states
rebuilt by recompute), on ``inductor`` without recompiling and over
three ranks (TP=3).  For Bamba also: static ``inductor`` without
recompiling, chunked prefill (the state carried from chunk to chunk) and
prompt log-probabilities equal to transformers'.  A request's state slot
is freed once it finishes or is aborted; prefix caching is refused,
naming why; Granite 4 with experts and rotary embeddings (no Mamba-2
layers) matches transformers too."""
from __future__ import annotations

import json

import pytest
import torch

from spyre_support.engines import (compile_count, greedy_requests,
                                   model_runner, spyre_engine, spyre_llm)
from spyre_support.envs import backend_env, spyre_env
from spyre_support.reference import (HFReference,
                                     prompt_logprobs_match_transformers)
from spyre_support.tiny_models import build_tiny_family

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


_BUILT: dict = {}


def _reference(name: str, tmp_path_factory):
    """(checkpoint folder, transformers' greedy ids of REQUESTS and of
    STATIC_REQUESTS) of the tiny hybrid ``name``, built once."""
    if name not in _BUILT:
        path = build_tiny_family(name, tmp_path_factory.mktemp(name))
        hf = HFReference(path)
        expected = {tuple(map(tuple, (p, [m]))): hf.greedy(p, m)[0]
                    for p, m in REQUESTS + STATIC_REQUESTS}
        del hf
        _BUILT[name] = (path, expected)
    return _BUILT[name]


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return _reference("bamba", tmp_path_factory)


@pytest.fixture(scope="module", params=["bamba", "granite4_h"])
def hybrid(request, tmp_path_factory):
    return _reference(request.param, tmp_path_factory)


def _expected(model, requests):
    _, table = model
    return [table[(tuple(p), (m, ))] for p, m in requests]


def _run(model, env, requests, **kwargs):
    path, _ = model
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


def test_static_eager(hybrid):
    got, _ = _run(hybrid, spyre_env("eager", **STATIC), STATIC_REQUESTS)
    assert got == _expected(hybrid, STATIC_REQUESTS)


def test_static_inductor_without_recompiling(bamba):
    got, info = _run(bamba, spyre_env("inductor", **ONE_SHAPE),
                     STATIC_REQUESTS)
    assert got == _expected(bamba, STATIC_REQUESTS)
    assert info["compiled"] == 0, info


def test_continuous_batching_preempted_and_recomputed(hybrid):
    """Four blocks of 64 tokens for three sequences of up to 130: the
    scheduler preempts, and the recomputed sequence rebuilds its state in
    the slot it holds."""
    got, info = _run(hybrid, {**CB, **backend_env("eager")}, REQUESTS,
                     num_gpu_blocks_override=4, **CB_ARGS)
    assert got == _expected(hybrid, REQUESTS)
    assert info["preempted"] > 0, info
    assert info["slots_held"] == 1, info


def test_continuous_batching_inductor_without_recompiling(hybrid):
    got, info = _run(hybrid, {**CB, **backend_env("inductor")}, REQUESTS,
                     **CB_ARGS)
    assert got == _expected(hybrid, REQUESTS)
    assert info["compiled"] == 0, info
    assert info["slots_held"] == 1, info


def test_aborted_request_frees_its_slot(bamba):
    """Three requests decoding; the longest aborted: the next step frees
    its slot (vLLM names it among the step's finished requests), the
    others keep theirs and finish with transformers' ids, and a new request
    takes the freed slot and does too."""
    from vllm import SamplingParams, TokensPrompt
    path, _ = bamba
    requests = {"0": REQUESTS[0], "1": REQUESTS[4], "2": REQUESTS[3],
                "3": REQUESTS[2]}

    def add(engine, rid):
        prompt, n = requests[rid]
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(temperature=0.0, max_tokens=n,
                                          ignore_eos=True))

    done = {}
    with spyre_engine(path, {**CB, **backend_env("eager")},
                      **CB_ARGS) as engine:
        slots = engine.model_executor.driver_worker.worker.model_runner \
            .state_slots
        for rid in "012":
            add(engine, rid)
        for _ in range(5):  # three prefills, two decode steps
            engine.step()
        assert slots.held == 3
        engine.abort_request("1")
        engine.step()
        assert slots.held == 2
        add(engine, "3")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
    assert sorted(done) == ["0", "2", "3"]
    assert [done[r] for r in "023"] == _expected(
        bamba, [requests[r] for r in "023"])


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


def test_prefix_caching_refused(hybrid):
    path, _ = hybrid
    with pytest.raises(NotImplementedError) as info:
        with spyre_llm(path, {**CB, **backend_env("eager")},
                       enable_prefix_caching=True, **CB_ARGS):
            pass
    arch = json.loads((path / "config.json").read_text())["architectures"]
    assert f"Prefix caching of {arch[0]}" in str(info.value)
    assert "states" in str(info.value)


def test_tensor_parallel_preempted(hybrid):
    """TP=3: attention, MLPs and Granite 4's experts split over the
    ranks, the Mamba-2 layers whole on each, every rank's state slots
    kept in step through a preemption."""
    got, info = _run(hybrid, {**CB, **backend_env("eager")}, REQUESTS,
                     num_gpu_blocks_override=4, tensor_parallel_size=3,
                     **CB_ARGS)
    assert got == _expected(hybrid, REQUESTS)
    assert info["preempted"] > 0, info


@pytest.fixture(scope="module")
def granite4_experts(tmp_path_factory):
    """Granite 4 with top-2 of 4 experts and rotary embeddings, every layer
    attention: Spyre's Granite 4 model without Mamba-2 layers."""
    path = build_tiny_family("granite4", tmp_path_factory.mktemp("g4e"),
                             experts=4)
    hf = HFReference(path)
    expected = {tuple(map(tuple, (p, [m]))): hf.greedy(p, m)[0]
                for p, m in STATIC_REQUESTS}
    del hf
    return path, expected


def test_granite4_experts_static(granite4_experts):
    got, _ = _run(granite4_experts, spyre_env("eager", **STATIC),
                  STATIC_REQUESTS)
    assert got == _expected(granite4_experts, STATIC_REQUESTS)
