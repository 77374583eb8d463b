"""Speculative decoding (``--speculative-config``, n-gram prompt lookup)
under continuous batching, offline.

Prompts built of repeated spans give the n-gram lookup something to
propose; greedy ids must equal Hugging Face transformers' (plain greedy
decoding) for every request, on both CPU backends, with proposals made
and accepted and nothing compiled after warm-up; again with prefix
caching and chunked prefill on, and with a block pool so small that
requests are preempted and recomputed.  Seeded sampled requests
reproduce themselves.  Settings Spyre does not run are refused at
start-up, naming the value."""
from __future__ import annotations

import pytest

from spyre_support.bench import repeated_spans
from spyre_support.engines import spyre_llm
from spyre_support.envs import cb_env
from spyre_support.speculative import (MAX_MODEL_LEN, MAX_NUM_SEQS, PLAN,
                                       assert_plain_greedy, assert_refused,
                                       assert_speculated)
from spyre_support.speculative import run_workload as run_spec

#: Every step with proposals verifies (``disable_by_batch_size`` above the
#: batch), so that what the tests see does not depend on the step times
#: measured at warm-up, which a busy machine skews.
SPEC = {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": 64}
#: Steps verify when the times measured at warm-up say it pays.
MEASURED = {k: v for k, v in SPEC.items() if k != "disable_by_batch_size"}
PREEMPT_PLAN = [(10, 10, 0, 60), (11, 10, 0, 50), (12, 10, 0, 40),
                (5, 1, 0, 30)]


def make_requests(vocab: int, plan=PLAN) -> list[tuple[list[int], int]]:
    return repeated_spans(vocab, plan)


def run_workload(model, backend, plan=PLAN, **kwargs) -> dict:
    return run_spec(model, backend, SPEC, plan, **kwargs)


@pytest.fixture(scope="module", params=["eager", "inductor"])
def spec_run(request, tiny_llama):
    return dict(run_workload(tiny_llama, request.param),
                backend=request.param)


def test_greedy_ids_equal_plain_decoding(spec_run, hf_tiny):
    assert_plain_greedy(spec_run, hf_tiny)


def test_proposals_are_made_and_accepted_without_compiling(spec_run):
    assert_speculated(spec_run)
    assert "warmup verify" in spec_run["timings"]


def test_with_prefix_caching_and_chunked_prefill(tiny_llama, hf_tiny):
    run = run_workload(tiny_llama, "eager", PLAN + PLAN[:3],
                       enable_prefix_caching=True,
                       enable_chunked_prefill=True,
                       max_num_batched_tokens=64)
    assert_speculated(run)
    assert_plain_greedy(run, hf_tiny)


def test_preempted_requests_finish_with_the_same_tokens(tiny_llama,
                                                        hf_tiny):
    run = run_workload(tiny_llama, "eager", PREEMPT_PLAN,
                       num_gpu_blocks_override=8)
    assert run["preemptions"] > 0
    assert_speculated(run)
    assert_plain_greedy(run, hf_tiny)


def test_the_default_model_equals_transformers(smollm2):
    from spyre_support.reference import HFReference
    run = run_workload(smollm2, "eager",
                       [(5, 6, 3, 24), (8, 4, 0, 16), (3, 1, 0, 20)])
    assert_speculated(run)
    assert_plain_greedy(run, HFReference(smollm2))


def test_seeded_sampled_requests_reproduce_themselves(tiny_llama):
    from vllm import SamplingParams, TokensPrompt
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=MAX_NUM_SEQS,
                   max_model_len=MAX_MODEL_LEN,
                   speculative_config=SPEC) as llm:
        reqs = make_requests(llm.llm_engine.model_config.get_vocab_size())
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs[:4]]
        params = [SamplingParams(temperature=0.7, top_k=3, seed=100 + i,
                                 max_tokens=40, ignore_eos=True)
                  for i in range(4)]
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)
        counters = llm.llm_engine.output_processor.counters
        assert counters.drafts > 0
    assert [list(o.outputs[0].token_ids) for o in first] == \
        [list(o.outputs[0].token_ids) for o in again[::-1]]


def test_guided_and_parallel_requests_beside_speculating_ones(tiny_llama,
                                                              hf_tiny):
    """A request with a choice (structured output) proposes nothing and
    answers one of its choices; two greedy samples (``n=2``) and the
    speculating requests beside them get plain decoding's tokens.  Here
    steps verify when the warm-up's step times say it pays."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import GuidedDecodingParams
    choices = ["alpha beta", "gamma", "delta epsilon zeta"]
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=MAX_NUM_SEQS,
                   max_model_len=MAX_MODEL_LEN,
                   speculative_config=MEASURED) as llm:
        runner = llm.llm_engine.model_executor.driver_worker.worker \
            .model_runner
        assert runner.cost.ratio(1) > 0 and runner.cost.ratio(3) > 0
        reqs = make_requests(llm.llm_engine.model_config.get_vocab_size())
        guided = SamplingParams(temperature=0, max_tokens=20,
                                guided_decoding=GuidedDecodingParams(
                                    choice=choices))
        # Two samples of the most likely token each time (vLLM takes n > 1
        # only for sampled requests): plain greedy decoding's tokens.
        plain = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                 for _, m in reqs[:3]]
        plain[0] = SamplingParams(temperature=1.0, top_k=1, n=2,
                                  max_tokens=reqs[0][1], ignore_eos=True)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in reqs[:3]] +
            [TokensPrompt(prompt_token_ids=reqs[0][0])], plain + [guided],
            use_tqdm=False)
    for (prompt, max_tokens), out in zip(reqs[:3], outs):
        want = hf_tiny.greedy(prompt, max_tokens)[0]
        assert [list(c.token_ids) for c in out.outputs] == \
            [want] * len(out.outputs)
    assert len(outs[0].outputs) == 2
    assert outs[3].outputs[0].text in choices


@pytest.mark.parametrize("env, spec, message", [
    (cb_env("eager"), dict(SPEC, num_speculative_tokens=0),
     "num_speculative_tokens to be greater than zero"),
    (cb_env("eager"), dict(SPEC, num_speculative_tokens=64),
     "num_speculative_tokens=64"),
    ({"VLLM_SPYRE_DYNAMO_BACKEND": "eager"}, SPEC, "VLLM_SPYRE_USE_CB=1"),
])
def test_settings_spyre_does_not_run_are_refused(tiny_llama, env, spec,
                                                 message):
    assert_refused(tiny_llama, spec, message, env)


def test_a_method_spyre_does_not_run_is_refused(tiny_llama):
    assert_refused(tiny_llama, {"method": "eagle", "model": str(tiny_llama),
                                "num_speculative_tokens": 2},
                   "method 'eagle' is not supported on Spyre")


def test_tensor_parallel_2_equals_transformers(tiny_llama, hf_tiny):
    """The driver proposes and samples; both ranks run the verify step."""
    plan = [(5, 6, 3, 40), (8, 8, 0, 33), (3, 1, 0, 30)]
    run = run_workload(tiny_llama, "eager", plan, tensor_parallel_size=2)
    assert_speculated(run)
    assert_plain_greedy(run, hf_tiny)


def test_lora_rows_speculate_on_their_adapters(tiny_llama, tmp_path):
    """vLLM's model code with two adapters: rows on each adapter and on
    none equal transformers with the adapter merged."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    from spyre_support.tiny_lora import MergedReference, build_adapter
    folders = [build_adapter(tiny_llama, tmp_path / f"a{i}", seed=i, rank=8)
               for i in (1, 2)]
    with spyre_llm(tiny_llama, cb_env("eager"), max_num_seqs=MAX_NUM_SEQS,
                   max_model_len=MAX_MODEL_LEN, speculative_config=SPEC,
                   model_impl="vllm", enable_lora=True, max_loras=2,
                   max_lora_rank=8) as llm:
        reqs = make_requests(llm.llm_engine.model_config.get_vocab_size())
        on = [0, 1, None, 1, 0, None, 0]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in reqs],
            [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
             for _, m in reqs],
            lora_request=[LoRARequest(f"a{a}", a + 1, str(folders[a]))
                          if a is not None else None for a in on],
            use_tqdm=False)
        assert llm.llm_engine.output_processor.counters.accepted > 0
    refs = {a: MergedReference(tiny_llama,
                               folders[a] if a is not None else None)
            for a in (0, 1, None)}
    for (prompt, max_tokens), a, out in zip(reqs, on, outs):
        assert list(out.outputs[0].token_ids) == \
            refs[a].greedy(prompt, max_tokens)[0]
